"""``kload cache push``, ``kload cache pull`` and ``kload cache list --remote``: the
local cache and the shared remote one (KLOAD_REMOTE_CACHE; docs/cache.md#remote-cache)."""
from __future__ import annotations

import json

from kload.cache.remote import Refused, Remote, RemoteError

from .. import knobs
from .cli_cache import human_size, open_store, select_entries, time_ago
from ..errors import KloadError
from ..resolve.remote import client_for, upload


def _remote() -> Remote:
    url = knobs.remote_cache()
    if url is None:
        raise KloadError("no remote cache: set KLOAD_REMOTE_CACHE=redis://HOST:PORT/DB")
    return client_for(url)


def _unusable(r: Remote, e: RemoteError) -> KloadError:
    return KloadError(f"the remote cache {r.where} is unusable: {e}")


def cmd_push(args) -> int:
    """Upload local entries (NAMEs or key prefixes; none: every library entry)."""
    store = open_store()
    entries = select_entries(store, args.names, not args.names, False)
    r = _remote()
    for e in entries:
        try:
            upload(r, e)
        except RemoteError as err:
            raise _unusable(r, err) from None
        print(f"pushed {e.path.name} ({human_size(e.manifest.get('size', 0))}) to {r.where}"
              + ("" if r.secret else " unsigned (KLOAD_REMOTE_CACHE_KEY is not set)"))
    return 0


def _remote_entries(r: Remote) -> list[dict]:
    try:
        return r.entries()
    except RemoteError as e:
        raise _unusable(r, e) from None


def cmd_pull(args) -> int:
    """Download remote entries (NAMEs or key prefixes; none: all), each verified; exit 1
    if any was refused."""
    r = _remote()
    found = [e for e in _remote_entries(r) if not e.get("unreadable")]
    if args.names:
        found = [e for e in found if any(e["name"] == n or (len(n) >= 4 and e["key"].startswith(n))
                                         for n in args.names)]
        if not found:
            raise KloadError(f"no entry on {r.where} matches {' '.join(args.names)} "
                             "(see `kload cache list --remote`)")
    store = open_store()
    pulled = refused = 0
    for e in found:
        try:
            got = r.download(store, e["source_key"], e["key"], e["name"])
        except Refused as why:
            refused += 1
            print(f"refused {e['name']}-{e['key'][:16]}: {why}")
            continue
        except RemoteError as err:
            raise _unusable(r, err) from None
        if got is not None:  # None: it left the server since it was listed
            pulled += 1
            print(f"pulled  {got.path.name} ({human_size(got.manifest.get('size', 0))})")
    print(f"pulled {pulled} entries from {r.where} into {store.root}" + (f"; refused {refused}" if refused else ""))
    return 1 if refused else 0


def cmd_list_remote(args) -> int:
    r = _remote()
    found = sorted(_remote_entries(r), key=lambda e: -(e.get("created") or 0))
    if args.json:
        print(json.dumps(found, indent=1))
        return 0
    print(f"remote cache: {r.where}")
    rows = [(str(e.get("name")), e["key"][:16], human_size(e.get("size") or 0), "yes" if e.get("signed") else "no",
             time_ago(e["created"]) if e.get("created") else "?", str(e.get("by") or "?"),
             str((e.get("torch") or {}).get("version", "-"))) for e in found if not e.get("unreadable")]
    head = ("NAME", "KEY", "SIZE", "SIGNED", "BUILT", "BY", "TORCH")
    widths = [max(len(row[i]) for row in rows + [head]) for i in range(len(head))]
    for row in [head] + rows:
        print("  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip())
    print(f"{len(rows)} entries, {human_size(sum(e.get('size') or 0 for e in found))}")
    return 0
