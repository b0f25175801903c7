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
_ended: list = []                                    # watches of deleted folders, to unschedule
_handles: "weakref.WeakSet" = weakref.WeakSet()      # handles that reload on save


def _norm(path: str) -> str:
    return os.path.normpath(os.path.abspath(path))


# What counts as a save in a directory watched whole: sources and headers (a standard-style header has
# no suffix), not an editor's swap, backup or lock files, a notebook's autosave or a log.
SOURCE_LIKE = {".c", ".cc", ".cpp", ".cxx", ".c++", ".cu", ".h", ".hh", ".hpp", ".hxx", ".h++", ".cuh", ".inc",
               ".inl", ".ipp", ".tcc", ".tpp", ".def", ""}


def source_like(path: str) -> bool:
    """Whether a save of ``path`` can change a build (its name, not its contents)."""
    name = os.path.basename(path)
    return not name.startswith((".", "#")) and not name.endswith("~") and os.path.splitext(name)[1] in SOURCE_LIKE


def _changed(paths: set[str]) -> None:
    try:
        dirs = {os.path.dirname(p) for p in paths if source_like(p)}
        for handle in list(_handles):
            if paths & handle._files or dirs & handle._dirs:
                handle._mark_stale()
    except Exception as e:  # noqa: BLE001 - the watcher thread must survive anything
        log.warning("file watcher: %s", e)


def _folder_event(d: str, deleted: bool) -> None:
    """A folder was deleted (a ``git checkout`` that removes it) or created. A deleted watched
    folder's watch ended with it: it is forgotten (unscheduled by the next ``watch()``, which
    holds the lock; this thread takes none, since older watchdogs call handlers under their
    own lock). Handles with files in or under ``d`` are marked stale: their next access
    watches again, the folder itself once it exists, or its nearest existing parent."""
    try:
        if deleted:
            w = _watched_dirs.get(d)
            if w is not None:
                _ended.append(w)  # before the pop: a watch() that sees it gone unschedules it first
                _watched_dirs.pop(d, None)
        under = d + os.sep
        for handle in list(_handles):
            if any(f.startswith(under) for f in handle._files):
                handle._mark_stale()
    except Exception as e:  # noqa: BLE001 - the watcher thread must survive anything
        log.warning("file watcher: %s", e)


def _make_handler():
    from watchdog.events import FileSystemEventHandler

    class Handler(FileSystemEventHandler):
        def on_any_event(self, event):
            if event.is_directory:
                if event.event_type in ("deleted", "created"):
                    _folder_event(_norm(event.src_path), event.event_type == "deleted")
                elif event.event_type == "moved":
                    _folder_event(_norm(event.src_path), True)
                    _folder_event(_norm(event.dest_path), False)
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
    with ``whole_dirs``, any source-like file in their directories (from the start of a
    build until one succeeds: the files a build reads are not known before it, and a
    failed one may lack a header that does not exist yet). A folder that does not exist
    is awaited from its nearest existing parent."""
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
            while _ended:  # watches that ended with their folder (_folder_event)
                try:
                    _observer.unschedule(_ended.pop())
                except KeyError:
                    pass
            for d in sorted({os.path.dirname(f) for f in files}):
                while not os.path.isdir(d) and os.path.dirname(d) != d:
                    d = os.path.dirname(d)  # deleted (a checkout under way): its parent says when it is back
                if d not in _watched_dirs:
                    _watched_dirs[d] = _observer.schedule(_handler, d, recursive=False)
        except Exception as e:  # noqa: BLE001 - e.g. out of inotify watches: reload() still works
            log.warning("cannot watch %s for changes (%s); call handle.reload() after an edit",
                        ", ".join(sorted(files)), e)
            return
        _handles.add(handle)
