"""When ``KLOAD_DISABLE_JIT=1`` refuses a miss (and for ``kload explain``):
why a build is (not) in the cache: compare its key inputs with the nearest entry.

    python -m kload explain my_ops.cpp -O2
    miss: nearest entry my_ops-3f2a9c0d11e4b7a2 (built 2026-12-02 15:04)
      header detail/scale.h changed
      cflags: -O2 added
"""
from __future__ import annotations

import os
import time

from kload.cache.key import CHANGED_MARK, file_sha256
from kload.cache.store import Entry, Store, read_json

from .plan import Plan


class Explanation:
    def __init__(self, hit: bool, entry: Entry | None, reasons: list[str]):
        self.hit, self.entry, self.reasons = hit, entry, reasons

    def text(self) -> str:
        if self.hit:
            return f"hit: {self.entry.path}"
        head = "miss"
        if self.entry is not None:
            when = time.strftime("%Y-%m-%d %H:%M", time.localtime(self.entry.manifest.get("created", 0)))
            head += f": nearest entry {self.entry.path.name} (built {when})"
        return "\n".join([head] + [f"  {r}" for r in self.reasons])


def _short(path: str, base: str) -> str:
    rel = os.path.relpath(path, base)
    return path if rel.startswith("..") else rel


def _list_diff(what: str, old: list, new: list) -> list[str]:
    out = [f"{what}: {f} added" for f in new if f not in old]
    out += [f"{what}: {f} removed" for f in old if f not in new]
    if not out and old != new:
        out.append(f"{what}: order changed")
    return out


def _version(ident) -> str:
    if not isinstance(ident, dict):
        return str(ident)
    return (ident.get("version") or "").splitlines()[0] if ident.get("version") else str(ident.get("path"))


def describe(old: dict, new: dict, base: str) -> list[str]:
    """What differs between two entries' key inputs, in words."""
    out: list[str] = []
    for field in sorted(set(old) | set(new)):
        a, b = old.get(field), new.get(field)
        if a == b:
            continue
        if field == "sources":
            oa = {s["path"]: s["sha256"] for s in a or []}
            ob = {s["path"]: s["sha256"] for s in b or []}
            for p in ob:
                if p not in oa:
                    out.append(f"source {_short(p, base)} added")
                elif oa[p] != ob[p]:
                    out.append(f"source {_short(p, base)} changed")
            out += [f"source {_short(p, base)} removed" for p in oa if p not in ob]
        elif field in ("cflags", "cuda_cflags", "ldflags", "include_paths"):
            out += _list_diff(field, a or [], b or [])
        elif field == "torch" and isinstance(a, dict) and isinstance(b, dict):
            for k in sorted(set(a) | set(b)):
                if a.get(k) != b.get(k):
                    out.append(f"torch {a.get(k)} → {b.get(k)}" if k == "version"
                               else f"torch {k}: {a.get(k)} → {b.get(k)}")
        elif field in ("cxx", "nvcc"):
            what = "compiler" if field == "cxx" else "nvcc"
            if _version(a) != _version(b):
                out.append(f"{what} {_version(a)} → {_version(b)}")
            else:
                out.append(f"{what} {a.get('path') if isinstance(a, dict) else a} → "
                           f"{b.get('path') if isinstance(b, dict) else b}")
        elif field == "env" and isinstance(a, dict) and isinstance(b, dict):
            for k in sorted(set(a) | set(b)):
                if a.get(k) != b.get(k):
                    out.append(f"env {k}: {a.get(k) or 'unset'} → {b.get(k) or 'unset'}")
        else:
            out.append(f"{field}: {a} → {b}")
    return out


def explain_plan(plan: Plan, store: Store) -> Explanation:
    entry = store.lookup(plan.skey)
    if entry is not None:
        return Explanation(True, entry, [])
    base = os.path.dirname(str(plan.built[0]))
    idx = read_json(store.index / f"{plan.skey}.json")
    if idx and idx.get("candidates"):
        # the same sources, flags and toolchain: a header differs from every build seen
        cand = idx["candidates"][-1]
        reasons = []
        for path, sha in cand.get("headers", {}).items():
            now = file_sha256(path)
            if sha.startswith(CHANGED_MARK):  # that build stands for no file's bytes (compile/pipeline.py)
                reasons.append(f"{_short(path, base)} was saved while the last build compiled")
            elif now is None:
                reasons.append(f"header {_short(path, base)} is gone")
            elif now != sha:
                reasons.append(f"header {_short(path, base)} changed")
        nearest = None
        m = read_json(store.entries / cand.get("entry", "?") / "manifest.json")
        if m is not None:
            nearest = Entry(store.entries / cand["entry"], m)
        else:
            reasons.append("its entry was removed (evicted, cleared or quarantined)")
        return Explanation(False, nearest, reasons or ["the entry for these inputs is unusable (see the log)"])
    best, best_reasons = None, None
    for e in store.all_entries():
        if e.manifest.get("kind") == "pch":  # a precompiled header is no candidate for a library
            continue
        inputs = e.manifest.get("inputs") or {}
        reasons = describe(inputs, plan.key_inputs(), base)
        rank = (inputs.get("name") != plan.name, len(reasons))
        if best is None or rank < best[0]:
            best, best_reasons = (rank, e), reasons
    if best is None:
        return Explanation(False, None, [f"the cache at {store.root} has no entries yet"])
    if best[0][0]:
        best_reasons = [f"no entry named {plan.name!r}; nearest is {best[1].manifest.get('name')!r}"] + best_reasons
    return Explanation(False, best[1], best_reasons)
