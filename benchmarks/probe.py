"""What opening a TORCH_LIBRARY build in a child first costs (registration.open_in_child):
a forked child of a process that has torch, against a fresh interpreter that imports torch
and opens the library (the other way to keep torch's abort out of the user's process).

    python benchmarks/probe.py [--repeat 9]

Builds one small TORCH_LIBRARY library into a private cache (not timed), then alternates
the two ways, each opening the same artifact; prints min / median of each and the ratio."""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SRC = """\
#include <torch/library.h>
#include <ATen/ATen.h>
at::Tensor probe_scale(const at::Tensor& x, double a) { return x * a; }
TORCH_LIBRARY(kload_probe_bench, m) { m.def("probe_scale(Tensor x, float a) -> Tensor"); }
TORCH_LIBRARY_IMPL(kload_probe_bench, CPU, m) { m.impl("probe_scale", &probe_scale); }
"""
FRESH = "import ctypes, sys, torch; ctypes.CDLL(sys.argv[1])"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=9)
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="kload-probe-"))
    os.environ["KLOAD_CACHE_DIR"] = str(work / "cache")
    import kload
    from kload.compile.registration import open_in_child

    (work / "probe_bench.cpp").write_text(SRC)
    artifact = str(kload.load(str(work / "probe_bench.cpp"), reload=False).build())
    times: dict[str, list[float]] = {"forked child": [], "fresh interpreter": []}
    for _ in range(args.repeat):
        t = time.perf_counter()
        found, said = open_in_child(artifact)
        times["forked child"].append(time.perf_counter() - t)
        assert found == ["kload_probe_bench"] and said is None, (found, said)
        t = time.perf_counter()
        subprocess.run([sys.executable, "-c", FRESH, artifact], check=True)
        times["fresh interpreter"].append(time.perf_counter() - t)
    print(f"open a TORCH_LIBRARY build in a child first ({args.repeat} runs each, alternating)")
    base = statistics.median(times["fresh interpreter"])
    for way, ts in times.items():
        print(f"  {way:<18} min {min(ts) * 1e3:8.1f} ms  median {statistics.median(ts) * 1e3:8.1f} ms  "
              f"{statistics.median(ts) / base:5.3f}x")


if __name__ == "__main__":
    main()
