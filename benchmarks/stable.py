"""The stable ABI, measured in one run (the edit loop is in benchmarks/live.py):

    python benchmarks/stable.py [--repeat N] [--before REV]

1. Per call: the same tiny op (out = x * 2 on 4 floats, written the same way)
   as a stable-ABI op (boxed: arguments cross the C shim as StableIValues) and
   as a classic TORCH_LIBRARY op of <kload/kernel.h>, both called through
   torch.ops; alternating, min of 7 x 20000 calls. Target: <= 1.6x.
2. Cold first use of the four shipped kernels (kload.kernels): every op built in
   a fresh cache, in a fresh interpreter, as `make demo` does on a new machine;
   the kernels of REV (default: the last commit before the port) against the
   working tree's, alternating, each round in new caches.
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import tempfile
from pathlib import Path

from common import _wait_background, py

ROOT = Path(__file__).resolve().parent.parent
BEFORE = "7994975"  # the shipped kernels on <kload/kernel.h>, before the stable-ABI port

STABLE_OP = """#include <kload/stable.h>
kload::Tensor twice(const kload::Tensor& x) {
  kload::Tensor out = torch::stable::empty_like(x);
  const float* px = x.const_data_ptr<float>();
  float* po = out.mutable_data_ptr<float>();
  for (int64_t i = 0; i < x.numel(); ++i) po[i] = px[i] * 2;
  return out;
}
KLOAD_LIBRARY(m) { m.def("twice(Tensor x) -> Tensor"); }
KLOAD_IMPL(CPU, m) { m.impl("twice", TORCH_BOX(&twice)); }
"""
CLASSIC_OP = """#include <kload/kernel.h>
at::Tensor twice(const at::Tensor& x) {
  at::Tensor out = at::empty_like(x);
  const float* px = x.const_data_ptr<float>();
  float* po = out.mutable_data_ptr<float>();
  for (int64_t i = 0; i < x.numel(); ++i) po[i] = px[i] * 2;
  return out;
}
KLOAD_LIBRARY(m) { m.def("twice(Tensor x) -> Tensor"); }
KLOAD_IMPL(CPU, m) { m.impl("twice", &twice); }
"""
PER_CALL = """
import json, timeit, torch, kload
ops = {{k: getattr(torch.ops, kload.load(p, name=k, reload=False, extra_cflags=["-O2"]).namespace).twice
       for k, p in {paths!r}.items()}}
x = torch.ones(4)
best = {{k: float("inf") for k in ops}}
for _ in range(7):
    for k, op in ops.items():  # alternating
        assert torch.equal(op(x), x * 2)
        best[k] = min(best[k], timeit.timeit(lambda: op(x), number=20000) / 20000)
print(json.dumps(best))
"""
COLD = """
import json, sys, time
sys.path.insert(0, {parent!r})
t0 = time.perf_counter()
import torch, kload
import {package} as kernels
per = {{}}
for op in kernels.__all__:
    t = time.perf_counter()
    kernels.handle(op)
    per[op] = time.perf_counter() - t
print(json.dumps({{"total": time.perf_counter() - t0, "per": per}}))
"""


def old_kernels(rev: str, work: Path) -> Path:
    """The kernels/ tree of ``rev``, as an importable package ``kernels_before``."""
    dest = work / "before"
    dest.mkdir()
    tar = subprocess.run(["git", "archive", rev, "kernels"], cwd=ROOT, capture_output=True, check=True).stdout
    subprocess.run(["tar", "-x", "-C", str(dest)], input=tar, check=True)
    (dest / "kernels").rename(dest / "kernels_before")
    init = dest / "kernels_before" / "__init__.py"
    # its own include/ first (kload/cpu/parallel.h of then), and its own build names
    init.write_text(init.read_text().replace(
        "extra_ldflags=LDFLAGS", f"extra_include_paths=[{str(dest / 'kernels_before' / 'include')!r}], extra_ldflags=LDFLAGS"))
    return dest


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeat", type=int, default=2, help="cold rounds per side")
    ap.add_argument("--before", default=BEFORE, help="the revision whose kernels are 'before'")
    args = ap.parse_args()
    import torch

    work = Path(tempfile.mkdtemp(prefix="kload-stable-"))
    print(f"machine: {os.uname().machine}, {os.cpu_count()} cores, torch {torch.__version__}, "
          f"MAX_JOBS={os.environ.get('MAX_JOBS', '-')}")

    paths = {}
    for key, text in (("twice_stable", STABLE_OP), ("twice_classic", CLASSIC_OP)):
        paths[key] = str(work / f"{key}.cpp")
        Path(paths[key]).write_text(text)
    cache = str(work / "cache-calls")
    best = py(PER_CALL.format(paths=paths), {"KLOAD_CACHE_DIR": cache})
    ratio = best["twice_stable"] / best["twice_classic"]
    print(f"per call through torch.ops (min of 7 x 20000): stable {best['twice_stable'] * 1e6:.2f} us, "
          f"TORCH_LIBRARY {best['twice_classic'] * 1e6:.2f} us = {ratio:.2f}x "
          f"(target <= 1.6x: {'met' if ratio <= 1.6 else 'MISSED'})")
    _wait_background(cache)

    before = old_kernels(args.before, work)
    runs = {"before": [], "after": []}
    for r in range(args.repeat):
        for side in ("before", "after"):
            cache = str(work / f"cache-{side}-{r}")
            code = COLD.format(parent=str(before) if side == "before" else str(ROOT),
                               package="kernels_before" if side == "before" else "kload.kernels")
            res = py(code, {"KLOAD_CACHE_DIR": cache})
            runs[side].append(res)
            _wait_background(cache)  # its background precompile must not slow the other side
    print(f"\ncold first use of the four shipped kernels (fresh cache, fresh interpreter; {args.repeat} rounds):")
    for side, label in (("before", f"kernel.h ({args.before})"), ("after", "stable ABI (this tree)")):
        totals = [x["total"] for x in runs[side]]
        per = {op: statistics.median(x["per"][op] for x in runs[side]) for op in runs[side][0]["per"]}
        print(f"  {label:<28} min {min(totals):6.1f} s, median {statistics.median(totals):6.1f} s   "
              + ", ".join(f"{op} {t:.1f}" for op, t in per.items()))
    speedup = statistics.median(x["total"] for x in runs["before"]) / statistics.median(
        x["total"] for x in runs["after"])
    print(f"  after vs before (medians): {1 / speedup:.2f}x the time ({speedup:.1f}x faster)")


if __name__ == "__main__":
    os.environ.setdefault("MAX_JOBS", "2")
    main()
