"""What a build read, and what it leaves for the next one: the header closure (every
local header the compiler read, hashed and stamped), the files written while it ran,
the record of its inputs' hashes that lets the next build recompile an object whose
input changed without its mtime moving, and the compilation database for editors.
"""
from __future__ import annotations

import json
import logging
import os
import subprocess
import time
from pathlib import Path

from kload.cache.key import file_sha256, settled, stamp_of, stat_stamp, written_since
from kload.cache.store import read_json, write_atomic

from .torchbuild import forget_objects
from ..errors import KloadError
from ..plan import toolchain
from ..plan.plan import Plan

log = logging.getLogger("kload")


def header_closure(ws: Path, plan: Plan, deps: dict[str, list[str]], pch_headers: set[str],
                   pch_dirs: tuple[str, ...]) -> tuple[dict[str, str], dict[str, list | None]]:
    """Every local header the compiler read, with its content hash and stat stamp.
    A precompiled header's stub and .gch are left out (the PCH key covers them);
    the headers it was made from are in, when a compile used it (its dependency
    file does not list them), so the key is the same with or without it."""
    if not deps:
        raise KloadError(f"ninja recorded no header dependencies in {ws}; refusing to cache a build "
                         "whose inputs cannot all be seen")
    skip = {str(p) for p in plan.built}
    system = toolchain.system_prefixes(plan.with_cuda) + pch_dirs
    headers: dict[str, str] = {}
    stamps: dict[str, list | None] = {}
    for p in sorted({p for files in deps.values() for p in files} | pch_headers):
        if p in skip or p.startswith(str(ws) + os.sep) or p.startswith(system):
            continue
        try:
            st = os.stat(p)
        except OSError:
            st = None
        digest = file_sha256(p)
        if st is None or digest is None:  # deleted (or made unreadable) since: changed_during_build says so
            headers[p], stamps[p] = "", None
            continue
        headers[p] = digest
        # written meanwhile, or too recently for a stamp to stand for its bytes: lookups hash it
        stamps[p] = stamp_of(st) if settled(st) and stat_stamp(p) == stamp_of(st) else None
    return headers, stamps


def changed_during_build(plan: Plan, headers: dict[str, str], since_ns: int) -> list[str]:
    """The sources and headers written or deleted after the build started (``written_since``):
    the compiler may have read either version, so the build stands for neither. A source is
    also compared with the bytes its key was made of (hashed before the compile)."""
    shas = {str(s.path): s.sha256 for s in plan.sources.sources if s.path in plan.built}
    now_ns = time.time_ns()
    return [p for p in sorted(set(headers) | set(shas))
            if written_since(p, since_ns, now_ns) or not headers.get(p, "-")
            or (p in shas and file_sha256(p) != shas[p])]


COMPDB = "compile_commands.json"


def write_compdb(ws: Path, split) -> None:
    """ninja's compilation database of this build (the real commands, flags and include
    paths; a split .cu as nvcc compiles it whole), for editors and clangd; ``kload ide``
    copies it beside the sources."""
    proc = subprocess.run(["ninja", "-t", "compdb"], cwd=ws, capture_output=True, text=True)
    if proc.returncode == 0 and proc.stdout.strip().startswith("["):
        write_atomic(ws / COMPDB, json.dumps(split.compdb(json.loads(proc.stdout)), indent=2))
    else:
        log.warning("could not write %s in %s: %s", COMPDB, ws, proc.stderr.strip())


RECORD = "kload_inputs.json"  # in the build directory: content hashes of the last build's inputs


def forget_stale_objects(ws: Path) -> None:
    """ninja rebuilds by mtime; kload keys by content. Before a build, delete every
    object whose recorded inputs changed content, so an edit whose mtime did not
    move (restored, coarse clock, copied tree) is still compiled."""
    record = read_json(ws / RECORD)
    if not record:
        return
    changed = {p for p, sha in record.items() if file_sha256(p) != sha}
    if changed:
        forget_objects(ws, changed)
