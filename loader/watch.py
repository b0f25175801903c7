"""Reload on save: one watchdog observer per process marks handles stale when a
file they were built from changes; the handle rebuilds at its next access.

The observer runs in its own thread, so the call path pays nothing: a handle's
ops live in its ``__dict__`` and are dropped from it when a file changes.
"""
from __future__ import annotations

import logging
import os
import threading
import weakref

log = logging.getLogger("kload")

_lock = threading.Lock()
_observer = None
_handler = None
_watched_dirs: dict[str, object] = {}               # directory -> watchdog watch
_handles: "weakref.WeakSet" = weakref.WeakSet()      # handles that reload on save


def _norm(path: str) -> str:
    return os.path.normpath(os.path.abspath(path))


# What counts as a save in a directory watched whole: sources and headers (a standard-style header has
# no suffix), not an editor's swap, backup or lock files, a notebook's autosave or a log.
SOURCE_LIKE = {".c", ".cc", ".cpp", ".cxx", ".c++", ".cu", ".h", ".hh", ".hpp", ".hxx", ".h++", ".cuh", ".inc",
               ".inl", ".ipp", ".tcc", ".tpp", ".def", ""}


def _source_like(path: str) -> bool:
    name = os.path.basename(path)
    return not name.startswith((".", "#")) and not name.endswith("~") and os.path.splitext(name)[1] in SOURCE_LIKE


def _changed(paths: set[str]) -> None:
    try:
        dirs = {os.path.dirname(p) for p in paths if _source_like(p)}
        for handle in list(_handles):
            if paths & handle._files or dirs & handle._dirs:
                handle._mark_stale()
    except Exception as e:  # noqa: BLE001 - the watcher thread must survive anything
        log.warning("kload: file watcher: %s", e)


def _lost(d: str) -> None:
    """A watched directory was deleted (a ``git checkout`` that removes it): its watch ended
    with it. Forget it, so that the next ``watch()`` there schedules it again (a rebuild's, at
    the handles' next access: they are marked stale here)."""
    try:
        with _lock:
            w = _watched_dirs.pop(d, None)
            if w is None:
                return
            try:
                _observer.unschedule(w)  # (watchdog allows it from a handler)
            except KeyError:  # already gone: nothing to undo
                pass
        for handle in list(_handles):
            if any(os.path.dirname(f) == d for f in handle._files):
                handle._mark_stale()
    except Exception as e:  # noqa: BLE001 - the watcher thread must survive anything
        log.warning("kload: file watcher: %s", e)


def _make_handler():
    from watchdog.events import FileSystemEventHandler

    class Handler(FileSystemEventHandler):
        def on_any_event(self, event):
            if event.is_directory:
                if event.event_type == "deleted":
                    _lost(_norm(event.src_path))
                return
            if event.event_type in ("opened", "closed_no_write"):
                return
            paths = {_norm(event.src_path)}
            dest = getattr(event, "dest_path", "")
            if dest:  # editors save by writing a temporary file and renaming it
                paths.add(_norm(dest))
            _changed(paths)

    return Handler()


def watch(handle, files, *, whole_dirs: bool = False) -> None:
    """Mark ``handle`` stale whenever one of ``files`` is written, replaced or removed;
    with ``whole_dirs``, any file in their directories (while the files a build reads
    are not known yet: during a first build, after a failed one, which may have missed
    a header that does not exist yet)."""
    global _observer, _handler
    files = {_norm(f) for f in files}
    handle.__dict__["_files"] = files
    handle.__dict__["_dirs"] = {os.path.dirname(f) for f in files} if whole_dirs else set()
    with _lock:
        try:
            if _observer is None:
                from watchdog.observers import Observer  # inotify on Linux

                _observer = Observer()
                _observer.daemon = True
                _observer.start()
                _handler = _make_handler()
            for d in sorted({os.path.dirname(f) for f in files}):
                if d not in _watched_dirs and os.path.isdir(d):
                    _watched_dirs[d] = _observer.schedule(_handler, d, recursive=False)
        except Exception as e:  # noqa: BLE001 - e.g. out of inotify watches: reload() still works
            log.warning("kload: cannot watch %s for changes (%s); call handle.reload() after an edit",
                        ", ".join(sorted(files)), e)
            return
        _handles.add(handle)
