"""Step 2 of a load: the entry for a set of options, and how it was found.

First the hit record (a fresh process finds its entry with a few ``stat`` calls:
fingerprint.py, kload/cache/__init__.py); else the plan (step 3: plan.py hashes the
inputs) and the miss (steps 4 to 7: obtain.py looks the key up, locks, asks the
remote cache, compiles, publishes). The plan and the miss machinery are imported on
a miss only, so a hit never loads them. Then the hit record is written for next time.
"""
from __future__ import annotations

import time
from pathlib import Path

from kload.cache import Entry, fast_lookup

from . import knobs
from .fingerprint import KEY_CODE, fingerprint
from .options import Options


def resolve_entry(opts: Options) -> Resolved:
    """The entry of ``opts``: the hit record, else the plan and the miss (obtain.py)."""
    started = time.perf_counter()
    root = knobs.cache_root()
    hit_key = fingerprint(opts)                      # the hit record: a few stat calls
    if hit_key is not None:
        entry = fast_lookup(root, opts.name, *hit_key)
        if entry is not None:
            entry.touch()
            return Resolved(entry, "cache", time.perf_counter() - started)
    from kload.cache.store import Store  # the full lookup: on a miss of the hit record only

    from .obtain import obtain
    from .plan import make_plan

    store = Store(Path(root))
    plan = make_plan(opts, store)                    # step 3: the key inputs, hashed
    entry, how, _ = obtain(plan, store, may_compile=not knobs.disable_jit())   # steps 4-7: the miss
    if hit_key is not None:
        _write_hit_record(store, plan, entry, *hit_key)
    return Resolved(entry, how, time.perf_counter() - started, plan)


class Resolved(str):
    """What ``Handle.build()`` returns: the artifact's path (a ``str``, as it always was),
    and how the entry was found."""

    entry: Entry
    how: str                 # "cache" (a hit, a download, or another process's build) or "built"
    seconds: float           # the whole resolve: a lookup, or the compile
    plan: object | None      # the Plan (plan.py) when one was made; None on a hit of the hit record

    def __new__(cls, entry: Entry, how: str, seconds: float, plan=None) -> Resolved:
        self = super().__new__(cls, str(entry.artifact))
        self.entry, self.how, self.seconds, self.plan = entry, how, seconds, plan
        return self

    def __reduce__(self):  # pickled or copied, it is the path (a plain str), as build() returned before
        return (str, (str(self),))

    @property
    def sources(self) -> list[str]:
        """Every source of the library, built or not."""
        return list(self.entry.manifest.get("source_paths") or [])

    @property
    def build_dir(self) -> Path | None:
        """The build directory the entry was compiled in (ninja's; its objects and
        ``compile_commands.json`` are kept there), or None for an entry without key inputs."""
        from kload.cache import MANIFEST, read_json
        from kload.cache.store import Store

        inputs = self.plan.key_inputs() if self.plan is not None else \
            (read_json(self.entry.path / MANIFEST) or {}).get("inputs")
        if not inputs:
            return None
        root = self.entry.path.parent.parent  # <cache>/entries/<entry>: the cache it was found in
        return Store(root).build_dir(self.entry.manifest.get("name", ""), inputs)


def _write_hit_record(store, plan, entry: Entry, fp: str, cxx: str) -> None:
    """The record that lets the next process find ``entry`` without planning: every file
    whose bytes are in the key (the sources, the headers read, the compiler binaries,
    kload's key-making code), stamped."""
    files: dict[str, str | None] = {str(s.path): s.sha256 for s in plan.sources.sources}
    files.update(entry.manifest.get("headers") or {})
    files[cxx] = None  # the compiler binary: its version is remembered by this stamp too
    proper = plan.cxx.get("proper")
    if proper:  # the GCC behind a wrapper (ccache): an upgrade of it changes this file, not the wrapper
        files[proper] = None
    for code in KEY_CODE:
        files[code] = None
    store.write_hit_record(plan.name, fp, cxx, entry, files)
