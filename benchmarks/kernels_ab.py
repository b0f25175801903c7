"""The shipped CPU kernels of a revision against the working tree's, in one process, called
alternately (a change to their loops must not cost speed):

    python benchmarks/kernels_ab.py [--base HEAD~1] [--rounds 7]

Both trees' kernels are built with this environment's compiler (CXX) into a fresh cache, loaded
side by side (each its own namespace), checked to agree, then timed: forward and backward of
conv2d and bias_gelu, matmul, vector_add; per op the median of ``--rounds`` rounds, each the
median of alternating calls (benchmarks/kernels.py's bench_pair). Prints before, after, ratio.
"""
from __future__ import annotations

import argparse
import importlib
import os
import statistics
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--base", default="HEAD~1")
    ap.add_argument("--rounds", type=int, default=7)
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="kload-kab-"))
    os.environ["KLOAD_CACHE_DIR"] = str(work / "cache")
    sys.path.insert(0, str(HERE))
    from stable import old_kernels

    tree = old_kernels(args.base, work)
    init = tree / "kernels_before" / "__init__.py"  # its libraries named apart from the working tree's
    init.write_text(init.read_text().replace('name=f"kload_{op}"', 'name=f"kload_before_{op}"')
                    .replace("kload_kernels", "kload_kernels_before"))  # and its torch.library namespace
    sys.path.insert(0, str(tree))
    import torch

    from kernels import bench_pair
    from kload import kernels as after
    before = importlib.import_module("kernels_before")

    torch.manual_seed(0)
    x = torch.randn(8, 16, 32, 32, requires_grad=True)
    w = torch.randn(32, 16, 3, 3, requires_grad=True)
    xb, bb = torch.randn(256, 1024, requires_grad=True), torch.randn(1024, requires_grad=True)
    a, b = torch.randn(256, 256), torch.randn(256, 256)
    va, vb = torch.randn(1 << 20), torch.randn(1 << 20)

    def steps(k):
        def conv():
            x.grad = w.grad = None
            k.conv2d(x, w, padding=(1, 1)).sum().backward()

        def gelu():
            xb.grad = bb.grad = None
            k.bias_gelu(xb, bb).sum().backward()

        return {"conv2d fwd+bwd": conv, "bias_gelu fwd+bwd": gelu,
                "matmul 256^3": lambda: k.matmul(a, b), "vector_add 1M": lambda: k.vector_add(va, vb)}

    old, new = steps(before), steps(after)
    for name in old:  # the same answers first
        torch.testing.assert_close(before.matmul(a, b), after.matmul(a, b))
        old[name](), new[name]()
    print(f"kernels of {args.base} vs the working tree, CXX={os.environ.get('CXX', 'c++')}, torch "
          f"{torch.__version__}, {torch.get_num_threads()} threads; median of {args.rounds} rounds, ms")
    print(f"  {'op':<20} {'before':>9} {'after':>9} {'after/before':>13}")
    for name in old:
        pairs = [bench_pair(old[name], new[name], min_time=0.5) for _ in range(args.rounds)]
        t_old = statistics.median(p[0] for p in pairs) * 1e3
        t_new = statistics.median(p[1] for p in pairs) * 1e3
        print(f"  {name:<20} {t_old:9.3f} {t_new:9.3f} {t_new / t_old:12.2f}x")


if __name__ == "__main__":
    main()
