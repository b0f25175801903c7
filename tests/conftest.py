"""Shared fixtures: a private cache for the whole session, subprocess runners, a
counting compiler wrapper. Everything compiles for real."""
from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples"  # the tutorial code users paste lives there


# The files' cost in the last timed run (docs/testing.md), most first: pytest-xdist hands files
# to its workers in collection order, so the longest start first and none is left for the end.
_HEAVY = ["test_pch.py", "test_cpp_extension.py", "test_clients.py", "test_live.py", "test_loader.py",
          "test_remote.py", "test_cache_cli.py", "test_faults.py", "test_race.py", "test_kernels.py"]


def pytest_collection_modifyitems(config, items):
    def cost(item):
        name = item.path.name
        return _HEAVY.index(name) if name in _HEAVY else len(_HEAVY)
    items.sort(key=cost)  # stable: the tests of a file keep their order


@pytest.fixture(scope="session", autouse=True)
def worker_temp_dir(tmp_path_factory):
    """Each pytest worker its own TMPDIR, so its own foreground lock (foreground.py): a
    machine's builds pause its background precompiles, which is right for one user, but
    here the other worker is an unrelated test. Sharing one lock, test_mistakes.py's
    run of builds held test_pch.py's precompiles stopped (all of test_pch.py had taken
    277 s; then its lifecycle test alone took 427 s, and the suite 1549-1599 s)."""
    import tempfile

    folder = tmp_path_factory.mktemp("tmp")
    old = os.environ.get("TMPDIR")
    os.environ["TMPDIR"], tempfile.tempdir = str(folder), None  # gettempdir() caches its answer
    yield folder
    if old is None:
        os.environ.pop("TMPDIR", None)
    else:
        os.environ["TMPDIR"] = old
    tempfile.tempdir = None


@pytest.fixture(scope="session", autouse=True)
def kload_cache(tmp_path_factory, worker_temp_dir):
    """One cache for the session: tests share compiled artifacts, CI starts cold."""
    cache = tmp_path_factory.mktemp("kload-cache")
    old = os.environ.get("KLOAD_CACHE_DIR")
    os.environ["KLOAD_CACHE_DIR"] = str(cache)
    os.environ.setdefault("MAX_JOBS", "2")
    yield cache
    if old is None:
        os.environ.pop("KLOAD_CACHE_DIR", None)
    else:
        os.environ["KLOAD_CACHE_DIR"] = old


@pytest.fixture(autouse=True)
def no_precompiled_headers_in_reliability(request, monkeypatch):
    """tests/reliability/ checks the cache's guarantees for libraries under faults,
    races and limits, in private caches of tiny op libraries. Precompiled headers
    (~400 MB entries, compiled in the background) would only add noise there to size
    limits, directory listings, mounts and "is a compiler running" probes;
    tests/test_pch.py covers them."""
    if "reliability" in request.node.path.parts:
        monkeypatch.setenv("KLOAD_PCH", "0")  # subprocesses inherit it (run_code, kload_cli)


@pytest.fixture(scope="session", autouse=True)
def background_builds_end(kload_cache, tmp_path_factory):
    """Precompiled headers are built by background processes; none of this session's
    (its caches are all under its base temporary directory) outlives it. Another pytest
    session's are left alone."""
    mine = str(tmp_path_factory.getbasetemp()).encode()
    yield
    import signal
    import time

    from kload.compile import pch_build

    pch_build.wait(timeout=300)
    deadline = time.monotonic() + 300
    while True:
        left = []
        for pid in (p for p in os.listdir("/proc") if p.isdigit()):
            try:
                cmd = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            if b"kload.compile.pch_build" in cmd and any(str(kload_cache).encode() in c or mine in c for c in cmd):
                left.append(int(pid))
        if not left:
            return
        if time.monotonic() > deadline:
            for pid in left:
                try:
                    os.killpg(pid, signal.SIGKILL)
                except OSError:
                    pass
            return
        time.sleep(1)


@pytest.fixture(scope="session")
def cxx_wrapper(tmp_path_factory):
    """A ``CXX`` that logs each invocation, then runs the real compiler. Background
    builds of precompiled headers (``-x c++-header``) go to a log of their own, so
    a count of the user's compiles does not depend on when one of those runs."""
    d = tmp_path_factory.mktemp("cxx")
    log = d / "calls.log"
    script = d / "counting-c++"
    script.write_text(f'#!/bin/sh\ncase "$*" in *c++-header*) echo "$*" >> "{d / "pch.log"}" ;; '
                      f'*) echo "$*" >> "{log}" ;; esac\nexec c++ "$@"\n')
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    return script, log


def compiles(log: Path, needle: str = "") -> int:
    """How many compile (-c) invocations the wrapper logged, optionally of one file. The
    toolchain's one-line link probe (kload/linking.py, once per toolchain and cache, in a
    kload-link-* directory) is not a compile of anyone's code, and is not counted."""
    if not log.exists():
        return 0
    return sum(1 for line in log.read_text().splitlines()
               if " -c " in f" {line} " and needle in line and "kload-link-" not in line)


def invocations(log: Path) -> int:
    return len(log.read_text().splitlines()) if log.exists() else 0


def run_py(code: str, env: dict | None = None, cwd=None, timeout=600) -> dict:
    """Run ``code`` in a fresh interpreter; it prints one JSON object as its last line."""
    return last_json(run_code(code, env, cwd=cwd, timeout=timeout))


def write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(textwrap.dedent(text))
    return path


VECTOR_ADD = """\
    #include <kload/kernel.h>
    #include "scale.h"

    at::Tensor vector_add(const at::Tensor& a, const at::Tensor& b) {
      CHECK_INPUT(a);
      CHECK_INPUT(b);
      TORCH_CHECK(a.sizes() == b.sizes(), "vector_add: shapes differ: ", a.sizes(), " vs ", b.sizes());
      auto out = a.new_empty(a.sizes());
      const float* pa = a.data_ptr<float>();
      const float* pb = b.data_ptr<float>();
      float* po = out.data_ptr<float>();
      for (int64_t i = 0; i < a.numel(); ++i) po[i] = SCALE * (pa[i] + pb[i]);
      return out;
    }

    KLOAD_LIBRARY(m) { m.def("vector_add(Tensor a, Tensor b) -> Tensor"); }
    KLOAD_IMPL(CPU, m) { m.impl("vector_add", &vector_add); }
"""


@pytest.fixture
def vadd_dir(tmp_path):
    """A fresh op-library source tree: vadd.cpp including a local header scale.h."""
    write(tmp_path / "scale.h", "#define SCALE 1.0f\n")
    write(tmp_path / "vadd.cpp", VECTOR_ADD)
    return tmp_path


# -- the reliability suite's figures (README reports them) ------------------------------

TALLY: dict[str, int] = {}


@pytest.fixture
def tally():
    """``tally("kills survived")`` counts one event for the end-of-run summary."""
    def count(what: str, n: int = 1) -> None:
        TALLY[what] = TALLY.get(what, 0) + n
    return count


def pytest_sessionfinish(session):
    worker_output = getattr(session.config, "workeroutput", None)
    if worker_output is not None:  # a pytest-xdist worker: its figures go to the controller
        worker_output["kload_tally"] = json.dumps(TALLY)


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error):
    """pytest-xdist's controller: add up the workers' figures."""
    for what, n in json.loads(getattr(node, "workeroutput", {}).get("kload_tally", "{}")).items():
        TALLY[what] = TALLY.get(what, 0) + n


def pytest_terminal_summary(terminalreporter):
    slowest_file = os.environ.get("KLOAD_SLOWEST_FILE")
    if slowest_file:  # `make test` prints these again at its very end
        reports = [r for key in ("passed", "failed", "error") for r in terminalreporter.stats.get(key, [])
                   if getattr(r, "when", "") == "call" or r.outcome != "passed"]
        reports.sort(key=lambda r: -r.duration)
        Path(slowest_file).write_text("".join(f"  {r.duration:7.1f} s  {r.nodeid}\n" for r in reports[:5]))
    if TALLY:
        terminalreporter.write_sep("-", "reliability figures")
        for what, n in TALLY.items():
            terminalreporter.write_line(f"{what}: {n}")


def kload_cli(*args, env: dict | None = None, timeout=600) -> subprocess.CompletedProcess:
    """``python -m kload ARGS`` in a fresh interpreter."""
    full_env = dict(os.environ)
    full_env.update(env or {})
    return subprocess.run([sys.executable, "-m", "kload", *map(str, args)], capture_output=True, text=True,
                          env=full_env, timeout=timeout)


# On the stable ABI: a tests' scene-setting build compiles in ~1.5 s (ATen's kernel.h
# without a precompiled header took 8-10 s), and it is still a real library, built,
# cached, loaded and called like any other.
TINY = """\
    #include <kload/stable.h>
    kload::Tensor {name}(const kload::Tensor& x) {{
      KLOAD_CHECK_DTYPE(x, kload::ScalarType::Float);
      kload::Tensor xc = kload::as_contiguous(x), out = kload::empty_like(xc);
      for (int64_t i = 0; i < xc.numel(); ++i)
        out.mutable_data_ptr<float>()[i] = {factor} * xc.const_data_ptr<float>()[i];
      return out;
    }}
    KLOAD_LIBRARY(m) {{ m.def("{name}(Tensor x) -> Tensor"); }}
    KLOAD_IMPL(CPU, m) {{ m.impl("{name}", TORCH_BOX(&{name})); }}
"""


def tiny(folder: Path, name: str, factor: int = 2) -> Path:
    """A small stable-ABI op library ``name(x) = x * factor`` in ``folder/name.cpp``."""
    return write(folder / f"{name}.cpp", TINY.format(name=name, factor=factor))


def tiny_call(src: Path, name: str, extra: str = "") -> str:
    """Code for run_py: load ``src``, call ``name`` on ones(2), print the result."""
    return f"""
        import json, logging, torch, kload
        logging.basicConfig(level=logging.WARNING)
        ops = kload.load({str(src)!r}{extra})
        print(json.dumps({{"out": getattr(ops, {name!r})(torch.ones(2)).tolist(), "path": ops.build()}}))
    """


def compiler_running(ws_root: Path) -> bool:
    """A compiler started by a build under ``ws_root`` (ninja runs it in the build directory)."""
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes()
            cwd = os.readlink(f"/proc/{pid}/cwd")
        except OSError:
            continue
        if b"cc1plus" in cmd and cwd.startswith(str(ws_root)):
            return True
    return False


def run_code(code: str, env: dict | None = None, cwd=None, timeout=600) -> subprocess.CompletedProcess:
    """Run ``code`` in a fresh interpreter and return the finished process, whatever its status."""
    full_env = dict(os.environ)
    full_env.update(env or {})
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                          env=full_env, cwd=cwd, timeout=timeout)


def last_json(proc: subprocess.CompletedProcess) -> dict:
    assert proc.returncode == 0, f"exit {proc.returncode}:\n{proc.stdout}\n{proc.stderr}"
    return json.loads(proc.stdout.strip().splitlines()[-1])


# -- crash-safe checks -------------------------------------------------------------------

def in_child(fn, timeout: float = 120) -> dict:
    """Run ``fn()`` in a forked child of this process: what it returns or raises comes
    back, and a crash (SIGSEGV, abort) or a hang fails the one test that asked, not the
    whole run. The child runs torch single-threaded (an OpenMP pool does not survive a
    fork) and ends with os._exit (no pytest teardown there)."""
    import select
    import signal
    import time

    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child
        os.close(r)
        try:
            import torch

            torch.set_num_threads(1)
            value = fn()
            out = {"returned": repr(value)[:2000]}
        except BaseException as e:  # noqa: BLE001 - reported to the parent
            out = {"raised": type(e).__name__, "mro": [c.__name__ for c in type(e).__mro__], "message": str(e)}
        data = json.dumps(out).encode()
        while data:
            data = data[os.write(w, data):]
        os._exit(0)
    os.close(w)
    chunks, deadline = [], time.monotonic() + timeout
    try:
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([r], [], [], left)[0]:
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
                pytest.fail(f"the call did not return within {timeout} s (killed)")
            chunk = os.read(r, 65536)
            if not chunk:
                break
            chunks.append(chunk)
    finally:
        os.close(r)
    _, status = os.waitpid(pid, 0)
    if os.WIFSIGNALED(status):
        pytest.fail(f"the call crashed the process: {signal.Signals(os.WTERMSIG(status)).name}")
    if not chunks:
        pytest.fail(f"the child exited with status {os.WEXITSTATUS(status)} and said nothing")
    return json.loads(b"".join(chunks))


def raises_in_fresh_process(code: str, exc: type[BaseException], match: str = "", env: dict | None = None) -> str:
    """raises_in_child for CUDA (a forked child cannot use CUDA): ``code`` (whose last
    statement is the call) runs in a fresh interpreter; it must raise ``exc`` matching
    ``match``. A crash fails with the signal's name."""
    import signal

    body = textwrap.indent(textwrap.dedent(code), "    ")
    wrapper = ("import json\ntry:\n" + body + "\n    print(json.dumps({'returned': True}))\n"
               "except BaseException as e:\n"
               "    print(json.dumps({'raised': type(e).__name__, 'mro': [c.__name__ for c in type(e).__mro__],"
               " 'message': str(e)}))\n")
    proc = run_code(wrapper, env)
    if proc.returncode < 0:
        pytest.fail(f"the call crashed the process: {signal.Signals(-proc.returncode).name}\n{proc.stderr[-2000:]}")
    return _expect_raised(last_json(proc), exc, match)


def _expect_raised(out: dict, exc: type[BaseException], match: str) -> str:
    """What a child reported (in_child's dict) raised ``exc`` matching ``match``: its message."""
    import re

    if "raised" not in out:
        pytest.fail(f"expected {exc.__name__}, but the call returned {out.get('returned', '')}")
    assert exc.__name__ in out["mro"], f"expected {exc.__name__}, got {out['raised']}: {out['message']}"
    assert re.search(match, out["message"]), f"{match!r} not in {out['message']!r}"
    return out["message"]


def raises_in_child(fn, exc: type[BaseException], match: str = "") -> str:
    """pytest.raises, crash-safe: ``fn()`` raises ``exc`` (or a subclass) whose message
    matches ``match``, in a child process. Returns the message."""
    return _expect_raised(in_child(fn), exc, match)
