"""The user's :class:`Handle`: lazy, memoized attribute access to ops; where a load
starts (with kload.load) and where it ends.

The first access of an op finds its entry (kload.resolve) and loads the library
(kload.resolve.library); the op is then stored on the instance, so later calls cost a
plain attribute lookup: ``handle.vector_add`` *is* ``torch.ops.<ns>.vector_add``.
A watched handle (kload.reloading) drops those attributes when a file changes, and
the next access rebuilds; a failed rebuild leaves the last good build serving.
"""
from __future__ import annotations

import logging
import threading
import time

from kload.cache import Entry, entry_in_use

from .. import knobs
from ..resolve.library import Loaded, load_entry
from ..options import Options
from ..resolve import Resolved, resolve_entry
from ..messages import msg
from ..reloading import Reloading

log = logging.getLogger("kload")

HISTORY: list[dict] = []  # what this process built or loaded, for `%kload` and `python -m kload`


class _Serving:
    """What keeps a Handle's library loaded and current: its first resolve and load, the
    rebuild after an edit (the last good build serving if it fails: kload.reloading), the
    device code bound into it. Handle is its public face."""

    def __init__(self, opts: Options):
        d = self.__dict__
        d["_opts"] = opts
        d["_mutex"] = threading.RLock()
        d["_loaded"] = None
        d["_resolved"] = None     # the last resolve_entry() result: the entry, how, the plan
        d["_reload"] = Reloading(opts.name, self._drop_ops)  # stale or not, failures said once (kload.reloading)
        d["_device"] = None       # device_code=: the live_glue.Server of its CudaModule, made at the first load
        d["_glue"] = None         # the loaded build's kernel slots that server binds

    @property
    def _entry(self) -> Entry | None:
        return self._resolved.entry if self._resolved is not None else None

    def _record(self, resolved: Resolved) -> None:
        self.__dict__["_resolved"] = resolved
        entry, how, seconds = resolved.entry, resolved.how, resolved.seconds
        HISTORY.append({"name": self._opts.name, "how": how, "seconds": seconds, "key": entry.key,
                        "path": str(entry.artifact), "time": time.time(),
                        "pch": entry.manifest.get("pch") if how == "built" else None})
        if how != "built":  # a build's summary replaced its progress line already
            ms = seconds * 1e3
            text = (f"loaded {self._opts.name} from cache in {ms:.1f} ms" if ms < 10 else
                    f"loaded {self._opts.name} from cache in {ms:.0f} ms")
            if knobs.output_mode() is None:
                log.info("%s", text)  # what say() would do, without importing the progress display
            else:
                from ..progress import say

                say(text)

    def _ensure(self) -> Loaded:
        loaded = self._loaded
        if loaded is not None:
            return loaded
        with self._mutex:
            if self._loaded is None:
                if self._resolved is None:
                    self._watch(whole_dirs=True)
                    self._record(resolve_entry(self._opts))
                with entry_in_use(self._entry.path):
                    loaded = load_entry(self._entry)
                    self._bind_device_code(loaded)
                self.__dict__["_loaded"] = loaded
                self._watch()
            return self._loaded

    def _bind_device_code(self, loaded: Loaded) -> None:
        """device_code=: bind the library's kernel slots to the NVRTC-compiled kernels
        (kload.live.glue), and keep them bound after each edit of the device code."""
        if self._opts.device_code is None:
            return
        from ..live import cuda_module as live_cuda, glue as live_glue  # only here: the CPU-only path imports nothing of CUDA

        if self._device is None:
            module = live_cuda.CudaModule(self._opts.device_code, include_paths=self._opts.include_paths,
                                          reload=self._opts.reload)
            self.__dict__["_device"] = live_glue.Server(module)
        # if the device code does not compile with this build's names, the next edit of it retries
        glue = self._device.attach(str(loaded.entry.artifact), self._glue, self._reload.mark_stale)
        self.__dict__["_glue"] = glue

    def _watch(self, *, whole_dirs: bool = False) -> None:
        """Reload on save: watch the sources and the headers the build read. From the start
        of a build until one succeeds, any source-like file in their directories (the headers
        are not known yet, or one may be missing); a build during which a file changed (the
        cache keeps it for no one) makes the next access check again."""
        if not self._opts.reload:  # reload() checks through the key and needs no file list
            return
        sources = [str(p) for p in self._opts.paths]
        if whole_dirs:
            self._reload.watch(sources + list(self._reload.files or ()), whole_dirs=True)
            return
        self._reload.watch(sources + list(self._entry.manifest.get("headers", {})))
        if self._entry.changed_during_build:
            self._reload.mark_stale()

    def _drop_ops(self) -> None:
        """The policy's ``on_stale`` (the watcher's thread): the next access of an op
        rebuilds. The flag is up before the ops go; ``__getattr__`` caches an op and then
        checks the flag, so an op fetched while a save is being marked is never kept past
        the mark."""
        for attr in [a for a in list(self.__dict__) if not a.startswith("_")]:  # list(): atomic copy
            self.__dict__.pop(attr, None)

    def _reload_now(self) -> bool:
        """``reload()``: the sources and headers, then the device code (its own key; the glue
        is not rebuilt for it). A failure of either is said once; the last good keeps serving."""
        self._reload.stale = True
        rebuilt = self._refresh()
        if self._device is None:
            return rebuilt
        from ..errors import KloadError

        try:
            changed = self._device.module.reload()
            if not changed:
                self._device.bind()  # one an earlier failure left undone (nothing, when bound)
            self._reload.recovered("device code")
        except KloadError as e:
            self._reload.failed(e, "device code")
            changed = False
        if self._reload.stale:  # the device code's edit lets a waiting build of the glue try again
            rebuilt = self._refresh() or rebuilt
        return changed or rebuilt

    def _refresh(self) -> bool:
        from ..errors import KloadError

        with self._mutex:
            if not self._reload.take_stale():
                return False
            if self._loaded is None:  # never loaded: the first access builds anyway
                self.__dict__["_resolved"] = None
                return False
            self._watch(whole_dirs=True)  # a save during this build, or after it fails, is seen
            try:
                resolved = resolve_entry(self._opts)
                if resolved.entry.key == self._entry.key:  # e.g. a broken edit undone: all is as loaded
                    self._reload.recovered()
                    self._watch()
                    return False
                with entry_in_use(resolved.entry.path):
                    loaded = load_entry(resolved.entry)
                    self._bind_device_code(loaded)
            except (KloadError, OSError) as e:
                self._reload.failed(e)  # (the directories stay watched whole)
                return False
            self._reload.recovered()
            self._record(resolved)
            if loaded.note:
                from ..progress import say

                say(loaded.note)
            self.__dict__["_loaded"] = loaded
            self._drop_ops()
            self._watch()
            return True


class Handle(_Serving):
    """Ops and functions of one kernel library, compiled at first use (``kload.load``,
    ``kload.load_inline`` and the ``%%kload`` magic make one).

    An op is an attribute: ``handle.vector_add`` *is* ``torch.ops.<ns>.vector_add`` once
    found, so a call costs what torch's dispatcher costs. The few names below are the
    handle's own; an op they shadow stays reachable through :attr:`ops`.

    Example::

        >>> ops = kload.load("vector_add.cpp")
        >>> ops.vector_add(torch.ones(3), torch.ones(3))   # first use: built or found, loaded
        tensor([2., 2., 2.])
        >>> ops.names()
        ['vector_add']
    """

    # -- public API (few names, so they rarely shadow an op; ops stay reachable via .ops) --
    def build(self) -> Resolved:
        """Compile now, or find the build in the cache.

        Loads nothing, a compile included (unlike torch's loader): ``load()`` or the
        first op access opens the library and registers its ops, where a mistake in
        the registration is an exception and not the end of the process.

        Returns:
            The artifact's path, a ``str``; it also says how it was found: ``.how``
            (``"built"`` or ``"cache"``), ``.seconds``, ``.entry`` (the cache entry),
            ``.build_dir`` (ninja's directory, with ``compile_commands.json``).

        Raises:
            CompileError: the compiler failed (first errors, and the full log's path).
            KloadError: no bindings in the sources, an unusable toolchain or cache,
                KLOAD_DISABLE_JIT=1 and no cached build.

        Example::

            >>> path = kload.load("vector_add.cpp").build()
            >>> path.how, path.build_dir / "compile_commands.json"
            ('built', PosixPath('.../compile_commands.json'))
        """
        with self._mutex:
            if self._resolved is None:
                self._record(resolve_entry(self._opts))
            return self._resolved

    def load(self) -> "Handle":
        """Build if needed and load the library into this process.

        Returns:
            This handle (so ``kload.load(...).load()`` chains).

        Raises:
            CompileError, KloadError: as :meth:`build`.
            RegistrationError: torch refused a registration (an op defined twice, a kernel
                whose types differ from its schema): at the user's ``m.impl``/``m.def`` line.
            KloadError: the library cannot be loaded (a fixed TORCH_LIBRARY namespace
                this process has already).

        Example::

            >>> ops = kload.load("vector_add.cpp").load()   # built and loaded now, not at the first call
            >>> ops.namespace                                 # its ops are in torch.ops.<namespace>
            'kload_vector_add_5d41402abc'
        """
        self._ensure()
        return self

    def reload(self) -> bool:
        """Check the sources and headers now (and the device code, with ``device_code=``);
        rebuild and switch to the new code if they changed. A failed rebuild is reported
        and the last good build keeps serving.

        Returns:
            True when new code was loaded.

        Raises:
            Nothing for a failed rebuild (it is said once, on stderr and the ``kload``
            log); CompileError or KloadError only where no build ever loaded.

        Example::

            >>> ops = kload.load("vector_add.cpp", reload=False)
            >>> # ... edit vector_add.cpp ...
            >>> ops.reload()
            True
        """
        return self._reload_now()

    @property
    def ops(self):
        """``torch.ops.<namespace>`` of this build (op libraries): every op, even one
        named like a handle method (``ops.ops.load``).

        Raises:
            AttributeError: a pybind11 module, which registers no operators."""
        import torch

        loaded = self._ensure()
        if not loaded.namespaces:
            raise AttributeError(msg(f"{self._opts.name!r} registers no operators (it is a pybind11 module)"))
        return getattr(torch.ops, loaded.namespaces[0])

    @property
    def module(self):
        """The pybind11 module of a classic extension (``PYBIND11_MODULE``), else None.

        Example::

            >>> kload.load("tutorial.cpp").module.forward   # a pybind11 function
        """
        return self._ensure().module

    @property
    def namespace(self) -> str | None:
        """The operator namespace of this build, as in ``torch.ops.<namespace>``: chosen by
        kload (``kload_<name>_<hex>``) for KLOAD_LIBRARY, the user's for TORCH_LIBRARY;
        None for a pybind11 module. Builds and loads the library first."""
        ns = self._ensure().namespaces
        return ns[0] if ns else None

    def names(self) -> list[str]:
        """Every op and function this library exposes (builds and loads it first).

        Returns:
            The names, sorted: ``["vector_add"]``."""
        return self._ensure().names()

    def __getattr__(self, attr: str):
        if attr.startswith("_"):
            raise AttributeError(attr)
        if self._reload.stale:
            self._refresh()
        loaded = self._ensure()
        value = loaded.attribute(attr)
        if value is None:
            names = loaded.names()
            raise AttributeError(msg(f"{self._opts.name!r} has no op or function {attr!r}; it has: "
                                     + (", ".join(names) if names else "(nothing)")))
        self.__dict__[attr] = value
        if self._reload.stale or self._loaded is not loaded:  # a save marked meanwhile (after the watcher's drop),
            self.__dict__.pop(attr, None)              # or another thread's rebuild: keep none of it
        return value

    def __setattr__(self, attr, value):
        raise AttributeError(msg(f"a handle's attributes are its ops; cannot set {attr!r}"))

    def __dir__(self):
        base = ["build", "load", "reload", "ops", "module", "namespace", "names"]
        return base + (self._loaded.names() if self._loaded is not None else [])

    def __repr__(self) -> str:
        state = "not built yet" if self._entry is None else f"entry {self._entry.path.name}"
        if self._loaded is not None:
            state += ", loaded: " + ", ".join(self._loaded.names())
        return f"<kload.Handle {self._opts.name!r} ({state})>"
