"""Step 2 of a load, the hit path: where builds live (content-hashed keys, the on-disk
store, the build lock), and the hit record.

This module holds what a cache hit needs and nothing more (a hit imports no
other module of the package): entries and their manifests, stat stamps, the
ownership check, and the *hit records* that let a fresh process find its entry
with a handful of ``stat`` calls. ``store.py`` has the rest (index, publish,
eviction, quarantine); ``key.py`` the hashing.

A hit record (``<root>/hits/<name>-<crc>.json``) is written after an entry was
found or built the full way (hashing every source, the toolchain and the header
closure). It names the entry (with the part of its manifest a hit reads), the
exact fingerprint of the options and environment that led there, and a stat
stamp (device, inode, size, mtime, ctime) of every file whose bytes went into
the key: the sources, the headers the compiler read, the compiler binary, the
linker, and kload's own key-making code.
Any write changes a file's ctime, which no ordinary call can set back, so equal
stamps mean equal bytes. A stamp is recorded only for a file whose ctime is at
least ``RACY_NS`` old (git's "racily clean" rule: a second write within the same
clock tick would leave the stamp unchanged), and only after re-hashing it.
Anything that does not match is a miss of the record, never an error: the full
lookup runs and writes a new record.
"""
from __future__ import annotations

import fcntl
import json
import logging
import os
import time
import zlib
from contextlib import contextmanager
from pathlib import Path

log = logging.getLogger("kload")

SCHEMA = 1  # bump when the layout or the meaning of a key changes
MANIFEST = "manifest.json"
LAST_USED = "last_used"   # its mtime is the entry's last use (kload writes it; atime is unreliable)
STAMP_EVERY = 60.0        # seconds: a hit rewrites the last-use stamp at most this often
HITS = "hits"             # the hit records
RACY_NS = 2_000_000_000   # a file changed less than this long ago gets no stamp in a hit record


def stamp_of(st: os.stat_result) -> list:
    return [st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns]


def check_private(path: Path, st: os.stat_result, what: str) -> None:
    """Refuse what another user owns or what group/others may write."""
    me = os.geteuid()
    if st.st_uid == me and not st.st_mode & 0o022:
        return
    from kload.errors import KloadError

    if st.st_uid != me:
        raise KloadError(
            f"refusing {what} {path}: it is owned by uid {st.st_uid}, not by you (uid {me}). "
            "Loading from it would run another user's code; set KLOAD_CACHE_DIR to a directory of your own."
        )
    raise KloadError(
        f"refusing {what} {path}: it is writable by group or others (mode {st.st_mode & 0o777:o}), "
        f"so anyone could replace what kload loads. Run `chmod go-w {path}` or set KLOAD_CACHE_DIR."
    )


@contextmanager
def entry_in_use(entry_path: Path):
    """A shared lock on an entry while it is checked and loaded: eviction and
    ``cache clear`` take it exclusively, so they never pull a library out from
    under a loading process."""
    try:
        fd = os.open(entry_path / MANIFEST, os.O_RDONLY)
    except OSError:
        yield
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_SH)
        yield
    finally:
        os.close(fd)


def read_json(path) -> dict | None:
    try:
        with open(path, "rb") as f:
            value = json.loads(f.read())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as e:
        log.warning("ignoring unreadable %s (%s)", path, e)
        return None
    return value if isinstance(value, dict) else None


class Entry:
    """A published build: its directory and its manifest."""

    __slots__ = ("path", "manifest")

    def __init__(self, path: Path, manifest: dict):
        self.path, self.manifest = path, manifest

    @property
    def artifact(self) -> Path:
        return self.path / self.manifest["artifact"]

    @property
    def key(self) -> str:
        return self.manifest["key"]

    @property
    def changed_during_build(self) -> list[str]:
        """The files saved while it compiled (loader/build.py): the entry served the process that
        built it, and no lookup finds it (nor should a prebuild, an upload or an export take it)."""
        return self.manifest.get("changed_during_build") or []

    def last_used(self) -> float:
        try:
            return os.stat(self.path / LAST_USED).st_mtime
        except OSError:
            return float(self.manifest.get("created", 0.0))

    def touch(self) -> None:
        """Record a use (at most every STAMP_EVERY seconds; silently not on a read-only cache)."""
        stamp = self.path / LAST_USED
        now = time.time()
        try:
            if now - os.stat(stamp).st_mtime < STAMP_EVERY:
                return
            os.utime(stamp, (now, now))
        except FileNotFoundError:
            try:
                os.close(os.open(stamp, os.O_WRONLY | os.O_CREAT, 0o600))
            except OSError:
                pass
        except OSError:
            pass


def hit_record_path(root, name: str, fingerprint: str) -> str:
    return os.path.join(root, HITS, f"{name}-{zlib.crc32(fingerprint.encode()):08x}.json")


def hit_manifest(manifest: dict) -> dict:
    """What a hit record keeps of an entry's manifest: all a hit reads (artifact,
    key, namespaces, headers, publish stamp), not the build inputs."""
    return {k: v for k, v in manifest.items() if k != "inputs"}


def fast_lookup(root: str, name: str, fingerprint: str, cxx: str) -> Entry | None:
    """The entry the hit record for ``fingerprint`` names, if every file it stamped
    is unchanged and the entry's artifact is the one published; else None.

    Plain strings and one JSON read: this runs once per fresh process, where
    every pathlib object and every function's first call shows in the load time.
    The entry's manifest is not read: the record carries what a hit needs of it,
    and the artifact's stamp (taken at publish, when its SHA-256 was computed)
    proves the artifact is that build's."""
    rec = read_json(hit_record_path(root, name, fingerprint))
    if rec is None or rec.get("fp") != fingerprint or rec.get("cxx") != cxx:
        return None
    try:
        for path, stamp in rec["files"]:
            if stamp_of(os.stat(path)) != stamp:
                return None
        check_private(root, os.stat(root), "cache directory")
        dirname, manifest = rec["entry"], rec["manifest"]
        artifact = manifest["artifact"]
        if "/" in dirname or dirname.startswith(".") or "/" in artifact or manifest.get("key") != rec["key"]:
            return None
        entry_path = os.path.join(root, "entries", dirname)
        check_private(entry_path, os.stat(entry_path), "cache entry")
        art = os.path.join(entry_path, artifact)
        st = os.stat(art)
        check_private(art, st, "cache artifact")
        if st.st_size != manifest.get("size") or stamp_of(st) != manifest.get("stat"):
            return None
    except (OSError, KeyError, TypeError, ValueError, AttributeError):
        return None
    return Entry(Path(entry_path), manifest)
