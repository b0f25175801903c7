"""Steps 4 to 7 of a load, on a miss of the hit record: the whole miss, in one function.

    4 look up → lock → look up again     (kload/cache/store.py, kload/cache/lock.py)
    5 the remote cache                    (remote.py; only with KLOAD_REMOTE_CACHE set)
    6 compile, or refuse                  (kload/build/pipeline.py; kload/plan/explain.py says why a refusal)
    7 publish → evict                     (kload/cache/publish.py, kload/cache/store.py)

:func:`obtain` tells it top to bottom and leaves for one call at a time. Imported on
a miss only: a hit never loads any of it.
"""
from __future__ import annotations

import errno

from kload.cache import Entry
from kload.cache.lock import build_lock
from kload.cache.publish import publish_artifact, sweep
from kload.cache.store import Store, writable_error

from ..compile import pipeline as build
from .. import knobs
from ..errors import KloadError
from .library import check_fixed_namespaces
from ..plan.plan import Plan

_FULL_DISK = (errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM)


def obtain(plan: Plan, store: Store, *, may_compile: bool) -> tuple[Entry, str, float]:
    """The entry of ``plan``: ``(entry, "cache" | "built", seconds compiling)``.

    ``may_compile=False`` (KLOAD_DISABLE_JIT=1) takes only what the local or the remote
    cache has, and raises a KloadError that says which key input differs otherwise."""
    entry = store.lookup(plan.skey)                      # 4. look up: a hit takes no lock
    if entry is not None:
        entry.touch()
        return entry, "cache", 0.0
    remote = _remote_cache()
    if may_compile:
        # a fixed TORCH_LIBRARY namespace can be registered once per process: refuse before
        # compiling what this process could not load
        check_fixed_namespaces(plan.name, plan.sources.fixed_namespaces, None, plan.sources.fixed_ops,
                               plan.sources.def_namespaces)
    seconds = 0.0
    # without a compile, the lock is taken only for a download (a read-only cache takes none)
    if may_compile or (remote is not None and _writable(store)):
        ws = store.build_dir(plan.name, plan.key_inputs())
        try:
            store.prepare()
            with build_lock(store.locks / f"{ws.name}.lock", plan.name):   # 4. lock: one build per directory
                entry = store.lookup(plan.skey)      # 4. look again: published while this one waited?
                if entry is None and not may_compile:     # 5. the remote cache's entry, once per node
                    entry = remote.fetch_only(plan, store)
                elif entry is None:

                    def compile_and_publish() -> tuple[Entry, float]:
                        done = build.compile(plan, store, ws)   # 6. compile (torch's loader; the headers read)
                        return publish_artifact(                # 7. publish
                            store, done.artifact, name=plan.name, skey=plan.skey, key=done.key,
                            headers=done.headers, stamps=done.stamps, manifest=done.manifest), done.seconds

                    if remote is None:
                        entry, seconds = compile_and_publish()
                    else:  # 5. a download, or another node's build awaited, else compile here and upload
                        entry, seconds = remote.around_build(plan, store, compile_and_publish)
        except OSError as e:
            if e.errno in _FULL_DISK:
                raise writable_error(store.root, e) from None
            raise
    if entry is None:
        raise refusal(plan, store)                   # 6. KLOAD_DISABLE_JIT=1: nothing compiles
    if seconds == 0.0:  # found under the lock, or downloaded: compiled by another process or node
        return entry, "cache", 0.0
    store.evict_after_publish(entry.path.name, knobs.cache_max_size())   # 7. evict
    sweep(store)  # and what processes killed mid-publish left
    return entry, "built", seconds


def _writable(store: Store) -> bool:
    try:
        store.prepare()
    except KloadError:
        return False
    return True


def _remote_cache():
    """remote.py where KLOAD_REMOTE_CACHE is set, else None (redis loads only then)."""
    if knobs.remote_cache() is None:
        return None
    from . import remote

    return remote


def refusal(plan: Plan, store: Store) -> KloadError:
    """KLOAD_DISABLE_JIT=1 and no entry: what differs from the nearest one, and what to do."""
    from ..plan.explain import explain_plan

    reasons = explain_plan(plan, store).reasons
    return KloadError(
        f"KLOAD_DISABLE_JIT=1 and the cache at {store.root} has no build of {plan.name!r} for "
        "these inputs, so nothing is compiled" + "".join(f"\n  {r}" for r in reasons)
        + "\nPrebuild it into the cache with `python -m kload build SOURCES...` (same flags), or unset "
        "KLOAD_DISABLE_JIT."
    )
