"""The shared remote cache (KLOAD_REMOTE_CACHE) against a real redis-server on a
loopback port in a temporary directory: simulated nodes are cache directories,
their processes real interpreters; every build compiles for real (a small
stable-ABI library, ~3 s), counted by a compiler wrapper."""
from __future__ import annotations

import hashlib
import hmac
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import redis

from conftest import kload_cli, write
from kload.cache.key import full_key
from kload.cache.remote import chunk_key

pytestmark = [pytest.mark.skipif(shutil.which("redis-server") is None,
                                 reason="redis-server is not installed (`make test` installs it as root)"),
              pytest.mark.slow]  # make test-quick leaves this file out (docs/testing.md)

SM = """\
    #include <kload/stable.h>
    using kload::Tensor;
    Tensor sm(const Tensor& a) {
      Tensor ac = torch::stable::contiguous(a);
      Tensor out = torch::stable::empty_like(ac);
      const float* pa = ac.const_data_ptr<float>();
      float* po = out.mutable_data_ptr<float>();
      for (int64_t i = 0; i < ac.numel(); ++i) po[i] = pa[i] * 3 + 1;
      return out;
    }
    KLOAD_LIBRARY(m) { m.def("sm(Tensor a) -> Tensor"); }
    KLOAD_IMPL(CPU, m) { m.impl("sm", TORCH_BOX(&sm)); }
"""
RIGHT = [1.0, 4.0, 7.0]  # sm(arange(3))
PREFIX = "kload:1:"
# KLOAD_REMOTE_CACHE_LEASE for every node here (30 s by default): a lease whose holder died
# expires after this; its holder renews it every third. Short, so that no test sleeps out 30 s windows.
LEASE_S = 6


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """A redis-server of our own: loopback, a temporary directory, no persistence."""

    def __init__(self, folder: Path, *conf: str, password: str | None = None):
        folder.mkdir(parents=True, exist_ok=True)
        for _ in range(5):  # a free port can be taken before redis binds it (the other worker's server)
            self.folder, self.port = folder, free_port()
            self.proc = subprocess.Popen(
                ["redis-server", "--port", str(self.port), "--bind", "127.0.0.1", "--dir", str(folder),
                 "--save", "", "--appendonly", "no", *conf, *(["--requirepass", password] if password else [])],
                stdout=open(folder / "redis.log", "w"), stderr=subprocess.STDOUT)
            self.client = redis.Redis(port=self.port, password=password, socket_timeout=5)
            if self._up():
                return
        raise RuntimeError((folder / "redis.log").read_text())

    def _up(self) -> bool:
        """Whether this server answers on its port (not another process that took the port first)."""
        deadline = time.monotonic() + 20
        while self.proc.poll() is None:
            try:
                if self.client.info("server")["process_id"] == self.proc.pid:
                    return True
                self.kill()  # the port answered for someone else
                return False
            except redis.AuthenticationError:  # a server without our password: not ours
                self.kill()
                return False
            except redis.ConnectionError:
                if time.monotonic() > deadline:
                    raise RuntimeError((self.folder / "redis.log").read_text())
                time.sleep(0.05)
        return False

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait()


@pytest.fixture
def server(tmp_path):
    s = Server(tmp_path / "redis")
    yield s
    s.kill()


@pytest.fixture
def src(tmp_path):
    return write(tmp_path / "src" / "sm.cpp", SM)


@pytest.fixture
def cxx(tmp_path):
    """A compiler wrapper that logs every call. Before compiling sm.cpp it waits for the file
    $GATE (a test opens it when its scene is set: no race against a fixed sleep), or sleeps
    $SLOW_CXX seconds (where time itself is the point: a build longer than the lease)."""
    log = tmp_path / "cxx.log"
    script = tmp_path / "logging-c++"
    script.write_text(f'#!/bin/sh\necho "$*" >> "{log}"\n'
                      f'case "$*" in *" -c "*sm.cpp*) if [ -n "${{GATE:-}}" ]; then i=0; '
                      f'while [ ! -e "$GATE" ] && [ $i -lt 6000 ]; do sleep 0.05; i=$((i+1)); done; '
                      f'else sleep "${{SLOW_CXX:-0}}"; fi ;; esac\nexec c++ "$@"\n')
    script.chmod(0o755)
    return script, log


def compiles(log: Path) -> int:
    return sum(" -c " in f" {line} " and "sm.cpp" in line for line in log.read_text().splitlines()) \
        if log.exists() else 0


CHILD = """\
    import json, logging, sys, torch, kload
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    ops = kload.load(sys.argv[1])
    print(json.dumps({"out": ops.sm(torch.arange(3.0)).tolist()}))
"""


def node_env(cache: Path, url: str | None, cxx, **extra) -> dict:
    env = dict(os.environ, KLOAD_CACHE_DIR=str(cache), CXX=str(cxx[0]), KLOAD_VERBOSE="0",
               KLOAD_REMOTE_CACHE_LEASE=f"{LEASE_S}s")
    env.pop("KLOAD_REMOTE_CACHE_KEY", None)
    if url:
        env["KLOAD_REMOTE_CACHE"] = url
    env.update({k: str(v) for k, v in extra.items()})
    return env


def start(src: Path, env: dict, err: Path | None = None, code: str = CHILD) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", textwrap.dedent(code), str(src)], env=env, text=True,
                            stdout=subprocess.PIPE, stderr=open(err, "w") if err else subprocess.PIPE,
                            start_new_session=True)


def finish(proc: subprocess.Popen, err: Path | None = None) -> tuple[list, str]:
    out, stderr = proc.communicate(timeout=300)
    stderr = err.read_text() if err else stderr
    assert proc.returncode == 0, f"exit {proc.returncode}\n{out}\n{stderr}"
    return json.loads(out.strip().splitlines()[-1])["out"], stderr


def run(src: Path, env: dict) -> tuple[list, str]:
    return finish(start(src, env))


def entry_manifest(cache: Path) -> dict:
    (entry,) = (cache / "entries").iterdir()
    return json.loads((entry / "manifest.json").read_text())


@pytest.fixture
def seeded(tmp_path, src, cxx):
    """A node that built ``sm`` with no remote cache (1 compile): its cache and manifest."""
    seed = tmp_path / "seed"
    assert run(src, node_env(seed, None, cxx))[0] == RIGHT
    assert compiles(cxx[1]) == 1
    return seed, entry_manifest(seed)


def test_cold_cluster_of_two_nodes_by_four_processes_compiles_once(tmp_path, server, src, cxx):
    nodes = [tmp_path / "node-a", tmp_path / "node-b"]
    procs = [start(src, node_env(node, server.url, cxx)) for _ in range(4) for node in nodes]
    results = [finish(p) for p in procs]
    assert [out for out, _ in results] == [RIGHT] * 8
    assert compiles(cxx[1]) == 1, cxx[1].read_text()
    logs = "".join(err for _, err in results)
    assert logs.count("kload: built sm") == 1 and logs.count("kload: uploaded sm-") == 1
    assert logs.count("kload: downloaded sm-") == 1, logs  # the other node, once; its other 3 hit locally
    for node in nodes:
        assert entry_manifest(node)["key"] == entry_manifest(nodes[0])["key"]
    assert server.client.get(PREFIX + "lease:" + entry_manifest(nodes[0])["source_key"]) is None  # released


def test_empty_cache_and_warm_server_compile_nothing_and_a_local_hit_never_asks_the_server(
        tmp_path, server, src, cxx, seeded):
    seed, m = seeded
    signed = {"KLOAD_REMOTE_CACHE": server.url, "KLOAD_REMOTE_CACHE_KEY": "s3cret"}
    push = kload_cli("cache", "push", "sm", env={"KLOAD_CACHE_DIR": str(seed), "KLOAD_REMOTE_CACHE_TTL": "2h",
                                                **signed})
    assert push.returncode == 0 and f"pushed sm-{m['key'][:16]}" in push.stdout, push.stdout + push.stderr
    for key in server.client.keys(PREFIX + "*"):  # every key of the entry expires (KLOAD_REMOTE_CACHE_TTL)
        assert 7000 < server.client.ttl(key) <= 7200, key
    listed = kload_cli("cache", "list", "--remote", "--json", env=signed)
    assert [(e["name"], e["key"], e["size"], e["signed"]) for e in json.loads(listed.stdout)] == \
        [("sm", m["key"], m["size"], True)]

    fresh = tmp_path / "fresh"
    out, err = run(src, node_env(fresh, server.url, cxx, KLOAD_REMOTE_CACHE_KEY="s3cret"))
    assert out == RIGHT and compiles(cxx[1]) == 1, err  # the seed's compile only
    assert f"kload: downloaded sm-{m['key'][:16]}" in err
    assert entry_manifest(fresh)["imported"]["remote"] == server.url
    pulled = kload_cli("cache", "pull", env={"KLOAD_CACHE_DIR": str(tmp_path / "pulled"), **signed})
    assert pulled.returncode == 0 and "pulled 1 entries" in pulled.stdout, pulled.stdout + pulled.stderr

    # KLOAD_DISABLE_JIT=1 compiles nothing, but takes what the cluster's cache has
    out, err = run(src, node_env(tmp_path / "jit-off", server.url, cxx, KLOAD_DISABLE_JIT=1))
    assert out == RIGHT and compiles(cxx[1]) == 1 and "kload: downloaded sm-" in err, err

    server.kill()  # a warm local hit must not notice: it never talks to the server
    out, err = run(src, node_env(fresh, server.url, cxx, KLOAD_REMOTE_CACHE_KEY="s3cret"))
    assert out == RIGHT and compiles(cxx[1]) == 1
    assert "remote cache" not in err and "loaded sm from cache" in err, err


def plant(client: redis.Redis, m: dict, artifact: bytes, sig: str | None) -> None:
    """What an attacker with write access to the server can do: a well-formed entry for
    the real key, with its own artifact and a manifest whose hash matches it."""
    planted = dict(m, sha256=hashlib.sha256(artifact).hexdigest(), size=len(artifact))
    body = json.dumps({"manifest": planted, "chunks": 1, "chunk": 1 << 22, "by": "attacker:1"}, sort_keys=True)
    client.set(chunk_key(m["key"], planted["sha256"], 0), artifact)
    client.set(f"{PREFIX}man:{m['key']}", json.dumps({"body": body, "sig": sig and sig.replace("$BODY", body)}))
    client.hset(PREFIX + "idx:" + m["source_key"], m["key"], json.dumps(m["headers"]))


@pytest.mark.parametrize("how", ["unsigned", "wrong key"])
def test_a_planted_entry_is_refused_and_rebuilt_when_a_key_is_set(tmp_path, server, src, cxx, seeded, how):
    _seed, m = seeded
    evil = b"\x7fELF planted: kload must never dlopen this"
    sig = None
    if how == "wrong key":
        body = json.dumps({"manifest": dict(m, sha256=hashlib.sha256(evil).hexdigest(), size=len(evil)),
                           "chunks": 1, "chunk": 1 << 22, "by": "attacker:1"}, sort_keys=True)
        sig = hmac.new(b"guessed", body.encode(), hashlib.sha256).hexdigest()
    plant(server.client, m, evil, sig)
    victim = tmp_path / "victim"
    out, err = run(src, node_env(victim, server.url, cxx, KLOAD_REMOTE_CACHE_KEY="s3cret"))
    assert out == RIGHT and compiles(cxx[1]) == 2, err  # refused, so built here
    why = "it is unsigned" if how == "unsigned" else "its signature does not match"
    assert f"refusing the remote entry sm-{m['key'][:16]}" in err and why in err, err
    assert hashlib.sha256((victim / "entries" / f"sm-{m['key'][:16]}" / "sm.so").read_bytes()).hexdigest() \
        == entry_manifest(victim)["sha256"] != hashlib.sha256(evil).hexdigest()
    # the victim's signed upload replaced the planted entry: a fresh node now downloads it
    pulled = kload_cli("cache", "pull", env={"KLOAD_CACHE_DIR": str(tmp_path / "after"),
                                              "KLOAD_REMOTE_CACHE": server.url, "KLOAD_REMOTE_CACHE_KEY": "s3cret"})
    assert pulled.returncode == 0 and "pulled 1 entries" in pulled.stdout, pulled.stdout + pulled.stderr


def test_a_hostile_server_cannot_hang_crash_or_write_outside_the_cache(tmp_path, server, src, cxx, seeded):
    """No key set (trust by hash): what anyone who can write to the server can plant for the
    real source key is refused or skipped, and the node builds its own."""
    _seed, m = seeded
    skey, c = m["source_key"], server.client
    escape = tmp_path / "escaped"
    # 1. a key that is a path: it must never name a file
    c.hset(PREFIX + "idx:" + skey, f"../../../../{escape}", "x")
    c.set(f"{PREFIX}man:../../../../{escape}", json.dumps({"body": json.dumps({"manifest": m}), "sig": None}))
    # 2. a self-consistent entry whose header closure names a device that never ends
    headers = {"/dev/zero": "0" * 64}
    evil = dict(m, headers=headers, key=full_key(skey, headers))
    body = json.dumps({"manifest": evil, "chunks": 1, "chunk": 1 << 22, "by": "attacker:1"})
    c.hset(PREFIX + "idx:" + skey, evil["key"], "x")
    c.set(f"{PREFIX}man:{evil['key']}", json.dumps({"body": body, "sig": None}))
    # 3. the real key, with values that break a careless parser
    c.hset(PREFIX + "idx:" + skey, m["key"], "x")
    c.set(f"{PREFIX}man:{m['key']}", '{"body": "{\\"manifest\\": {}, \\"chunks\\": Infinity, \\"chunk\\": 1}"}')
    started = time.monotonic()
    out, err = run(src, node_env(tmp_path / "victim", server.url, cxx))
    assert out == RIGHT and compiles(cxx[1]) == 2 and "kload: built sm" in err, err
    assert time.monotonic() - started < 120 and not escape.exists()
    assert "refusing the remote entry" in err and "Traceback" not in err


def test_a_truncated_remote_artifact_is_refused_rebuilt_and_repaired(tmp_path, server, src, cxx, seeded):
    seed, m = seeded
    env = {"KLOAD_CACHE_DIR": str(seed), "KLOAD_REMOTE_CACHE": server.url}
    assert kload_cli("cache", "push", env=env).returncode == 0
    chunk = chunk_key(m["key"], m["sha256"], 0)
    whole = server.client.get(chunk)
    server.client.set(chunk, whole[: len(whole) // 2])
    out, err = run(src, node_env(tmp_path / "victim", server.url, cxx))
    assert out == RIGHT and compiles(cxx[1]) == 2, err
    assert "refusing the remote entry" in err and "chunk 0 of 1 has" in err and "truncated" in err, err
    assert "KLOAD_REMOTE_CACHE_KEY is not set" in err
    # the rebuild was uploaded over it: its manifest names the new build's own chunks, which are whole
    rebuilt = entry_manifest(tmp_path / "victim")
    assert json.loads(json.loads(server.client.get(PREFIX + "man:" + m["key"]))["body"])["manifest"]["sha256"] \
        == rebuilt["sha256"]
    assert server.client.get(chunk_key(m["key"], rebuilt["sha256"], 0)) == \
        (tmp_path / "victim" / "entries" / f"sm-{m['key'][:16]}" / "sm.so").read_bytes()
    assert not [p for p in (tmp_path / "victim").iterdir() if p.name.startswith(".remote-")]


def holder_and_waiter(tmp_path, server, src, cxx, slow_a: float = 0, code: str = CHILD, gate: Path | None = None):
    """Node a starts building (its compile waits for ``gate``, or sleeps ``slow_a`` s) and
    takes the lease; node b starts and waits for it. Returns both processes and their
    stderr files."""
    a_err, b_err = tmp_path / "a.err", tmp_path / "b.err"
    slow = {"GATE": str(gate)} if gate else {"SLOW_CXX": slow_a}
    a = start(src, node_env(tmp_path / "a", server.url, cxx, **slow), a_err, code)
    deadline = time.monotonic() + 300  # a fresh interpreter, torch, a plan: slow beside the other worker
    while not server.client.keys(PREFIX + "lease:*"):  # a holds the lease: it is compiling
        assert time.monotonic() < deadline and a.poll() is None, a_err.read_text()
        time.sleep(0.1)
    b = start(src, node_env(tmp_path / "b", server.url, cxx), b_err, code)
    deadline = time.monotonic() + 300
    while "waiting for" not in b_err.read_text():
        assert time.monotonic() < deadline and b.poll() is None, b_err.read_text()
        time.sleep(0.1)
    assert f"waiting for {socket.gethostname()}:{a.pid} building sm" in b_err.read_text()
    return a, b, a_err, b_err


def test_server_killed_mid_build_both_nodes_finish_locally_with_one_warning(tmp_path, server, src, cxx):
    gate = tmp_path / "gate"
    a, b, a_err, b_err = holder_and_waiter(tmp_path, server, src, cxx, gate=gate)
    server.kill()
    gate.touch()  # a compiles now, b is waiting: both find the server gone
    (out_a, err_a), (out_b, err_b) = finish(a, a_err), finish(b, b_err)
    assert out_a == out_b == RIGHT
    assert compiles(cxx[1]) == 2
    for err in (err_a, err_b):
        assert err.count("is unusable") == 1, err
    for node in ("a", "b"):
        assert kload_cli("cache", "verify", env={"KLOAD_CACHE_DIR": str(tmp_path / node)}).returncode == 0


def test_a_build_longer_than_the_lease_keeps_it_renewed_and_the_waiter_downloads(tmp_path, server, src, cxx):
    gate = tmp_path / "gate"
    a, b, a_err, b_err = holder_and_waiter(tmp_path, server, src, cxx, gate=gate)
    time.sleep(LEASE_S + 3)  # the point: a holds the lease past its expiry while b waits (a renews it)
    gate.touch()
    (out_a, _), (out_b, err_b) = finish(a, a_err), finish(b, b_err)
    assert out_a == out_b == RIGHT
    assert compiles(cxx[1]) == 1, err_b  # b never took over: a renewed its lease
    assert "kload: downloaded sm-" in err_b


def test_waiting_is_bounded_by_KLOAD_REMOTE_CACHE_WAIT(tmp_path, server, src, cxx):
    a_err, b_err = tmp_path / "a.err", tmp_path / "b.err"
    gate = tmp_path / "gate"
    a = start(src, node_env(tmp_path / "a", server.url, cxx, GATE=gate), a_err)
    deadline = time.monotonic() + 120
    while not server.client.keys(PREFIX + "lease:*"):
        assert time.monotonic() < deadline and a.poll() is None, a_err.read_text()
        time.sleep(0.1)
    out_b, err_b = finish(start(src, node_env(tmp_path / "b", server.url, cxx, KLOAD_REMOTE_CACHE_WAIT="2s"), b_err),
                          b_err)
    assert out_b == RIGHT and a.poll() is None  # b is done while a still compiles: it waited 2 s only
    assert "KLOAD_REMOTE_CACHE_WAIT" in err_b and "building sm here" in err_b and "kload: built sm" in err_b
    gate.touch()
    assert finish(a, a_err)[0] == RIGHT
    assert compiles(cxx[1]) == 2


def test_a_holder_that_dies_lets_its_lease_expire_and_the_waiter_builds(tmp_path, server, src, cxx):
    a, b, _a_err, b_err = holder_and_waiter(tmp_path, server, src, cxx, slow_a=600)
    os.killpg(a.pid, signal.SIGKILL)  # the holder and its compiler: a node lost mid-build
    a.wait()
    started = time.monotonic()
    while not any(f":{b.pid} building sm" in (server.client.get(k) or b"").decode()
                  for k in server.client.keys(PREFIX + "lease:*")):  # b took the lease a's death left
        assert time.monotonic() - started < LEASE_S + 30 and b.poll() is None, b_err.read_text()
        time.sleep(0.1)
    out_b, err_b = finish(b, b_err)
    assert out_b == RIGHT and "kload: built sm" in err_b, err_b
    assert compiles(cxx[1]) == 2  # a's compile that died, and b's


def test_when_the_holders_build_fails_the_waiter_stops_waiting_and_builds(tmp_path, server, src, cxx):
    src.write_text(SM.replace("return out;", "return out  // a missing semicolon"))
    code = """\
        import json, logging, sys, kload
        logging.basicConfig(level=logging.INFO, format="%(message)s")
        try:
            kload.load(sys.argv[1]).build()
        except kload.CompileError as e:
            print(json.dumps({"out": str(e).splitlines()[1]}))
    """
    gate = tmp_path / "gate"
    a, b, a_err, b_err = holder_and_waiter(tmp_path, server, src, cxx, code=code, gate=gate)
    gate.touch()  # b is waiting: now a's compile fails
    (out_a, _), (out_b, err_b) = finish(a, a_err), finish(b, b_err)
    assert "sm.cpp:" in out_a and out_a == out_b  # the same compile error, with file:line, on both nodes
    assert f"kload: {socket.gethostname()}:{a.pid} building sm failed" in err_b and "building sm here" in err_b
    assert compiles(cxx[1]) == 2


def test_a_build_during_which_its_source_was_saved_is_not_uploaded(tmp_path, server, src, cxx):
    # its own build: a compiler that saves the source right after compiling it (no node could use the
    # build, whose key stands for no file's bytes; uploaded, it would only make waiters wait)
    saving = write(tmp_path / "saving-c++", f"""\
        #!/bin/sh
        "{cxx[0]}" "$@"; rc=$?
        case "$*" in *" -c "*sm.cpp*) touch "{src}" ;; esac
        exit $rc
    """)
    saving.chmod(0o755)
    out, err = run(src, node_env(tmp_path / "a", server.url, (saving, cxx[1])))
    assert out == RIGHT and "changed while sm compiled" in err and "kload: uploaded" not in err, err
    assert compiles(cxx[1]) == 1 and not server.client.keys(PREFIX + "man:*")


class Silent:
    """A TCP port that accepts connections and never answers (a hung server)."""

    def __init__(self):
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(16)
        self.url = f"redis://127.0.0.1:{self.sock.getsockname()[1]}/0"


@pytest.mark.parametrize("fault", ["never started", "never answers", "full"])
def test_an_unusable_server_means_a_local_build_one_warning_and_no_half_entry(tmp_path, src, cxx, fault):
    started = time.monotonic()
    keep = None
    if fault == "never started":
        url = f"redis://127.0.0.1:{free_port()}/0"
    elif fault == "never answers":
        keep = Silent()
        url = keep.url
    else:  # full: maxmemory reached, and noeviction refuses every write
        keep = Server(tmp_path / "redis")
        keep.client.set("filler", b"x" * (2 << 20))
        keep.client.config_set("maxmemory-policy", "noeviction")
        keep.client.config_set("maxmemory", "1mb")
        url = keep.url
    try:
        out, err = run(src, node_env(tmp_path / "node", url, cxx, KLOAD_REMOTE_CACHE_TIMEOUT=1))
        assert out == RIGHT and compiles(cxx[1]) == 1
        assert err.count("is unusable") == 1, err
        reason = {"never started": "Connection refused", "never answers": "Timeout",
                  "full": "maxmemory"}[fault]
        assert reason in err, err
        if fault == "full":
            assert keep.client.keys(PREFIX + "man:*") == []  # no manifest: no reader sees the partial upload
        assert time.monotonic() - started < 120
        out, err = run(src, node_env(tmp_path / "node", url, cxx, KLOAD_REMOTE_CACHE_TIMEOUT=1))
        assert out == RIGHT and compiles(cxx[1]) == 1 and "remote" not in err  # a local hit: no server call
    finally:
        if isinstance(keep, Server):
            keep.kill()
        elif keep is not None:
            keep.sock.close()


def test_a_password_in_the_url_or_its_knob_works_and_never_shows(tmp_path):
    s = Server(tmp_path / "redis", password="pa55word")
    try:
        url = f"redis://:pa55word@127.0.0.1:{s.port}/0"
        listed = kload_cli("cache", "list", "--remote", env={"KLOAD_REMOTE_CACHE": url})
        assert listed.returncode == 0 and f"redis://:***@127.0.0.1:{s.port}/0" in listed.stdout, listed.stderr
        knob = kload_cli("cache", "list", "--remote", env={"KLOAD_REMOTE_CACHE": f"redis://127.0.0.1:{s.port}/0",
                                                           "KLOAD_REMOTE_CACHE_PASSWORD": "pa55word"})
        assert knob.returncode == 0 and "0 entries" in knob.stdout, knob.stderr
        wrong = kload_cli("cache", "list", "--remote", env={"KLOAD_REMOTE_CACHE": url.replace("pa55word", "nope")})
        assert wrong.returncode == 1 and "is unusable" in wrong.stderr and "AuthenticationError" in wrong.stderr
        for proc in (listed, knob, wrong):
            assert "pa55word" not in proc.stdout + proc.stderr and "nope" not in proc.stdout + proc.stderr
        bad = kload_cli("cache", "list", "--remote", env={"KLOAD_REMOTE_CACHE": "http://127.0.0.1:1/0"})
        assert bad.returncode == 1 and "is not a redis://" in bad.stderr
        unset = kload_cli("cache", "pull", env={"KLOAD_REMOTE_CACHE": ""})
        assert unset.returncode == 1 and "set KLOAD_REMOTE_CACHE=redis://" in unset.stderr
    finally:
        s.kill()


@pytest.mark.skipif(shutil.which("openssl") is None, reason="openssl makes the test's certificate")
def test_rediss_with_the_servers_certificate(tmp_path):
    """TLS: rediss:// with the CA in the URL (redis-py's ssl_ca_certs query argument)."""
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj",
                    "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1", "-keyout", str(key),
                    "-out", str(cert)], check=True, capture_output=True)
    port = free_port()
    proc = subprocess.Popen(["redis-server", "--port", "0", "--tls-port", str(port), "--bind", "127.0.0.1",
                             "--tls-cert-file", str(cert), "--tls-key-file", str(key), "--tls-auth-clients", "no",
                             "--dir", str(tmp_path), "--save", ""], stdout=subprocess.DEVNULL)
    try:
        url = f"rediss://127.0.0.1:{port}/0?ssl_ca_certs={cert}"
        deadline = time.monotonic() + 20
        while True:
            listed = kload_cli("cache", "list", "--remote", env={"KLOAD_REMOTE_CACHE": url})
            if listed.returncode == 0 or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        assert listed.returncode == 0 and "0 entries" in listed.stdout, listed.stderr
        untrusted = kload_cli("cache", "list", "--remote", env={"KLOAD_REMOTE_CACHE": url.split("?")[0]})
        assert untrusted.returncode == 1 and "CERTIFICATE_VERIFY_FAILED" in untrusted.stderr, untrusted.stderr
    finally:
        proc.kill()
        proc.wait()
