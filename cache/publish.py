"""Step 7 of a load (and every other way an entry arrives): publish.

One way in for every kind of entry: a build's library (obtain.py), a precompiled
header (pch_build.py), an NVRTC cubin (cubin.py), a bundle's entry (bundle.py) and
a remote download (remote.py, through bundle.py). Each fills a staging directory
beside the entries; :func:`publish` writes its manifest, renames it into place and
adds it to the index last, so a reader finds no entry or a whole one.
"""
from __future__ import annotations

import os
import shutil
import time
import uuid
from pathlib import Path
from typing import Callable

from . import LAST_USED, MANIFEST, SCHEMA, Entry
from .key import file_sha256, stat_stamp
from .store import GRACE, Store, discard, write_json_atomic


def stage(store: Store, dest_name: str) -> Path:
    """A fresh staging directory for the entry ``dest_name`` (hidden, beside the
    entries, so the rename into place stays on one file system)."""
    store.entries.mkdir(mode=0o700, parents=True, exist_ok=True)
    staged = store.entries / f".staging-{dest_name}-{uuid.uuid4().hex[:6]}"
    staged.mkdir(mode=0o700)
    return staged


def publish(store: Store, staged: Path, dest_name: str, manifest: dict, *, candidate: dict | None = None,
            existing: Callable[[Path], Entry | None] | None = None) -> Entry:
    """Publish a filled staging directory as ``entries/<dest_name>``: its manifest and
    ``last_used`` are written, it is renamed into place, and ``candidate`` (``{"key",
    "headers", "stamps"}``) goes into the index of ``manifest["source_key"]`` last, so a
    lookup finds no entry or a whole one. Builds, precompiled headers, NVRTC cubins,
    bundle imports and remote downloads all publish here.

    ``existing(dest)``, when an entry is at the destination already: the Entry to use
    instead (this staging directory is then deleted), or None to replace it (a damaged
    or half-published entry of this very key). On any failure the staging directory is
    deleted: never half an entry."""
    dest = store.entries / dest_name
    try:
        write_json_atomic(staged / MANIFEST, manifest)
        os.close(os.open(staged / LAST_USED, os.O_WRONLY | os.O_CREAT, 0o600))
        if dest.exists():
            other = existing(dest) if existing is not None else None
            if other is not None:
                shutil.rmtree(staged, ignore_errors=True)
                return other
            discard(dest)
        try:
            os.rename(staged, dest)
        except OSError:
            # another process published this key in between (a non-empty directory is there)
            other = existing(dest) if existing is not None and dest.exists() else None
            if other is None:
                raise
            shutil.rmtree(staged, ignore_errors=True)
            return other
    except BaseException:
        shutil.rmtree(staged, ignore_errors=True)
        raise
    if candidate is not None:
        try:
            store.add_candidate(manifest["source_key"], dict(candidate, entry=dest_name))
        except BaseException:  # an entry no index names would only take space: never half a publish
            discard(dest)
            raise
    return Entry(dest, manifest)


def publish_artifact(store: Store, built_artifact: Path, *, name: str, skey: str, key: str, headers: dict,
                     stamps: dict, manifest: dict) -> Entry:
    """A build's artifact as the entry ``<name>-<key16>`` (see :func:`publish`). The
    artifact is moved with ``os.replace`` (same inode), so a process that loaded it from
    the build directory keeps a valid mapping."""
    dest_name = f"{name}-{key[:16]}"
    staged = stage(store, dest_name)
    try:
        artifact = staged / built_artifact.name
        os.replace(built_artifact, artifact)
        os.chmod(artifact, 0o700)
        full = dict(manifest)
        full.update(schema=SCHEMA, name=name, key=key, source_key=skey, headers=headers, artifact=artifact.name,
                    size=artifact.stat().st_size, sha256=file_sha256(str(artifact)),
                    stat=stat_stamp(str(artifact)), created=time.time())
    except BaseException:
        shutil.rmtree(staged, ignore_errors=True)
        raise
    return publish(store, staged, dest_name, full, candidate={"key": key, "headers": headers, "stamps": stamps})


def sweep(store: Store, older_than: float = GRACE) -> int:
    """Delete staging and moved-aside directories among the entries older than
    ``older_than`` seconds: a process killed between its staging and its rename left
    them, and no lookup, eviction or listing sees them. Returns how many went."""
    gone = 0
    try:
        names = [n for n in os.listdir(store.entries) if n.startswith((".staging-", ".trash-"))]
    except OSError:
        return 0
    for n in names:
        try:
            old = time.time() - (store.entries / n).stat().st_mtime > older_than
        except OSError:
            continue
        if old:
            shutil.rmtree(store.entries / n, ignore_errors=True)
            gone += 1
    return gone
