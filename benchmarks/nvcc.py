"""What torch's headers cost nvcc: the shipped vector_add.cu as it is now (torch-free:
kernels and an extern "C" launcher; the stable-ABI glue is in the .cpp) against the
same op's .cu of before the port (REV), with KLOAD_LEAN and with ATen's whole API,
alternately.

    python benchmarks/nvcc.py [--repeat N] [--before REV]

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
    ap.add_argument("--before", default="7994975", help="a revision whose kernels/ used <kload/kernel.h>")
    args = ap.parse_args()
    if shutil.which("nvcc") is None:
        sys.exit("nvcc is not on PATH")
    import torch
    from torch.utils.cpp_extension import include_paths

    src = ROOT / "kernels" / "vector_add" / "vector_add.cu"
    work = Path(tempfile.mkdtemp(prefix="kload-nvcc-"))
    tar = subprocess.run(["git", "archive", args.before, "kernels"], cwd=ROOT, capture_output=True,
                         check=True).stdout
    subprocess.run(["tar", "-x", "-C", str(work)], input=tar, check=True)
    old = work / "kernels" / "vector_add" / "vector_add.cu"
    text = old.read_text()
    assert "#define KLOAD_LEAN" in text, f"{old} ({args.before}) does not define KLOAD_LEAN"
    lean, full = old, old.with_name("full_vector_add.cu")
    full.write_text(text.replace("#define KLOAD_LEAN", "// (whole API)"))
    stable = [f"-I{ROOT / 'kernels' / 'include'}"]  # the torch-free .cu needs no torch include path
    flags = ["-std=c++20", "-c", "--compiler-options", "-fPIC", "-arch=sm_90"]
    old_flags = [f"-I{work / 'kernels' / 'include'}"]
    for p in include_paths():
        old_flags += ["-isystem", p]
    if torch.version.cuda is None:
        old_flags += ["-isystem", str(ROOT / "tests" / "data" / "cuda_headers")]
    nvcc = subprocess.run(["nvcc", "--version"], capture_output=True, text=True).stdout.strip().splitlines()[-1]
    print(f"nvcc: {nvcc}; torch {torch.__version__}; {src.relative_to(ROOT)} now and at {args.before}; "
          f"{args.repeat} runs each, alternating")
    times = {"stable": [], "lean": [], "full": []}
    for _ in range(args.repeat):
        for key, path, extra in (("stable", src, stable), ("lean", lean, old_flags), ("full", full, old_flags)):
            t = time.perf_counter()
            proc = subprocess.run(["nvcc", *flags, *extra, str(path), "-o", str(work / f"{key}.o")],
                                  capture_output=True, text=True)
            times[key].append(time.perf_counter() - t)
            if proc.returncode != 0:
                sys.exit(f"nvcc failed on {key}:\n{proc.stderr[-3000:]}")
    peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 2**20
    for key, label in (("stable", "now: torch-free .cu (stable split)"),
                       ("lean", "before: KLOAD_LEAN (Tensor + registration)"), ("full", "before: whole ATen API")):
        ts = times[key]
        print(f"  {label:<44} min {min(ts):6.2f} s   median {statistics.median(ts):6.2f} s")
    med = {k: statistics.median(v) for k, v in times.items()}
    print(f"  now / KLOAD_LEAN: {med['stable'] / med['lean']:.2f}x; whole API / KLOAD_LEAN: "
          f"{med['full'] / med['lean']:.2f}x; largest compiler process: {peak:.2f} GB")
    shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
