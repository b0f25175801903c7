"""Steps 4 and 7 of a load (the lookup; eviction after a publish): the on-disk cache: index
files, entries, manifests, build directories; one way to move aside (publish.py has the way in).

    <root>/index/<source key>.json      header sets seen for these inputs -> entry
    <root>/entries/<name>-<key16>/      <name>.so + manifest.json (written last)
    <root>/build/<name>-<ws12>/         ninja's working directory (objects kept)
    <root>/locks/<name>-<ws12>.lock     the build lock of that directory
    <root>/quarantine/                  entries whose artifact failed its check
    <root>/hits/<name>-<crc>.json       hit records: how a fresh process finds its entry (__init__.py)

Loading never raises for a missing, stale or corrupt entry: a corrupt one is
moved to quarantine/, logged, and reported as a miss; the caller rebuilds.
A cache directory or entry that another user owns, or that group or others may
write, is refused (KloadError): loading from it would run their code.
"""
from __future__ import annotations

import errno
import fcntl
import json
import logging
import os
import stat
import shutil
import time
import uuid
from pathlib import Path

from kload.errors import KloadError

from . import (HITS, LAST_USED, MANIFEST, RACY_NS, SCHEMA, Entry, check_private, entry_in_use,  # noqa: F401
               hit_manifest, hit_record_path, read_json, stamp_of)
from .key import settled, sha256_now, unchanged, workspace_key
from kload.messages import msg

log = logging.getLogger("kload")

GRACE = 600.0             # seconds: eviction never takes an entry used or built more recently


def not_a_directory(root: Path) -> KloadError:
    """The cache directory is a file, or below one: say which file."""
    blocker = next((p for p in [Path(root), *Path(root).parents] if p.exists() and not p.is_dir()), Path(root))
    where = "is a regular file" if blocker == Path(root) else f"is below {blocker}, which is a regular file"
    return KloadError(f"the cache directory {root} {where}, not a directory: set KLOAD_CACHE_DIR to a directory")


def writable_error(root: Path, e: OSError) -> KloadError:
    """A clear error for a cache kload cannot write (full, read-only, no permission, a file in the way)."""
    if e.errno in (errno.ENOTDIR, errno.EEXIST):
        return not_a_directory(Path(e.filename) if e.filename else root)
    why = {errno.ENOSPC: "the disk is full", errno.EDQUOT: "the disk quota is exhausted",
           errno.EROFS: "it is on a read-only file system", errno.EACCES: "permission denied",
           errno.EPERM: "permission denied"}.get(e.errno, e.strerror or str(e))
    return KloadError(f"cannot write the cache at {root}: {why} ({e.filename or root}). Existing entries are "
                      "untouched and still load; to build, free space or set KLOAD_CACHE_DIR to a writable directory.")


def parse_size(text: str) -> int | None:
    """``"10G"``, ``"500M"``, ``"1.5GiB"``, ``"1234"`` -> bytes; ``"0"``/``"none"`` -> None (no limit)."""
    t = str(text).strip().lower().replace(" ", "")
    if t in ("", "0", "none", "off", "unlimited"):
        return None
    units = {"": 1, "b": 1, "k": 1 << 10, "kb": 1 << 10, "kib": 1 << 10, "m": 1 << 20, "mb": 1 << 20,
             "mib": 1 << 20, "g": 1 << 30, "gb": 1 << 30, "gib": 1 << 30, "t": 1 << 40, "tb": 1 << 40,
             "tib": 1 << 40}
    num = t.rstrip("kmgtib")
    unit = t[len(num):]
    try:
        value = float(num)
    except ValueError:
        value = -1.0
    if unit not in units or value < 0:
        raise ValueError(msg(f"not a size: {text!r} (use a number of bytes, or e.g. 500M, 10G)"))
    return int(value * units[unit])


def dir_size(path: Path) -> int:
    total = 0
    for dirpath, _dirs, files in os.walk(path):
        for f in files:
            try:
                total += os.lstat(os.path.join(dirpath, f)).st_size
            except OSError:
                pass
    return total


def write_atomic(path: Path, text: str, mode: int = 0o600) -> None:
    """Write ``text`` to a temporary file beside ``path`` (created with ``mode``), then
    ``os.replace`` it into place: a reader never sees half a file, and an
    executable is executable before anyone can run it."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def move_aside(path: Path) -> Path:
    """Rename ``path`` to a hidden ``.trash-<name>-<random>`` beside it and return that: at
    once, no reader sees it at its name any more (also a directory that processes still
    write into: their relative writes follow it). The caller deletes it."""
    trash = path.with_name(f".trash-{path.name}-{uuid.uuid4().hex[:6]}")
    os.replace(path, trash)
    return trash


def discard(path: Path) -> None:
    """:func:`move_aside`, then delete (nothing to do if it is gone already)."""
    try:
        trash = move_aside(path)
    except FileNotFoundError:
        return
    shutil.rmtree(trash, ignore_errors=True)


def write_json_atomic(path: Path, obj) -> None:
    write_atomic(path, json.dumps(obj, indent=1, sort_keys=True))


class Store:
    def __init__(self, root: Path):
        self.root = Path(root)
        self.index = self.root / "index"
        self.entries = self.root / "entries"
        self.builds = self.root / "build"
        self.locks = self.root / "locks"
        self.inline = self.root / "inline"
        self.quarantine_dir = self.root / "quarantine"
        self.hits = self.root / HITS
        self._prepared = False

    def check_root(self) -> bool:
        """Refuse a cache root that is not a directory private to this user; False if it is not there."""
        try:
            st = os.stat(self.root)
        except FileNotFoundError:
            return False
        except NotADirectoryError:
            st = None
        if st is None or not stat.S_ISDIR(st.st_mode):
            raise not_a_directory(self.root)
        check_private(self.root, st, "cache directory")
        return True

    def prepare(self) -> None:
        """Create the layout (0700) for a build; a clear error when the cache cannot be written."""
        if self._prepared:
            return
        try:
            for d in (self.root, self.index, self.entries, self.builds, self.locks, self.inline):
                d.mkdir(mode=0o700, parents=True, exist_ok=True)
            probe = self.locks / f".probe-{os.getpid()}"
            os.close(os.open(probe, os.O_WRONLY | os.O_CREAT, 0o600))
            os.unlink(probe)
        except OSError as e:
            raise writable_error(self.root, e) from None
        self.check_root()
        self._prepared = True

    # -- lookup ---------------------------------------------------------------
    def lookup(self, skey: str) -> Entry | None:
        """The entry for these inputs whose recorded headers all still match, or None."""
        if not self.check_root():
            return None
        idx = read_json(self.index / f"{skey}.json")
        if not idx:
            return None
        for cand in reversed(idx.get("candidates", [])):  # newest first
            headers, stamps = cand.get("headers", {}), cand.get("stamps", {})
            if not all(unchanged(p, h, stamps.get(p)) for p, h in headers.items()):
                continue
            entry = self.open_entry(self.entries / cand.get("entry", "?"), cand.get("key"))
            if entry is not None:
                return entry
        return None

    def write_hit_record(self, name: str, fingerprint: str, cxx: str, entry: Entry,
                         files: dict[str, str | None]) -> bool:
        """Record how ``fingerprint`` found ``entry`` (see the package docstring):
        ``files`` maps each file whose bytes are in the key to its SHA-256 (None for
        a binary identified by its stamp alone). Nothing is written while any file is
        too fresh to stamp safely, differs from its hash, or changes while hashed."""
        stamped = []
        for path, sha in files.items():
            try:
                before = os.stat(path)
                if not settled(before):
                    return False
                if sha is not None and sha256_now(path) != sha:
                    return False
                stamp = stamp_of(before)
                if stamp_of(os.stat(path)) != stamp:
                    return False
            except OSError:
                return False
            stamped.append([path, stamp])
        try:
            self.hits.mkdir(mode=0o700, exist_ok=True)
            write_json_atomic(Path(hit_record_path(self.root, name, fingerprint)),
                              {"fp": fingerprint, "cxx": cxx, "entry": entry.path.name, "key": entry.key,
                               "files": stamped, "manifest": hit_manifest(entry.manifest)})
        except OSError:  # a read-only or full cache: hits just take the full lookup
            return False
        return True

    def open_entry(self, path: Path, key: str | None) -> Entry | None:
        manifest = read_json(path / MANIFEST)
        if manifest is None:
            if path.exists():
                log.warning("entry %s has no readable manifest; rebuilding", path.name)
            return None
        if manifest.get("schema") != SCHEMA or (key is not None and manifest.get("key") != key):
            log.warning("entry %s does not match its index; rebuilding", path.name)
            return None
        entry = Entry(path, manifest)
        check_private(path, os.stat(path), "cache entry")
        problem = self.check_artifact(entry)
        if problem:
            self.quarantine(path, problem)
            return None
        return entry

    def quarantine(self, path: Path, problem: str) -> Path | None:
        """Move a bad entry out of the way (kept for a post-mortem, never loaded)."""
        dest = self.quarantine_dir / f"{path.name}-{int(time.time())}-{uuid.uuid4().hex[:6]}"
        try:
            self.quarantine_dir.mkdir(mode=0o700, exist_ok=True)
            os.replace(path, dest)
            (dest / "QUARANTINED").write_text(problem + "\n")
        except OSError as e:
            log.warning("entry %s is unusable (%s) and could not be quarantined (%s); rebuilding",
                        path.name, problem, e)
            return None
        log.warning("entry %s is unusable (%s); moved to %s, rebuilding", path.name, problem, dest)
        return dest

    @staticmethod
    def check_artifact(entry: Entry, full: bool = False) -> str | None:
        """Why the entry's artifact cannot be trusted, or None. ``full`` re-hashes
        even when the stat stamp matches (``cache verify``)."""
        art = entry.artifact
        try:
            st = art.stat()
        except OSError:
            return f"{art.name} is missing"
        check_private(art, st, "cache artifact")
        size = st.st_size
        if size != entry.manifest.get("size"):
            return f"{art.name} has {size} bytes, the manifest says {entry.manifest.get('size')}"
        if full:
            ok = sha256_now(art) == entry.manifest.get("sha256")
        else:
            ok = unchanged(str(art), entry.manifest.get("sha256"), entry.manifest.get("stat"), st)
        if not ok:
            return f"{art.name} does not match the manifest's sha256"
        return None

    def build_dir(self, name: str, inputs: dict) -> Path:
        """The persistent ninja directory of a library's key inputs (its objects survive
        edits of the sources); its build lock is ``locks/<same name>.lock``."""
        return self.builds / f"{name}-{workspace_key(inputs)[:12]}"

    # -- the index (cache/publish.py adds entries) ------------------------------
    def add_candidate(self, skey: str, cand: dict) -> None:
        """Add (or replace, by key) one entry among those of source key ``skey``."""
        path = self.index / f"{skey}.json"
        idx = read_json(path) or {"candidates": []}
        cands = [c for c in idx.get("candidates", []) if c.get("key") != cand["key"]]
        cands.append(cand)
        write_json_atomic(path, {"candidates": cands})

    # -- management (python -m kload cache ...) ---------------------------------
    def all_entries(self) -> list[Entry]:
        """Every published entry (those with a readable manifest)."""
        out = []
        try:
            names = sorted(os.listdir(self.entries))
        except OSError:
            return out
        for n in names:
            if n.startswith("."):
                continue
            m = read_json(self.entries / n / MANIFEST)
            if m is not None and "artifact" in m and "key" in m:
                out.append(Entry(self.entries / n, m))
        return out

    def remove(self, entry: Entry, *, force_recent: bool = False) -> bool:
        """Delete an entry unless a process is loading it (or it was used or built
        within GRACE seconds, unless ``force_recent``). True if removed."""
        if not force_recent and time.time() - entry.last_used() < GRACE:
            return False
        try:
            fd = os.open(entry.path / MANIFEST, os.O_RDONLY)
        except OSError:
            fd = None
        try:
            if fd is not None:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except OSError:
                    return False  # being loaded right now
            try:
                trash = move_aside(entry.path)
            except OSError:
                return False
        finally:
            if fd is not None:
                os.close(fd)
        shutil.rmtree(trash, ignore_errors=True)
        return True

    def evict_after_publish(self, keep: str, max_size: str) -> None:
        """After ``keep`` (an entry's directory name) was published: evict least-recently-used
        entries down to ``max_size`` (KLOAD_CACHE_MAX_SIZE's text). A bad value is said and
        ignored: it must not fail a build that succeeded."""
        try:
            limit = parse_size(max_size)
        except ValueError as e:
            log.warning("%s; KLOAD_CACHE_MAX_SIZE is ignored", e)
            return
        if limit is not None:
            for gone in self.evict_to(limit, keep={keep}):
                log.info("evicted %s (least recently used; KLOAD_CACHE_MAX_SIZE)", gone.path.name)

    def evict_to(self, max_bytes: int, keep: set[str] = frozenset()) -> list[Entry]:
        """Remove least-recently-used entries until the entries total at most
        ``max_bytes``; returns what was removed."""
        entries = [(e.last_used(), e) for e in self.all_entries()]
        sizes = {e.path.name: dir_size(e.path) for _, e in entries}
        total = sum(sizes.values())
        removed = []
        for _, e in sorted(entries, key=lambda t: t[0]):
            if total <= max_bytes:
                break
            if e.path.name in keep:
                continue
            if self.remove(e):
                total -= sizes[e.path.name]
                removed.append(e)
        return removed
