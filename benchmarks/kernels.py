"""kload's shipped kernels vs torch eager vs a naive Python loop vs the machine's
ceiling, in one run; prints a table (the tutorial's section 6 shape) and saves a chart.

    python benchmarks/kernels.py [--out benchmarks/out]
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from kload import kernels


def bench(fn, *, min_time=0.3, warmup=2) -> float:
    """Median seconds per call over enough calls to fill ``min_time``."""
    return bench_pair(fn, None, min_time=min_time, warmup=warmup)[0]


def bench_pair(fa, fb, *, min_time=0.6, warmup=2) -> tuple[float, float]:
    """Median seconds per call of ``fa`` and ``fb``, timed alternately: on a noisy
    machine whatever slows one slows the other, and the ratio holds."""
    fns = [f for f in (fa, fb) if f is not None]
    for _ in range(warmup):
        for f in fns:
            f()
    times: list[list[float]] = [[] for _ in fns]
    start = time.perf_counter()
    while time.perf_counter() - start < min_time or len(times[0]) < 5:
        for f, ts in zip(fns, times):
            t = time.perf_counter()
            f()
            ts.append(time.perf_counter() - t)
    meds = [sorted(ts)[len(ts) // 2] for ts in times]
    return meds[0], (meds[1] if fb is not None else 0.0)


def naive_vector_add(a, b):
    return [x + y for x, y in zip(a.tolist(), b.tolist())]


def naive_matmul(a, b):
    a_, b_ = a.tolist(), b.t().tolist()
    return [[sum(x * y for x, y in zip(row, col)) for col in b_] for row in a_]


def bias_gelu_step(rows: int) -> None:
    """fwd+bwd of bias + GELU, fused vs eager, in this (fresh) process; prints JSON."""
    xg = torch.randn(rows, 1024, requires_grad=True)
    bg = torch.randn(1024, requires_grad=True)
    grad = torch.randn(rows, 1024)

    def fused():
        xg.grad = bg.grad = None
        kernels.bias_gelu(xg, bg).backward(grad)

    def eager():
        xg.grad = bg.grad = None
        F.gelu(xg + bg).backward(grad)

    def faults(fn):
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        fn()
        return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before

    t_eager, t_fused = bench_pair(eager, fused, min_time=2.0)
    out = {"eager": t_eager, "fused": t_fused}
    out.update(eager_faults=faults(eager), fused_faults=faults(fused))
    print(json.dumps(out))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(Path(__file__).parent / "out"))
    ap.add_argument("--bias-gelu", type=int, metavar="ROWS", help=argparse.SUPPRESS)  # one fresh-process step
    args = ap.parse_args()
    if args.bias_gelu:
        bias_gelu_step(args.bias_gelu)
        return
    torch.manual_seed(0)
    rows = []  # (operation, size, baseline name, baseline s, kload s, note)

    # memory bandwidth ceiling: a plain copy moves 2 bytes per byte copied
    n = 16 * 1024 * 1024
    a, b = torch.randn(n), torch.randn(n)
    out = torch.empty_like(a)
    t_copy = bench(lambda: out.copy_(a))
    copy_gbs = 2 * 4 * n / t_copy / 1e9

    for size in (1000, 16 * 1024 * 1024):
        a, b = torch.randn(size), torch.randn(size)
        t_t, t_k = bench_pair(lambda: torch.add(a, b), lambda: kernels.vector_add(a, b))
        rows.append(("vector_add", f"{size:,}", "torch.add", t_t, t_k, f"{3 * 4 * size / t_k / 1e9:.1f} GB/s"))
        if size <= 1000:
            t_p = bench(lambda: naive_vector_add(a, b), min_time=0.2)
            rows.append(("vector_add", f"{size:,}", "python loop", t_p, t_k, ""))

    for m in (64, 1024):
        a, b = torch.randn(m, m), torch.randn(m, m)
        t_t, t_k = bench_pair(lambda: torch.matmul(a, b), lambda: kernels.matmul(a, b))
        rows.append(("matmul", f"{m}^3", "torch.matmul", t_t, t_k, f"{2 * m ** 3 / t_k / 1e9:.0f} GFLOP/s "
                     f"(torch {2 * m ** 3 / t_t / 1e9:.0f})"))
        if m <= 64:
            t_p = bench(lambda: naive_matmul(a, b), min_time=0.2, warmup=1)
            rows.append(("matmul", f"{m}^3", "python loop", t_p, t_k, ""))

    x, w, bias = torch.randn(8, 64, 56, 56), torch.randn(64, 64, 3, 3), torch.randn(64)
    t_t, t_k = bench_pair(lambda: F.conv2d(x, w, bias, 1, 1), lambda: kernels.conv2d(x, w, bias, 1, 1),
                          min_time=1.5)
    flops = 2 * 8 * 64 * 64 * 9 * 56 * 56
    rows.append(("conv2d", "8x64x56x56, 3x3", "F.conv2d", t_t, t_k, f"{flops / t_k / 1e9:.0f} GFLOP/s"))

    # bias + GELU at two sizes, each in a fresh interpreter (what ran before changes
    # how glibc's malloc serves large buffers): 16 MB tensors, whose buffers malloc
    # hands out again; and 32 MB ones, at glibc's largest mmap threshold, where every
    # buffer is a fresh mapping and page faults weigh on both sides (eager allocates
    # three such buffers per step, the fused op two)
    for rows_ in (4096, 8192):
        proc = subprocess.run([sys.executable, __file__, "--bias-gelu", str(rows_)], capture_output=True,
                              text=True, check=True)
        r = json.loads(proc.stdout.strip().splitlines()[-1])
        rows.append(("bias_gelu fwd+bwd", f"{rows_}x1024", "torch eager", r["eager"], r["fused"],
                     f"fused; {rows_ * 4 >> 10} MB buffers, page faults/step: eager {r['eager_faults']}, "
                     f"kload {r['fused_faults']}"))

    print(f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
          f"torch {torch.__version__}, {torch.get_num_threads()} threads; copy bandwidth {copy_gbs:.1f} GB/s")
    print(f"{'operation':18} {'size':>16} {'baseline':>13} {'baseline ms':>12} {'kload ms':>10} {'speed-up':>9}  note")
    for op, size, base, tb, tk, note in rows:
        print(f"{op:18} {size:>16} {base:>13} {tb * 1e3:12.3f} {tk * 1e3:10.3f} {tb / tk:8.2f}x  {note}")
    va16 = next(r for r in rows if r[0] == "vector_add" and r[1].startswith("16") and r[2] == "torch.add")
    mm = next(r for r in rows if r[0] == "matmul" and r[1] == "1024^3" and r[2] == "torch.matmul")
    cv = next(r for r in rows if r[0] == "conv2d")
    fu = [r for r in rows if r[0].startswith("bias_gelu")]
    print("\ntargets (CPU):")
    for what, ratio, limit in (("vector_add 16M vs torch.add", va16[3] / va16[4], 0.9),
                               ("matmul 1024 vs torch.matmul", mm[3] / mm[4], 0.5),
                               ("conv2d vs F.conv2d", cv[3] / cv[4], 0.5),
                               *((f"bias_gelu fwd+bwd {r[1]} vs eager", r[3] / r[4], 1.5) for r in fu)):
        print(f"  {what:40} {ratio:5.2f}x  (target >= {limit}x: {'met' if ratio >= limit else 'MISSED'})")
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("(matplotlib is not installed: no chart)")
        return
    Path(args.out).mkdir(parents=True, exist_ok=True)
    labels = [f"{r[0]}\n{r[1]}\nvs {r[2]}" for r in rows]
    fig, ax = plt.subplots(figsize=(11, 4.5))
    ax.bar(range(len(rows)), [r[3] / r[4] for r in rows], color="#3b7dd8")
    ax.axhline(1.0, color="grey", lw=1)
    ax.set_yscale("log")
    ax.set_xticks(range(len(rows)), labels, fontsize=7)
    ax.set_ylabel("speed-up of kload (x, log)")
    ax.set_title(f"kload kernels vs baselines ({os.cpu_count()} cores, torch {torch.__version__})")
    fig.tight_layout()
    path = Path(args.out) / "kernels.png"
    fig.savefig(path, dpi=120)
    print(f"chart: {path}")


if __name__ == "__main__":
    main()
