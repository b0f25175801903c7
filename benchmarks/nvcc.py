"""What <kload/kernel.h> costs nvcc: a shipped .cu compiled with KLOAD_LEAN (what
kernels/*.cu do) and without it (the whole ATen API), alternately.

    python benchmarks/nvcc.py [--repeat N]

nvcc has no precompiled headers, so a .cu pays for every header it includes on
every compile. Compiled as tests/test_cuda_compile.py does (for sm_90, against
the installed torch's headers; with a CPU torch, plus the one generated CUDA
header the CPU wheel lacks). No GPU is needed: this times the compiler only.
"""
from __future__ import annotations

import argparse
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--source", default=str(ROOT / "kernels" / "vector_add" / "vector_add.cu"))
    args = ap.parse_args()
    if shutil.which("nvcc") is None:
        sys.exit("nvcc is not on PATH")
    import torch
    from torch.utils.cpp_extension import include_paths

    src = Path(args.source)
    work = Path(tempfile.mkdtemp(prefix="kload-nvcc-"))
    lean = work / src.name
    full = work / ("full_" + src.name)
    text = src.read_text()
    assert "#define KLOAD_LEAN" in text, f"{src} does not define KLOAD_LEAN"
    lean.write_text(text)
    full.write_text(text.replace("#define KLOAD_LEAN", "// (whole API)"))
    for h in src.parent.glob("*.h"):
        shutil.copy(h, work / h.name)
    flags = ["-std=c++20", "-c", "--compiler-options", "-fPIC", "-arch=sm_90",
             f"-I{ROOT / 'kernels' / 'include'}"]
    for p in include_paths():
        flags += ["-isystem", p]
    if torch.version.cuda is None:
        flags += ["-isystem", str(ROOT / "tests" / "data" / "cuda_headers")]
    nvcc = subprocess.run(["nvcc", "--version"], capture_output=True, text=True).stdout.strip().splitlines()[-1]
    print(f"nvcc: {nvcc}; torch {torch.__version__}; {src.relative_to(ROOT)}; {args.repeat} runs each, alternating")
    times = {"lean": [], "full": []}
    for _ in range(args.repeat):
        for key, path in (("lean", lean), ("full", full)):
            t = time.perf_counter()
            proc = subprocess.run(["nvcc", *flags, str(path), "-o", str(work / f"{key}.o")],
                                  capture_output=True, text=True)
            times[key].append(time.perf_counter() - t)
            if proc.returncode != 0:
                sys.exit(f"nvcc failed on {key}:\n{proc.stderr[-3000:]}")
    peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 2**20
    for key, label in (("lean", "KLOAD_LEAN (Tensor + registration API)"), ("full", "whole ATen API")):
        ts = times[key]
        print(f"  {label:<40} min {min(ts):6.2f} s   median {statistics.median(ts):6.2f} s")
    print(f"  whole API / lean (medians): {statistics.median(times['full']) / statistics.median(times['lean']):.2f}x; "
          f"largest compiler process: {peak:.2f} GB")
    shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
