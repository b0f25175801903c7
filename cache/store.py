"""The on-disk cache: index files, entries, manifests; atomic publish.

    <root>/index/<source key>.json      header sets seen for these inputs -> entry
    <root>/entries/<name>-<key16>/      <name>.so + manifest.json (written last)
    <root>/build/<name>-<ws12>/         ninja's working directory (objects kept)
    <root>/locks/<name>-<ws12>.lock     the build lock of that directory

Loading never raises for a missing, stale or corrupt entry: it logs and reports
a miss, and the caller rebuilds.
"""
from __future__ import annotations

import json
import logging
import os
import time
import uuid
from pathlib import Path

from .key import SCHEMA, file_sha256, stat_stamp, unchanged

log = logging.getLogger("kload")

MANIFEST = "manifest.json"


def read_json(path: Path) -> dict | None:
    try:
        with open(path, encoding="utf-8") as f:
            value = json.load(f)
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as e:
        log.warning("kload: ignoring unreadable %s (%s)", path, e)
        return None
    return value if isinstance(value, dict) else None


def write_json_atomic(path: Path, obj) -> None:
    """Write to a temporary file beside ``path``, then ``os.replace`` it into place."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(obj, f, indent=1, sort_keys=True)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


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


class Store:
    def __init__(self, root: Path):
        self.root = Path(root)
        self.index = self.root / "index"
        self.entries = self.root / "entries"
        self.builds = self.root / "build"
        self.locks = self.root / "locks"
        self.inline = self.root / "inline"
        self._prepared = False

    def prepare(self) -> None:
        if self._prepared:
            return
        for d in (self.root, self.index, self.entries, self.builds, self.locks, self.inline):
            d.mkdir(mode=0o700, parents=True, exist_ok=True)
        self._prepared = True

    # -- lookup ---------------------------------------------------------------
    def lookup(self, skey: str) -> Entry | None:
        """The entry for these inputs whose recorded headers all still match, or None."""
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

    def open_entry(self, path: Path, key: str | None) -> Entry | None:
        manifest = read_json(path / MANIFEST)
        if manifest is None:
            if path.exists():
                log.warning("kload: entry %s has no readable manifest; rebuilding", path.name)
            return None
        if manifest.get("schema") != SCHEMA or (key is not None and manifest.get("key") != key):
            log.warning("kload: entry %s does not match its index; rebuilding", path.name)
            return None
        entry = Entry(path, manifest)
        problem = self.check_artifact(entry)
        if problem:
            log.warning("kload: entry %s is unusable (%s); rebuilding", path.name, problem)
            return None
        return entry

    @staticmethod
    def check_artifact(entry: Entry) -> str | None:
        art = entry.artifact
        try:
            size = art.stat().st_size
        except OSError:
            return f"{art.name} is missing"
        if size != entry.manifest.get("size"):
            return f"{art.name} has {size} bytes, the manifest says {entry.manifest.get('size')}"
        if not unchanged(str(art), entry.manifest.get("sha256"), entry.manifest.get("stat")):
            return f"{art.name} does not match the manifest's sha256"
        return None

    # -- publish --------------------------------------------------------------
    def publish(self, *, name: str, skey: str, key: str, headers: dict, stamps: dict, built_artifact: Path,
                manifest: dict) -> Entry:
        """Move a freshly built artifact into its entry; manifest, then index, last.

        The artifact is moved with ``os.replace`` (same inode), so a process that
        loaded it from the build directory keeps a valid mapping.
        """
        dest = self.entries / f"{name}-{key[:16]}"
        if dest.exists():  # a half-published or damaged entry for this very key
            trash = self.entries / f".trash-{dest.name}-{uuid.uuid4().hex[:6]}"
            os.replace(dest, trash)
            import shutil

            shutil.rmtree(trash, ignore_errors=True)
        dest.mkdir(mode=0o700)
        artifact = dest / built_artifact.name
        os.replace(built_artifact, artifact)
        os.chmod(artifact, 0o700)
        full = dict(manifest)
        full.update(
            schema=SCHEMA,
            name=name,
            key=key,
            source_key=skey,
            headers=headers,
            artifact=artifact.name,
            size=artifact.stat().st_size,
            sha256=file_sha256(str(artifact)),
            stat=stat_stamp(str(artifact)),
            created=time.time(),
        )
        write_json_atomic(dest / MANIFEST, full)
        self._add_candidate(skey, {"key": key, "entry": dest.name, "headers": headers, "stamps": stamps})
        return Entry(dest, full)

    def _add_candidate(self, skey: str, cand: dict) -> None:
        path = self.index / f"{skey}.json"
        idx = read_json(path) or {"candidates": []}
        cands = [c for c in idx.get("candidates", []) if c.get("key") != cand["key"]]
        cands.append(cand)
        write_json_atomic(path, {"candidates": cands})
