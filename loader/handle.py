"""Step 7 of a load: the user's :class:`Handle`: lazy, memoized attribute access to ops.

The first access of an op finds its entry (resolve.py) and loads the library
(library.py); the op is then stored on the instance, so later calls cost a
plain attribute lookup: ``handle.vector_add`` *is* ``torch.ops.<ns>.vector_add``.
A watched handle (watch.py) drops those attributes when a file changes, and the
next access rebuilds.
"""
from __future__ import annotations

import logging
import threading
import time

from kload.cache import Entry, entry_in_use

from . import knobs
from .library import Loaded, load_entry
from .options import Options
from .resolve import resolve_entry

log = logging.getLogger("kload")

HISTORY: list[dict] = []  # what this process built or loaded, for `%kload` and `python -m kload`


class Handle:
    """Ops and functions of one kernel library, compiled at first use."""

    def __init__(self, opts: Options):
        d = self.__dict__
        d["_opts"] = opts
        d["_mutex"] = threading.RLock()
        d["_loaded"] = None
        d["_entry"] = None
        d["_stale"] = False       # a watched file changed: rebuild at the next access
        d["_files"] = set()       # what the watcher looks at (sources + local headers), if watched
        d["_last_error"] = None   # the rebuild error reported last (each is reported once)

    # -- public API (few names, so they rarely shadow an op; ops stay reachable via .ops) --
    def build(self) -> str:
        """Compile now, or find the build in the cache; returns the artifact's path.

        A cache hit loads nothing. A compile in this process leaves the library
        loaded, as torch's loader does with what it builds (its static
        registrations ran), but binds no ops to this handle: ``load()`` or the
        first op access does that, for every binding style."""
        with self._mutex:
            if self._entry is None:
                entry, how, seconds = resolve_entry(self._opts)
                self._record(entry, how, seconds)
            return str(self._entry.artifact)

    def load(self) -> "Handle":
        """Build if needed and load into this process; returns the handle."""
        self._ensure()
        return self

    def reload(self) -> bool:
        """Check the sources and headers now; rebuild and switch to the new code if
        they changed. True when new code was loaded. A failed rebuild is reported
        and the last good build keeps serving."""
        self.__dict__["_stale"] = True
        return self._refresh()

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
                        "path": str(entry.artifact), "time": time.time(),
                        "pch": entry.manifest.get("pch") if how == "built" else None})
        if how != "built":  # a build's summary replaced its progress line already
            ms = seconds * 1e3
            text = (f"kload: loaded {self._opts.name} from cache in {ms:.1f} ms" if ms < 10 else
                    f"kload: loaded {self._opts.name} from cache in {ms:.0f} ms")
            if knobs.output_mode() is None:
                log.info("%s", text)  # what say() would do, without importing the progress display
            else:
                from .progress import say

                say(text)

    def _ensure(self) -> Loaded:
        loaded = self._loaded
        if loaded is not None:
            return loaded
        with self._mutex:
            if self._loaded is None:
                if self._entry is None:
                    entry, how, seconds = resolve_entry(self._opts)
                    self._record(entry, how, seconds)
                with entry_in_use(self._entry.path):
                    self.__dict__["_loaded"] = load_entry(self._entry)
                self._watch()
            return self._loaded

    def _watch(self) -> None:
        if self._opts.reload:  # reload() checks through the key and needs no file list
            from .watch import watch

            watch(self, [str(p) for p in self._opts.paths] + list(self._entry.manifest.get("headers", {})))

    def _drop_ops(self) -> None:
        for attr in [a for a in list(self.__dict__) if not a.startswith("_")]:  # list(): atomic copy
            self.__dict__.pop(attr, None)

    def _mark_stale(self) -> None:
        """Called by the watcher thread: the next access of an op rebuilds."""
        self.__dict__["_stale"] = True
        self._drop_ops()

    def _refresh(self) -> bool:
        from .errors import KloadError

        with self._mutex:
            if not self._stale:
                return False
            self.__dict__["_stale"] = False
            if self._loaded is None:  # never loaded: the first access builds anyway
                self.__dict__["_entry"] = None
                return False
            try:
                entry, how, seconds = resolve_entry(self._opts)
                if entry.key == self._entry.key:
                    return False
                with entry_in_use(entry.path):
                    loaded = load_entry(entry)
            except (KloadError, OSError) as e:
                text = str(e)
                if text != self._last_error:
                    from .progress import say

                    self.__dict__["_last_error"] = text
                    say(f"kload: rebuilding {self._opts.name} failed; still running the last good build.\n{text}",
                        error=True)
                return False
            self.__dict__["_last_error"] = None
            self._record(entry, how, seconds)
            if loaded.note:
                from .progress import say

                say(loaded.note)
            self.__dict__["_loaded"] = loaded
            self._drop_ops()
            self._watch()
            return True

    def __getattr__(self, attr: str):
        if attr.startswith("_"):
            raise AttributeError(attr)
        if self._stale:
            self._refresh()
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
        base = ["build", "load", "reload", "ops", "module", "namespace", "names"]
        return base + (self._loaded.names() if self._loaded is not None else [])

    def __repr__(self) -> str:
        state = "not built yet" if self._entry is None else f"entry {self._entry.path.name}"
        if self._loaded is not None:
            state += ", loaded: " + ", ".join(self._loaded.names())
        return f"<kload.Handle {self._opts.name!r} ({state})>"
