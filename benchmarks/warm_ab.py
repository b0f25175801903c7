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

    --edits N: also the edit loop (issue 43's bar: no slower than 0.2 s): in a fresh process
    per edit, the library loaded from the cache, one line of it edited, then
    ``handle.reload()`` and a call timed; the sides alternate, each with its precompiled
    <kload/kernel.h> ready (built once per side, not timed).
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


EDIT = """
import json, sys, time, torch
sys.path.insert(0, {pkg!r})
import kload
try:
    from kload.compile import pch_build
except ImportError:  # a revision before loader/ had folders
    from kload import pch_build
ops = kload.load({src!r}, reload=False)
ops.vector_add(torch.ones(4), torch.ones(4))
ready = pch_build.wait(900)
with open({src!r}, "a") as f:
    f.write("\\nstatic int kload_edit_{n}() {{ return {n}; }}\\n")
t = time.perf_counter()
changed = ops.reload()
ops.vector_add(torch.ones(4), torch.ones(4))
end = time.perf_counter()
print(json.dumps({{"s": end - t, "changed": changed, "pch_ready": ready,
                  "pch": ops.build().entry.manifest.get("pch")}}))
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
    ap.add_argument("--edits", type=int, default=0, help="timed edits a side (0: the warm hit only)")
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
    if args.edits:
        edit_loop(sides, work, args.base, args.edits)
    shutil.rmtree(work, ignore_errors=True)


def edit_loop(sides: dict[str, Path], work: Path, base: str, n: int) -> None:
    """One edit a fresh process, the sides alternating: reload() + the call after the edit."""
    times: dict[str, list[float]] = {s: [] for s in sides}
    srcs = {}
    for side, pkg in sides.items():
        srcs[side] = work / f"edit-{pkg.name}" / SRC.name
        srcs[side].parent.mkdir()
        shutil.copy(SRC, srcs[side])
    for i in range(n + 1):  # the first edit of each side also waits for its precompiled header: not timed
        for side, pkg in sides.items():
            env = dict(os.environ, KLOAD_CACHE_DIR=str(work / f"edit-cache-{pkg.name}"), KLOAD_VERBOSE="0")
            code = EDIT.format(pkg=str(pkg), src=str(srcs[side]), n=i)
            proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, cwd=pkg)
            if proc.returncode != 0:
                sys.exit(proc.stderr)
            got = json.loads(proc.stdout.strip().splitlines()[-1])
            assert got["changed"] and got["pch_ready"], got
            if i:
                assert any("used the precompiled" in v for v in got["pch"].values()), got["pch"]
                times[side].append(got["s"])
    print(f"edit loop, fresh process per edit: one line of {SRC.name} edited, reload() + call "
          f"({n} edits a side, alternating; precompiled kernel.h ready)")
    mid = statistics.median(times[base])
    for side, ts in times.items():
        print(f"  {side:<14} min {min(ts):6.2f} s  median {statistics.median(ts):6.2f} s  "
              f"{statistics.median(ts) - mid:+6.2f} s")


if __name__ == "__main__":
    main()
