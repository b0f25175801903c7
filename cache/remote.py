"""The shared remote cache on Redis (docs/cache.md#remote-cache): entries, their
signatures, and the cluster-wide build lease. ``kload/remote.py`` decides when
to use it; this module only speaks to the server.

Keys (``kload:<schema>:`` first, so one server can hold other tools' caches):

    idx:<source key>    a hash: full key -> the artifact's SHA-256. Which keys to read; nothing
                        else in it is trusted (the signed manifest decides)
    man:<key>           {"body": manifest JSON, "sig": HMAC-SHA256 hex or null}; written
                        after every chunk, so a reader that finds it finds a whole upload
    art:<key>:<sha>:<i> the artifact, in chunks of ``chunk`` bytes (named by the artifact's SHA-256 too,
                        so a second upload of the key never rewrites chunks a reader is fetching)
    lease:<source key>  "HOST:PID building NAME": SET NX with an expiry, renewed while the
                        build runs, deleted (by its holder only) after the upload
    fail:<source key>   the holder's build failed: waiters stop waiting and build locally

Every key of an entry carries the TTL (``KLOAD_REMOTE_CACHE_TTL``); a download
refreshes it. Eviction beyond that (``maxmemory``) is the server's: an entry whose
chunks were evicted fails its size/hash check and is a miss, never half an entry.

Every call has a timeout (connect and read) and no retries: a server that is down,
slow, full or drops the connection raises :class:`RemoteError` at once, and the
caller builds locally. Nothing downloaded is trusted: it is staged in the cache root,
hashed on the way, checked against its manifest (and its signature when a secret is
set), and published with the same rename a bundle import uses (bundle.py).
"""
from __future__ import annotations

import hashlib
import hmac
import json
import os
import re
import shutil
import socket
import uuid
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from . import LAST_USED, MANIFEST, SCHEMA, Entry
from .bundle import publish_staged
from .key import manifest_problem
from .store import Store
from kload.messages import msg

PREFIX = f"kload:{SCHEMA}:"
MAX_ARTIFACT = 4 << 30      # bytes: a manifest that claims more is refused unread
MAX_MANIFEST = 64 << 20     # bytes: a manifest value larger than this is refused unread
MAX_CANDIDATES = 16         # entries read for one source key (the index is not trusted)
MIN_CHUNK = 1 << 16         # bytes: smaller chunks are refused (a million round trips is a hang)
_HEX64 = re.compile(r"[0-9a-f]{64}\Z")


def chunk_key(key: str, sha256: str, i: int) -> str:
    return f"{PREFIX}art:{key}:{sha256[:16]}:{i}"


class RemoteError(Exception):
    """The server could not be used (down, refusing, slow, full, dropped): build locally."""


class Refused(Exception):
    """A remote entry that did not verify: it is never loaded. ``again``: this very
    manifest was refused before in this process (not worth another warning)."""

    def __init__(self, why: str, again: bool = False):
        super().__init__(why)
        self.again = again


def redact(url: str) -> str:
    """The URL without its password, in the user part or the query (for messages and manifests)."""
    parts = urlsplit(url)
    netloc = parts.netloc
    if "@" in netloc:
        user, host = netloc.rsplit("@", 1)
        if ":" in user:
            netloc = f"{user.split(':', 1)[0]}:***@{host}"
    query = parts.query
    if "password=" in query:
        query = urlencode([(k, "***" if k == "password" else v) for k, v in parse_qsl(query, keep_blank_values=True)],
                          safe="*/")
    return urlunsplit(parts._replace(netloc=netloc, query=query))


def this_process() -> str:
    return f"{socket.gethostname()}:{os.getpid()}"


# compare-and-delete / compare-and-renew: only the holder touches its lease
_RELEASE = "if redis.call('get', KEYS[1]) == ARGV[1] then return redis.call('del', KEYS[1]) else return 0 end"
_RENEW = ("if redis.call('get', KEYS[1]) == ARGV[1] then return redis.call('pexpire', KEYS[1], ARGV[2]) "
          "else return 0 end")


class Remote:
    """One Redis server. ``secret``: the HMAC key (None: entries are trusted by hash)."""

    def __init__(self, url: str, *, password: str | None, secret: bytes | None, timeout: float,
                 ttl: int | None, chunk: int):
        scheme = urlsplit(url).scheme
        if scheme not in ("redis", "rediss", "unix"):
            raise ValueError(msg(f"KLOAD_REMOTE_CACHE={redact(url)!r} is not a redis://, rediss:// or unix:// URL"))
        self.where = redact(url)
        self.secret, self.ttl, self.chunk = secret, ttl, max(MIN_CHUNK, chunk)
        self.refused: set[tuple[str, str]] = set()  # (key, manifest digest) refused in this process
        kwargs = {"password": password} if password else {}
        self.r = redis.Redis.from_url(url, socket_timeout=timeout, socket_connect_timeout=timeout,
                                      retry=Retry(NoBackoff(), 0), health_check_interval=0, **kwargs)

    def _do(self, what: str, fn, *args):
        try:
            return fn(*args)
        except (redis.RedisError, OSError) as e:
            raise RemoteError(f"{what}: {type(e).__name__}: {e}") from None

    # -- entries ----------------------------------------------------------------------
    def candidates(self, skey: str) -> list[str]:
        """The full keys uploaded for this source key (well-formed ones, at most MAX_CANDIDATES)."""
        keys = [k.decode(errors="replace") for k in self._do("reading the index", self.r.hkeys, PREFIX + "idx:" + skey)]
        return [k for k in keys if _HEX64.match(k)][:MAX_CANDIDATES]

    def _sign(self, body: bytes) -> str | None:
        return hmac.new(self.secret, body, hashlib.sha256).hexdigest() if self.secret else None

    def upload(self, entry: Entry) -> int:
        """Put ``entry`` on the server: chunks, then the signed manifest, then the index
        hint. Returns the bytes sent. A failure part-way leaves no manifest, so no reader
        sees the partial upload (its chunks expire)."""
        m = {k: v for k, v in entry.manifest.items() if k not in ("stat", "imported")}
        key, skey = m["key"], m["source_key"]
        ex = self.ttl
        sent = 0
        with open(entry.artifact, "rb") as f:
            i = 0
            while True:
                data = f.read(self.chunk)
                if not data and i:
                    break
                self._do("uploading", self.r.set, chunk_key(key, m["sha256"], i), data, ex)
                sent += len(data)
                i += 1
                if len(data) < self.chunk:
                    break
        if sent != m["size"]:
            raise RemoteError(f"{entry.artifact} changed while it was uploaded")
        body = json.dumps({"manifest": m, "chunks": i, "chunk": self.chunk, "by": this_process()}, sort_keys=True).encode()
        doc = json.dumps({"body": body.decode(), "sig": self._sign(body)})
        self._do("uploading", self.r.set, f"{PREFIX}man:{key}", doc, ex)
        pipe = self.r.pipeline(transaction=False)
        pipe.hset(PREFIX + "idx:" + skey, key, m["sha256"])
        if ex:
            pipe.expire(PREFIX + "idx:" + skey, ex)
        self._do("uploading", pipe.execute)
        return sent

    def manifest(self, key: str) -> tuple[dict, int, int, str | None, str] | None:
        """``(manifest, chunks, chunk size, uploader, digest of the stored value)`` of ``key``: its signature
        checked (with a secret), then its shape; None if there is none; :class:`Refused` if it
        does not verify."""
        if not _HEX64.match(key):
            raise Refused("its key is not a SHA-256")
        name = f"{PREFIX}man:{key}"
        if self._do("reading a manifest", self.r.strlen, name) > MAX_MANIFEST:
            raise Refused(f"its manifest is larger than {MAX_MANIFEST} bytes")
        raw = self._do("reading a manifest", self.r.get, name)
        if raw is None:
            return None
        digest = hashlib.sha256(raw).hexdigest()
        if (key, digest) in self.refused:
            raise Refused("refused before", again=True)
        try:
            return (*self._verify(key, raw), digest)
        except Refused:
            self.refused.add((key, digest))
            raise

    def _verify(self, key: str, raw: bytes) -> tuple[dict, int, int, str | None]:
        try:
            doc = json.loads(raw)
            body = doc["body"].encode()
            sig = doc.get("sig")
        except (ValueError, KeyError, TypeError, AttributeError, RecursionError) as e:
            raise Refused(f"its manifest is not readable ({type(e).__name__})") from None
        if self.secret is not None:  # before anything else of the body is read
            if not isinstance(sig, str):
                raise Refused("it is unsigned and KLOAD_REMOTE_CACHE_KEY is set")
            if not hmac.compare_digest(sig, self._sign(body)):
                raise Refused("its signature does not match (another key signed it, or it was altered)")
        try:
            outer = json.loads(body)
            m, chunks, chunk = outer["manifest"], outer["chunks"], outer["chunk"]
        except (ValueError, KeyError, TypeError, AttributeError, RecursionError) as e:
            raise Refused(f"its manifest is not readable ({type(e).__name__})") from None
        if not isinstance(m, dict) or m.get("key") != key:
            raise Refused("its manifest is not the manifest of its key")
        size, sha = m.get("size"), m.get("sha256")
        if not (isinstance(sha, str) and _HEX64.match(sha)):
            raise Refused("its manifest has no artifact SHA-256")
        if not (type(size) is int and 0 <= size <= MAX_ARTIFACT and type(chunks) is int and type(chunk) is int
                and chunk >= MIN_CHUNK and chunks == max(1, -(-size // chunk))):
            raise Refused(f"its manifest lists {chunks!r} chunks of {chunk!r} bytes for {size!r} bytes")
        by = outer.get("by")
        return m, chunks, chunk, by if isinstance(by, str) else None

    def download(self, store: Store, skey: str, key: str, name: str, headers_ok=None) -> Entry | None:
        """Fetch, verify and publish entry ``key`` of library ``name`` into ``store``; None
        if the server has none, or if ``headers_ok(headers)`` says its header closure is
        not this machine's. :class:`Refused` if it does not verify (nothing is written)."""
        got = self.manifest(key)
        if got is None:
            return None
        m, chunks, chunk, by, digest = got
        try:
            return self._download(store, skey, key, name, headers_ok, m, chunks, chunk, by)
        except Refused:
            self.refused.add((key, digest))
            raise

    def _download(self, store: Store, skey: str, key: str, name: str, headers_ok, m: dict, chunks: int,
                  chunk: int, by: str | None) -> Entry | None:
        if not (name.isidentifier() and name.isascii()):
            raise Refused(f"{name!r} is not a library name")
        artifact = m.get("artifact")
        if artifact not in (name, f"{name}.so") or artifact in (MANIFEST, LAST_USED):
            raise Refused(f"its artifact {artifact!r} is not {name!r}'s")
        if m.get("source_key") != skey:
            raise Refused("its source key is not the one looked up")
        # everything but the artifact's bytes, before anything is written or any header is read
        problem = manifest_problem(m, {"key": key, "name": name, "artifact": artifact}, m["sha256"], m["size"])
        if problem:
            raise Refused(f"{name}-{key[:16]}{problem}")
        if headers_ok is not None and not headers_ok(m["headers"]):
            return None
        store.prepare()
        staging = store.root / f".remote-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        staged = staging / f"{name}-{key[:16]}"
        try:
            staged.mkdir(mode=0o700, parents=True)
            h, size = hashlib.sha256(), 0
            fd = os.open(staged / artifact, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "wb") as f:
                for i in range(chunks):  # GETRANGE: never more than a chunk in memory, whatever is stored
                    want = min(chunk, m["size"] - i * chunk)
                    data = self._do("downloading", self.r.getrange, chunk_key(key, m["sha256"], i), 0, chunk - 1)
                    if len(data) != want:
                        raise Refused(f"chunk {i} of {chunks} has {len(data)} bytes, not {want} (evicted, truncated, "
                                      "or the upload was cut)")
                    size += len(data)
                    h.update(data)
                    f.write(data)
            problem = manifest_problem(m, {"key": key, "name": name, "artifact": artifact}, h.hexdigest(), size)
            if problem:
                raise Refused(f"{name}-{key[:16]}{problem}")
            with open(staged / MANIFEST, "w") as f:
                json.dump(m, f, indent=1, sort_keys=True)
            publish_staged(store, staged, m, {"remote": self.where, "by": by})
        finally:
            shutil.rmtree(staging, ignore_errors=True)
        if self.ttl:
            try:
                self.touch(key, m["sha256"], chunks, skey)
            except RemoteError:
                pass  # the entry is here already; its TTL is the server's loss
        return store.open_entry(store.entries / staged.name, key)

    def touch(self, key: str, sha256: str, chunks: int, skey: str) -> None:
        """A download refreshes the entry's TTL (the server's eviction sees it used)."""
        pipe = self.r.pipeline(transaction=False)
        for k in [f"{PREFIX}man:{key}", PREFIX + "idx:" + skey] + [chunk_key(key, sha256, i) for i in range(chunks)]:
            pipe.expire(k, self.ttl)
        self._do("refreshing the TTL", pipe.execute)

    def entries(self) -> list[dict]:
        """Every manifest on the server (``kload cache list --remote``), unverified."""
        out = []
        for k in self._do("listing", lambda: list(self.r.scan_iter(match=PREFIX + "man:*", count=500))):
            key = k.decode(errors="replace")[len(PREFIX) + 4:]
            try:
                if self._do("listing", self.r.strlen, k) > MAX_MANIFEST:
                    raise ValueError("too large")
                doc = json.loads(self._do("listing", self.r.get, k))
                sig, body = doc.get("sig"), doc["body"]
                outer = json.loads(body)
                m = outer["manifest"]
                num = (lambda v: v if type(v) in (int, float) else None)
                out.append({"key": key, "name": str(m.get("name")), "size": num(m.get("size")),
                            "by": str(outer.get("by")), "created": num(m.get("created")),
                            # with a secret: a signature that verifies; without: one is there (unchecked)
                            "signed": isinstance(sig, str) and (self.secret is None or hmac.compare_digest(
                                sig, self._sign(body.encode()))),
                            "source_key": str(m.get("source_key")), "torch": (m.get("inputs") or {}).get("torch")})
            except (ValueError, KeyError, TypeError, AttributeError, RecursionError):
                out.append({"key": key, "name": None, "unreadable": True})
        return out

    # -- the cluster-wide build lease ---------------------------------------------------------
    def take_lease(self, skey: str, holder: str, ms: int) -> bool:
        return bool(self._do("taking the build lease", self.r.set, PREFIX + "lease:" + skey, holder, None, ms, True))

    def renew_lease(self, skey: str, holder: str, ms: int) -> bool:
        return bool(self._do("renewing the build lease", self.r.eval, _RENEW, 1, PREFIX + "lease:" + skey, holder, ms))

    def release_lease(self, skey: str, holder: str) -> None:
        self._do("releasing the build lease", self.r.eval, _RELEASE, 1, PREFIX + "lease:" + skey, holder)

    def lease_holder(self, skey: str) -> str | None:
        v = self._do("reading the build lease", self.r.get, PREFIX + "lease:" + skey)
        return v.decode(errors="replace") if v is not None else None

    def mark_failed(self, skey: str, holder: str, seconds: int = 120) -> None:
        self._do("recording a failed build", self.r.set, PREFIX + "fail:" + skey, holder, seconds)

    def failed(self, skey: str) -> str | None:
        v = self._do("reading the build state", self.r.get, PREFIX + "fail:" + skey)
        return v.decode(errors="replace") if v is not None else None

    def clear_failed(self, skey: str) -> None:
        self._do("clearing the build state", self.r.delete, PREFIX + "fail:" + skey)
