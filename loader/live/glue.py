"""C++ glue with device code: hand NVRTC-compiled kernels to the glue's slots.

    ops = kload.load("saxpy_op.cpp", device_code="saxpy.cu")

The glue declares ``kload::live::Kernel saxpy("saxpy<float>")`` objects (kload/live.h); each
registers its name expression in the library as the library opens. Once the library is
loaded (library.py), the handle's ``Server`` reads those names (``kload_live_v1_name``), has
its CudaModule (live/cuda_module.py) compile them for this machine's GPUs (NVRTC, or a cache hit),
loads the image and binds every slot to its CUkernel and parameter list
(``kload_live_v1_bind``). After an edit of the device code the module compiles again and the
server binds the new kernels, so the next call of the same ``torch.ops`` name launches them;
the glue itself is not rebuilt. A new build of the glue replaces the old one the same way.
Nothing here is imported unless ``device_code`` is given.
"""
from __future__ import annotations

import ctypes
import os
import threading

from . import cuda_module as live_cuda
from ..errors import CompileError, KloadError

_lock = threading.Lock()  # held over each binding, and over a change of a library's server
# library path -> [the Server its slots are bound by, the key of that binding]: the last load that
# attached the library (a notebook cell run again makes a new handle for the same library; the old
# handle's server then lets go of it)
_serving: dict[str, list] = {}


class Glue:
    """The kernel slots of one loaded glue library."""

    __slots__ = ("path", "names", "_lib")

    def __init__(self, path: str):
        try:
            lib = ctypes.CDLL(path)  # the library is loaded already: this is its handle, not a second copy
        except OSError as e:
            raise KloadError(f"cannot open {path}: {e}") from None
        if not hasattr(lib, "kload_live_v1_count"):
            raise KloadError(f"{os.path.basename(path)} was given device_code but declares no "
                             "kload::live::Kernel (#include <kload/live.h>; see its first lines)")
        lib.kload_live_v1_name.restype = ctypes.c_char_p
        lib.kload_live_v1_name.argtypes = [ctypes.c_int]
        lib.kload_live_v1_bind.argtypes = [ctypes.c_char_p, ctypes.c_void_p] + [ctypes.c_char_p] * 3
        self.path, self._lib = path, lib
        self.names = frozenset(lib.kload_live_v1_name(i).decode() for i in range(lib.kload_live_v1_count()))

    def bind(self, server: "Server", image, where: str, reason: str | None, missing: str = "") -> None:
        """Bind every slot to ``image``'s kernel of its name, if ``server`` is the library's.
        ``reason`` (no GPU, no NVRTC): bound to no kernel, with it as the error a launch raises;
        a name ``image`` lacks is bound to none, with ``missing`` as the reason."""
        key = (image.entry.key if image is not None else None, reason, missing)
        with _lock:
            serving = _serving.get(self.path)
            if serving is None or serving[0] is not server or serving[1] == key:
                return
        todo = []  # every kernel first, outside the lock (the driver may load the image), then every slot
        for name in sorted(self.names):
            k = image.kernels.get(name) if image is not None else None
            if k is None:
                todo.append((name, 0, "?", missing or reason or "it was not compiled"))
                continue
            params = " ".join(f"{kind}{size}" for kind, size in k["params"])
            todo.append((name, image.kernel(name)[0].value if reason is None else 0, params, reason or ""))
        with _lock:
            serving = _serving.get(self.path)
            if serving is None or serving[0] is not server:  # another server took the library meanwhile
                return
            for name, kernel, params, why in todo:
                self._lib.kload_live_v1_bind(name.encode(), kernel, params.encode(), where.encode(), why.encode())
            serving[1] = key


def target() -> tuple[str, str | None]:
    """What the glue's kernels compile for, and why they cannot be loaded (None: they can):
    the GPUs' own architecture, PTX of the oldest when they differ, ``sm_90`` without a GPU."""
    import torch

    if not torch.cuda.is_available():
        return "sm_90", "no CUDA device here (NVRTC compiled the kernels for sm_90 as a check)"
    targets = {live_cuda.device_target(i) for i in range(torch.cuda.device_count())}
    if len(targets) == 1:
        return targets.pop(), None
    return f"compute_{min(int(t.split('_')[1]) for t in targets)}", None


class Server:
    """Keeps the slots of one handle's glue libraries bound to one CudaModule's kernels: at each
    attach, and after each edit of the device code (the module's edit hook)."""

    def __init__(self, module: live_cuda.CudaModule):
        self.module, self.glues, self.retry, self.lock = module, [], None, threading.RLock()
        module.on_edit(self._after_edit)

    def attach(self, path: str, replaces: Glue | None = None, on_retry=None) -> Glue:
        """Serve the loaded library at ``path`` (instead of ``replaces``, the handle's previous
        build): compile its names, bind its slots. If that fails, nothing else changes: the
        glues served before keep their kernels, a library another server had goes back to it,
        and the error is raised; for a CompileError (the device code does not compile with this
        build's names) the new slots are bound to what there is, the rest say why, and
        ``on_retry`` is called at the next edit of the device code."""
        glue = Glue(path)
        with _lock:
            before = _serving.get(path)
            _serving[path] = [self, None]
        previous = before[0] if before is not None and before[0] is not self else None
        with self.lock:
            old = list(self.glues)
            self.glues[:] = [g for g in self.glues if g is not replaces and g.path != path] + [glue]
            try:
                self.bind()
            except KloadError as e:
                self.glues[:] = old
                try:
                    image, reason = self.bind()  # the names served before: compiled already
                except KloadError:
                    image, reason = None, None
                if previous is not None:
                    with _lock:
                        _serving[path] = [previous, None]
                    try:
                        previous.bind()
                    except KloadError:
                        pass
                elif isinstance(e, CompileError):
                    first = str(e).splitlines()[0]
                    glue.bind(self, image, os.path.basename(self.module.path), reason,
                              missing=f"the device code did not compile with this build's names ({first})")
                if isinstance(e, CompileError):
                    self.retry = on_retry
                raise e from None
            self.retry = None
        if previous is not None:
            previous.let_go(path)
        if replaces is not None and replaces.path != path:
            with _lock:  # the handle's previous build: nobody binds it any more
                if _serving.get(replaces.path, [None])[0] is self:
                    del _serving[replaces.path]
        return glue

    def let_go(self, path: str) -> None:
        """Another handle's server took the library at ``path``."""
        with self.lock:
            self.glues[:] = [g for g in self.glues if g.path != path]
            self.module.want(self, set().union(*(g.names for g in self.glues)))

    def bind(self) -> tuple:
        """Compile (or find) the served names for this machine's GPUs and bind every slot;
        returns the image bound and why it has no kernels (None: it has). Without a GPU the
        kernels are compiled as a check and bound to no kernel, with the reason; without NVRTC
        too, only the reason."""
        t, reason = target()
        with self.lock:
            self.module.want(self, set().union(*(g.names for g in self.glues)))
            if not self.glues:  # nothing to serve: no compile
                return None, reason
            try:
                img = self.module.image_with_names(t)  # names new to the module: one more compile
            except KloadError as e:
                if reason is None or isinstance(e, CompileError):
                    raise
                img, reason = None, f"no CUDA device here, and no NVRTC to compile the device code with ({e})"
            for glue in self.glues:
                glue.bind(self, img, os.path.basename(self.module.path), reason)
            return img, reason

    def _after_edit(self) -> None:
        with self.lock:
            retry, self.retry = self.retry, None
        if retry is not None:  # a build of the glue waits for device code that compiles with its names
            retry()
        self.bind()

