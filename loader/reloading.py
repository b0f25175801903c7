"""The reload policy, one for everything that reloads (a Handle, a CudaModule), and
reload on save.

The policy (:class:`Reloading`): a file changed or ``reload()`` was asked, so the
thing is *stale* and its next use builds again; a rebuild that fails leaves the last
good build serving, and each failure is said once, not at every use; a rebuild that
works makes the next failure worth saying again.

Reload on save: one watchdog observer per process marks a policy stale when a file
it watches changes. The observer runs in its own thread, so the call path pays
nothing: a handle's ops live in its ``__dict__`` and are dropped from it when a
file changes (the owner's ``on_stale``).
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
_policies: "weakref.WeakSet" = weakref.WeakSet()      # the policies that reload on save


class Reloading:
    """The reload state of one Handle or CudaModule (``name`` is what messages call it).

    ``on_stale`` (a bound method, held weakly: the policy keeps its owner alive) runs
    after the flag goes up, from the watcher's thread or ``reload()``'s."""

    __slots__ = ("name", "stale", "files", "dirs", "_on_stale", "_said", "__weakref__")

    def __init__(self, name: str, on_stale=None):
        self.name, self.stale = name, False
        self.files: set[str] | None = None  # what the watcher looks at; None: not watched
        self.dirs: set[str] = set()          # ... and directories it looks at whole
        self._on_stale = weakref.WeakMethod(on_stale) if on_stale is not None else None
        self._said: dict[str, str] = {}     # part -> the failure said last

    @property
    def watched(self) -> bool:
        return self.files is not None

    def mark_stale(self) -> None:
        """The next use builds again. The flag goes up before ``on_stale`` runs."""
        self.stale = True
        hook = self._on_stale() if self._on_stale is not None else None
        if hook is not None:
            hook()

    def take_stale(self) -> bool:
        """Whether it was stale; it no longer is."""
        if not self.stale:
            return False
        self.stale = False
        return True

    def failed(self, error: Exception, part: str = "build") -> None:
        """A rebuild of ``part`` failed and the last good one keeps serving: said once
        for each new failure (an error, on stderr and the ``kload`` log)."""
        text = str(error)
        if self._said.get(part) == text:
            return
        self._said[part] = text
        from .progress import say

        say(f"rebuilding {self.name} failed; its last good build keeps serving.\n{text}", error=True)

    def recovered(self, part: str = "build") -> None:
        """A rebuild of ``part`` worked: its next failure is said again."""
        self._said.pop(part, None)

    def watch(self, files, *, whole_dirs: bool = False) -> None:
        """Reload on save: see :func:`watch`."""
        watch(self, files, whole_dirs=whole_dirs)


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
        for policy in list(_policies):
            if paths & policy.files or dirs & policy.dirs:
                policy.mark_stale()
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
        for policy in list(_policies):
            if any(f.startswith(under) for f in policy.files):
                policy.mark_stale()
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


def watch(policy: Reloading, files, *, whole_dirs: bool = False) -> None:
    """Mark ``policy`` stale whenever one of ``files`` is written, replaced or removed;
    with ``whole_dirs``, any source-like file in their directories (from the start of a
    build until one succeeds: the files a build reads are not known before it, and a
    failed one may lack a header that does not exist yet). A folder that does not exist
    is awaited from its nearest existing parent."""
    global _observer, _handler
    files = {_norm(f) for f in files}
    policy.files = files
    policy.dirs = {os.path.dirname(f) for f in files} if whole_dirs else set()
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
        _policies.add(policy)
