"""The warm path of two kload revisions side by side, in one run: a restructure must
not make a cache hit slower or import more.

    python benchmarks/warm_ab.py [--base REV] [--repeat N]     (default: HEAD against the working tree)

Each side is the package as that revision has it (``git archive REV``; the working
tree as it is), put together the way an install lays it out (``kload/`` = loader/,
with cache/ and kernels/ inside), with a cache of its own. Each side builds
examples/vector_add.cpp once (not timed) and once more to write its hit record; then
fresh interpreters alternate between the sides, each timing ``import kload`` +
``kload.load`` + the first op call (after ``import torch``), and reporting which kload
modules it imported.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SRC = ROOT / "examples" / "vector_add.cpp"

RUN = """
import json, sys, time, torch
sys.path.insert(0, {pkg!r})
t = time.perf_counter()
import kload
ops = kload.load({src!r}, reload=False)
ops.vector_add(torch.ones(4), torch.ones(4))
end = time.perf_counter()
print(json.dumps({{"s": end - t, "how": kload.HISTORY[-1]["how"], "file": kload.__file__,
                  "modules": sorted(m for m in sys.modules if m == "kload" or m.startswith("kload."))}}))
"""


def lay_out(tree: Path, dest: Path) -> Path:
    """``dest/kload`` as an install has it: loader/'s modules, cache/ and kernels/ inside."""
    pkg = dest / "kload"
    shutil.copytree(tree / "loader", pkg, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copytree(tree / "cache", pkg / "cache", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copytree(tree / "kernels", pkg / "kernels", ignore=shutil.ignore_patterns("__pycache__"))
    return dest


def run(pkg: Path, cache: Path) -> dict:
    env = dict(os.environ, KLOAD_CACHE_DIR=str(cache), KLOAD_PCH="0", KLOAD_VERBOSE="0")
    proc = subprocess.run([sys.executable, "-c", RUN.format(pkg=str(pkg), src=str(SRC))], env=env,
                          capture_output=True, text=True, cwd=pkg)
    if proc.returncode != 0:
        sys.exit(proc.stderr)
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--base", default="HEAD", help="the revision to compare the working tree with")
    ap.add_argument("--repeat", type=int, default=15)
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="kload-warm-ab-"))
    base_tree = work / "base-tree"
    base_tree.mkdir()
    archive = subprocess.run(["git", "archive", args.base, "loader", "cache", "kernels"], cwd=ROOT,
                             capture_output=True, check=True).stdout
    tar = work / "base.tar"
    tar.write_bytes(archive)
    with tarfile.open(tar) as tf:
        tf.extractall(base_tree, filter="data")
    sides = {args.base: lay_out(base_tree, work / "base"), "working tree": lay_out(ROOT, work / "new")}
    times: dict[str, list[float]] = {s: [] for s in sides}
    mods = {}
    for side, pkg in sides.items():
        for _ in range(2):  # the build, then the full lookup that writes the hit record
            first = run(pkg, work / f"cache-{pkg.name}")
        assert first["file"].startswith(str(pkg)), first["file"]
    for _ in range(args.repeat):
        for side, pkg in sides.items():
            got = run(pkg, work / f"cache-{pkg.name}")
            assert got["how"] == "cache", got
            times[side].append(got["s"] * 1e3)
            mods[side] = got["modules"]
    print(f"warm hit, fresh process: import kload + load + first call ({args.repeat} runs a side, alternating)")
    base = statistics.median(times[args.base])
    for side, ts in times.items():
        print(f"  {side:<14} min {min(ts):7.1f} ms  median {statistics.median(ts):7.1f} ms  "
              f"{statistics.median(ts) / base:5.2f}x   {len(mods[side])} kload modules")
    for side, m in mods.items():
        print(f"  {side} imports: {' '.join(m)}")
    shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
