"""The handle ``kload.load`` returns: lazy, memoized, attribute access to ops.

The first access of an op builds (or finds in the cache) and loads the library;
the op is then stored on the instance, so later calls cost a plain attribute
lookup: ``handle.vector_add`` *is* ``torch.ops.<ns>.vector_add``.
"""
from __future__ import annotations

import logging
import threading
import time

from kload.cache.store import Entry, Store

from . import knobs
from .plan import Options, plan
from .runtime import Loaded, check_fixed_namespaces, load_entry

log = logging.getLogger("kload")

HISTORY: list[dict] = []  # what this process built or loaded, for `%kload` and `python -m kload`


def resolve_entry(opts: Options) -> tuple[Entry, str, float]:
    """``(entry, "cache" | "built", seconds)``: look up, else lock and compile."""
    started = time.perf_counter()
    store = Store(knobs.cache_dir())
    p = plan(opts, store)
    entry = store.lookup(p.skey)
    if entry is not None:
        return entry, "cache", time.perf_counter() - started
    # a fixed TORCH_LIBRARY namespace can be registered once per process: refuse
    # before compiling, since torch loads what it builds
    check_fixed_namespaces(opts.name, p.sources.fixed_namespaces, None)
    from .build import compile_plan  # the compile machinery loads on a miss only

    entry, seconds = compile_plan(p, store)
    how = "built" if seconds > 0 else "cache"
    return entry, how, time.perf_counter() - started


class Handle:
    """Ops and functions of one kernel library, compiled at first use."""

    def __init__(self, opts: Options):
        d = self.__dict__
        d["_opts"] = opts
        d["_mutex"] = threading.RLock()
        d["_loaded"] = None
        d["_entry"] = None

    # -- public API (few names, so they rarely shadow an op; ops stay reachable via .ops) --
    def build(self) -> str:
        """Compile now (or find in the cache) without loading; returns the artifact's path."""
        with self._mutex:
            if self._entry is None:
                entry, how, seconds = resolve_entry(self._opts)
                self._record(entry, how, seconds)
            return str(self._entry.artifact)

    def load(self) -> "Handle":
        """Build if needed and load into this process; returns the handle."""
        self._ensure()
        return self

    @property
    def ops(self):
        """``torch.ops.<namespace>`` of this build (op libraries)."""
        import torch

        loaded = self._ensure()
        if not loaded.namespaces:
            raise AttributeError(f"kload: {self._opts.name!r} registers no operators (it is a pybind11 module)")
        return getattr(torch.ops, loaded.namespaces[0])

    @property
    def module(self):
        """The pybind11 module of a classic extension, else None."""
        return self._ensure().module

    @property
    def namespace(self) -> str | None:
        """The operator namespace of this build, as in ``torch.ops.<namespace>``."""
        ns = self._ensure().namespaces
        return ns[0] if ns else None

    def names(self) -> list[str]:
        """Every op and function this library exposes."""
        return self._ensure().names()

    # -- machinery --------------------------------------------------------------
    def _record(self, entry: Entry, how: str, seconds: float) -> None:
        self.__dict__["_entry"] = entry
        HISTORY.append({"name": self._opts.name, "how": how, "seconds": seconds, "key": entry.key,
                        "path": str(entry.artifact), "time": time.time()})
        if how == "built":
            log.info("kload: built %s in %.1f s", self._opts.name, seconds)
        else:
            log.info("kload: loaded %s from cache in %.0f ms", self._opts.name, seconds * 1e3)

    def _ensure(self) -> Loaded:
        loaded = self._loaded
        if loaded is not None:
            return loaded
        with self._mutex:
            if self._loaded is None:
                if self._entry is None:
                    entry, how, seconds = resolve_entry(self._opts)
                    self._record(entry, how, seconds)
                else:
                    how = "cache"
                self.__dict__["_loaded"] = load_entry(self._entry, just_built=(how == "built"))
            return self._loaded

    def __getattr__(self, attr: str):
        if attr.startswith("_"):
            raise AttributeError(attr)
        loaded = self._ensure()
        value = loaded.resolve(attr)
        if value is None:
            names = loaded.names()
            raise AttributeError(
                f"kload: {self._opts.name!r} has no op or function {attr!r}; it has: "
                + (", ".join(names) if names else "(nothing)")
            )
        self.__dict__[attr] = value
        return value

    def __setattr__(self, attr, value):
        raise AttributeError(f"kload: a handle's attributes are its ops; cannot set {attr!r}")

    def __dir__(self):
        base = ["build", "load", "ops", "module", "namespace", "names"]
        return base + (self._loaded.names() if self._loaded is not None else [])

    def __repr__(self) -> str:
        state = "not built yet" if self._entry is None else f"entry {self._entry.path.name}"
        if self._loaded is not None:
            state += ", loaded: " + ", ".join(self._loaded.names())
        return f"<kload.Handle {self._opts.name!r} ({state})>"
