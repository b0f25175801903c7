"""NVRTC through ctypes: device code -> a cubin (or PTX) in tens of milliseconds.

No torch, no CUDA driver and no GPU needed: ``compile()`` runs on any machine that
has ``libnvrtc`` (a CUDA build of torch brings it: ``nvidia/cu13/lib`` in
site-packages). Why ctypes and not NVIDIA's cuda-bindings: docs/design.md,
"CUDA device code at edit speed". kload.live.cuda_module uses this; nothing on the
CPU-only path imports it.

    lib = nvrtc.library()                                   # KloadError if none is found
    out = nvrtc.compile(text, "/abs/saxpy.cu", ["-arch=sm_90"], ["saxpy", "scale<float>"])
    out.image, out.lowered["scale<float>"], out.params[out.lowered["saxpy"]]
"""
from __future__ import annotations

import ctypes
import glob
import os
import re
import sys
import threading
import time

from ..errors import CompileError, Diagnostic, KloadError

COMPILES = 0  # NVRTC compiles run by this process (the tests count them)

_lock = threading.Lock()
_lib = None


class Library:
    """libnvrtc: where it is, its identity for cache keys (soname and size: no dlopen, so a
    cache hit never loads the 100 MB library), and where its CUDA headers live."""

    def __init__(self, path: str):
        self.path, self._cdll = path, None
        self.identity = {"soname": os.path.basename(path), "size": os.path.getsize(path)}
        # CUDA headers (cuda_fp16.h, cuda_bf16.h) beside the library: nvidia/cu13/include, or the toolkit's
        inc = os.path.normpath(os.path.join(os.path.dirname(path), "..", "include"))
        self.include = inc if os.path.isfile(os.path.join(inc, "cuda_fp16.h")) else None

    @property
    def cdll(self) -> ctypes.CDLL:
        """The library, loaded on first use, after its builtins library from the same
        directory (NVRTC dlopens that one by soname and fails unless it is findable)."""
        if self._cdll is None:
            with _lock:
                if self._cdll is None:
                    folder = os.path.dirname(self.path)
                    try:
                        for b in sorted(glob.glob(os.path.join(folder, "libnvrtc-builtins.so.*"))):
                            if ".alt." not in os.path.basename(b):
                                ctypes.CDLL(b, mode=ctypes.RTLD_GLOBAL)
                        self._cdll = ctypes.CDLL(self.path)
                    except OSError as e:
                        raise KloadError(f"NVRTC at {self.path} cannot be loaded: {e}") from None
        return self._cdll

    @property
    def version(self) -> tuple[int, int]:
        major, minor = ctypes.c_int(), ctypes.c_int()
        self.cdll.nvrtcVersion(ctypes.byref(major), ctypes.byref(minor))
        return major.value, minor.value

    def archs(self) -> list[int]:
        """The real architectures this NVRTC compiles for (90 = sm_90)."""
        n = ctypes.c_int()
        self.cdll.nvrtcGetNumSupportedArchs(ctypes.byref(n))
        arr = (ctypes.c_int * n.value)()
        self.cdll.nvrtcGetSupportedArchs(arr)
        return list(arr)


def _candidates() -> list[str]:
    """libnvrtc in a PyPI CUDA build's site-packages first, then the toolkit's."""
    found = []
    for base in sys.path:
        found += sorted(glob.glob(os.path.join(base, "nvidia", "cu1[0-9]", "lib", "libnvrtc.so.*")), reverse=True)
        found += sorted(glob.glob(os.path.join(base, "nvidia", "cuda_nvrtc", "lib", "libnvrtc.so.*")), reverse=True)
    for home in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"):
        if home:
            found += sorted(glob.glob(os.path.join(home, "lib64", "libnvrtc.so*")), reverse=True)
    return [p for p in found if ".alt." not in os.path.basename(p)]


def library() -> Library:
    """libnvrtc (found once per process; loaded at the first compile)."""
    global _lib
    if _lib is None:
        found = _candidates()
        if not found:
            raise KloadError("NVRTC (libnvrtc) was not found; it comes with a CUDA build of torch "
                             "(nvidia/cu13/lib in site-packages) or a CUDA toolkit (CUDA_HOME/lib64)")
        _lib = Library(found[0])
    return _lib


class Output:
    """What one compile made: the image (cubin, or PTX text for a virtual arch), each
    name expression's lowered name, and each kernel's parameters from the PTX."""

    __slots__ = ("image", "ptx", "lowered", "params", "seconds", "log")

    def __init__(self, image: bytes, ptx: str, lowered: dict, params: dict, seconds: float, log: str):
        self.image, self.ptx, self.lowered, self.params, self.seconds, self.log = (
            image, ptx, lowered, params, seconds, log)


def _check(rc: int, what: str) -> None:
    if rc != 0:
        err = library().cdll
        err.nvrtcGetErrorString.restype = ctypes.c_char_p
        raise KloadError(f"NVRTC {what} failed: {err.nvrtcGetErrorString(rc).decode()}")


def _bytes(cdll, prog, what: str) -> bytes:
    size = ctypes.c_size_t()
    if getattr(cdll, f"nvrtcGet{what}Size")(prog, ctypes.byref(size)) != 0 or size.value == 0:
        return b""
    buf = ctypes.create_string_buffer(size.value)
    _check(getattr(cdll, f"nvrtcGet{what}")(prog, buf), f"nvrtcGet{what}")
    return buf.raw[: size.value]


def compile(source: str, filename: str, options: list[str], names: list[str], log_path: str | None = None) -> Output:
    """Compile ``source`` (named ``filename``: errors and relative includes use it) with
    NVRTC. ``names``: the kernels to look up (``"saxpy"``, ``"scale<float>"``). A
    failure raises CompileError with ``file:line:col`` of the kernel source (the full
    log is written to ``log_path`` when given)."""
    global COMPILES
    cdll = library().cdll
    prog = ctypes.c_void_p()
    _check(cdll.nvrtcCreateProgram(ctypes.byref(prog), source.encode(), filename.encode(), 0, None, None),
           "nvrtcCreateProgram")
    try:
        for n in names:
            _check(cdll.nvrtcAddNameExpression(prog, n.encode()), f"nvrtcAddNameExpression({n!r})")
        opts = [o.encode() for o in options]
        started = time.perf_counter()
        rc = cdll.nvrtcCompileProgram(prog, len(opts), (ctypes.c_char_p * len(opts))(*opts))
        seconds = time.perf_counter() - started
        COMPILES += 1
        log = _bytes(cdll, prog, "ProgramLog").rstrip(b"\0").decode(errors="replace")
        if rc != 0:
            if log_path:
                with open(log_path, "w") as f:
                    f.write(" ".join(options) + "\n" + log)
            stem = os.path.basename(filename)
            raise CompileError(stem, parse_log(log, filename), log_path or "(not written)", log)
        ptx = _bytes(cdll, prog, "PTX").rstrip(b"\0").decode()
        cubin = _bytes(cdll, prog, "CUBIN")
        lowered = {}
        for n in names:
            out = ctypes.c_char_p()
            _check(cdll.nvrtcGetLoweredName(prog, n.encode(), ctypes.byref(out)), f"nvrtcGetLoweredName({n!r})")
            lowered[n] = out.value.decode()
        return Output(cubin or ptx.encode(), ptx, lowered, ptx_params(ptx), seconds, log)
    finally:
        cdll.nvrtcDestroyProgram(ctypes.byref(prog))


# NVRTC's log: "file(12): error: message", then the line, then a caret under the column,
# each indented by two spaces. Name expressions are checked in a generated "__nv_name_map".
_ERR = re.compile(r"^(?P<file>[^\s(][^(]*)\((?P<line>\d+)\): (?:catastrophic )?error: (?P<msg>.*)$")
_NAME = re.compile(r"#pragma nv_mangled_name (?P<expr>.*)$")


def parse_log(log: str, filename: str) -> list[Diagnostic]:
    """The errors of an NVRTC log as Diagnostics with file:line:col (the column from
    the caret line). An unknown kernel name becomes one error on the kernel file."""
    lines, out, bad_names = log.splitlines(), [], []
    for i, text in enumerate(lines):
        m = _ERR.match(text)
        if not m:
            continue
        if m["file"] == "__nv_name_map":
            expr = _NAME.search(lines[i + 1]) if i + 1 < len(lines) else None
            if expr and expr["expr"].strip() not in bad_names:
                bad_names.append(expr["expr"].strip())
            continue
        col = None
        if i + 2 < len(lines) and lines[i + 2].strip() == "^":
            col = lines[i + 2].index("^") - 1  # two spaces of indent; columns count from 1
        source_line = lines[i + 1][2:] if i + 1 < len(lines) and lines[i + 1].startswith("  ") else None
        out.append(Diagnostic(m["file"], int(m["line"]), col, m["msg"].strip(), source_line))
    for expr in bad_names:
        out.append(Diagnostic(filename, None, None, f"no __global__ function here matches {expr!r}"))
    return out


# .visible .entry NAME( .param .u64 NAME_param_0, .param .align 4 .b8 NAME_param_1[8] )
_ENTRY = re.compile(r"\.entry\s+(?P<name>[\w$]+)\s*\((?P<params>[^)]*)\)", re.S)
_PARAM = re.compile(r"\.param\s+(?:\.align\s+\d+\s+)?\.(?P<type>[busf])(?P<bits>\d+)\b[^,]*?(?:\[(?P<n>\d+)\])?\s*$")


def ptx_params(ptx: str) -> dict[str, list[list]]:
    """Each kernel's parameters, from its PTX ``.entry``: ``[kind, bytes]`` with kind
    ``f`` (float), ``u``/``s``/``b`` (integer or pointer; ``b`` with a byte count is a
    struct passed by value). What a launch packs Python values into."""
    out = {}
    for m in _ENTRY.finditer(ptx):
        params = []
        for p in m["params"].split(","):
            p = p.strip()
            if not p:
                continue
            q = _PARAM.match(p)
            if q is None:
                raise KloadError(f"cannot read the PTX parameter {p!r} of {m['name']}")
            size = int(q["bits"]) // 8 * (int(q["n"]) if q["n"] else 1)
            params.append([q["type"], size])
        out[m["name"]] = params
    return out
