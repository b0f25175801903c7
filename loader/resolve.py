"""Step 6 of a load: the entry for a set of options.

First the hit record (a fresh process finds its entry with a few ``stat``
calls: fingerprint.py, kload/cache/__init__.py); else the full lookup (plan.py
hashes the inputs, kload/cache/store.py looks the key up); else lock and
compile (build.py). The full lookup and the build machinery are imported on a
miss only, so a hit never loads them.
"""
from __future__ import annotations

import time
from pathlib import Path

from kload.cache import Entry, fast_lookup

from . import knobs
from .fingerprint import KEY_CODE, fingerprint
from .library import check_fixed_namespaces, claim_fixed_namespaces
from .options import Options


def resolve_entry(opts: Options) -> tuple[Entry, str, float]:
    """``(entry, "cache" | "built", seconds)``: the hit record, else the full lookup,
    else lock and compile."""
    started = time.perf_counter()
    root = knobs.cache_root()
    fast = fingerprint(opts)
    if fast is not None:
        entry = fast_lookup(root, opts.name, *fast)
        if entry is not None:
            entry.touch()
            return entry, "cache", time.perf_counter() - started
    entry, how = resolve_full(opts, Path(root), fast)
    return entry, how, time.perf_counter() - started


def _remote_hit(p, store) -> Entry | None:
    """KLOAD_DISABLE_JIT=1: the remote cache's entry, downloaded under the build lock as a
    build would be (so the ranks of a node publish it once)."""
    if not knobs.remote_cache():
        return None
    from kload.cache.lock import build_lock

    from .build import workspace
    from .errors import KloadError
    from .remote import fetch_only  # redis: only when a remote cache is set

    try:
        store.prepare()
    except KloadError:  # a read-only cache cannot take a download: the miss is reported as it is
        return None
    with build_lock(store.locks / f"{workspace(p, store).name}.lock", p.name):
        return store.lookup(p.skey) or fetch_only(p, store)


def resolve_full(opts: Options, root: Path, fast: tuple[str, str] | None) -> tuple[Entry, str]:
    """``(entry, "cache" | "built")`` the full way: hash the inputs, look the key up,
    else lock and compile. Then write the hit record for ``fast`` (the fingerprint
    and compiler path from fingerprint.py), so the next process need not."""
    from kload.cache.store import Store  # the full lookup: on a miss of the hit record only

    from .plan import plan

    store = Store(root)
    p = plan(opts, store)
    entry = store.lookup(p.skey)
    how = "cache"
    if entry is not None:
        entry.touch()
    elif knobs.disable_jit() and (fetched := _remote_hit(p, store)) is not None:
        entry = fetched  # KLOAD_DISABLE_JIT compiles nothing, but a cluster's cache may have it
    else:
        if knobs.disable_jit():
            from .errors import KloadError
            from .explain import explain_plan

            reasons = explain_plan(p, store).reasons
            raise KloadError(
                f"kload: KLOAD_DISABLE_JIT=1 and the cache at {store.root} has no build of {opts.name!r} for "
                "these inputs, so nothing is compiled" + "".join(f"\n  {r}" for r in reasons)
                + "\nPrebuild it into the cache with `python -m kload build SOURCES...` (same flags), or unset "
                "KLOAD_DISABLE_JIT."
            )
        from .build import compile_plan  # the compile machinery loads on a miss only

        # a fixed TORCH_LIBRARY namespace can be registered once per process: refuse
        # before compiling, since torch loads what it builds
        check_fixed_namespaces(opts.name, p.sources.fixed_namespaces, None, p.sources.fixed_ops)
        entry, seconds = compile_plan(p, store)
        if seconds > 0:
            how = "built"
            # torch's loader has loaded what it built (its TORCH_LIBRARY blocks ran): this
            # build owns those namespaces now, so a load() after build() is no second owner
            claim_fixed_namespaces(entry.manifest.get("fixed_namespaces") or [], entry.key)
            knobs.evict_after_build(store, entry.path.name)
    if fast is not None:
        fp, cxx = fast
        files: dict[str, str | None] = {str(s.path): s.sha256 for s in p.sources.sources}
        files.update(entry.manifest.get("headers") or {})
        files[cxx] = None  # the compiler binary: its version is remembered by this stamp too
        proper = p.inputs["cxx"].get("proper")
        if proper:  # the GCC behind a wrapper (ccache): an upgrade of it changes this file, not the wrapper
            files[proper] = None
        for code in KEY_CODE:
            files[code] = None
        store.write_hit_record(opts.name, fp, cxx, entry, files)
    return entry, how
