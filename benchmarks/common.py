"""Helpers the benchmarks share: a step in a fresh interpreter, the %%kload re-run,
the watched handle's per-call cost, waiting for background precompiles, GPU time by
CUDA events."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path


def py(code: str, env: dict | None = None, timeout: float = 1800) -> dict:
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                          env={**os.environ, **(env or {})}, timeout=timeout)
    if proc.returncode != 0:
        raise RuntimeError(f"benchmark step failed:\n{proc.stdout}\n{proc.stderr}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


COMPILERS = ("nvcc", "cudafe++", "cicc", "ptxas", "cc1plus", "ld")


def wait_quiet(limit: float = 600.0) -> None:
    """Wait until no compiler runs on this machine (a timed edit must not share the cores)."""
    end = time.monotonic() + limit
    while time.monotonic() < end:
        busy = [c for c in COMPILERS if subprocess.run(["pgrep", "-x", c], capture_output=True).returncode == 0]
        if not busy:
            return
        time.sleep(1.0)
    sys.exit(f"compilers still running after {limit:.0f} s: {', '.join(busy)}")


CELL = """at::Tensor twice(const at::Tensor& x) { return x * 2; }
KLOAD_LIBRARY(m) { m.def("twice(Tensor x) -> Tensor"); }
KLOAD_IMPL(CPU, m) { m.impl("twice", &twice); }"""


def magic_rerun() -> float:
    """The median of 9 re-runs of an unchanged %%kload cell, in a real Jupyter kernel."""
    import nbformat
    from nbclient import NotebookClient

    C = nbformat.v4.new_code_cell
    nb = nbformat.v4.new_notebook()
    nb.cells = [
        C("import time, json, statistics, torch, kload\n%load_ext kload"),
        C(f"get_ipython().run_cell_magic('kload', 'twice', {CELL!r})"),
        C("runs = []\nfor _ in range(9):\n    t = time.perf_counter()\n"
          f"    get_ipython().run_cell_magic('kload', 'twice', {CELL!r})\n"
          "    runs.append(time.perf_counter() - t)\n"
          "print(json.dumps(statistics.median(runs)))"),
    ]
    NotebookClient(nb, timeout=900, kernel_name="python3").execute()
    out = [o for o in nb.cells[2].outputs if o.get("name") == "stdout"][0]["text"]
    return json.loads(out.strip().splitlines()[-1])


PER_CALL = """
import json, timeit, torch, kload
ops = kload.load({src!r}, name="bump_full_pch", reload=True)
x = torch.ones(4)
ops.bump(x)
direct = getattr(torch.ops, ops.namespace).bump
n = 20000
h = min(timeit.repeat(lambda: ops.bump(x), number=n, repeat=7)) / n
d = min(timeit.repeat(lambda: direct(x), number=n, repeat=7)) / n
print(json.dumps([h, d]))
"""


def watched_call(work: Path, cache: str) -> tuple[float, float]:
    return tuple(py(PER_CALL.format(src=str(work / "full_pch" / "bump.cpp")), {"KLOAD_CACHE_DIR": cache}))


def _wait_background(cache: str, timeout: float = 600) -> None:
    """Wait until no background precompile of this cache runs."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        busy = False
        for pid in (p for p in os.listdir("/proc") if p.isdigit()):
            try:
                cmd = Path(f"/proc/{pid}/cmdline").read_bytes()
            except OSError:
                continue
            if b"kload.compile.pch_build" in cmd and cache.encode() in cmd:
                busy = True
        if not busy:
            return
        time.sleep(0.5)


def cuda_device(script: str) -> str | None:
    """The GPU's name, after printing what the figures are measured on; None (said) without one."""
    import torch

    if not torch.cuda.is_available():
        print(f"{script}: needs a CUDA device")
        return None
    dev = torch.cuda.get_device_name()
    print(f"device: {dev}, torch {torch.__version__}, CUDA {torch.version.cuda}, "
          f"capability {torch.cuda.get_device_capability()}")
    return dev


def event_seconds(fn, calls: int = 1) -> float:
    """GPU seconds per call of `calls` calls of fn in a row on the current stream, between
    two CUDA events (several calls for kernels of microseconds: one call per event pair
    would time the events)."""
    import torch

    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(calls):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3 / calls
