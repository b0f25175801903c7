"""The tutorial's CUDA edit loop: section 4.1's .cu (examples/tutorial_my_ops_cuda.cu,
<torch/extension.h> + ATen/cuda/CUDAContext.h, bindings in the .cpp), edited and
rebuilt, in one run, sides alternating:

    PYTHON benchmarks/tutorial_cuda.py [--repeat N]     (a CUDA build of torch: make upgrade-check's venv)

- torch: torch.utils.cpp_extension.load (torch's whole <torch/extension.h>, the
  same architectures kload picks), the baseline kload had until now;
- kload, KLOAD_LEAN_CUDA=0: torch's whole header, nvcc --threads over the architectures;
- kload: the lean <torch/extension.h> (torch/types.h; no Python, pybind11 or torch::
  frontend), nvcc --threads.

Each side first builds once (not timed), then each repeat edits one constant of the
.cu and times the rebuild in a fresh process: only the .cu recompiles, then the link.
No precompiled header is built (KLOAD_PCH=0: a .cu edit recompiles no .cpp, and a
background header build would run beside the next side's timed edit), and each timed
edit starts only once no compiler of an earlier step is still running.
Needs a CUDA build of torch and nvcc; no GPU (it times the compiler). nvcc's own
per-phase times of the last edit of each side go to benchmarks/out/.
"""
from __future__ import annotations

import argparse
import os
import shlex
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import py, wait_quiet  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
CU, CPP = ROOT / "examples" / "tutorial_my_ops_cuda.cu", ROOT / "examples" / "tutorial_my_ops_cuda.cpp"
ARCHS = "8.0;9.0+PTX"  # kload's choice where no GPU is visible (and torch's loader needs one given)

KLOAD = """
import json, time, kload
t = time.perf_counter()
kload.load({cpp!r}, {cu!r}, name="tutorial_cuda").build()
print(json.dumps(time.perf_counter() - t))
"""
TORCH = """
import json, time
from torch.utils.cpp_extension import load
t = time.perf_counter()
load(name="tutorial_cuda", sources=[{cpp!r}, {cu!r}], build_directory={ws!r},
     extra_cuda_cflags=[{checks_cu!r}] + {cuda_inc!r}, extra_cflags=[{checks!r}] + {cuda_inc!r})
print(json.dumps(time.perf_counter() - t))
"""
CHECKS = shlex.quote("-DCHECK_INPUT(x)=TORCH_CHECK(x.is_contiguous())")  # the tutorial uses it undefined; torch cannot build it


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    import torch

    from kload.toolchain import find_cuda_home, pip_cuda_includes

    if torch.version.cuda is None or shutil.which("nvcc") is None:
        sys.exit("needs a CUDA build of torch and nvcc on PATH")
    out = ROOT / "benchmarks" / "out"
    out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="kload-tutcu-"))
    sides = {}
    for side in ("torch", "kload full header", "kload"):
        d = work / side.replace(" ", "_")
        (d / "ws").mkdir(parents=True)
        shutil.copy(CPP, d / CPP.name)
        shutil.copy(CU, d / CU.name)
        # torch's loader guesses CUDA_HOME from nvcc's folder (/usr/local for /usr/local/bin/nvcc): tell it
        # TORCH_NO_COMPILER_WRAPPER: recent torch puts a ccache found on PATH in front of the compilers
        env = {"KLOAD_CACHE_DIR": str(d / "cache"), "TORCH_CUDA_ARCH_LIST": ARCHS, "MAX_JOBS": "2",
               "CUDA_HOME": find_cuda_home(), "TORCH_NO_COMPILER_WRAPPER": "1", "KLOAD_PCH": "0",
               "KLOAD_LEAN_CUDA": "0" if side == "kload full header" else "1"}
        code = (TORCH if side == "torch" else KLOAD).format(
            cpp=str(d / CPP.name), cu=str(d / CU.name), ws=str(d / "ws"), checks=CHECKS,
            checks_cu=shlex.quote("-DCHECK_CUDA(x)=TORCH_CHECK(x.is_cuda())"),
            # torch's CUDA headers include cusparse.h & co., which a PyPI torch keeps in nvidia/*/include
            cuda_inc=[f"-isystem {p}" for p in pip_cuda_includes()])
        sides[side] = (d, env, code, [])
    print(f"torch {torch.__version__}; nvcc for {ARCHS}; {os.cpu_count()} cores; MAX_JOBS=2; "
          f"{args.repeat} edits a side, alternating")
    for d, env, code, _ in sides.values():  # the cold builds (the .cpp too): not timed
        py(code, env)
    for i in range(args.repeat):
        for side, (d, env, code, times) in sides.items():
            cu = d / CU.name
            cu.write_text(cu.read_text().replace("out[i] = a[i] + b[i]", f"out[i] = a[i] + b[i] + {i + 1} - {i + 1}"))
            last = i == args.repeat - 1
            wait_quiet()
            e = dict(env, NVCC_APPEND_FLAGS=f"-time {out / ('tutorial_cuda_' + side.replace(' ', '_') + '.csv')}")
            times.append(py(code, e if last else env))
    base = statistics.median(sides["torch"][3])
    print(f"{'edit of the .cu -> rebuilt':<34} {'min':>8} {'median':>8}  vs torch")
    for side, (_, _, _, times) in sides.items():
        med = statistics.median(times)
        print(f"  {side:<32} {min(times):7.1f}s {med:7.1f}s  {med / base:5.2f}x")
    shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
