"""The CUDA driver API through ctypes: load a cubin, find a kernel, launch it.

Three driver calls do the work: ``cuLibraryLoadData`` (context-independent: one
library serves every device; CUDA >= 12.0), ``cuLibraryGetKernel`` (by lowered
name) and ``cuLaunchKernel`` (a CUkernel launches in the current context, the one
torch made current for the device). Every result code is checked: a bad launch is
a KloadError, never a crash.

``launch_config`` and ``pack`` are pure (no driver, no GPU): they check a launch
configuration and turn Python values into kernel arguments by the parameter list
read from the PTX (kload.nvrtc.ptx_params).
"""
from __future__ import annotations

import ctypes
import struct
import threading

from ..errors import KloadError

_lock = threading.Lock()
_cuda = None
CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES = 8
MAX_STATIC_SHARED = 48 * 1024  # more dynamic shared memory needs the attribute above


def driver() -> ctypes.CDLL:
    """libcuda, initialized once per process."""
    global _cuda
    if _cuda is None:
        with _lock:
            if _cuda is None:
                try:
                    lib = ctypes.CDLL("libcuda.so.1")
                except OSError as e:
                    raise KloadError(f"the CUDA driver (libcuda.so.1) cannot be loaded: {e}") from None
                lib.cuGetErrorName.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)]
                lib.cuLaunchKernel.argtypes = [ctypes.c_void_p] + [ctypes.c_uint] * 6 + [
                    ctypes.c_uint, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
                _check(lib, lib.cuInit(0), "cuInit")
                _cuda = lib
    return _cuda


def _check(lib, rc: int, what: str) -> None:
    if rc != 0:
        name, text = ctypes.c_char_p(), ctypes.c_char_p()
        lib.cuGetErrorName(rc, ctypes.byref(name))
        lib.cuGetErrorString(rc, ctypes.byref(text))
        raise KloadError(f"{what}: {(name.value or b'CUDA error %d' % rc).decode()}: "
                         f"{(text.value or b'').decode()}")


def load_library(image: bytes) -> ctypes.c_void_p:
    """A CUlibrary from a cubin (or NUL-terminated PTX, which the driver compiles)."""
    lib, handle = driver(), ctypes.c_void_p()
    buf = ctypes.create_string_buffer(image if not image.startswith(b"//") else image + b"\0", len(image) + 1)
    _check(lib, lib.cuLibraryLoadData(ctypes.byref(handle), buf, None, None, 0, None, None, 0),
           "cuLibraryLoadData")
    return handle


def get_kernel(library: ctypes.c_void_p, lowered: str) -> ctypes.c_void_p:
    lib, kern = driver(), ctypes.c_void_p()
    _check(lib, lib.cuLibraryGetKernel(ctypes.byref(kern), library, lowered.encode()),
           f"cuLibraryGetKernel({lowered})")
    return kern


def allow_shared(kernel: ctypes.c_void_p, smem: int, device: int) -> None:
    """Let ``kernel`` use ``smem`` bytes of dynamic shared memory on ``device`` (needed above 48 KiB)."""
    lib = driver()
    dev = ctypes.c_int()
    _check(lib, lib.cuDeviceGet(ctypes.byref(dev), device), "cuDeviceGet")
    _check(lib, lib.cuKernelSetAttribute(CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, smem, kernel, dev),
           f"{smem} bytes of dynamic shared memory")


_primary: dict[int, ctypes.c_void_p] = {}


def ensure_context(device: int) -> None:
    """Make ``device``'s primary context (the one torch uses) current on this thread: a
    CUkernel launches in the current context. Checked at every launch (one cuCtxGetCurrent):
    a thread that made no CUDA call yet has none, and another library may have left its own."""
    lib, cur = _cuda or driver(), ctypes.c_void_p()
    ctx = _primary.get(device)
    if ctx is None:
        dev, ctx = ctypes.c_int(), ctypes.c_void_p()
        _check(lib, lib.cuDeviceGet(ctypes.byref(dev), device), "cuDeviceGet")
        _check(lib, lib.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev), "cuDevicePrimaryCtxRetain")
        ctx = _primary.setdefault(device, ctx)  # retained once per device and process
    _check(lib, lib.cuCtxGetCurrent(ctypes.byref(cur)), "cuCtxGetCurrent")
    if cur.value != ctx.value:
        _check(lib, lib.cuCtxSetCurrent(ctx), "cuCtxSetCurrent")


def launch(kernel, grid: tuple, block: tuple, smem: int, stream: int, params, what) -> None:
    """``cuLaunchKernel``; a failure is a KloadError that starts with ``what()``."""
    lib = _cuda or driver()
    rc = lib.cuLaunchKernel(kernel, *grid, *block, smem, stream, params, None)
    if rc:
        _check(lib, rc, what())


# -- pure: the launch configuration and the arguments ---------------------------------

_BLOCK_MAX, _GRID_MAX = (1024, 1024, 64), ((1 << 31) - 1, 65535, 65535)


def _dims(value, what: str, name: str) -> tuple[int, int, int]:
    dims = tuple(value) if isinstance(value, (tuple, list)) else (value,)
    if not 1 <= len(dims) <= 3 or not all(isinstance(d, int) and not isinstance(d, bool) for d in dims):
        raise KloadError(f"{name}: {what} must be an int or a tuple of 1 to 3 ints, got {value!r}")
    return dims + (1,) * (3 - len(dims))


def launch_config(name: str, config) -> tuple[tuple, tuple, int]:
    """``kernel[grid, block]`` / ``[grid, block, shared_bytes]`` -> (grid, block, smem),
    each dimension checked against CUDA's limits (a KloadError says which and why)."""
    if not isinstance(config, tuple) or len(config) not in (2, 3):
        raise KloadError(f"{name}[...] takes [grid, block] or [grid, block, shared_bytes], got {config!r}")
    grid, block = _dims(config[0], "grid", name), _dims(config[1], "block", name)
    smem = config[2] if len(config) == 3 else 0
    if not isinstance(smem, int) or smem < 0:
        raise KloadError(f"{name}: shared_bytes must be an int >= 0, got {smem!r}")
    for what, dims, top in (("grid", grid, _GRID_MAX), ("block", block, _BLOCK_MAX)):
        for axis, d, t in zip("xyz", dims, top):
            if not 1 <= d <= t:
                raise KloadError(f"{name}: {what}.{axis} = {d}; CUDA allows 1 to {t}")
    threads = block[0] * block[1] * block[2]
    if threads > 1024:
        raise KloadError(f"{name}: a block of {block[0]}x{block[1]}x{block[2]} = {threads} threads; "
                         "CUDA allows at most 1024")
    return grid, block, smem


class Packer:
    """``pack`` for one kernel, made fast for the call path: the arguments go into one
    ctypes Structure laid out as the parameters, and the ``void**`` array points at its
    fields. Anything this path refuses is re-checked by ``pack``, whose error says why."""

    __slots__ = ("name", "params", "struct", "array", "offsets", "convert")

    def __init__(self, name: str, params: list):
        self.name, self.params = name, params
        fields, self.convert = [], []
        for i, (kind, size) in enumerate(params):
            if kind == "f" and size in _FLOAT:
                ctype, conv = (ctypes.c_float if size == 4 else ctypes.c_double), _as_float
            elif size in _INT:
                ctype = {1: ctypes.c_uint8, 2: ctypes.c_uint16, 4: ctypes.c_uint32, 8: ctypes.c_uint64}[size]
                conv = _int_of(8 * size)
            else:
                ctype, conv = ctypes.c_char * size, _as_struct(size)
            fields.append((f"p{i}", ctype))
            self.convert.append(conv)
        self.struct = type(f"{name}_args", (ctypes.Structure,), {"_fields_": fields})
        self.array = ctypes.c_void_p * max(1, len(params))
        self.offsets = [getattr(self.struct, f"p{i}").offset for i in range(len(params))]

    def __call__(self, args: tuple):
        try:
            if len(args) != len(self.convert):
                raise ValueError
            values = self.struct(*[conv(a) for conv, a in zip(self.convert, args)])
        except (TypeError, ValueError, AttributeError, OverflowError):
            return pack(self.name, self.params, args)  # raises with the reason
        base = ctypes.addressof(values)
        return self.array(*[base + o for o in self.offsets]), values


def _as_float(a):
    if isinstance(a, (float, int)) and not isinstance(a, bool):
        return a
    raise TypeError


def _int_of(bits: int):
    lo, hi, mask = -(1 << (bits - 1)), 1 << bits, (1 << bits) - 1

    def conv(a):
        if type(a) is int or type(a) is bool:
            if lo <= a < hi:
                return a & mask
            raise OverflowError
        if bits == 64 and hasattr(a, "data_ptr"):
            return a.data_ptr()
        raise TypeError
    return conv


def _as_struct(size: int):
    def conv(a):
        if isinstance(a, (bytes, bytearray)) and len(a) == size:
            return bytes(a)
        raise TypeError
    return conv


_INT = {1: "B", 2: "H", 4: "I", 8: "Q"}
_FLOAT = {4: "f", 8: "d"}


def pack(name: str, params: list, args: tuple) -> tuple:
    """The kernel arguments for ``args`` by the kernel's ``params`` (``[kind, bytes]``
    from its PTX): a tensor -> its data pointer (an 8-byte parameter), a float -> a
    float or double parameter, an int -> an integer of the parameter's width (range
    checked), a bool -> 0/1, bytes -> a struct of the same size. Returns the ``void**``
    array and the buffers it points into (keep both alive over the launch)."""
    if len(args) != len(params):
        raise KloadError(f"{name} takes {len(params)} arguments, got {len(args)}")
    bufs = []
    for i, (arg, (kind, size)) in enumerate(zip(args, params)):
        where = f"{name}: argument {i} ({type(arg).__name__})"
        if hasattr(arg, "data_ptr"):
            if kind == "f" or size != 8:
                raise KloadError(f"{where}: the kernel takes a {size}-byte {'float' if kind == 'f' else 'value'} "
                                 "here, not a pointer")
            raw = struct.pack("Q", arg.data_ptr())
        elif isinstance(arg, (bytes, bytearray)):
            if len(arg) != size:
                raise KloadError(f"{where}: {len(arg)} bytes for a {size}-byte parameter")
            raw = bytes(arg)
        elif isinstance(arg, float) or (kind == "f" and isinstance(arg, int) and not isinstance(arg, bool)):
            if kind != "f" or size not in _FLOAT:
                raise KloadError(f"{where}: the kernel takes a {size}-byte integer or pointer here, not a float")
            raw = struct.pack(_FLOAT[size], float(arg))
        elif isinstance(arg, int):
            if size not in _INT:
                raise KloadError(f"{where}: the kernel takes a {size}-byte struct here (pass bytes)")
            bits = 8 * size
            if not -(1 << (bits - 1)) <= arg < (1 << bits):
                raise KloadError(f"{where}: {arg} does not fit the kernel's {size}-byte integer")
            raw = struct.pack(_INT[size], arg & ((1 << bits) - 1))
        else:
            raise KloadError(f"{where}: kernel arguments are tensors, floats, ints, bools or bytes")
        bufs.append(ctypes.create_string_buffer(raw, len(raw)))
    ptrs = (ctypes.c_void_p * max(1, len(bufs)))(*[ctypes.addressof(b) for b in bufs])
    return ptrs, bufs
