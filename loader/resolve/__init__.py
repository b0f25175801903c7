"""The resolve: takes a load's Options, gives its cache Entry (built, found or
fetched) and opens it in this process.

- here, on the hit path: the hit record. A fresh process finds its entry with a few
  ``stat`` calls (kload/cache/__init__.py), under the options' *fingerprint*: everything
  the record must match exactly before it may stand in for the full key (the options,
  the keyed environment, the compiler command, torch's and Python's identity). It is a
  ``repr`` of plain values, computed without hashing a file; the files whose bytes go
  into the key are stamped in the record instead, and ``KEY_CODE`` lists kload's own
  key-making modules among them, so a record is void once the code that makes keys
  changes. Else the plan (kload.plan hashes the inputs) and the miss;
- ``obtain``: the miss: look the key up, lock, ask the remote cache, compile
  (kload.compile), publish. Imported on a miss only, as the plan is;
- ``remote``: the shared remote cache (``KLOAD_REMOTE_CACHE``);
- ``library``: the entry opened in this process, its ops registered.
"""
from __future__ import annotations

import os
import time
from pathlib import Path

import kload.cache as _cache
from kload.cache import SCHEMA, Entry, fast_lookup

from .. import knobs
from ..options import (CUDA_SUFFIXES, KERNELS_DIR, LOADER_DIR, Options, cxx_command, host_cpu,
                           keyed_environment, python_identity, torch_identity, which)

# kload's own code that turns inputs into a key: a hit record is void once it changes
KEY_CODE = [os.path.join(LOADER_DIR, f) for f in ("options.py", "resolve/__init__.py", "plan/plan.py",
                                                  "plan/sources.py", "plan/toolchain.py", "knobs.py")] + [
    os.path.join(os.path.dirname(os.path.abspath(_cache.__file__)), "key.py")]
HIT_RECORD_FORMAT = 2  # the hit record's own format: a record of another format is void


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
    from ..plan.plan import make_plan

    store = Store(Path(root))
    plan = make_plan(opts, store)                    # the key inputs, hashed (kload.plan)
    entry, how, _ = obtain(plan, store, may_compile=not knobs.disable_jit())   # the miss (obtain.py)
    if hit_key is not None:
        _write_hit_record(store, plan, entry, *hit_key)
    return Resolved(entry, how, time.perf_counter() - started, plan)


def fingerprint(opts: Options) -> tuple[str, str] | None:
    """``(fingerprint, compiler path)`` for the hit record of these options, or None
    where the record cannot stand in for the full lookup: CUDA sources (the key
    depends on the GPUs found). ``-march=native`` builds add the CPU model and flags
    (one read of /proc/cpuinfo), as their key does."""
    if any(p.suffix in CUDA_SUFFIXES for p in opts.paths):
        return None
    native = host_cpu() if any("native" in f for f in opts.cflags + opts.ldflags) else None
    command = cxx_command()
    cxx = which(command)
    if cxx is None:
        return None  # the full lookup says what is wrong
    env = keyed_environment()
    env["PATH"] = os.environ.get("PATH", "")
    # repr() of str/bool/list/dict values is unambiguous and cheap (no hashing here)
    return repr((HIT_RECORD_FORMAT, SCHEMA, opts.name, [str(p) for p in opts.paths], opts.cflags, opts.cuda_cflags,
                 opts.ldflags, opts.include_paths, opts.debug, opts.with_cuda, opts.standalone, native,
                 knobs.fast_link(), sorted(env.items()),
                 command, sorted(torch_identity().items()), sorted(python_identity().items()),
                 KERNELS_DIR)), cxx


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
