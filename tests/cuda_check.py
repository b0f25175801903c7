"""CUDA builds without a GPU (run by `make upgrade-check` under the CUDA build of torch):

    python tests/cuda_check.py

The .cu sources of every binding style (the tutorial's section 4.1 as written among
them) build with nvcc through kload and load; their CUDA kernels are in the dispatch
table, and each, called with a CPU tensor (the dispatcher told to run the CUDA
entry: no GPU here), raises its own clear error, never a crash. A .cu with torch's host
headers compiles in two halves (each line says how each .cu compiled). kload finds the toolkit behind
an nvcc wrapper, the PyPI CUDA headers, and an architecture list by itself.
Prints one line per style; exits non-zero when one failed.
"""
from __future__ import annotations

import os
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import torch

import kload

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"

STYLES = {
    # KLOAD_LIBRARY op library: .cpp with the schema and CPU kernel, .cu with the CUDA kernel
    "op_library": {
        "cc_op.cpp": """\
            #include <kload/kernel.h>
            at::Tensor cc_op_cpu(const at::Tensor& x) { return x * 2; }
            KLOAD_LIBRARY(m) { m.def("cc_op(Tensor x) -> Tensor"); }
            KLOAD_IMPL(CPU, m) { m.impl("cc_op", &cc_op_cpu); }
            """,
        "cc_op_cuda.cu": """\
            #define KLOAD_LEAN
            #include <kload/kernel.h>
            #include <ATen/ops/empty_like.h>
            #include <c10/cuda/CUDAGuard.h>
            #include <c10/cuda/CUDAStream.h>
            __global__ void twice(const float* x, float* y, int64_t n) {
              int64_t i = blockIdx.x * 256 + threadIdx.x;
              if (i < n) y[i] = 2 * x[i];
            }
            at::Tensor cc_op_cuda(const at::Tensor& x) {
              TORCH_CHECK(x.is_cuda(), "cc_op: x must be a CUDA tensor, got one on ", x.device());
              const c10::cuda::CUDAGuard guard(x.device());
              auto y = at::empty_like(x);
              twice<<<(x.numel() + 255) / 256, 256, 0, c10::cuda::getCurrentCUDAStream()>>>(
                  x.data_ptr<float>(), y.data_ptr<float>(), x.numel());
              return y;
            }
            KLOAD_IMPL(CUDA, m) { m.impl("cc_op", &cc_op_cuda); }
            """,
    },
    # the tutorial's section 4.1 as written (examples/): PYBIND11_MODULE in the .cpp, the
    # kernel and its launcher in a .cu that includes <torch/extension.h> and ATen/cuda/CUDAContext.h
    "pybind11": {f: (EXAMPLES / f).read_text() for f in ("tutorial_my_ops_cuda.cpp", "tutorial_my_ops_cuda.cu")},
    # plain TORCH_LIBRARY with a fixed namespace
    "torch_library": {
        "cc_fixed.cpp": """\
            #include <torch/library.h>
            #include <ATen/ATen.h>
            at::Tensor cc_fixed_cpu(const at::Tensor& x) { return x * 2; }
            TORCH_LIBRARY(kload_cuda_check, m) { m.def("cc_fixed(Tensor x) -> Tensor"); }
            TORCH_LIBRARY_IMPL(kload_cuda_check, CPU, m) { m.impl("cc_fixed", &cc_fixed_cpu); }
            """,
        "cc_fixed_cuda.cu": """\
            #include <torch/library.h>
            #include <ATen/core/Tensor.h>
            #include <ATen/ops/empty_like.h>
            __global__ void twice(const float* x, float* y, int64_t n) {
              int64_t i = blockIdx.x * 256 + threadIdx.x;
              if (i < n) y[i] = 2 * x[i];
            }
            at::Tensor cc_fixed_cuda(const at::Tensor& x) {
              TORCH_CHECK(x.is_cuda(), "cc_fixed: x must be a CUDA tensor, got one on ", x.device());
              auto y = at::empty_like(x);
              twice<<<(x.numel() + 255) / 256, 256>>>(x.data_ptr<float>(), y.data_ptr<float>(), x.numel());
              return y;
            }
            TORCH_LIBRARY_IMPL(kload_cuda_check, CUDA, m) { m.impl("cc_fixed", &cc_fixed_cuda); }
            """,
    },
    # the stable ABI: a torch-free .cu with an extern "C" launcher, the glue in the .cpp
    "stable": {
        "cc_stable.cpp": """\
            #include <kload/stable.h>
            using kload::Tensor;
            Tensor cc_stable_cpu(const Tensor& x) {
              KLOAD_CHECK_DTYPE(x, kload::ScalarType::Float);
              Tensor xc = torch::stable::contiguous(x);
              Tensor y = torch::stable::empty_like(xc);
              for (int64_t i = 0; i < xc.numel(); ++i)
                y.mutable_data_ptr<float>()[i] = 2 * xc.const_data_ptr<float>()[i];
              return y;
            }
            #ifdef KLOAD_WITH_CUDA
            extern "C" const char* cc_stable_launch(const float* x, float* y, int64_t n, void* stream);
            Tensor cc_stable_cuda(const Tensor& x) {
              KLOAD_CHECK_CUDA(x);
              kload::DeviceGuard guard(x.get_device_index());
              Tensor xc = torch::stable::contiguous(x);
              Tensor y = torch::stable::empty_like(xc);
              KLOAD_CHECK_LAUNCH(cc_stable_launch(xc.const_data_ptr<float>(), y.mutable_data_ptr<float>(),
                                                  xc.numel(), kload::cuda_stream(xc)));
              return y;
            }
            KLOAD_IMPL(CUDA, m) { m.impl("cc_stable", TORCH_BOX(&cc_stable_cuda)); }
            #endif
            KLOAD_LIBRARY(m) { m.def("cc_stable(Tensor x) -> Tensor"); }
            KLOAD_IMPL(CPU, m) { m.impl("cc_stable", TORCH_BOX(&cc_stable_cpu)); }
            """,
        "cc_stable_cuda.cu": """\
            #include <cuda_runtime.h>
            #include <cstdint>
            __global__ void twice(const float* x, float* y, int64_t n) {
              int64_t i = blockIdx.x * 256 + threadIdx.x;
              if (i < n) y[i] = 2 * x[i];
            }
            extern "C" const char* cc_stable_launch(const float* x, float* y, int64_t n, void* stream) {
              twice<<<(n + 255) / 256, 256, 0, static_cast<cudaStream_t>(stream)>>>(x, y, n);
              cudaError_t err = cudaGetLastError();
              return err == cudaSuccess ? nullptr : cudaGetErrorString(err);
            }
            """,
    },
}


# styles whose .cu includes torch's host headers and is written as the halves take it:
# compiled in two halves (split_build.py) unless KLOAD_SPLIT_CUDA=0
SPLIT_STYLES = ("op_library", "pybind11", "torch_library")


def cuda_kernel_error(op, *args) -> str:
    """Call the op's CUDA kernel itself, with a CPU tensor (no GPU here to make a CUDA
    one): the dispatcher is told to run the CUDA entry. The kernel's own input check
    must raise a clear error; a crash or a silent answer fails the check."""
    keyset = torch._C.DispatchKeySet(torch._C.DispatchKey.CUDA)
    try:
        op.default.redispatch(keyset, *(args or (torch.ones(4),)))
    except RuntimeError as e:
        return str(e).splitlines()[0]
    raise AssertionError("the CUDA kernel accepted a CPU tensor")


def check_style(style: str, files: dict[str, str], work: Path) -> str:
    folder = work / style
    folder.mkdir()
    paths = []
    for fname, text in files.items():
        (folder / fname).write_text(textwrap.dedent(text))
        paths.append(folder / fname)
    # one style takes kload's own choice (no GPU here: 8.0;9.0+PTX, side by side); the others one
    # architecture (the compile is what is checked, not every target twice)
    if style == "op_library" or "TORCH_CUDA_ARCH_LIST" in os.environ:
        arch = None
    else:
        arch = os.environ["TORCH_CUDA_ARCH_LIST"] = "9.0"
    started = time.perf_counter()
    try:
        h = kload.load(*paths, reload=False).load()
    finally:
        if arch:
            del os.environ["TORCH_CUDA_ARCH_LIST"]
    seconds = time.perf_counter() - started
    m = h._loaded.entry.manifest
    assert m["cuda_built"] and not m["cuda_skipped"], m
    x = torch.arange(4.0)
    if h.module is not None:
        fn = lambda t: h.vector_add(t, t)  # noqa: E731
    else:
        ns = h.namespace
        op = next(iter(h._loaded.op_names()))
        qual = f"{ns}::{op}"
        for key in ("CPU", "CUDA"):
            assert torch._C._dispatch_has_kernel_for_dispatch_key(qual, key), f"{qual} has no {key} kernel"
        fn = getattr(getattr(torch.ops, ns), op)
    assert torch.equal(fn(x), x * 2)
    if h.module is not None:  # a Python function: its CUDA branch needs a CUDA tensor; the .cu linked (it loaded)
        cuda = "the .cu's vector_add_cuda linked into the module (no GPU here to call it)"
    else:
        cuda = "its CUDA kernel, called with a CPU tensor, says: " + cuda_kernel_error(fn)
    halves = m.get("cuda_split") or {}  # .cu -> how it compiled (split_build.py)
    if style in SPLIT_STYLES and os.environ.get("KLOAD_SPLIT_CUDA", "1") != "0":
        assert halves and all(n.startswith("split") for n in halves.values()), halves
    split = "; ".join(f"{Path(f).name} {n}" for f, n in halves.items()) or "no .cu split"
    return f"built and loaded in {seconds:.1f} s ({m['inputs'].get('cuda_arch')}); {split}; CPU runs; {cuda}"


def check_shipped() -> str:
    from kload import kernels

    os.environ.setdefault("TORCH_CUDA_ARCH_LIST", "9.0")  # test_cuda_compile.py compiles them for 8.0 too
    started = time.perf_counter()
    for op in kernels.__all__:
        h = kernels.handle(op)
        m = h._loaded.entry.manifest
        assert m["cuda_built"], (op, m.get("cuda_skipped"))
        qual = f"{h.namespace}::{op}"
        assert torch._C._dispatch_has_kernel_for_dispatch_key(qual, "CUDA"), f"{qual} has no CUDA kernel"
    x = torch.ones(4)
    err = cuda_kernel_error(getattr(torch.ops, kernels.handle("vector_add").namespace).vector_add, x, x)
    return f"all {len(kernels.__all__)} built and loaded in {time.perf_counter() - started:.1f} s; CUDA kernel: {err}"


def main() -> None:
    if torch.version.cuda is None:
        raise SystemExit(f"cuda-check: torch {torch.__version__} is a CPU build; run it with a CUDA build")
    print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, GPU: {torch.cuda.is_available()}, "
          f"CUDA_HOME={os.environ.get('CUDA_HOME', '(unset)')}, "
          f"TORCH_CUDA_ARCH_LIST={os.environ.get('TORCH_CUDA_ARCH_LIST', '(unset)')}", flush=True)
    work = Path(tempfile.mkdtemp(prefix="kload-cuda-check-"))
    checks = [(style, lambda style=style, files=files: check_style(style, files, work))
              for style, files in STYLES.items()] + [("shipped kernels", check_shipped)]
    failed = 0
    for name, check in checks:  # every check runs; the exit status says whether one failed
        try:
            print(f"PASS  {name}: {check()}", flush=True)
        except (AssertionError, RuntimeError) as e:  # KloadError and CompileError are RuntimeErrors
            print(f"FAIL  {name}: {e}", flush=True)
            failed += 1
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
