"""The candidates for a fast edit of an ATen .cu (issue 34), side by side on the
tutorial's .cu (examples/tutorial_my_ops_cuda.cu), alternating, compile only:

    PYTHON benchmarks/cuda_candidates.py [--repeat N]     (a CUDA build of torch)

- nvcc as torch's loader runs it (the flags read from the ninja file torch writes);
- the same with --threads 2 (kload's whole-file compile), with -rdc=true (--device-c,
  a device link later), with -static-global-template-stub=false;
- clang++-19 in CUDA mode (clang can precompile headers in CUDA mode): where it is
  installed, whether it compiles this toolkit's headers at all;
- the split (cusplit.py): nvcc on the device half alone, g++ on the host half without
  and with its #include block precompiled (the prefix's PCH built once, not timed).

Every variant compiles the whole .cu (or half) from scratch: what a kernel edit costs
it. The architectures are kload's choice without a GPU (8.0;9.0+PTX).
"""
from __future__ import annotations

import argparse
import os
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CU = ROOT / "examples" / "tutorial_my_ops_cuda.cu"
ARCHS = "8.0;9.0+PTX"
CHECKS = ["-DCHECK_INPUT(x)=TORCH_CHECK(x.is_contiguous())", "-DCHECK_CUDA(x)=TORCH_CHECK(x.is_cuda())"]


def timed(cmd: list[str], cwd: Path) -> float | str:
    t = time.perf_counter()
    p = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True)
    if p.returncode:
        first = next((ln for ln in (p.stdout + p.stderr).splitlines() if "error" in ln), p.stderr[-300:])
        return f"fails: {first.strip()[:150]}"
    return time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeat", type=int, default=2)
    args = ap.parse_args()
    import torch

    from kload.compile.cuda_split import split as cusplit
    from kload.options import include_dir
    from kload.compile.torchbuild import torch_ninja_variables
    from kload.compile.cuda_split.units import host_flags
    from kload.plan.toolchain import find_cuda_home, pip_cuda_includes

    os.environ["TORCH_CUDA_ARCH_LIST"] = ARCHS
    cuda_home = os.environ.setdefault("CUDA_HOME", find_cuda_home())
    work = Path(tempfile.mkdtemp(prefix="kload-cucand-"))
    shutil.copy(CU, work / CU.name)
    sys_inc = [f"-isystem{p}" for p in pip_cuda_includes()]
    found = torch_ninja_variables(name="cand", sources=[str(work / "x.cpp"), str(work / CU.name)],
                                  cflags=CHECKS + sys_inc, cuda_cflags=CHECKS + sys_inc, include_paths=[],
                                  with_cuda=True)
    nvcc = shlex.split(found["nvcc"]) + shlex.split(found["cuda_cflags"]) + shlex.split(found["cuda_post_cflags"])
    cxx = shlex.split(found.get("cxx", "c++"))
    host = shlex.split(found["cflags"]) + shlex.split(found["post_cflags"]) + host_flags(nvcc, cxx[-1])
    whole = nvcc + ["-c", CU.name, "-o", "whole.o"]
    variants = {
        "nvcc, torch's command": whole,
        "nvcc --threads 2 (kload whole)": whole + ["--threads", "2"],
        "nvcc -rdc=true": whole + ["-rdc=true"],
        "nvcc -static-global-template-stub=false": whole + ["-static-global-template-stub=false"],
    }
    clang = shutil.which("clang++-19")
    if clang:
        variants["clang++-19 -x cuda (no PCH yet)"] = (
            [clang, "-x", "cuda", f"--cuda-path={cuda_home}", "--cuda-gpu-arch=sm_80", "--cuda-gpu-arch=sm_90",
             "--no-cuda-version-check"] + shlex.split(found["cflags"]) + shlex.split(found["post_cflags"])
            + ["-c", CU.name, "-o", "clang.o"])
    sp = cusplit.split(CU.read_text(), str(work / CU.name), [str(include_dir())])
    (work / "dev.cu").write_text(sp.device)
    prefix = sp.prefix + "#include <kload/split/host.h>\n"
    (work / "inc").mkdir()
    (work / "inc" / "prefix.h").write_text(prefix)
    (work / "host.cpp").write_text('#include "prefix.h"\n' + sp.host)
    inc = [f"-I{include_dir()}"]
    dev = [a for a in nvcc if not a.startswith("-DTORCH_API_INCLUDE")] + inc + ["-c", "dev.cu", "-o", "dev.o"]
    variants["split: device half (nvcc --threads 2)"] = dev + ["--threads", "2"]
    hostcmd = cxx + host + inc + ["-Iinc", "-c", "host.cpp", "-o", "host.o"]
    variants["split: host half (g++, no PCH)"] = hostcmd
    (work / "pch").mkdir()
    (work / "pch" / "prefix.h").write_text(prefix)
    pch = subprocess.run(cxx + host + inc + ["-x", "c++-header", "pch/prefix.h", "-o", "pch/prefix.h.gch"],
                         cwd=work, capture_output=True, text=True)
    if pch.returncode == 0:
        variants["split: host half (g++, #include block precompiled)"] = cxx + host + inc + [
            "-Ipch", "-Winvalid-pch", "-c", "host.cpp", "-o", "host_pch.o"]
    print(f"torch {torch.__version__}; {ARCHS}; {os.cpu_count()} cores; {args.repeat} runs each, alternating; "
          f"compile only", flush=True)
    times: dict[str, list] = {k: [] for k in variants}
    for _ in range(args.repeat):
        for name, cmd in variants.items():
            times[name].append(timed(cmd, work))
    for name, ts in times.items():
        bad = [t for t in ts if isinstance(t, str)]
        if bad:
            print(f"  {name:<52} {bad[0]}")
        else:
            print(f"  {name:<52} min {min(ts):6.2f} s   median {statistics.median(ts):6.2f} s")
    shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
