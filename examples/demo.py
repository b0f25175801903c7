"""kload's main job: JIT-compile a shipped kernel on first use, run it, then show
a fresh process finding it in the cache.

    python examples/demo.py
"""
from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import torch

import kload

HERE = Path(__file__).resolve().parent

FRESH_PROCESS = f"""
import time, torch
t = time.perf_counter()
import kload
ops = kload.load({str(HERE / "vector_add.cpp")!r})
out = ops.vector_add(torch.ones(3), torch.ones(3))
print(f"fresh process: {{out.tolist()}} in {{(time.perf_counter() - t) * 1e3:.1f}} ms (import kload + cache hit + call)")
"""


def main() -> None:
    print(f"kload {kload.__version__}, torch {torch.__version__}, cache {kload.knobs.cache_dir()}")
    ops = kload.load(HERE / "vector_add.cpp")          # returns at once: nothing is compiled yet
    a, b = torch.arange(8.0), torch.full((8,), 0.5)
    t = time.perf_counter()
    c = ops.vector_add(a, b)                           # first use: compile, or find in the cache
    first = time.perf_counter() - t
    how = ops.build().how                              # the artifact's path, and how it was found
    print(f"first use ({'compiled' if how == 'built' else 'cache hit'}) in {first:.2f} s: {c.tolist()}")
    assert torch.equal(c, a + b)

    print("fresh process:", end=" ", flush=True)
    out = subprocess.run([sys.executable, "-c", FRESH_PROCESS], capture_output=True, text=True, check=True)
    print(out.stdout.strip().removeprefix("fresh process: "))

    live_edit(a, b)

    from kload import kernels  # the shipped kernels: each compiles on its first call

    x, w, m = torch.randn(2, 3, 16, 16), torch.randn(4, 3, 3, 3), torch.randn(100, 64)
    for name, call, want in (
        ("matmul", lambda: kernels.matmul(m, m.t()), m @ m.t()),
        ("conv2d", lambda: kernels.conv2d(x, w, padding=1), torch.nn.functional.conv2d(x, w, padding=1)),
        ("bias_gelu", lambda: kernels.bias_gelu(x, torch.zeros(16)), torch.nn.functional.gelu(x)),
    ):
        t = time.perf_counter()
        got = call()
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
        print(f"kload.kernels.{name}: {tuple(got.shape)} matches torch, first call {time.perf_counter() - t:.2f} s")

    ext = kload.load(HERE / "tutorial_my_ops.cpp")    # the tutorial's pybind11 code, as written
    t = time.perf_counter()
    d = ext.vector_add(a, b)
    print(f"tutorial extension (pybind11, torch/extension.h) ready in {time.perf_counter() - t:.2f} s: "
          f"{d.tolist()}")
    assert torch.equal(d, a + b)


def live_edit(a, b) -> None:
    """An edit of a watched source, timed until the call returns the new result:
    with <kload/kernel.h> precompiled (built in the background since the first
    compile above), the edit compiles one translation unit against it."""
    import shutil
    import tempfile

    from kload.compile import pch_build

    t = time.perf_counter()
    pch_build.wait(timeout=600)  # the background build of <kload/kernel.h> the first compile started
    print(f"precompiled <kload/kernel.h> ready ({time.perf_counter() - t:.1f} s more wait)")
    src = Path(tempfile.mkdtemp(prefix="kload-demo-")) / "vector_add.cpp"
    shutil.copy(HERE / "vector_add.cpp", src)
    ops = kload.load(src, reload=True)
    ops.vector_add(a, b)
    src.write_text(src.read_text().replace("return a.add(b);", "return a + b * 2;"))  # an edit, saved
    t = time.perf_counter()
    while not torch.equal(out := ops.vector_add(a, b), a + b * 2):
        time.sleep(0.01)
    note = next(iter((ops.build().entry.manifest.get("pch") or {}).values()), "")
    print(f"edit -> new result in {time.perf_counter() - t:.2f} s: {out.tolist()} ({note})")
    shutil.rmtree(src.parent, ignore_errors=True)


if __name__ == "__main__":
    main()
