"""CUDA builds without a GPU (run by `make upgrade-check` under the CUDA build of torch):

    python tests/cuda_check.py

The .cu sources of every binding style build with nvcc through kload and load;
their CUDA kernels are in the dispatch table, and a call with CUDA tensors gets
torch's clear error (no GPU here), never a crash. kload finds the toolkit behind
an nvcc wrapper, the PyPI CUDA headers, and an architecture list by itself.
Prints one line per style; exits non-zero on the first failure.
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
              const c10::cuda::CUDAGuard guard(x.device());
              auto y = at::empty_like(x);
              twice<<<(x.numel() + 255) / 256, 256, 0, c10::cuda::getCurrentCUDAStream()>>>(
                  x.data_ptr<float>(), y.data_ptr<float>(), x.numel());
              return y;
            }
            KLOAD_IMPL(CUDA, m) { m.impl("cc_op", &cc_op_cuda); }
            """,
    },
    # the tutorial's style: PYBIND11_MODULE in the .cpp, the kernel and its launcher in the .cu
    "pybind11": {
        "cc_py.cpp": """\
            #include <torch/extension.h>
            torch::Tensor twice_cuda(torch::Tensor x);
            torch::Tensor twice(torch::Tensor x) {
              CHECK_INPUT(x);
              return x.is_cuda() ? twice_cuda(x) : x * 2;
            }
            PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def("twice", &twice); }
            """,
        "cc_py_cuda.cu": """\
            #include <torch/extension.h>
            __global__ void twice_kernel(const float* x, float* y, int64_t n) {
              int64_t i = blockIdx.x * 256 + threadIdx.x;
              if (i < n) y[i] = 2 * x[i];
            }
            torch::Tensor twice_cuda(torch::Tensor x) {
              auto y = torch::empty_like(x);
              twice_kernel<<<(x.numel() + 255) / 256, 256>>>(x.data_ptr<float>(), y.data_ptr<float>(), x.numel());
              return y;
            }
            """,
    },
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


def cuda_call_error(fn) -> str:
    """A call with CUDA tensors must raise torch's clear error here (no GPU), never crash."""
    try:
        fn(torch.ones(4, device="cuda"))
    except (RuntimeError, AssertionError) as e:
        return str(e).splitlines()[0]
    raise SystemExit("cuda-check: a CUDA call succeeded on a machine without a GPU?")


def check_style(style: str, files: dict[str, str], work: Path) -> str:
    folder = work / style
    folder.mkdir()
    paths = []
    for fname, text in files.items():
        (folder / fname).write_text(textwrap.dedent(text))
        paths.append(folder / fname)
    started = time.perf_counter()
    h = kload.load(*paths, reload=False).load()
    seconds = time.perf_counter() - started
    m = h._loaded.entry.manifest
    assert m["cuda_built"] and not m["cuda_skipped"], m
    x = torch.arange(4.0)
    if h.module is not None:
        fn = h.twice
    else:
        ns = h.namespace
        op = next(iter(h._loaded.op_names()))
        qual = f"{ns}::{op}"
        for key in ("CPU", "CUDA"):
            assert torch._C._dispatch_has_kernel_for_dispatch_key(qual, key), f"{qual} has no {key} kernel"
        fn = getattr(getattr(torch.ops, ns), op)
    assert torch.equal(fn(x), x * 2)
    err = cuda_call_error(fn)
    return f"built and loaded in {seconds:.1f} s ({m['inputs'].get('cuda_arch')}); CPU runs; CUDA call: {err}"


def check_shipped() -> str:
    from kload import kernels

    started = time.perf_counter()
    for op in kernels.__all__:
        h = kernels.handle(op)
        m = h._loaded.entry.manifest
        assert m["cuda_built"], (op, m.get("cuda_skipped"))
        qual = f"{h.namespace}::{op}"
        assert torch._C._dispatch_has_kernel_for_dispatch_key(qual, "CUDA"), f"{qual} has no CUDA kernel"
    err = cuda_call_error(lambda t: kernels.vector_add(t, t))
    return f"all {len(kernels.__all__)} built and loaded in {time.perf_counter() - started:.1f} s; CUDA call: {err}"


def main() -> None:
    if torch.version.cuda is None:
        raise SystemExit(f"cuda-check: torch {torch.__version__} is a CPU build; run it with a CUDA build")
    print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, GPU: {torch.cuda.is_available()}, "
          f"CUDA_HOME={os.environ.get('CUDA_HOME', '(unset)')}, "
          f"TORCH_CUDA_ARCH_LIST={os.environ.get('TORCH_CUDA_ARCH_LIST', '(unset)')}", flush=True)
    work = Path(tempfile.mkdtemp(prefix="kload-cuda-check-"))
    for style, files in STYLES.items():
        try:
            print(f"PASS  {style}: {check_style(style, files, work)}", flush=True)
        except (AssertionError, kload.KloadError) as e:
            print(f"FAIL  {style}: {e}", flush=True)
            sys.exit(1)
    try:
        print(f"PASS  shipped kernels: {check_shipped()}", flush=True)
    except (AssertionError, kload.KloadError) as e:
        print(f"FAIL  shipped kernels: {e}", flush=True)
        sys.exit(1)


if __name__ == "__main__":
    main()
