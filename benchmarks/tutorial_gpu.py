"""The tutorial's section 4.1 on a GPU, as written (examples/tutorial_my_ops_cuda.cu with
its .cpp bindings): it builds with the image's own compiler settings, matches a + b,
refuses bad inputs with a Python exception (each in a child process: a crash fails the
check, not the run), and an edit of the .cu runs its new code; the edit is timed.

    python benchmarks/tutorial_gpu.py        (part of benchmarks/gpu.sh)
"""
from __future__ import annotations

import multiprocessing as mp
import shutil
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def bad_call(args):
    import torch

    import kload

    src, case = args
    h = kload.load(str(src / "tutorial_my_ops_cuda.cpp"), str(src / "tutorial_my_ops_cuda.cu"), name="tut41")
    a = torch.ones(8, device="cuda")
    calls = {"int32": lambda: h.vector_add(a.int(), a.int()), "shape": lambda: h.vector_add(a, torch.ones(9, device="cuda")),
             "cpu+cuda": lambda: h.vector_add(a, a.cpu()), "too large": lambda: h.vector_add(*[torch.ones(1 << 20, device="cuda")] * 2)}
    try:
        calls[case]()
        torch.cuda.synchronize()
    except RuntimeError as e:
        return "RuntimeError: " + str(e).splitlines()[0]
    return "no error"


def main() -> int:
    import torch

    import kload

    work = Path(tempfile.mkdtemp(prefix="kload-tut41-"))
    for f in ("tutorial_my_ops_cuda.cpp", "tutorial_my_ops_cuda.cu"):
        shutil.copy(ROOT / "examples" / f, work / f)
    ok = True
    t = time.perf_counter()
    h = kload.load(str(work / "tutorial_my_ops_cuda.cpp"), str(work / "tutorial_my_ops_cuda.cu"), name="tut41")
    a, b = torch.randn(100_000, device="cuda"), torch.randn(100_000, device="cuda")
    ok &= torch.equal(h.vector_add(a, b), a + b)
    print(f"cold build + first call: {time.perf_counter() - t:.1f} s; matches a + b: {ok}")
    with mp.get_context("spawn").Pool(1) as pool:
        for case, msg in zip(("int32", "shape", "cpu+cuda", "too large"),
                             pool.map(bad_call, [(work, c) for c in ("int32", "shape", "cpu+cuda", "too large")])):
            print(f"  bad input {case}: {msg}")
            ok &= msg.startswith("RuntimeError")
    cu = work / "tutorial_my_ops_cuda.cu"
    cu.write_text(cu.read_text().replace("out[i] = a[i] + b[i];", "out[i] = a[i] + 2 * b[i];"))
    t = time.perf_counter()
    h.reload()
    got = h.vector_add(a, b)
    torch.cuda.synchronize()
    edit = time.perf_counter() - t
    new_ok = torch.allclose(got, a + 2 * b)
    print(f"edit of the .cu -> new result: {edit:.1f} s; new code runs: {new_ok}")
    ok &= new_ok
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
