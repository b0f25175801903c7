"""Real clients of torch.utils.cpp_extension, unmodified: torch's own loader against
the same loader patched by kload (kload.patch()), in the same run.

    python benchmarks/clients.py [--reps 2]

- DeepSpeed CPU Adam: its op builder calls `load(name="cpu_adam", ...)` when the
  optimizer is made; the timed figure is that call (DeepSpeed itself spends seconds
  around it probing the CPU).
- SRU: `import sru` calls `load` twice (its CUDA op, which falls back to a stub here,
  and its CPU op); the timed figure is the sum of the calls.
Cold: an empty TORCH_EXTENSIONS_DIR / KLOAD_CACHE_DIR, no compiler cache in front
(TORCH_NO_COMPILER_WRAPPER=1, as kload does in its own builds). Warm: the next fresh
process. The two sides alternate; min and median of --reps.

Also: the namespace check of a warm TORCH_LIBRARY load (issue 17, item 7): listing
every op of the process (before) against looking up the library's own names (now).
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import textwrap
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import py  # noqa: E402

SHIM = """
import json, os, time, warnings
warnings.simplefilter("ignore")
os.environ.setdefault("DS_ACCELERATOR", "cpu")
if {kload}:
    import kload
    kload.patch()
import torch.utils.cpp_extension as ce
inner, calls = ce.load, []
def timed(*a, **k):
    t = time.perf_counter()
    try:
        return inner(*a, **k)
    finally:
        calls.append(time.perf_counter() - t)
ce.load = timed
"""

WORK = {
    "deepspeed": """
import torch
from deepspeed.ops.adam import DeepSpeedCPUAdam
p = [torch.nn.Parameter(torch.randn(1000))]
opt = DeepSpeedCPUAdam(p, lr=1e-2)
p[0].grad = torch.randn(1000)
opt.step()
""",
    "sru": """
import torch, sru
with torch.no_grad():
    sru.SRU(16, 16, num_layers=1).eval()(torch.randn(5, 2, 16))
""",
}


def one(client: str, side: str, ext_dir: str, cache: str) -> float:
    code = SHIM.format(kload=side == "kload") + WORK[client] + "\nprint(json.dumps(sum(calls)))\n"
    env = {"TORCH_EXTENSIONS_DIR": ext_dir, "KLOAD_CACHE_DIR": cache, "TORCH_NO_COMPILER_WRAPPER": "1",
           "KLOAD_PCH": "0", "MAX_JOBS": "2"}
    return py(code, env=env)


NS_CHECK = """
import json, os, time, timeit, torch, kload
from kload.resolve import library
src = {src!r}
t = time.perf_counter()
h = kload.load(src, reload=False).load()
first = time.perf_counter() - t
ns, ops = "kload_bench_ns", ["mymuladd"]
n = 200
before = min(timeit.repeat(lambda: library.ops_in_namespace(ns), number=n, repeat=5)) / n
now = min(timeit.repeat(lambda: library._has_any_op(ns, ops), number=n, repeat=5)) / n
print(json.dumps([first, before, now, len(torch._C._dispatch_get_all_op_names())]))
"""


def ns_check(work: Path) -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
    from test_cpp_extension import MULADD

    src = work / "muladd.cpp"
    src.write_text(textwrap.dedent(MULADD).replace("NS", "kload_bench_ns"))
    cache = str(work / "ns-cache")
    py(NS_CHECK.format(src=str(src)), env={"KLOAD_CACHE_DIR": cache, "KLOAD_PCH": "0"})  # build
    runs = [py(NS_CHECK.format(src=str(src)), env={"KLOAD_CACHE_DIR": cache}) for _ in range(5)]
    first = sorted(r[0] for r in runs)
    before = min(r[1] for r in runs)
    now = min(r[2] for r in runs)
    print(f"\nwarm load of a TORCH_LIBRARY library (extension-cpp's muladd), fresh process, 5 runs: "
          f"min {first[0] * 1e3:.2f} ms, median {statistics.median(first) * 1e3:.2f} ms")
    print(f"namespace check: list all {runs[0][3]} ops (before) {before * 1e3:.3f} ms, "
          f"look up the library's own names (now) {now * 1e3:.4f} ms ({before / now:.0f}x less)")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--clients", default="deepspeed,sru")
    args = ap.parse_args()
    # a user's Python writes bytecode; without it each fresh process would compile kload's modules again
    os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
    work = Path(tempfile.mkdtemp(prefix="kload-clients-"))
    rows = []
    for client in args.clients.split(","):
        res = {(side, phase): [] for side in ("torch", "kload") for phase in ("cold", "warm")}
        for rep in range(args.reps):
            for side in (("torch", "kload") if rep % 2 == 0 else ("kload", "torch")):
                ext_dir, cache = str(work / f"{client}-{side}-{rep}-ext"), str(work / f"{client}-{side}-{rep}-cache")
                res[side, "cold"].append(one(client, side, ext_dir, cache))
                for _ in range(3):
                    res[side, "warm"].append(one(client, side, ext_dir, cache))
                print(f"{client} rep {rep} {side}: cold {res[side, 'cold'][-1]:.1f} s, "
                      f"warm {res[side, 'warm'][-1] * 1e3:.1f} ms", flush=True)
        for phase in ("cold", "warm"):
            t, k = res["torch", phase], res["kload", phase]
            rows.append((client, phase, min(t), statistics.median(t), min(k), statistics.median(k)))
    print(f"\n{'client':<10} {'phase':<5} {'torch min':>10} {'torch med':>10} {'kload min':>10} {'kload med':>10}"
          f" {'ratio (med)':>11}")
    for client, phase, tmin, tmed, kmin, kmed in rows:
        f = (lambda s: f"{s:.1f} s") if phase == "cold" else (lambda s: f"{s * 1e3:.1f} ms")
        print(f"{client:<10} {phase:<5} {f(tmin):>10} {f(tmed):>10} {f(kmin):>10} {f(kmed):>10} {kmed / tmed:>10.2f}x")
    ns_check(work)


if __name__ == "__main__":
    main()
