"""Step 3 of a load (the key): cache keys: canonical JSON (types are part of the syntax) hashed with SHA-256.

Two-level, as ccache's direct mode: the *source key* covers everything known
before compiling (sources, flags, toolchain, environment); the *key* adds the
headers the compiler really read, taken from its depfile. An index file per
source key lists the header sets seen so far, so reverting a header edit finds
the earlier entry again without compiling.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import time

from . import RACY_NS, SCHEMA, stamp_of  # noqa: F401 (re-exported)

_HEX64 = re.compile(r"[0-9a-f]{64}\Z")


def digest(obj) -> str:
    blob = json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    return hashlib.sha256(blob.encode()).hexdigest()


def source_key(inputs: dict) -> str:
    return digest({"schema": SCHEMA, "kind": "source", "inputs": inputs})


def full_key(skey: str, headers: dict[str, str]) -> str:
    return digest({"schema": SCHEMA, "kind": "full", "source_key": skey, "headers": headers})


def workspace_key(inputs: dict) -> str:
    """The same for every edit of the same files with the same flags: the ninja
    build directory it names keeps object files between edits (incremental)."""
    stable = dict(inputs)
    stable["sources"] = [s["path"] for s in inputs["sources"]]
    return digest({"schema": SCHEMA, "kind": "workspace", "inputs": stable})


def stat_stamp(path: str) -> list | None:
    """Device, inode, size, mtime and ctime: any write changes ctime, which no
    ordinary call can set back, so an equal stamp means the bytes hashed then."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return stamp_of(st)


def settled(st: os.stat_result) -> bool:
    """Whether a file was last written at least ``RACY_NS`` ago. Only then does its stat
    stamp stand for its bytes: a second same-size write within one clock tick (1-10 ms)
    would leave size, mtime and ctime as they were (git's "racily clean" files)."""
    now = time.time_ns()
    return now - st.st_ctime_ns >= RACY_NS and now - st.st_mtime_ns >= RACY_NS


def unchanged(path: str, sha256: str, stamp: list | None, st: os.stat_result | None = None) -> bool:
    """Does ``path`` still hold the bytes whose hash is ``sha256``? A matching stat
    stamp answers without reading the file (on another machine it differs: then hash).
    ``st``: the caller's fresh ``os.stat`` of ``path``, so it is not taken twice."""
    if stamp is not None and (stamp_of(st) if st is not None else stat_stamp(path)) == stamp:
        return True
    return file_sha256(path) == sha256


# What a build during which a file changed records in place of that file's hash (loader/build.py,
# loader/cubin.py): no file hashes so, so no lookup finds the entry again; unique per build (a suffix), so
# two never share a key.
CHANGED_MARK = "changed while compiled, build "


def written_since(path: str, since_ns: int, now_ns: int) -> bool:
    """Whether ``path`` was written (or removed) between ``since_ns`` and ``now_ns`` (ccache's
    "too new" rule, for a file a compile started at ``since_ns`` may have read in either
    version). ctime, which every write sets and no call can set back (tar, rsync and
    ``cp -p`` set mtime): a write before the start cannot count, since file times come from
    a clock that lags the real one, never leads it; a ctime past now is another clock's (a
    network file system's server), not a write."""
    try:
        return since_ns <= os.stat(path).st_ctime_ns <= now_ns
    except OSError:
        return True


_file_memo: dict[str, tuple[tuple, str]] = {}


def file_sha256(path: str) -> str | None:
    """SHA-256 of a file's bytes, or None if it cannot be read.

    Memoized in-process by the full stat signature (size, mtime, ctime, inode):
    a rewrite changes ctime even when size and mtime are restored. A file written
    less than ``RACY_NS`` ago is hashed at each call (see :func:`settled`).
    """
    try:
        st = os.stat(path)
    except OSError:
        return None
    sig = (st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino, st.st_dev)
    hit = _file_memo.get(path)
    if hit is not None and hit[0] == sig:
        return hit[1]
    value = sha256_now(path)
    if value is not None and settled(st):
        _file_memo[path] = (sig, value)
    return value


def sha256_now(path) -> str | None:
    """SHA-256 of the bytes on disk now (no memo), or None if unreadable."""
    h = hashlib.sha256()
    try:
        with open(path, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                h.update(chunk)
    except OSError:
        return None
    return h.hexdigest()


def manifest_problem(m: dict, expect: dict, art_sha: str, art_size: int) -> str | None:
    """Why an entry manifest that came from outside (a bundle, a remote cache) cannot be
    published, or None: its schema, its ``key``/``name``/``artifact`` against ``expect``,
    the artifact's hash and size, and its key against its source key and header closure.
    The text follows the entry's name (" has …" / ": …")."""
    if m.get("schema") != SCHEMA:
        return f" has cache schema {m.get('schema')!r}; this kload reads schema {SCHEMA}"
    for k in ("key", "name", "artifact"):
        if m.get(k) != expect[k]:
            return f": its manifest's {k} {m.get(k)!r} is not the expected {expect[k]!r}"
    if m.get("kind", "library") != "library":
        return f" is not a library entry (kind {m.get('kind')!r})"
    if m.get("sha256") != art_sha or m.get("size") != art_size:
        return (f": its manifest's artifact sha256/size does not match the artifact {expect['artifact']} "
                "(the artifact was altered)")
    skey, headers = m.get("source_key"), m.get("headers")
    if not (isinstance(skey, str) and _HEX64.match(skey) and isinstance(headers, dict)
            and all(isinstance(k, str) and isinstance(v, str) for k, v in headers.items())
            and full_key(skey, headers) == m["key"]):
        return ": its key is not the hash of its source key and header closure"
    return None
