"""Portable bundles: ``kload cache export`` and ``kload cache import`` (docs/cache.md#bundles).

One tar file (plain, or ``.tar.gz``/``.tgz``/``.tar.xz`` by its suffix) carries library entries:

    kload-bundle.json                       first: format, kload version, created, the SHA-256 and size of
                                            every other file, each entry's key, name, style, torch, stable target
    entries/<name>-<key16>/manifest.json    the entry's manifest, as published
    entries/<name>-<key16>/<name>.so        its artifact

Import writes the index record from the entry's manifest (source key, header closure; the key must be
their hash); hit records, last-use stamps and precompiled headers stay behind. It trusts nothing in the
tar: every check that needs no write runs first (the bundle file's owner and mode; each member's type,
path, mode, listing and size), then the listed files are streamed, never ``extract``ed (no tar metadata
reaches the disk), into a staging directory inside the cache root and hashed on the way, and each entry
manifest is checked against its artifact and key. Any failure refuses the whole bundle and removes the
staging directory. Then each entry is published as a build publishes it: private modes, the artifact's
stat stamp, a rename, the index record last.
"""
from __future__ import annotations

import hashlib
import io
import json
import os
import re
import shutil
import stat
import tarfile
import time
import uuid
from contextlib import ExitStack
from pathlib import Path

from kload.errors import KloadError

from . import LAST_USED, MANIFEST, SCHEMA, Entry, entry_in_use, read_json, stamp_of
from .key import manifest_problem, sha256_now
from .publish import publish
from .store import Store

BUNDLE_MANIFEST = "kload-bundle.json"
FORMAT = 1                  # bump when the bundle layout changes
MAX_MANIFEST = 64 << 20     # bytes: a bundle manifest larger than this is refused unread
_HEX64 = re.compile(r"[0-9a-f]{64}\Z")
_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")


# -- export ---------------------------------------------------------------------------

class _Hashing(io.RawIOBase):
    """A reader that hashes what passes through it (the bytes the tar really holds)."""

    def __init__(self, f):
        self.f, self.h = f, hashlib.sha256()

    def read(self, n=-1):
        data = self.f.read(n)
        self.h.update(data)
        return data


def _info(name: str, size: int, mode: int, mtime: float) -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.size, info.mode, info.mtime, info.type, info.uid, info.gid = size, mode, int(mtime), tarfile.REGTYPE, 0, 0
    info.uname = info.gname = ""
    return info


def export(store: Store, entries: list[Entry], out: Path, kload_version: str) -> dict:
    """Write ``entries`` (library entries of ``store``) into the bundle ``out``: a
    temporary file beside it, renamed into place when whole. Returns the bundle
    manifest. An entry whose artifact does not match its manifest is refused."""
    out = Path(out)
    chosen = list({e.path.name: e for e in entries}.values())
    if not chosen:
        raise KloadError("nothing to export")
    created = time.time()
    files, records, sources = {}, [], []
    with ExitStack() as held:
        for e in chosen:
            m = e.manifest
            if m.get("kind", "library") != "library":
                raise KloadError(f"{e.path.name} is a precompiled header ({m.get('kind')}); bundles carry "
                                 "libraries only (run `kload build --pch` where they are needed)")
            held.enter_context(entry_in_use(e.path))  # eviction and `cache clear` wait for us
            art, name = e.artifact, m.get("artifact", "")
            sha = sha256_now(art)
            if "/" in name or sha is None or sha != m.get("sha256"):
                raise KloadError(f"cannot export {e.path.name}: its artifact does not match its manifest "
                                 "(run `kload cache verify`)")
            for fname, path, perm in ((MANIFEST, e.path / MANIFEST, 0o600), (name, art, 0o700)):
                rel = f"entries/{e.path.name}/{fname}"
                files[rel] = {"sha256": sha if path == art else sha256_now(path), "size": os.stat(path).st_size}
                sources.append((rel, path, perm))
            inputs = m.get("inputs") or {}
            records.append({"dir": e.path.name, "key": e.key, "name": m.get("name"), "artifact": name,
                            "style": m.get("style"), "torch": inputs.get("torch"),
                            "stable_target": m.get("stable_target"), "created": m.get("created")})
        manifest = {"format": "kload-bundle", "version": FORMAT, "kload": kload_version, "schema": SCHEMA,
                    "created": created, "files": files, "entries": records}
        blob = json.dumps(manifest, indent=1, sort_keys=True).encode()
        tmp = out.with_name(f".{out.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp")
        low = out.name.lower()  # compressed by suffix
        mode = "w:gz" if low.endswith((".gz", ".tgz")) else "w:xz" if low.endswith((".xz", ".txz")) else "w"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            with os.fdopen(fd, "wb") as f:
                with tarfile.open(fileobj=f, mode=mode, format=tarfile.PAX_FORMAT) as tf:
                    tf.addfile(_info(BUNDLE_MANIFEST, len(blob), 0o600, created), io.BytesIO(blob))
                    for rel, path, perm in sources:
                        with open(path, "rb") as src:
                            reader = _Hashing(src)
                            tf.addfile(_info(rel, files[rel]["size"], perm, created), reader)
                        if reader.h.hexdigest() != files[rel]["sha256"]:
                            raise KloadError(f"{path} changed while it was exported; try again")
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, out)
        except BaseException:
            try:
                os.unlink(tmp)
            except OSError:
                pass
            raise
    return manifest


# -- import ---------------------------------------------------------------------------

def _refused(bundle, why: str) -> KloadError:  # every refusal says which bundle, what, and that nothing changed
    return KloadError(f"refusing bundle {bundle}: {why}. Nothing was imported.")


def _check_file(bundle, st: os.stat_result) -> None:
    """Same spirit as check_private: a file someone else could have written is not loaded."""
    me = os.geteuid()
    if not stat.S_ISREG(st.st_mode):
        raise _refused(bundle, "it is not a regular file")
    if st.st_uid not in (me, 0):
        raise _refused(bundle, f"the bundle file is owned by uid {st.st_uid}, not by you (uid {me}) or root")
    if st.st_mode & 0o022:
        raise _refused(bundle, f"the bundle file is writable by group or others (mode {st.st_mode & 0o777:o}); "
                               f"run `chmod go-w {bundle}` if you trust its content")


_KINDS = {tarfile.SYMTYPE: "a symbolic link", tarfile.LNKTYPE: "a hard link", tarfile.CHRTYPE: "a character device",
          tarfile.BLKTYPE: "a block device", tarfile.FIFOTYPE: "a FIFO"}


def _check_members(bundle, tf: tarfile.TarFile) -> tuple[dict, dict]:
    """(the bundle manifest, {path: member}) after every check that needs no write."""
    try:
        members = tf.getmembers()
    except (tarfile.TarError, EOFError, OSError) as e:
        raise _refused(bundle, f"it is not a readable tar file ({e})") from None
    found: dict[str, tarfile.TarInfo] = {}
    for m in members:
        name = m.name
        while name.startswith("./"):
            name = name[2:]
        name = name or "."
        if name != "." and (name.startswith("/") or any(p in ("", ".", "..") for p in name.split("/"))):
            raise _refused(bundle, f"member {m.name!r} has an absolute path or a '..' or empty component")
        if not (m.type in (tarfile.REGTYPE, tarfile.AREGTYPE) or m.isdir()):
            what = _KINDS.get(m.type, f"a special member (tar type {m.type!r})")
            raise _refused(bundle, f"member {m.name!r} is {what}; only regular files and directories are allowed")
        if m.mode & (stat.S_ISUID | stat.S_ISGID | stat.S_ISVTX):
            raise _refused(bundle, f"member {m.name!r} has the setuid, setgid or sticky bit (mode {m.mode:o})")
        if m.mode & 0o022:
            raise _refused(bundle, f"member {m.name!r} is writable by group or others (mode {m.mode & 0o777:o})")
        if name in found:
            raise _refused(bundle, f"member {m.name!r} appears twice")
        found[name] = m
    top = found.pop(BUNDLE_MANIFEST, None)
    if top is None or not top.isfile():
        raise _refused(bundle, f"it has no {BUNDLE_MANIFEST} (not a kload bundle)")
    if top.size > MAX_MANIFEST:
        raise _refused(bundle, f"its {BUNDLE_MANIFEST} is {top.size} bytes, more than a bundle manifest can be")
    try:
        manifest = json.loads(tf.extractfile(top).read())
    except (tarfile.TarError, EOFError, OSError, ValueError) as e:
        raise _refused(bundle, f"its {BUNDLE_MANIFEST} is unreadable ({e})") from None
    files, dirs = _check_listing(bundle, manifest)
    for name, m in sorted(found.items()):
        if (name != "." and name not in dirs) if m.isdir() else name not in files:
            raise _refused(bundle, f"member {m.name!r} is not listed in the bundle manifest")
        elif m.size != files[name]["size"]:
            raise _refused(bundle, f"member {m.name!r} has {m.size} bytes, the bundle manifest says "
                                   f"{files[name]['size']}")
    for missing in sorted(set(files) - {n for n, m in found.items() if m.isfile()})[:1]:
        raise _refused(bundle, f"{missing} is listed in the bundle manifest but missing from the bundle")
    return manifest, found


def _check_listing(bundle, bm) -> tuple[dict, set]:
    """The bundle manifest's shape: every listed file belongs to a listed entry's
    directory, and every entry lists exactly its manifest and its artifact."""
    if not isinstance(bm, dict) or bm.get("format") != "kload-bundle":
        raise _refused(bundle, f"its {BUNDLE_MANIFEST} is not a kload bundle manifest")
    if bm.get("version") != FORMAT:
        raise _refused(bundle, f"it is bundle format {bm.get('version')!r}; this kload reads format {FORMAT}")
    files, entries = bm.get("files"), bm.get("entries")
    if not isinstance(files, dict) or not isinstance(entries, list) or not entries:
        raise _refused(bundle, f"its {BUNDLE_MANIFEST} lists no entries")
    for rel, f in files.items():
        if not (isinstance(f, dict) and isinstance(f.get("sha256"), str) and _HEX64.match(f["sha256"])
                and isinstance(f.get("size"), int) and f["size"] >= 0):
            raise _refused(bundle, f"its {BUNDLE_MANIFEST} gives no valid sha256 and size for {rel!r}")
    expected, dirs = set(), {"entries"}
    for r in entries:
        ok = isinstance(r, dict) and all(isinstance(r.get(k), str) for k in ("dir", "key", "name", "artifact"))
        if not ok or not _HEX64.match(r["key"]) or not _NAME.match(r["name"]) \
                or r["dir"] != f"{r['name']}-{r['key'][:16]}" or r["dir"] in dirs:
            raise _refused(bundle, f"its {BUNDLE_MANIFEST} has a malformed or repeated entry record {r!r:.200}")
        art = r["artifact"]
        if "/" in art or art.startswith(".") or art in (MANIFEST, LAST_USED):
            raise _refused(bundle, f"entry {r['dir']} names an artifact {art!r} that is not a plain file name")
        dirs.add(r["dir"])
        expected |= {f"entries/{r['dir']}/{MANIFEST}", f"entries/{r['dir']}/{art}"}
    if set(files) != expected:
        odd = sorted(set(files) ^ expected)[0]
        raise _refused(bundle, f"its {BUNDLE_MANIFEST} lists {odd!r} outside an entry's manifest and artifact"
                       if odd in files else f"its {BUNDLE_MANIFEST} does not list {odd!r}")
    return files, {f"entries/{d}" if d != "entries" else d for d in dirs}


def _stage(bundle, tf, found: dict, files: dict, staging: Path) -> None:
    """Stream every listed file into ``staging`` (created 0600 by us), hashing it on the way."""
    for rel in sorted(files):
        dest = staging / rel.split("/", 1)[1]
        dest.parent.mkdir(mode=0o700, exist_ok=True)
        h, n = hashlib.sha256(), 0
        try:
            src = tf.extractfile(found[rel])
            fd = os.open(dest, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
            with os.fdopen(fd, "wb") as out:
                for chunk in iter(lambda: src.read(1 << 20), b""):
                    n += len(chunk)
                    h.update(chunk)
                    out.write(chunk)
        except (tarfile.TarError, EOFError) as e:
            raise _refused(bundle, f"{rel} cannot be read: the bundle is truncated or damaged ({e})") from None
        if n != files[rel]["size"] or h.hexdigest() != files[rel]["sha256"]:
            raise _refused(bundle, f"{rel} does not match the bundle manifest (sha256 {h.hexdigest()[:16]}…, "
                                   f"{n} bytes; listed: {files[rel]['sha256'][:16]}…, {files[rel]['size']} bytes)")


def _check_entry(bundle, r: dict, staged: Path, art_sha: str) -> dict:
    """The staged entry manifest, once it matches its record, its artifact and its key."""
    m = read_json(staged / MANIFEST)
    where = f"entry {r['dir']}"
    if m is None:
        raise _refused(bundle, f"{where} has no readable manifest")
    problem = manifest_problem(m, r, art_sha, os.stat(staged / r["artifact"]).st_size)
    if problem:
        raise _refused(bundle, f"{where}{problem}")
    return m


def publish_staged(store: Store, staged: Path, m: dict, origin: dict) -> str:
    """Move a verified staged entry into the cache as a build publishes it; "imported"
    or "present" (an intact entry of that key is there already: left as it is).
    ``origin`` (where it came from: a bundle, a remote cache) goes into its manifest
    as ``imported``. Also the remote cache's download path (remote.py)."""
    dest = store.entries / staged.name
    cand = {"key": m["key"], "headers": m["headers"], "stamps": {}}
    have = read_json(dest / MANIFEST)
    if have is not None and have.get("key") == m["key"]:
        try:
            intact = store.check_artifact(Entry(dest, have), full=True) is None
        except KloadError:
            intact = False
        if intact:
            idx = read_json(store.index / f"{m['source_key']}.json") or {}
            if not any(c.get("key") == m["key"] for c in idx.get("candidates", [])):
                store.add_candidate(m["source_key"], dict(cand, entry=dest.name))
            return "present"
    art = staged / m["artifact"]
    os.chmod(art, 0o700)
    # the stamp a hit record compares with; a damaged or half-published entry of this key is replaced
    m = dict(m, stat=stamp_of(os.stat(art)), imported=dict(origin, at=time.time()))
    publish(store, staged, dest.name, m, candidate=cand)
    return "imported"


def _absent(m: dict) -> dict:
    """Header and source paths of the entry that this machine lacks or holds other bytes at."""
    missing = [p for p in m["headers"] if not os.path.exists(p)]
    differ = [p for p, sha in m["headers"].items() if p not in missing and sha256_now(p) != sha]
    sources = [p for p in m.get("source_paths") or [] if not os.path.exists(p)]
    return {"missing_headers": missing, "changed_headers": differ, "missing_sources": sources}


def import_bundle(store: Store, bundle: Path) -> list[dict]:
    """Verify ``bundle`` whole, then publish its entries into ``store``. Returns one
    dict per entry: dir, name, key, status ("imported" or "present") and the header
    and source paths this machine lacks or holds other bytes at."""
    bundle = Path(bundle)
    try:  # O_NONBLOCK: a FIFO at that path is refused below, not waited on
        f = os.fdopen(os.open(bundle, os.O_RDONLY | os.O_NONBLOCK), "rb")
    except OSError as e:
        raise KloadError(f"cannot read bundle {bundle}: {e.strerror or e}") from None
    with f:
        _check_file(bundle, os.fstat(f.fileno()))
        try:
            tf = tarfile.open(fileobj=f, mode="r:*")
        except (tarfile.TarError, EOFError, OSError) as e:
            raise _refused(bundle, f"it is not a readable tar file ({e})") from None
        with tf:
            manifest, found = _check_members(bundle, tf)
            existed = store.check_root()
            store.root.mkdir(mode=0o700, parents=True, exist_ok=True)
            staging = store.root / f".import-{os.getpid()}-{uuid.uuid4().hex[:8]}"
            staging.mkdir(mode=0o700)
            try:
                _stage(bundle, tf, found, manifest["files"], staging)
                verified = []
                for r in manifest["entries"]:
                    sha = manifest["files"][f"entries/{r['dir']}/{r['artifact']}"]["sha256"]
                    verified.append((r, _check_entry(bundle, r, staging / r["dir"], sha)))
                store.prepare()
                out = []
                for r, m in verified:
                    status = publish_staged(store, staging / r["dir"], m, {"bundle": os.path.abspath(bundle)})
                    out.append(dict(dir=r["dir"], name=r["name"], key=r["key"], status=status,
                                    torch=(m.get("inputs") or {}).get("torch"), **_absent(m)))
                return out
            finally:
                shutil.rmtree(staging, ignore_errors=True)
                if not existed:
                    try:
                        os.rmdir(store.root)  # a root this call made: removed unless something was imported
                    except OSError:
                        pass
