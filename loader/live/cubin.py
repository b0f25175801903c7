"""Cache entries of kind ``cubin``: NVRTC's output for one kernel file, name set and target.

    entries/cubin-<stem>-<key16>/<stem>.cubin    (<stem>.ptx for a compute_XY target)
                                 manifest.json   kind cubin, key, size, SHA-256, stat stamp, header closure,
                                                 each name's lowered name and parameters (from the PTX)

1. key (``Plan``): the kernel file and every file it may include, by content (a scan of
   ``#include`` lines: NVRTC reports no dependencies), the name expressions, NVRTC's identity,
   the target (``sm_90``, or ``compute_90`` for PTX), the options and a schema version.
2. ``lookup``: the entry, checked as any (size, SHA-256 behind its stamp, ownership), or None.
3. ``build``: compile (kload.nvrtc), publish (a staging directory renamed into place), evict.
   A file written since the key was made (the too-new rule of loader/build.py) gives the
   entry a key no lookup makes: it serves the process that compiled it, no one else.
"""
from __future__ import annotations

import copy
import os
import re
import shutil
import time
import uuid
from pathlib import Path

from kload.cache import SCHEMA, Entry, stamp_of
from kload.cache.key import CHANGED_MARK, digest, file_sha256, sha256_now, written_since
from kload.cache.publish import publish, stage
from kload.cache.store import Store

from .. import knobs
from . import nvrtc
from ..options import include_dir
from ..progress import say

CUBIN_SCHEMA = 1  # bump when the entry's layout or the meaning of its key changes
DEFAULT_OPTIONS = ("-std=c++17",)
_INCLUDE = re.compile(r'^[ \t]*#[ \t]*include[ \t]*([<"])([^>"]+)[>"]', re.M)


def closure(path: str, include_dirs: list[str], system_dir: str | None) -> dict[str, str | None]:
    """Every file ``path`` may include (quoted: beside the includer, then ``include_dirs``;
    <angled>: ``include_dirs``), with its SHA-256; a name found nowhere maps to None (its
    later appearance changes the key). Conditional includes are followed too: the closure
    can be larger than what NVRTC read, never smaller. Headers in NVRTC's own CUDA include
    directory are not followed (the NVRTC identity covers them)."""
    out: dict[str, str | None] = {}
    todo = [os.path.abspath(path)]
    while todo:
        f = todo.pop()
        if f in out:
            continue
        out[f] = file_sha256(f)
        if out[f] is None:
            continue
        with open(f, encoding="utf-8", errors="replace") as fh:
            text = fh.read()
        for quote, name in _INCLUDE.findall(text):
            dirs = ([os.path.dirname(f)] if quote == '"' else []) + include_dirs
            hit = next((os.path.join(d, name) for d in dirs if os.path.isfile(os.path.join(d, name))), None)
            if hit is None:
                if not (system_dir and os.path.isfile(os.path.join(system_dir, name))):
                    out.setdefault(f"<missing>{name}", None)
            elif not (system_dir and os.path.abspath(hit).startswith(system_dir + os.sep)):
                todo.append(os.path.abspath(hit))
    return out


class Plan:
    """One compile: the key, what it hashes, and where its entry lives."""

    __slots__ = ("key", "inputs", "options", "names", "target", "files", "entry_dir", "stem", "_scan", "_since_ns")

    def __init__(self, store: Store, path: str, names, options: list[str], include_paths: list[str], target: str):
        lib = nvrtc.library()
        dirs = [os.path.dirname(path)] + include_paths + [str(include_dir())]
        self.target, self.stem, self.names = target, Path(path).stem.split(".")[0], sorted(names)
        self.options = (list(DEFAULT_OPTIONS) + [f"-arch={target}"] + [f"-I{d}" for d in dirs]
                        + ([f"-I{lib.include}"] if lib.include else []) + list(options))
        self._scan, self._since_ns = (path, dirs, lib.include), time.time_ns()
        self.files = closure(*self._scan)
        self.inputs = {"schema": CUBIN_SCHEMA, "kind": "cubin", "file": path, "names": self.names,
                       "nvrtc": lib.identity, "target": target, "options": self.options,
                       "cxx": {"path": lib.path, "version": f"NVRTC {lib.identity['soname']} -> {target}"}}
        self.key = digest({"schema": SCHEMA, "inputs": self.inputs, "files": self.files})
        self.entry_dir = store.entries / f"cubin-{self.stem}-{self.key[:16]}"

    def changed(self) -> list[str]:
        """The files written since the key was made, or whose closure differs from it
        now (an include added, a missing header created): NVRTC, which read them after,
        may have compiled either version."""
        now, now_ns = closure(*self._scan), time.time_ns()
        return sorted({f.removeprefix("<missing>") for f in set(now) | set(self.files)
                       if now.get(f) != self.files.get(f) or (not f.startswith("<")
                                                               and written_since(f, self._since_ns, now_ns))})

    def unreusable(self) -> "Plan":
        """This plan under a key no lookup makes (one build's own)."""
        other = copy.copy(self)
        other.key = digest({"schema": SCHEMA, "inputs": self.inputs, "files": self.files,
                            "changed": CHANGED_MARK + uuid.uuid4().hex})
        other.entry_dir = self.entry_dir.parent / f"cubin-{self.stem}-{other.key[:16]}"
        return other


def lookup(store: Store, plan: Plan) -> Entry | None:
    """The published entry of ``plan``, checked as any entry (size, SHA-256 behind
    its stamp, ownership); a damaged one is quarantined and reported as a miss."""
    if not plan.entry_dir.is_dir() or not store.check_root():
        return None
    entry = store.open_entry(plan.entry_dir, plan.key)
    if entry is not None and entry.manifest.get("kind") != "cubin":
        return None
    return entry


def build(store: Store, plan: Plan, source_path: str) -> Entry:
    """Compile ``plan`` with NVRTC and publish its entry (staging directory, then a rename)."""
    store.prepare()
    log_path = store.builds / f"nvrtc-{plan.stem}-{plan.key[:16]}.log"
    with open(source_path, encoding="utf-8") as f:
        text = f.read()
    out = nvrtc.compile(text, source_path, plan.options, plan.names, str(log_path))
    changed = plan.changed()
    if changed:
        say(f"{', '.join(changed)} changed while NVRTC compiled {os.path.basename(source_path)}; this "
            "image is not reused (the next load compiles again)", warning=True)
        plan = plan.unreusable()
    suffix = ".ptx" if plan.target.startswith("compute_") else ".cubin"
    staged = stage(store, plan.entry_dir.name)
    try:
        art = staged / (plan.stem + suffix)
        fd = os.open(art, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "wb") as fh:
            fh.write(out.image)
        st = os.stat(art)
        kernels = {n: {"lowered": low, "params": out.params.get(low, [])} for n, low in out.lowered.items()}
        manifest = {"schema": SCHEMA, "kind": "cubin", "name": f"cubin:{plan.stem}", "key": plan.key,
                    "source_key": plan.key, "artifact": art.name, "size": st.st_size, "sha256": sha256_now(art),
                    "stat": stamp_of(st), "created": time.time(), "headers": {k: v for k, v in plan.files.items()
                                                                              if v is not None},
                    "inputs": plan.inputs, "kernels": kernels, "build_seconds": round(out.seconds, 4),
                    "changed_during_build": changed}
    except BaseException:
        shutil.rmtree(staged, ignore_errors=True)
        raise
    # an entry there already: another process's (used), or a damaged one (replaced)
    entry = publish(store, staged, plan.entry_dir.name, manifest, existing=lambda _: lookup(store, plan))
    store.evict_after_publish(plan.entry_dir.name, knobs.cache_max_size())
    return entry
