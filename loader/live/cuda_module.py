"""CUDA device code compiled by NVRTC, cached, and swapped in place on edit.

    mod = kload.cuda_module("saxpy.cu")            # __global__ functions only; nothing compiles yet
    mod.saxpy[blocks, 256](out, x, y, 2.0, n)      # first launch: NVRTC (or a cache hit), load, launch
    mod["scale<float>"][blocks, 256, 0](x, n)      # a template: its name expression; [grid, block, shared]

The key, lookup, compile and publish: kload.cubin (a cache entry of kind ``cubin``).
The load: kload.cudadrv, on the first launch on a device of that architecture.
The swap: after an edit (the file watcher, or ``mod.reload()``) the next launch compiles
   again and launches the new kernel; a failed compile is reported once and the last
   good kernel keeps serving. A ``torch.library.custom_op`` that launches ``mod.k`` keeps
   its ``torch.ops`` name and runs the new kernel.
"""
from __future__ import annotations

import logging
import os
import threading
import time

from kload.cache import Entry
from kload.cache.store import Store

from . import cubin, cudadrv, nvrtc
from .. import knobs
from ..reloading import Reloading
from ..errors import CompileError, KloadError

log = logging.getLogger("kload")


class Image:
    """One compiled entry, loaded into the driver on first use."""

    __slots__ = ("entry", "kernels", "_library", "_handles")

    def __init__(self, entry: Entry):
        self.entry, self.kernels = entry, entry.manifest["kernels"]
        self._library, self._handles = None, {}

    def kernel(self, name: str):
        """(CUkernel, its argument Packer) of a name expression; loads the library on first use."""
        h = self._handles.get(name)
        if h is None:
            if self._library is None:
                self._library = cudadrv.load_library(self.entry.artifact.read_bytes())
            k = self.kernels[name]
            h = self._handles[name] = (cudadrv.get_kernel(self._library, k["lowered"]),
                                       cudadrv.Packer(name, k["params"]))
        return h


class CudaModule:
    """The device code of one ``.cu`` file; ``mod.<kernel>`` / ``mod["expr<T>"]`` launch it."""

    def __init__(self, path, *, names=(), options=(), include_paths=(), reload=None):
        self.path = os.path.abspath(os.fspath(path))
        self.options = [str(o) for o in options]
        self.include_paths = [os.path.abspath(os.fspath(p)) for p in include_paths]
        self.store = Store(knobs.cache_dir())
        self.compiles = 0                 # NVRTC runs of this module (a cache hit is none)
        self._names = set(names)          # name expressions asked for by the user or a first launch
        self._wanted: dict = {}           # ... and by an owner (kload.live.glue): owner -> names
        self._images: dict[str, Image] = {}  # target -> its current image
        self._kernels: dict[str, Kernel] = {}
        self._on_edit: list = []
        self._timer: threading.Timer | None = None
        self._lock = threading.RLock()
        self._reload = Reloading(os.path.basename(self.path), self._edited)  # kload.reloading
        if not os.path.isfile(self.path):
            raise KloadError(f"no such kernel file: {self.path}")
        bad = [o for o in self.options if o.startswith(("-arch", "--gpu-architecture"))]
        if bad or not all(isinstance(n, str) and n for n in self._names):
            raise KloadError(f"cuda_module({os.path.basename(self.path)!r}): " + (
                f"{bad[0]!r}: the target is each device's own (mod.compile(target) without a GPU)" if bad
                else f"names must be kernel names or name expressions (strings), got {sorted(map(repr, names))}"))
        if knobs.reload() if reload is None else reload:
            self._reload.watch([self.path])

    def _edited(self) -> None:  # the policy's on_stale: the file watcher, from its own thread
        if self._on_edit:  # e.g. C++ glue, which calls no Python: rebind soon, off the watcher's thread
            if self._timer is not None:
                self._timer.cancel()  # a burst of events (an editor's save): one compile, 50 ms after the last
            self._timer = threading.Timer(0.05, self._after_edit)
            self._timer.daemon = True
            self._timer.start()

    def _after_edit(self) -> None:
        for hook in list(self._on_edit):
            try:
                hook()
            except Exception as e:  # noqa: BLE001 - a timer thread: report, keep the last good kernels
                self._reload.failed(e, "glue")

    def on_edit(self, hook) -> None:
        """Call ``hook()`` after each edit: from a timer thread 50 ms after a save (with reload
        on), and from ``reload()`` when the kernels changed (kload.live.glue rebinds C++ glue so)."""
        self._on_edit.append(hook)

    def want(self, owner, names) -> None:
        """Compile ``names`` too, for ``owner`` (replacing what it wanted before; empty: nothing)."""
        with self._lock:
            self._wanted[owner] = frozenset(names)

    def names(self) -> set[str]:
        """Every name expression the next compile asks NVRTC for."""
        return set(self._names).union(*self._wanted.values())

    def image_with_names(self, target: str) -> Image:
        """``image(target)``, compiled again if it lacks a name ``want`` added since."""
        with self._lock:
            img = self.image(target)
            if not self.names() <= set(img.kernels):
                img = self._images[target] = self._load(target)
            return img

    def __getattr__(self, name: str) -> "Kernel":
        if name.startswith("_"):
            raise AttributeError(name)
        return self[name]

    def __getitem__(self, expr: str) -> "Kernel":
        k = self._kernels.get(expr)
        if k is None:
            k = self._kernels[expr] = Kernel(self, expr)
        return k

    def image(self, target: str) -> Image:
        """The current image for ``target`` (``sm_90``, or ``compute_90`` for PTX): compiled or
        found in the cache; after an edit, compiled again (every loaded target)."""
        img = self._images.get(target)
        if img is not None and not self._reload.stale:
            return img
        with self._lock:
            if self._reload.take_stale():
                return self._swap(set(self._images) | {target}, target)
            img = self._images.get(target)
            return img if img is not None else self._swap({target}, target)

    def _swap(self, targets: set, target: str) -> Image:
        """Compile or look up ``targets``; a failure keeps each target's last good image
        and is reported once (raised if there is none)."""
        reloading = self._reload.watched
        if reloading:  # a save during the compile, or after it fails, is seen (the next good one narrows it)
            self._reload.watch(self._reload.files, whole_dirs=True)
        failed = False
        for t in sorted(targets):
            try:
                self._images[t] = self._load(t)
            except CompileError as e:
                if reloading:  # a header it lacks may appear beside the others
                    self._reload.watch(self._reload.files, whole_dirs=True)
                if t not in self._images:
                    raise
                self._reload.failed(e)  # said once; the last good image keeps serving
                failed = True
        if not failed:
            self._reload.recovered()
        return self._images[target]

    def _load(self, target: str) -> Image:
        """The image of ``target`` for the file as it is now: the loaded one if its key is
        unchanged (a save without a change), else a new one from the cache or NVRTC."""
        plan = cubin.Plan(self.store, self.path, self.names(), self.options, self.include_paths, target)
        entry = cubin.lookup(self.store, plan)
        if entry is None:
            started = time.perf_counter()
            entry = cubin.build(self.store, plan, self.path)
            self.compiles += 1
            log.info("NVRTC compiled %s for %s in %.0f ms", os.path.basename(self.path), target,
                     (time.perf_counter() - started) * 1e3)
        if self._reload.watched:  # reload on save: watch the headers too
            self._reload.watch([f for f in plan.files if not f.startswith("<")])
            if entry.changed_during_build:  # a file saved while NVRTC compiled: the next access checks again
                self._reload.stale = True
        old = self._images.get(target)
        return old if old is not None and old.entry.key == entry.key else Image(entry)

    def reload(self) -> bool:
        """Check the file and its headers now; True if a target's kernels changed."""
        with self._lock:
            before = {t: img.entry.key for t, img in self._images.items()}
            self._reload.stale = True
            for t in before or ():
                self.image(t)
            changed = {t: img.entry.key for t, img in self._images.items()} != before
        for hook in list(self._on_edit) if changed else ():
            hook()
        return changed

    def compile(self, target: str | None = None) -> Entry:
        """Compile (or find) this file's device code for ``target`` (default: the current
        GPU's, else sm_90); no GPU needed. Returns the cache entry; raises CompileError."""
        if target is None:
            import torch

            target = device_target(torch.cuda.current_device()) if torch.cuda.is_available() else "sm_90"
        return self.image(target).entry

    def _need(self, expr: str, target: str) -> Image:
        """The image of ``target`` with kernel ``expr`` in it (a new name: one more compile)."""
        img = self.image(target)
        if expr in img.kernels:
            return img
        with self._lock:
            self._names.add(expr)
            try:
                img = self._images[target] = self._load(target)
            except BaseException:
                self._names.discard(expr)
                raise
        return img


_ARCH: dict[int, str] = {}


def device_target(index: int) -> str:
    """What to compile for device ``index``: its own ``sm_XY``, or PTX for the newest
    architecture this NVRTC knows when the device is newer (the driver compiles that)."""
    import torch

    major, minor = torch.cuda.get_device_capability(index)
    cc, known = major * 10 + minor, nvrtc.library().archs()
    _ARCH[index] = f"sm_{cc}" if cc in known else f"compute_{max([a for a in known if a <= cc] or known)}"
    return _ARCH[index]


class Kernel:
    """``mod.name[grid, block]`` or ``[grid, block, shared_bytes]`` -> a launcher."""

    __slots__ = ("mod", "name", "_configs")

    def __init__(self, mod: CudaModule, name: str):
        self.mod, self.name, self._configs = mod, name, {}

    def __getitem__(self, config) -> "Launch":
        try:
            return self._configs[config]
        except (KeyError, TypeError):  # a new configuration, or one with a list (unhashable)
            launch = Launch(self, *cudadrv.launch_config(self.name, config))
            if len(self._configs) < 64:
                try:
                    self._configs[config] = launch
                except TypeError:
                    pass
            return launch

    def __repr__(self) -> str:
        return f"<kload kernel {self.name} of {self.mod.path}>"


class Launch:
    __slots__ = ("kernel", "grid", "block", "smem")

    def __init__(self, kernel: Kernel, grid, block, smem):
        self.kernel, self.grid, self.block, self.smem = kernel, grid, block, smem

    def __call__(self, *args, stream=None) -> None:
        """Launch on ``stream`` (default: torch's current stream of the tensors' device),
        under that device's guard. Tensors must all be on one CUDA device."""
        import torch

        name, index = self.kernel.name, None
        for a in args:
            if isinstance(a, torch.Tensor):
                d = a.get_device()  # -1 on the CPU
                if index is None:
                    index = d
                elif d != index:
                    index = -2
        if index is None or index < 0:
            raise KloadError(f"{name}: the tensor arguments must be on one CUDA device, got "
                             f"{sorted({str(a.device) for a in args if isinstance(a, torch.Tensor)}) or 'none'}")
        target = _ARCH.get(index) or device_target(index)
        with torch.cuda.device(index):
            cudadrv.ensure_context(index)
            kern, packer = self.kernel.mod._need(name, target).kernel(name)
            ptrs, keep = packer(args)
            if self.smem > cudadrv.MAX_STATIC_SHARED:
                cudadrv.allow_shared(kern, self.smem, index)
            s = _raw_stream(index) if stream is None else getattr(stream, "cuda_stream", stream)
            cudadrv.launch(kern, self.grid, self.block, self.smem, s, ptrs, self._describe)
        del keep

    def _describe(self) -> str:
        return (f"launching {self.kernel.name} ({os.path.basename(self.kernel.mod.path)}) with grid "
                f"{self.grid}, block {self.block}, {self.smem} shared bytes")


def _raw_stream(index: int) -> int:
    """torch's current stream of device ``index``, as the CUstream value."""
    import torch

    raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)  # no Stream object: ~1 us less a launch
    return raw(index) if raw is not None else torch.cuda.current_stream(index).cuda_stream


def cuda_module(path, *, names=(), options=(), include_paths=(), reload=None) -> CudaModule:
    """The CUDA device code of ``path`` (``__global__`` functions and what they use; no
    host code), compiled with NVRTC at first launch and cached by content.

    Args:
        path: the kernel file.
        names: name expressions to compile up front (``"scale<float>"``); others are added
            at their first launch (each addition is one more compile, or a cache hit).
        options: extra NVRTC options (``-use_fast_math``, ``-DTILE=32``, ``-lineinfo``).
        include_paths: searched for ``#include`` after the file's own directory.
        reload: recompile on save (default: as ``kload.load``, KLOAD_RELOAD).
    Returns:
        a CudaModule: ``mod.saxpy[grid, block](args...)``, ``mod["k<float>"][grid, block, smem](...)``.
    Raises:
        KloadError: no such file. At launch: CompileError (file:line:col), KloadError (bad
        configuration or arguments, a CUDA error of the launch, no NVRTC or driver).

    Example::

        >>> mod = kload.cuda_module("saxpy.cu")             # nothing compiles yet
        >>> x, y = torch.ones(1024, device="cuda"), torch.ones(1024, device="cuda")
        >>> out = torch.empty_like(x)
        >>> mod.saxpy[4, 256](out, x, y, 2.0, 1024)          # NVRTC (or a cache hit), then the launch
        >>> mod.compile("sm_90").path                         # no GPU needed: the cubin's cache entry
    """
    return CudaModule(path, names=names, options=options, include_paths=include_paths, reload=reload)
