"""The shipped kernels on a GPU vs torch, and vector_add vs the device's copy
bandwidth measured in the same run (CUDA events, median of repeats).

    python benchmarks/gpu.py
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from kload import kernels


def cuda_time(fn, repeat=50) -> float:
    for _ in range(5):
        fn()
    times = []
    for _ in range(repeat):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    times.sort()
    return times[len(times) // 2]


def main() -> None:
    assert torch.cuda.is_available(), "needs a CUDA device"
    print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}, CUDA {torch.version.cuda}")
    n = 64 * 1024 * 1024
    a, b = torch.randn(n, device="cuda"), torch.randn(n, device="cuda")
    out = torch.empty_like(a)
    t_copy = cuda_time(lambda: out.copy_(a))
    copy_bw = 2 * 4 * n / t_copy
    t_k = cuda_time(lambda: kernels.vector_add(a, b))
    t_t = cuda_time(lambda: torch.add(a, b))
    bw = 3 * 4 * n / t_k
    rows = [("vector_add 64M fp32", t_t, t_k, f"{bw / 1e9:.0f} GB/s = {bw / copy_bw:.0%} of copy {copy_bw / 1e9:.0f} GB/s")]
    for dtype in (torch.float32, torch.bfloat16):
        m = 4096
        x, y = torch.randn(m, m, device="cuda", dtype=dtype), torch.randn(m, m, device="cuda", dtype=dtype)
        tk, tt = cuda_time(lambda: kernels.matmul(x, y), 10), cuda_time(lambda: x @ y, 10)
        rows.append((f"matmul 4096^3 {str(dtype)[6:]}", tt, tk, f"{2 * m ** 3 / tk / 1e12:.1f} TFLOP/s"))
    xc, wc, bc = (torch.randn(8, 64, 56, 56, device="cuda"), torch.randn(64, 64, 3, 3, device="cuda"),
                  torch.randn(64, device="cuda"))
    rows.append(("conv2d 8x64x56x56 3x3", cuda_time(lambda: F.conv2d(xc, wc, bc, 1, 1)),
                 cuda_time(lambda: kernels.conv2d(xc, wc, bc, 1, 1)), "direct kernel vs cuDNN"))
    xg = torch.randn(8192, 4096, device="cuda", requires_grad=True)
    bg = torch.randn(4096, device="cuda", requires_grad=True)
    g = torch.randn(8192, 4096, device="cuda")
    rows.append(("bias_gelu fwd+bwd", cuda_time(lambda: F.gelu(xg + bg).backward(g), 20),
                 cuda_time(lambda: kernels.bias_gelu(xg, bg).backward(g), 20), "fused"))
    print(f"{'operation':26} {'torch ms':>10} {'kload ms':>10} {'speed-up':>9}  note")
    for what, tt, tk, note in rows:
        print(f"{what:26} {tt * 1e3:10.3f} {tk * 1e3:10.3f} {tt / tk:8.2f}x  {note}")
    print(f"target: vector_add >= 85% of copy bandwidth: {'met' if bw / copy_bw >= 0.85 else 'MISSED'}")


if __name__ == "__main__":
    main()
