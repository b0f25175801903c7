"""The shipped kernels on a GPU against torch and against their first versions, with
issue 28's targets: one table (a target column, PASS or MISSED per row), the device's
copy bandwidth measured in the same run, and a picture of achieved bandwidth and
FLOP/s against that copy bandwidth and torch's matmul (benchmarks/out/gpu.png, when
matplotlib is importable).

    python benchmarks/gpu.py [--out benchmarks/out] [--quick]

Each row times torch, the fast kernels (the default) and the simple ones
(KLOAD_KERNELS_IMPL=simple, read by the launchers at each call), with CUDA events
(median of the repeats), and checks the fast kernels' result against torch's once.
A row that fails says so and the run goes on; the exit status is 1 when a row
failed or a result was wrong (a MISSED target is not a failure).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import traceback
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F

from common import cuda_device, event_seconds
from kload import kernels


def cuda_time(fn, repeat: int = 50, warmup: int = 5) -> float:
    """Median seconds of fn() on the current stream (CUDA events)."""
    for _ in range(warmup):
        fn()
    times = sorted(event_seconds(fn) for _ in range(repeat))
    return times[len(times) // 2]


class simple_kernels:
    """KLOAD_KERNELS_IMPL=simple for the body: the first, one-thread-per-element kernels."""

    def __enter__(self):
        self.saved = os.environ.get("KLOAD_KERNELS_IMPL")
        os.environ["KLOAD_KERNELS_IMPL"] = "simple"

    def __exit__(self, *exc):
        if self.saved is None:
            os.environ.pop("KLOAD_KERNELS_IMPL", None)
        else:
            os.environ["KLOAD_KERNELS_IMPL"] = self.saved


@dataclass
class Row:
    op: str
    kind: str                   # "bytes" (memory-bound: work is bytes) or "flops"
    work: float                 # bytes or FLOPs per call
    target: str                 # what the issue asks, in words
    t_torch: float = math.nan   # seconds
    t_fast: float = math.nan
    t_simple: float = math.nan
    check: str = ""             # "ok", "WRONG: ...", or "error: ..."
    verdict: str = ""           # PASS, MISSED, n/a, or ERROR
    note: str = ""
    extra: dict = field(default_factory=dict)


def compare(got, want, rtol, atol) -> str:
    try:
        torch.testing.assert_close(got, want, rtol=rtol, atol=atol, equal_nan=True)
        return "ok"
    except AssertionError as e:
        return "WRONG: " + str(e).splitlines()[0][:80]


def run_row(row: Row, torch_fn, fast_fn, check_fn, judge, repeat: int) -> Row:
    """Times torch, fast and simple; checks; judges. Never raises."""
    try:
        row.check = check_fn()
        row.t_torch = cuda_time(torch_fn, repeat)
        row.t_fast = cuda_time(fast_fn, repeat)
        with simple_kernels():
            row.t_simple = cuda_time(fast_fn, max(3, repeat // 5), warmup=1)
        passed = judge(row)
        row.verdict = "n/a" if passed is None else ("PASS" if passed else "MISSED")
    except Exception as e:  # noqa: BLE001 - a failing row is reported, the run goes on
        row.verdict = "ERROR"
        row.check = row.check or f"error: {type(e).__name__}: {str(e).splitlines()[0][:100] if str(e) else ''}"
        traceback.print_exc()
    return row


def rate(row: Row, t: float) -> str:
    if not t or math.isnan(t):
        return "-"
    return f"{row.work / t / 1e9:.0f} GB/s" if row.kind == "bytes" else f"{row.work / t / 1e12:.1f} TFLOP/s"


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=str(Path(__file__).resolve().parent / "out"))
    parser.add_argument("--quick", action="store_true", help="fewer repeats")
    args = parser.parse_args()
    dev = cuda_device("gpu.py")
    if dev is None:
        return 1
    rep = 10 if args.quick else 50
    rep_mm = 5 if args.quick else 20
    torch.manual_seed(0)
    rows: list[Row] = []

    # -- the device's copy bandwidth: read + write of 64M fp32 (256 MB each way, past L2)
    n = 64 * 1024 * 1024
    src = torch.randn(n, device="cuda")
    dst = torch.empty_like(src)
    t_copy = cuda_time(lambda: dst.copy_(src), rep)
    copy_bw = 2 * 4 * n / t_copy
    print(f"device-to-device copy: {copy_bw / 1e9:.0f} GB/s ({t_copy * 1e3:.3f} ms for 2 x 256 MB)")

    # -- vector_add: >= 90% of the copy bandwidth and >= 0.95x torch.add
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        a, b = torch.randn(n, device="cuda", dtype=dtype), torch.randn(n, device="cuda", dtype=dtype)
        es = a.element_size()
        row = Row(f"vector_add 64M {str(dtype)[6:]}", "bytes", 3 * es * n, ">= 90% of copy BW, >= 0.95x torch")

        def judge(r: Row) -> bool:
            r.note = f"{r.work / r.t_fast / copy_bw:.0%} of copy"
            return r.work / r.t_fast >= 0.9 * copy_bw and r.t_torch / r.t_fast >= 0.95

        rows.append(run_row(row, lambda: torch.add(a, b), lambda: kernels.vector_add(a, b),
                            lambda: compare(kernels.vector_add(a, b), a + b, 0, 0), judge, rep))

    # -- matmul: bf16/fp16 >= 50% of torch at 4096^3, >= 30% at 1024^3; fp32 (no TF32) >= 35%
    def mm_row(m: int, dtype, tf32: bool, need: float | None) -> Row:
        x, y = torch.randn(m, m, device="cuda", dtype=dtype), torch.randn(m, m, device="cuda", dtype=dtype)
        label = f"matmul {m}^3 {str(dtype)[6:]}" + (" tf32" if dtype == torch.float32 and tf32 else "")
        row = Row(label, "flops", 2.0 * m ** 3, f">= {need:.2f}x torch" if need else "none set (TF32: info)")
        saved = torch.backends.cuda.matmul.allow_tf32

        def torch_mm():
            return x @ y

        def check() -> str:
            want = (x.double() @ y.double())
            tol = {torch.float16: 2e-3, torch.bfloat16: 1.6e-2}.get(dtype, 5e-3 if tf32 else 2e-5)
            return compare(kernels.matmul(x, y, tf32).double(), want, tol, tol * m ** 0.5)

        try:
            torch.backends.cuda.matmul.allow_tf32 = tf32  # torch under the same rule as kload
            return run_row(row, torch_mm, lambda: kernels.matmul(x, y, tf32), check,
                           lambda r: None if need is None else r.t_torch / r.t_fast >= need, rep_mm)
        finally:
            torch.backends.cuda.matmul.allow_tf32 = saved

    for m, dtype, tf32, need in [(4096, torch.bfloat16, False, 0.5), (1024, torch.bfloat16, False, 0.3),
                                 (4096, torch.float16, False, 0.5), (1024, torch.float16, False, 0.3),
                                 (4096, torch.float32, False, 0.35), (4096, torch.float32, True, None)]:
        rows.append(mm_row(m, dtype, tf32, need))
        torch.cuda.empty_cache()

    # -- conv2d 8x64x56x56, 3x3, padding 1: bf16/fp16 >= 0.3x cuDNN; fp32 as fast as before or faster
    def judge_half(r: Row) -> bool:
        return r.t_torch / r.t_fast >= 0.3

    def judge_fp32(r: Row) -> bool:
        return r.t_simple / r.t_fast >= 0.95

    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        xc = torch.randn(8, 64, 56, 56, device="cuda", dtype=dtype)
        wc = torch.randn(64, 64, 3, 3, device="cuda", dtype=dtype)
        bc = torch.randn(64, device="cuda", dtype=dtype)
        flops = 2.0 * 8 * 64 * 56 * 56 * 64 * 9
        fp32 = dtype == torch.float32
        row = Row(f"conv2d 8x64x56x56 3x3 {str(dtype)[6:]}", "flops", flops,
                  ">= 0.95x the simple kernel" if fp32 else ">= 0.30x cuDNN")
        if fp32:
            row.note = "fp32: direct kernel (torch: cuDNN, TF32 allowed by default)"

        def check(xc=xc, wc=wc, bc=bc, dtype=dtype) -> str:
            want = F.conv2d(xc.double(), wc.double(), bc.double(), 1, 1)
            tol = {torch.float16: 2e-3, torch.bfloat16: 1.6e-2, torch.float32: 1e-5}[dtype]
            return compare(kernels.conv2d(xc, wc, bc, 1, 1).double(), want, tol, tol * 24)

        rows.append(run_row(row, lambda xc=xc, wc=wc, bc=bc: F.conv2d(xc, wc, bc, 1, 1),
                            lambda xc=xc, wc=wc, bc=bc: kernels.conv2d(xc, wc, bc, 1, 1), check,
                            judge_fp32 if fp32 else judge_half, rep))

    # -- bias_gelu forward + backward, [8192, 4096]: >= 1.3x torch eager, fp32 and bf16
    for dtype in (torch.float32, torch.bfloat16):
        xg = torch.randn(8192, 4096, device="cuda", dtype=dtype, requires_grad=True)
        bg = torch.randn(4096, device="cuda", dtype=dtype, requires_grad=True)
        g = torch.randn(8192, 4096, device="cuda", dtype=dtype)
        es = xg.element_size()
        # the least traffic: forward reads x, writes y; backward reads grad and x, writes grad_x
        row = Row(f"bias_gelu fwd+bwd {str(dtype)[6:]}", "bytes", 5.0 * es * xg.numel(), ">= 1.30x torch eager")

        def fwd_bwd(op, xg=xg, bg=bg, g=g):
            y = op(xg, bg)
            return torch.autograd.grad(y, (xg, bg), g)  # no .grad accumulation in the timing

        def check(xg=xg, bg=bg, g=g, dtype=dtype) -> str:
            gx, gb = fwd_bwd(kernels.bias_gelu)
            ex, eb = fwd_bwd(lambda x, b: F.gelu(x + b))
            tol = 1e-5 if dtype == torch.float32 else 8e-3
            return compare((gx, gb), (ex, eb), tol, tol * 100)

        rows.append(run_row(row, lambda: fwd_bwd(lambda x, b: F.gelu(x + b)), lambda: fwd_bwd(kernels.bias_gelu),
                            check, lambda r: r.t_torch / r.t_fast >= 1.3, rep))

    # -- the table
    head = (f"{'op':34} {'torch ms':>9} {'kload ms':>9} {'simple ms':>10} {'kload/torch':>11} "
            f"{'fast/simple':>11}  {'kload rate':>14}  {'target':36} {'result':7} check")
    print()
    print(head)
    print("-" * len(head))
    md = ["| op | torch ms | kload ms | simple ms | kload / torch speed | fast / simple | kload rate | target | "
          "result | check |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        sp = r.t_torch / r.t_fast if r.t_fast else math.nan
        fs = r.t_simple / r.t_fast if r.t_fast else math.nan
        note = f"  ({r.note})" if r.note else ""
        print(f"{r.op:34} {r.t_torch * 1e3:9.3f} {r.t_fast * 1e3:9.3f} {r.t_simple * 1e3:10.3f} {sp:10.2f}x "
              f"{fs:10.2f}x  {rate(r, r.t_fast):>14}  {r.target:36} {r.verdict:7} {r.check}{note}")
        md.append(f"| {r.op} | {r.t_torch * 1e3:.3f} | {r.t_fast * 1e3:.3f} | {r.t_simple * 1e3:.3f} | {sp:.2f}x | "
                  f"{fs:.2f}x | {rate(r, r.t_fast)} | {r.target} | {r.verdict} | {r.check}{note} |")
    print(f"\ncopy bandwidth measured in this run: {copy_bw / 1e9:.0f} GB/s")
    passed = sum(r.verdict == "PASS" for r in rows)
    judged = sum(r.verdict in ("PASS", "MISSED") for r in rows)
    print(f"targets: {passed} of {judged} met")

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    header = (f"{dev}, torch {torch.__version__}, CUDA {torch.version.cuda}; copy bandwidth "
              f"{copy_bw / 1e9:.0f} GB/s; CUDA events, median")
    (out / "gpu.md").write_text(header + "\n\n" + "\n".join(md) + "\n")
    (out / "gpu.json").write_text(json.dumps({"device": dev, "torch": torch.__version__, "copy_bw": copy_bw,
                                              "rows": [asdict(r) for r in rows]}, indent=1))
    print(f"wrote {out / 'gpu.md'} and {out / 'gpu.json'}")
    picture(rows, copy_bw, out / "gpu.png")
    failed = [r.op for r in rows if r.verdict == "ERROR" or r.check.startswith("WRONG")]
    if failed:
        print(f"gpu.py: failed or wrong: {', '.join(failed)}")
    return 1 if failed else 0


def picture(rows: list[Row], copy_bw: float, path: Path) -> None:
    """Achieved bandwidth (memory-bound rows) and FLOP/s (the others) of torch, the fast
    and the simple kernels, against the measured copy bandwidth and torch's matmul."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("gpu.py: matplotlib is not importable here: no picture")
        return
    fig, axes = plt.subplots(1, 2, figsize=(15, 5.5))
    for ax, kind, unit, scale in ((axes[0], "bytes", "GB/s", 1e9), (axes[1], "flops", "TFLOP/s", 1e12)):
        sel = [r for r in rows if r.kind == kind]
        xs = range(len(sel))
        for k, (label, attr) in enumerate((("torch", "t_torch"), ("kload", "t_fast"), ("kload simple", "t_simple"))):
            ys = [r.work / getattr(r, attr) / scale if getattr(r, attr) else 0 for r in sel]
            ax.bar([x + (k - 1) * 0.27 for x in xs], ys, width=0.27, label=label)
        if kind == "bytes":
            ax.axhline(copy_bw / scale, color="k", linestyle="--", label=f"copy {copy_bw / 1e9:.0f} GB/s")
        else:
            roof = [r for r in sel if r.op.startswith("matmul 4096^3 bf16") and r.t_torch]
            if roof:
                ax.axhline(roof[0].work / roof[0].t_torch / scale, color="k", linestyle="--",
                           label="torch matmul 4096^3 bf16")
            ax.set_yscale("log")
        ax.set_xticks(list(xs))
        ax.set_xticklabels([r.op for r in sel], rotation=30, ha="right", fontsize=8)
        ax.set_ylabel(unit)
        ax.legend(fontsize=8)
    axes[0].set_title("memory-bound: achieved bandwidth (least bytes / time)")
    axes[1].set_title("compute-bound: achieved FLOP/s")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"wrote {path}")


if __name__ == "__main__":
    sys.exit(main())
