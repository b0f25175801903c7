"""Per call: an op registered through torch's stable C shim (a first build's
<kload/register.h>) against the same op registered by torch::Library (KLOAD_TRIM=0).

    python benchmarks/registration.py [--repeat 3]

Both sides build examples/vector_add.cpp once into their own cache (KLOAD_PCH=0, so
every build is a first build), then each repeat times 20,000 calls of the op on 4
floats in a fresh process, min of 5 timeit runs; sides alternate."""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CODE = r'''
import sys, timeit, torch, kload
op = kload.load(sys.argv[1], name=sys.argv[2]).vector_add
a, b = torch.ones(4), torch.ones(4)
op(a, b)
print(min(timeit.repeat(lambda: op(a, b), number=20000, repeat=5)) / 20000 * 1e6)
'''


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    sides = {"C shim": {}, "torch/library.h": {"KLOAD_TRIM": "0"}}
    res: dict[str, list[float]] = {s: [] for s in sides}
    with tempfile.TemporaryDirectory() as tmp:
        for _ in range(args.repeat):
            for i, (side, env) in enumerate(sides.items()):
                e = dict(os.environ, KLOAD_CACHE_DIR=f"{tmp}/cache{i}", KLOAD_PCH="0", **env)
                out = subprocess.run([sys.executable, "-c", CODE, str(ROOT / "examples" / "vector_add.cpp"),
                                      f"reg_bench_{i}"], env=e, capture_output=True, text=True, check=True)
                res[side].append(float(out.stdout.split()[-1]))
    for side, v in res.items():
        s = sorted(v)
        print(f"{side:16s} per call, 4 floats: min {s[0]:.2f} us, median {s[len(s) // 2]:.2f} us")
    print(f"C shim / torch/library.h, min: {min(res['C shim']) / min(res['torch/library.h']):.2f}x")


if __name__ == "__main__":
    main()
