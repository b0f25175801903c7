"""Live editing of CUDA, in one run: an edit of one kernel's device code, four ways.

    .venv-next/bin/python benchmarks/live.py --cuda [--repeat N]      (a CUDA build of torch)

The same kernel (``out[i] = x[i] * 2 + VALUE``, float32), edited (VALUE changes) and
made ready again in a fresh process, timed after ``import torch``:

- NVRTC: a kernel file through ``kload.cuda_module`` (device code only), compiled to a cubin;
- nvcc, torch-free .cu: a kload op library, the kernel and its launcher in a .cu with no
  torch header, the op in a .cpp (kload's shipped kernels are built so);
- nvcc, ATen in the .cu: a kload op library whose .cu includes <kload/kernel.h> and
  ATen/cuda/CUDAContext.h (the op and the kernel in one file; as users write it);
- torch's load_inline with ``cuda_sources`` (<torch/extension.h>, pybind11 bindings).

Each side builds once (not timed); then the edits alternate between the sides, each
starting once no compiler of an earlier step runs. Every side builds for one
architecture, sm_90 (TORCH_CUDA_ARCH_LIST=9.0; NVRTC's target sm_90), as on a GPU
machine. Without a GPU this is the compile half of the loop (edit -> the new code
loaded); with one, each side also runs the op and checks the new value.
"""
from __future__ import annotations

import shutil
import statistics
import sys
import tempfile
from pathlib import Path

from common import py, wait_quiet

KERNEL = '__global__ void bump_kernel(const float* x, float* out, long long n) {{\n' \
         '  long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;\n' \
         '  if (i < n) out[i] = x[i] * 2 + {value}.0f;\n}}\n'

FILES = {
    "NVRTC (kload.cuda_module)": {
        "bump.cu": 'extern "C" ' + KERNEL,
    },
    "nvcc, torch-free .cu (kload.load)": {
        "bump_cuda.cu": "#include <cuda_runtime.h>\n" + KERNEL + (
            "void bump_launch(const float* x, float* out, long long n, cudaStream_t s) {{\n"
            "  bump_kernel<<<(n + 255) / 256, 256, 0, s>>>(x, out, n);\n}}\n"),
        "bump.cpp": """#include <kload/kernel.h>
#include <ATen/cuda/CUDAContext.h>
void bump_launch(const float* x, float* out, long long n, cudaStream_t s);
at::Tensor bump(const at::Tensor& x) {{
  auto out = at::empty_like(x);
  bump_launch(x.data_ptr<float>(), out.data_ptr<float>(), x.numel(), at::cuda::getCurrentCUDAStream());
  return out;
}}
KLOAD_LIBRARY(m) {{ m.def("bump(Tensor x) -> Tensor"); }}
KLOAD_IMPL(CUDA, m) {{ m.impl("bump", &bump); }}
""",
    },
    "nvcc, ATen in the .cu (kload.load)": {
        "bump_aten.cu": """#include <kload/kernel.h>
#include <ATen/cuda/CUDAContext.h>
""" + KERNEL + """at::Tensor bump(const at::Tensor& x) {{
  auto out = at::empty_like(x);
  bump_kernel<<<(x.numel() + 255) / 256, 256, 0, at::cuda::getCurrentCUDAStream()>>>(
      x.data_ptr<float>(), out.data_ptr<float>(), x.numel());
  return out;
}}
KLOAD_LIBRARY(m) {{ m.def("bump(Tensor x) -> Tensor"); }}
KLOAD_IMPL(CUDA, m) {{ m.impl("bump", &bump); }}
""",
    },
    "torch load_inline, cuda_sources": {
        "inline.cu": "#include <torch/extension.h>\n#include <ATen/cuda/CUDAContext.h>\n" + KERNEL + """
torch::Tensor bump(torch::Tensor x) {{
  auto out = torch::empty_like(x);
  bump_kernel<<<(x.numel() + 255) / 256, 256, 0, at::cuda::getCurrentCUDAStream()>>>(
      x.data_ptr<float>(), out.data_ptr<float>(), x.numel());
  return out;
}}
""",
    },
}

# each prints [seconds from after `import torch` to the op ready, the new value or None without a GPU]
CHECK = """
    value = None
    if torch.cuda.is_available():
        value = float(call(torch.ones(4, device="cuda"))[0])
    print(json.dumps([time.perf_counter() - t, value]))
"""
RUNS = {
    "NVRTC (kload.cuda_module)": """
    import json, time, torch
    t = time.perf_counter()
    import kload
    mod = kload.cuda_module({d!r} + "/bump.cu", names=["bump_kernel"], reload=False)
    mod.compile()
    def call(x):
        out = torch.empty_like(x)
        mod.bump_kernel[(x.numel() + 255) // 256, 256](x, out, x.numel())
        return out
""",
    "kload": """
    import json, time, torch
    t = time.perf_counter()
    import kload
    h = kload.load(*{srcs!r}, name={name!r}, reload=False).load()
    call = h.bump
""",
    "torch load_inline, cuda_sources": """
    import json, time, torch
    t = time.perf_counter()
    from torch.utils.cpp_extension import load_inline
    m = load_inline("bump_inline", cpp_sources="torch::Tensor bump(torch::Tensor x);",
                    cuda_sources=open({d!r} + "/inline.cu").read(), functions=["bump"],
                    build_directory={d!r} + "/ws")
    call = m.bump
""",
}


def write(d: Path, side: str, value: int) -> None:
    for name, text in FILES[side].items():
        (d / name).write_text(text.format(value=value))


def code(side: str, d: Path) -> str:
    key = side if side in RUNS else "kload"
    srcs = [str(d / f) for f in sorted(FILES[side], key=lambda f: f.endswith(".cu"))]
    return RUNS[key].format(d=str(d), srcs=srcs, name="bump_" + d.name) + CHECK


def main(repeat: int) -> None:
    import torch

    from kload.plan.toolchain import find_cuda_home, pip_cuda_includes

    if torch.version.cuda is None or shutil.which("nvcc") is None:
        sys.exit("live.py --cuda needs a CUDA build of torch and nvcc on PATH")
    work = Path(tempfile.mkdtemp(prefix="kload-live-cuda-"))
    env = {"TORCH_CUDA_ARCH_LIST": "9.0", "MAX_JOBS": "2", "KLOAD_PCH": "0", "TORCH_NO_COMPILER_WRAPPER": "1",
           "CUDA_HOME": find_cuda_home(), "KLOAD_CACHE_DIR": str(work / "cache"),
           # torch's CUDA headers include cusparse.h & co., which a PyPI torch keeps in nvidia/*/include
           "CPATH": ":".join(pip_cuda_includes())}
    sides = {}
    for i, side in enumerate(FILES):
        d = work / f"side{i}"
        (d / "ws").mkdir(parents=True)
        write(d, side, 0)
        py(code(side, d), env)  # the first build: not timed
        sides[side] = (d, [])
    gpu = torch.cuda.is_available()
    print(f"torch {torch.__version__}; sm_90; {'a GPU' if gpu else 'no GPU: the compile half'}; "
          f"{repeat} edits a side, alternating; fresh processes")
    for n in range(1, repeat + 1):
        for side, (d, times) in sides.items():
            write(d, side, n)
            wait_quiet()
            seconds, value = py(code(side, d), env)
            if gpu and value != 2 + n:
                sys.exit(f"{side}: the edit's new value is {value}, not {2 + n}")
            times.append(seconds)
    base = statistics.median(sides["NVRTC (kload.cuda_module)"][1])
    print(f"{'edit of the kernel -> ready' + (' (new result)' if gpu else ''):<44} {'min':>8} {'median':>8}  / NVRTC")
    for side, (_, times) in sides.items():
        med = statistics.median(times)
        print(f"  {side:<42} {min(times):7.2f}s {med:7.2f}s  {med / base:7.1f}x")
    shutil.rmtree(work, ignore_errors=True)
