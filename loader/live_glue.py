"""Step 8 for C++ glue with device code: hand NVRTC-compiled kernels to the glue's slots.

    ops = kload.load("saxpy_op.cpp", device_code="saxpy.cu")

The glue declares ``kload::live::Kernel saxpy("saxpy<float>")`` objects (kload/live.h); each
registers its name expression in the library as the library opens. Once the library is
loaded (library.py), ``attach`` reads those names (``kload_live_v1_name``), has the
device code's CudaModule (live_cuda.py) compile them for this machine's GPUs (NVRTC, or a
cache hit), loads the image and binds every slot to its CUkernel and parameter list
(``kload_live_v1_bind``). After an edit of the device code the module compiles again and
binds the new kernels (``Glue.bind``), so the next call of the same ``torch.ops`` name
launches them; the glue itself is not rebuilt. A new build of the glue is attached the
same way. Nothing here is imported unless ``device_code`` is given.
"""
from __future__ import annotations

import ctypes
import logging
import os

from . import live_cuda
from .errors import KloadError

log = logging.getLogger("kload")

# library path -> [the CudaModule its slots are bound to, the binding's key]: the module is the last
# one that attached the library (a notebook cell run again makes a new handle for the same library;
# the old handle's edits then leave its slots alone)
_serving: dict[str, list] = {}


class Glue:
    """The kernel slots of one loaded glue library."""

    __slots__ = ("path", "names", "_lib")

    def __init__(self, path: str):
        try:
            lib = ctypes.CDLL(path)  # the library is loaded already: this is its handle, not a second copy
        except OSError as e:
            raise KloadError(f"kload: cannot open {path}: {e}") from None
        if not hasattr(lib, "kload_live_v1_count"):
            raise KloadError(f"kload: {os.path.basename(path)} was given device_code but declares no "
                             "kload::live::Kernel (#include <kload/live.h>; see its first lines)")
        lib.kload_live_v1_name.restype = ctypes.c_char_p
        lib.kload_live_v1_name.argtypes = [ctypes.c_int]
        lib.kload_live_v1_bind.argtypes = [ctypes.c_char_p, ctypes.c_void_p] + [ctypes.c_char_p] * 3
        self.path, self._lib = path, lib
        self.names = sorted({lib.kload_live_v1_name(i).decode() for i in range(lib.kload_live_v1_count())})

    def bind(self, module, image: "live_cuda.Image | None", where: str, reason: str | None) -> None:
        """Bind every slot to ``image``'s kernel of its name; ``reason`` (no GPU, no NVRTC) binds
        them to nothing, with that reason for the error a launch raises. Nothing happens unless
        ``module`` is the one the library was last attached to."""
        key = (image.entry.key if image is not None else None, reason)
        serving = _serving.get(self.path)
        if serving is None or serving[0] is not module or serving[1] == key:
            return
        for name in self.names:
            kernel, params = 0, "?"
            if image is not None:
                params = " ".join(f"{kind}{size}" for kind, size in image.kernels[name]["params"])
                if reason is None:
                    kernel = image.kernel(name)[0].value
            self._lib.kload_live_v1_bind(name.encode(), kernel, params.encode(), where.encode(),
                                         (reason or "").encode())
        serving[1] = key


def attach(module: live_cuda.CudaModule, library_path: str) -> Glue:
    """Bind the slots of the loaded library at ``library_path`` to ``module``'s kernels now,
    and after every edit of the device code. Raises CompileError (the device code does not
    compile) or KloadError (no slots; no NVRTC or driver where a GPU is)."""
    _serving[library_path] = [module, None]
    return module.serve(Glue(library_path))
