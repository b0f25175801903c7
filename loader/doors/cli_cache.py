"""``kload cache ...``: list, inspect, verify, prune and clear the cache (the
commands; ``__main__.py`` parses the command line)."""
from __future__ import annotations

import json
import os
import shutil
import time

from .. import knobs
from ..errors import KloadError
from ..options import torch_identity


def human_size(n: float) -> str:
    for unit in ("B", "K", "M", "G", "T"):
        if n < 1024 or unit == "T":
            return f"{n:.0f}{unit}" if unit == "B" else f"{n:.1f}{unit}"
        n /= 1024
    return f"{n}"


def time_ago(t: float) -> str:
    d = time.time() - t
    if d < 120:
        return f"{d:.0f} s ago"
    if d < 7200:
        return f"{d / 60:.0f} min ago"
    if d < 172800:
        return f"{d / 3600:.0f} h ago"
    return time.strftime("%Y-%m-%d", time.localtime(t))


def open_store():
    from kload.cache.store import Store

    store = Store(knobs.cache_dir())
    store.check_root()
    return store


def _find(store, key: str):
    key = key.strip()
    if len(key) < 4:
        raise KloadError(f"a key prefix needs at least 4 characters, got {key!r}")
    found = [e for e in store.all_entries() if e.key.startswith(key) or e.path.name.startswith(key)]
    if not found:
        raise KloadError(f"no entry in {store.root} matches {key!r} (see `python -m kload cache list`)")
    if len(found) > 1:
        raise KloadError(f"{key!r} matches {len(found)} entries: "
                         + ", ".join(e.path.name for e in found) + "; give more of the key")
    return found[0]


# -- cache ------------------------------------------------------------------------------

def cmd_list(args) -> int:
    from kload.cache.store import dir_size

    store = open_store()
    entries = sorted(store.all_entries(), key=lambda e: -e.last_used())
    sizes = {e.path.name: dir_size(e.path) for e in entries}

    def torch_version(e) -> str:
        return str((e.manifest.get("inputs") or {}).get("torch", {}).get("version", "?"))

    if args.json:
        print(json.dumps([{"name": e.manifest.get("name"), "kind": e.manifest.get("kind", "library"),
                           "key": e.key, "path": str(e.path),
                           "size": sizes[e.path.name], "last_used": e.last_used(), "torch": torch_version(e),
                           "compiler": _compiler(e)} for e in entries], indent=1))
        return 0
    print(f"cache: {store.root}")
    if not entries:
        print("no entries")
        return 0
    rows = [(e.manifest.get("name", "?"), e.manifest.get("kind", "library"), e.key[:16], human_size(sizes[e.path.name]),
             time_ago(e.last_used()), torch_version(e), _compiler(e)) for e in entries]
    head = ("NAME", "KIND", "KEY", "SIZE", "LAST USED", "TORCH", "COMPILER")
    widths = [max(len(r[i]) for r in rows + [head]) for i in range(len(head))]
    for r in [head] + rows:
        print("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip())
    print(f"{len(entries)} entries, {human_size(sum(sizes.values()))} "
          f"(limit {knobs.cache_max_size()})")
    return 0


def _compiler(e) -> str:
    cxx = (e.manifest.get("inputs") or {}).get("cxx") or {}
    first = (cxx.get("version") or "").splitlines()[:1]
    return first[0] if first else str(cxx.get("path", "?"))


def cmd_info(args) -> int:
    from kload.cache.store import dir_size

    store = open_store()
    e = _find(store, args.key)
    m = e.manifest
    info = {
        "entry": str(e.path), "name": m.get("name"), "key": e.key, "source_key": m.get("source_key"),
        "artifact": str(e.artifact), "size": dir_size(e.path), "sha256": m.get("sha256"),
        "created": time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(m.get("created", 0))),
        "last_used": time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(e.last_used())),
        "build_seconds": m.get("build_seconds"), "style": m.get("style"), "namespace": m.get("namespace"),
        "stable_target": m.get("stable_target"),
        "headers": m.get("headers"), "inputs": m.get("inputs"),
    }
    print(json.dumps(info, indent=2, ensure_ascii=False))
    return 0


def cmd_verify(args) -> int:
    from kload.cache.store import MANIFEST, Entry, read_json

    store = open_store()
    ok = bad = 0
    try:
        names = sorted(n for n in os.listdir(store.entries) if not n.startswith("."))
    except FileNotFoundError:
        names = []
    for n in names:
        path = store.entries / n
        m = read_json(path / MANIFEST)
        if m is None or "artifact" not in m:
            problem = "no readable manifest (an incomplete or damaged entry)"
        else:
            try:
                problem = store.check_artifact(Entry(path, m), full=True)
            except KloadError as e:
                problem = str(e)
        if problem:
            bad += 1
            dest = store.quarantine(path, problem)
            print(f"BAD  {n}: {problem}" + (f" -> quarantined in {dest}" if dest else " (could not quarantine)"))
        else:
            ok += 1
            print(f"ok   {n}")
    print(f"verified {ok + bad} entries: {ok} ok, {bad} quarantined")
    return 1 if bad else 0


def cmd_prune(args) -> int:
    from kload.cache.store import GRACE, dir_size, parse_size

    if args.max_size is None and args.older_than is None:
        raise KloadError("cache prune needs --max-size SIZE and/or --older-than DAYS")
    store = open_store()
    used = {e.path.name: e.last_used() for e in store.all_entries()}
    removed = []
    if args.older_than is not None:
        if args.older_than < 0:
            raise KloadError(f"--older-than must be a number of days >= 0, got {args.older_than}")
        cutoff = time.time() - args.older_than * 86400
        for e in store.all_entries():
            if e.last_used() < cutoff:
                size = dir_size(e.path)
                if store.remove(e):
                    removed.append((e, size))
    if args.max_size is not None:
        limit = parse_size(args.max_size)
        if limit is not None:
            sizes = {e.path.name: dir_size(e.path) for e in store.all_entries()}
            removed += [(e, sizes.get(e.path.name, 0)) for e in store.evict_to(limit)]
    for e, size in removed:
        print(f"removed {e.path.name} ({human_size(size)}, last used {time_ago(used.get(e.path.name, 0))})")
    left = store.all_entries()
    print(f"removed {len(removed)} entries, {human_size(sum(s for _, s in removed))}; "
          f"{len(left)} left, {human_size(sum(dir_size(e.path) for e in left))} "
          f"(entries used in the last {GRACE / 60:.0f} minutes or being loaded are kept)")
    return 0


def cmd_clear(args) -> int:
    from filelock import FileLock, Timeout

    from kload.cache.publish import sweep

    store = open_store()
    n = kept = 0
    sweep(store)  # half-published directories of killed processes (not a running one's)
    for e in store.all_entries():
        if store.remove(e, force_recent=True):
            n += 1
        else:
            kept += 1
    for d in (store.index, store.hits, store.quarantine_dir):
        shutil.rmtree(d, ignore_errors=True)
    builds = 0
    if store.builds.exists():
        for ws in sorted(store.builds.iterdir()):
            if not ws.is_dir():  # a precompile's spec, log or failure mark
                ws.unlink(missing_ok=True)
                continue
            lock = FileLock(str(store.locks / f"{ws.name}.lock"))
            try:
                lock.acquire(timeout=0)
            except Timeout:
                kept += 1  # being built right now
                continue
            try:
                shutil.rmtree(ws, ignore_errors=True)
                builds += 1
            finally:
                lock.release()
    try:
        os.unlink(store.root / "toolchain.json")
    except FileNotFoundError:
        pass
    print(f"cleared {n} entries and {builds} build directories from {store.root}"
          + (f"; kept {kept} in use" if kept else ""))
    return 0


# -- bundles (cache/bundle.py) ------------------------------------------------------------

def select_entries(store, names, every: bool, latest: bool) -> list:
    """``--all``: every library entry. Else each NAME is a library name (all its entries;
    with ``--latest`` the newest build only) or, failing that, a key prefix or entry
    name as ``cache info`` takes it. A build during which a file was saved is no one's (no
    lookup finds it): only its key prefix or entry name takes it."""
    built = [e for e in store.all_entries() if e.manifest.get("kind", "library") == "library"]
    libs = [e for e in built if not e.changed_during_build]
    if every:
        if names:
            raise KloadError("cache export takes NAMEs or --all, not both")
        if not libs:
            raise KloadError(f"the cache at {store.root} has no library entry to export")
        return libs
    if not names:
        raise KloadError("cache export needs NAMEs (library names or key prefixes) or --all")
    chosen = []
    for n in names:
        same = [e for e in libs if e.manifest.get("name") == n]
        if not same and any(e.manifest.get("name") == n for e in built):
            raise KloadError(f"every build of {n} in {store.root} had a file saved while it compiled "
                             "(no load would find it): load or build it again, then export")
        if same and latest:
            same = [max(same, key=lambda e: e.manifest.get("created", 0.0))]
        chosen += same or [_find(store, n)]
    return list({e.path.name: e for e in chosen}.values())


def cmd_export(args) -> int:
    from importlib.metadata import PackageNotFoundError, version
    from pathlib import Path

    from kload.cache.bundle import export

    store = open_store()
    entries = select_entries(store, args.names, args.all, args.latest)
    try:
        mine = version("kload")
    except PackageNotFoundError:
        mine = "unknown"
    out = Path(args.output)
    manifest = export(store, entries, out, mine)
    for e in entries:
        print(f"exported {e.path.name} ({human_size(e.manifest.get('size', 0))})")
    print(f"wrote {out}: {len(manifest['entries'])} entries, {human_size(out.stat().st_size)}")
    return 0


def cmd_import(args) -> int:
    from pathlib import Path

    from kload.cache.bundle import import_bundle

    store = open_store()
    results = import_bundle(store, Path(args.bundle))
    for r in results:
        print(f"imported {r['dir']}" if r["status"] == "imported"
              else f"skipped  {r['dir']}: already present in the cache")
        torch = r.get("torch") or {}  # a stable-ABI entry has no torch version in its key
        here = torch_identity() if "version" in torch else {}  # imports torch: only when needed
        if here and (torch["version"], torch.get("git")) != (here["version"], here["git"]):
            print(f"  warning: built for torch {torch['version']}, this is torch {here['version']}: "
                  "loads here will not find it")
        for what, why in (("missing_headers", "do not exist on this machine"),
                          ("changed_headers", "hold other bytes on this machine"),
                          ("missing_sources", "do not exist on this machine")):
            paths = r[what]
            if paths:
                kind = "sources" if what == "missing_sources" else "headers"
                print(f"  warning: {len(paths)} of its {kind} {why} (e.g. {paths[0]}); the entry is keyed by "
                      f"them, so a load here finds it only where the same {kind} are at the same paths")
    added = sum(r["status"] == "imported" for r in results)
    print(f"imported {added} entries, skipped {len(results) - added} already present, into {store.root}")
    return 0
