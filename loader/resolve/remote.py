"""On a local miss with ``KLOAD_REMOTE_CACHE`` set: the shared
remote cache (kload/cache/remote.py speaks to the server; docs/cache.md#remote-cache).

Under the node's build lock (one process per build directory of a cache gets here),
obtain.py calls :func:`around_build` (or :func:`fetch_only` where nothing may compile):

1. Look the source key up on the server; an entry whose (signed) manifest verifies
   and whose header closure matches this machine's headers is downloaded, verified
   and published locally: no compile.
2. Else take the cluster-wide lease for the source key (SET NX, expiring, renewed
   while the build runs) and build; then upload, and release the lease.
3. If another node holds the lease, wait for its upload ("waiting for HOST:PID
   building X"), then download. Waiting ends, and this node builds, past
   ``KLOAD_REMOTE_CACHE_WAIT``, when the holder's build failed, or when its lease
   expired (its process died): then this node takes the lease.

Any fault of the server (down, refusing, slow, full, a dropped connection) gives one
warning and a local build; the server is not asked again by this process for
``RETRY_AFTER`` seconds. An entry that does not verify is refused with a warning
and never loaded.
"""
from __future__ import annotations

import logging
import os
import stat
import threading
import time

from kload.cache import Entry
from kload.cache.key import file_sha256
from kload.cache.remote import Refused, Remote, RemoteError, this_process
from kload.cache.store import Store

from .. import knobs
from ..progress import say

log = logging.getLogger("kload")

POLL = 0.25           # seconds between looks while another node builds
SAY_EVERY = 15.0      # seconds between "waiting for ..." lines
RETRY_AFTER = 300.0   # seconds a process leaves a faulty server alone after its one warning


def _lease_ms() -> int:
    """A lease whose holder died expires after this (KLOAD_REMOTE_CACHE_LEASE, 30 s); its
    holder renews it every third of it."""
    return int(knobs.remote_lease() * 1000)


_remotes: dict[tuple, Remote] = {}
_down_until: dict[tuple, float] = {}


def server() -> Remote | None:
    """The configured server, or None (unset, misconfigured, or faulty a moment ago)."""
    url = knobs.remote_cache()
    if url is None:
        return None
    secret = knobs.remote_secret()
    ident = (url, knobs.remote_password(), secret)
    if _down_until.get(ident, 0.0) > time.monotonic():
        return None
    r = _remotes.get(ident)
    if r is None:
        try:
            r = client_for(url)
            knobs.remote_wait()  # a bad knob is said here, once
        except (ValueError, OverflowError) as e:
            log.warning("%s; the remote cache is not used", e)
            _down_until[ident] = float("inf")
            return None
        r.ident = ident
        if secret is None:
            log.warning("KLOAD_REMOTE_CACHE_KEY is not set, so entries from %s are trusted by their SHA-256 "
                        "only: anyone who can write to that server can make kload load their code", r.where)
        _remotes[ident] = r
    return r


def client_for(url: str) -> Remote:
    """A client for ``url`` with every knob applied (ValueError: a bad URL or knob)."""
    return Remote(url, password=knobs.remote_password(), secret=knobs.remote_secret(),
                  timeout=knobs.remote_timeout(), ttl=knobs.remote_ttl(), chunk=knobs.remote_chunk())


def set_aside(r: Remote, e: Exception) -> None:
    """One warning, then leave the server alone for a while."""
    if _down_until.get(r.ident, 0.0) > time.monotonic():
        return
    _down_until[r.ident] = time.monotonic() + RETRY_AFTER
    why = str(e) if isinstance(e, RemoteError) else f"{type(e).__name__}: {e}"
    log.warning("the remote cache %s is unusable (%s); building locally (not asking it again for %.0f s)",
                r.where, why, RETRY_AFTER)


def _headers_here(headers: dict) -> bool:
    """Do these headers hold these bytes here? Regular files at absolute paths only: a manifest
    cannot make kload read a device or a pipe."""
    try:
        for path, sha in headers.items():
            if not (os.path.isabs(path) and stat.S_ISREG(os.stat(path).st_mode) and file_sha256(path) == sha):
                return False
    except (OSError, ValueError, TypeError):
        return False
    return True


def fetch(r: Remote, plan, store: Store) -> Entry | None:
    """Download the entry for the plan's source key whose headers match this machine's."""
    for key in r.candidates(plan.skey):
        started = time.perf_counter()
        try:
            entry = r.download(store, plan.skey, key, plan.name, _headers_here)
        except Refused as why:
            if not why.again:
                log.warning("refusing the remote entry %s-%s from %s: %s; it is not loaded",
                            plan.name, key[:16], r.where, why)
            continue
        if entry is not None:
            log.info("downloaded %s (%d bytes) from %s in %.2f s", entry.path.name,
                     entry.manifest.get("size", 0), r.where, time.perf_counter() - started)
            return entry
    return None


class Lease:
    """This node's claim to build a key: renewed in a thread until :meth:`end`."""

    def __init__(self, r: Remote, skey: str, holder: str):
        self.r, self.skey, self.holder = r, skey, holder
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._renew, name="kload-lease", daemon=True)
        self._thread.start()

    def _renew(self) -> None:
        while not self._stop.wait(_lease_ms() / 3000):
            try:
                if not self.r.renew_lease(self.skey, self.holder, _lease_ms()):
                    log.warning("the build lease of %s expired; another node may build it too", self.holder)
                    return
            except Exception as e:  # noqa: BLE001
                set_aside(self.r, e)
                return

    def end(self, entry: Entry | None) -> None:
        """Upload ``entry`` (None: the build failed, so waiters build themselves), release."""
        self._stop.set()
        self._thread.join()
        # each step best effort: a failed upload (e.g. the server is full) still marks the build
        # failed, so waiters do not wait for it; an unreleased lease expires within the lease time
        # (not a build during which a file changed: no node could use it, and its waiters had better build)
        uploaded = entry is not None and not entry.changed_during_build and self._quietly(upload, self.r, entry)
        if uploaded:
            self._quietly(self.r.clear_failed, self.skey)
        else:
            self._quietly(self.r.mark_failed, self.skey, self.holder)
        self._quietly(self.r.release_lease, self.skey, self.holder)

    def _quietly(self, fn, *args) -> bool:
        try:
            fn(*args)
        except Exception as e:  # noqa: BLE001 (the build is done: never fail the load over the server)
            set_aside(self.r, e)
            return False
        return True


def upload(r: Remote, entry: Entry) -> None:
    started = time.perf_counter()
    sent = r.upload(entry)
    log.info("uploaded %s (%d bytes) to %s in %.2f s", entry.path.name, sent, r.where,
             time.perf_counter() - started)


def fetch_or_lease(r: Remote, plan, store: Store) -> tuple[Entry | None, Lease | None]:
    """A downloaded entry, or the lease to build (None, None: build without one)."""
    name, skey = plan.name, plan.skey
    mine = f"{this_process()} building {name}"
    started = time.monotonic()
    deadline, said, waited = started + knobs.remote_wait(), 0.0, None
    while True:
        entry = fetch(r, plan, store)
        if entry is not None:
            return entry, None
        if waited is not None and r.failed(skey) == waited:  # the build it waited for failed (not an older one)
            log.warning("%s failed; building %s here", waited, name)
            return None, None
        if r.take_lease(skey, mine, _lease_ms()):
            entry = fetch(r, plan, store)  # the holder may have uploaded and released in between
            if entry is not None:
                r.release_lease(skey, mine)
                return entry, None
            if waited is not None and r.failed(skey) == waited:  # it failed and released between our two looks
                log.warning("%s failed; building %s here", waited, name)
            return None, Lease(r, skey, mine)
        holder = r.lease_holder(skey)
        now = time.monotonic()
        if now > deadline:
            log.warning("waited %.0f s for %s (KLOAD_REMOTE_CACHE_WAIT); building %s here",
                        now - started, holder or waited, name)
            return None, None
        if holder is not None and (holder != waited or now - said >= SAY_EVERY):
            say(f"waiting for {holder} ({now - started:.0f} s; remote cache {r.where})")
            waited, said = holder, now
        time.sleep(POLL)


def around_build(plan, store: Store, build) -> tuple[Entry, float]:
    """``build()`` (-> (entry, seconds)) with the remote cache in front of it (a download, or
    another node's build awaited) and behind it (the upload)."""
    r = server()
    if r is None:
        return build()
    lease = None
    try:
        entry, lease = fetch_or_lease(r, plan, store)
        if entry is not None:
            return entry, 0.0
    except Exception as e:  # noqa: BLE001 (any failure of the remote path is a local build, never a failed load)
        set_aside(r, e)
    try:
        entry, seconds = build()
    except BaseException:
        if lease is not None:
            lease.end(None)
        raise
    if lease is not None:
        lease.end(entry)
    elif server() is r and not entry.changed_during_build:
        try:
            upload(r, entry)
        except Exception as e:  # noqa: BLE001 (the build succeeded: never fail the load over its upload)
            set_aside(r, e)
    return entry, seconds


def fetch_only(plan, store: Store) -> Entry | None:
    """A remote hit for ``KLOAD_DISABLE_JIT=1`` (nothing compiles, nothing is leased)."""
    r = server()
    if r is None:
        return None
    try:
        return fetch(r, plan, store)
    except Exception as e:  # noqa: BLE001
        set_aside(r, e)
        return None
