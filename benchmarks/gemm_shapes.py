"""The tensor-core GEMM's block-tile shapes side by side on a GPU: the shipped default
(4 warps of 64 x 64, 4 cp.async stages) and the others kload/cuda/gemm.cuh compiles
with -DKLOAD_GEMM_WARPS_N / -DKLOAD_GEMM_STAGES, each built as its own matmul library
(the same kernels/matmul sources, under another name), against torch.matmul in one run.

    python benchmarks/gemm_shapes.py [--quick]

Per shape and size: the median over rounds of CUDA-event timings (3 or 50 calls in a row
between two events), torch and each shape alternating, TFLOP/s, the ratio to torch, and
a check of the result against torch's.
The fastest shape per size is marked: the one to ship, if it is not the default.
"""
from __future__ import annotations

import argparse
import sys
from concurrent.futures import ThreadPoolExecutor

import torch

import kload
from common import cuda_device, event_seconds
from kload import kernels

# (warps along N, stages): the default first; (4, 3) is the first version of the kernel
SHAPES = [(2, 4), (2, 3), (4, 3), (4, 4)]
SIZES = [(4096, torch.bfloat16), (1024, torch.bfloat16), (4096, torch.float16)]


def label(shape) -> str:
    wn, stages = shape
    return f"{2 * wn} warps of 64x{128 // wn}, {stages} stages" + (" (default)" if shape == SHAPES[0] else "")


def build(shape):
    wn, stages = shape
    if shape == SHAPES[0]:
        return kernels.op("matmul")
    h = kload.load(*kernels.sources("matmul"), name=f"kload_matmul_w{wn}s{stages}", extra_cflags=kernels.CFLAGS + kernels.openmp_flags()[0],
                   extra_cuda_cflags=kernels.CUDA_CFLAGS + [f"-DKLOAD_GEMM_WARPS_N={wn}", f"-DKLOAD_GEMM_STAGES={stages}"],
                   extra_ldflags=kernels.LDFLAGS + kernels.openmp_flags()[1], reload=False)
    return h.matmul


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true", help="fewer rounds")
    args = parser.parse_args()
    if cuda_device("gemm_shapes.py") is None:
        return 1
    rounds = 5 if args.quick else 20
    with ThreadPoolExecutor(len(SHAPES)) as pool:  # the builds in parallel (ninja uses the cores besides)
        ops = dict(zip(SHAPES, pool.map(build, SHAPES)))
    failed = False
    for m, dtype in SIZES:
        x, y = torch.randn(m, m, device="cuda", dtype=dtype), torch.randn(m, m, device="cuda", dtype=dtype)
        want = x.double() @ y.double()
        flops = 2.0 * m ** 3
        times = {s: [] for s in ["torch", *SHAPES]}
        for s, op in ops.items():
            for _ in range(3):  # warm up
                op(x, y, False)
            tol = 2e-3 if dtype == torch.float16 else 1.6e-2
            try:
                torch.testing.assert_close(op(x, y, False).double(), want, rtol=tol, atol=tol * m ** 0.5)
            except AssertionError as e:
                print(f"WRONG: {label(s)} at {m}^3 {dtype}: {str(e).splitlines()[0]}")
                failed = True
        calls = 3 if m >= 4096 else 50
        for _ in range(rounds):
            times["torch"].append(event_seconds(lambda: x @ y, calls))
            for s, op in ops.items():
                times[s].append(event_seconds(lambda op=op: op(x, y, False), calls))
        med = {s: sorted(t)[len(t) // 2] for s, t in times.items()}
        best = min(SHAPES, key=lambda s: med[s])
        print(f"\nmatmul {m}^3 {str(dtype)[6:]}: torch {med['torch'] * 1e3:.3f} ms, "
              f"{flops / med['torch'] / 1e12:.0f} TFLOP/s")
        for s in SHAPES:
            print(f"  {label(s):40} {med[s] * 1e3:8.3f} ms {flops / med[s] / 1e12:7.0f} TFLOP/s "
                  f"{med['torch'] / med[s]:6.2f}x torch{'  <- fastest' if s == best else ''}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
