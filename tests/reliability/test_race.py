"""Many processes, many ranks: one compile, every process served."""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import textwrap
import time

import pytest

from conftest import compiles, tiny

pytestmark = pytest.mark.slow  # make test-quick leaves this file out (docs/testing.md)

RACER = """
    import json, os, sys, time, torch
    go = sys.argv[1]
    open(f"{go}.ready.{os.getpid()}", "w").close()  # torch is imported
    while not os.path.exists(go):      # everyone imports torch first, then all start at once
        time.sleep(0.005)
    import kload
    ops = kload.load(sys.argv[2])
    print(json.dumps({"out": ops.race16(torch.ones(3)).tolist()}))
"""


def test_sixteen_processes_one_compile(tmp_path, cxx_wrapper, tally):
    cxx, log = cxx_wrapper
    src = tiny(tmp_path, "race16", factor=3)
    go = tmp_path / "go"
    env = dict(os.environ, CXX=str(cxx), KLOAD_CACHE_DIR=str(tmp_path / "cache"))
    procs = [subprocess.Popen([sys.executable, "-c", textwrap.dedent(RACER), str(go), str(src)], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(16)]
    before = compiles(log, "race16.cpp")  # the wrapper's log is the session's: count from here
    deadline = time.monotonic() + 600  # 16 imports of torch on 2 cores take a while: wait for all of them
    while len(list(tmp_path.glob("go.ready.*"))) < 16:
        assert time.monotonic() < deadline and all(p.poll() is None for p in procs), "a racer died or hung"
        time.sleep(0.05)
    go.write_text("go")
    results = [p.communicate(timeout=600) for p in procs]
    for p, (out, err) in zip(procs, results):
        assert p.returncode == 0, err
        assert json.loads(out.strip().splitlines()[-1])["out"] == [3.0, 3.0, 3.0]
    assert compiles(log, "race16.cpp") == before + 1, "exactly one process compiles"
    entries = [p for p in (tmp_path / "cache" / "entries").iterdir() if not p.name.startswith(".")]
    assert len(entries) == 1
    tally("processes raced", 16)


RANK = """
    import json, os, sys, torch, torch.distributed as dist
    dist.init_process_group("gloo")
    import kload
    ops = kload.load(sys.argv[1])
    out = ops.ranked(torch.full((2,), float(dist.get_rank() + 1)))
    total = out.clone()
    dist.all_reduce(total)
    dist.barrier()
    print(json.dumps({"rank": dist.get_rank(), "out": out.tolist(), "total": total.tolist()}))
    dist.destroy_process_group()
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_torch_distributed_four_ranks_one_compile(tmp_path, cxx_wrapper, tally):
    cxx, log = cxx_wrapper
    src = tiny(tmp_path, "ranked", factor=2)
    port = _free_port()
    before = compiles(log, "ranked.cpp")
    procs = []
    for rank in range(4):
        env = dict(os.environ, CXX=str(cxx), KLOAD_CACHE_DIR=str(tmp_path / "cache"), MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="4")
        procs.append(subprocess.Popen([sys.executable, "-c", textwrap.dedent(RANK), str(src)], env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    outs = [p.communicate(timeout=600) for p in procs]
    for p, (out, err) in zip(procs, outs):
        assert p.returncode == 0, err
        r = json.loads(out.strip().splitlines()[-1])
        assert r["out"] == [2.0 * (r["rank"] + 1)] * 2
        assert r["total"] == [20.0, 20.0]  # 2 * (1 + 2 + 3 + 4): every rank ran the op
    assert compiles(log, "ranked.cpp") == before + 1, "one rank compiles, the other three wait and load"
    tally("ranks (torch.distributed, gloo)", 4)
