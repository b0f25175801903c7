"""kload vs torch.utils.cpp_extension.load on the tutorial's vector_add, in one run.

    python benchmarks/loader.py [--repeat N]

Every timing is taken in a fresh interpreter, from just after ``import torch`` to
the first result of the op (or, for the per-call figure, in-process with timeit).
torch builds the tutorial's pybind11 code (examples/tutorial_my_ops.cpp, with the
CHECK_INPUT definition torch needs and kload supplies); kload its op-library
version (examples/vector_add.cpp).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

from common import wait_quiet

ROOT = Path(__file__).resolve().parent.parent
TUTORIAL = ROOT / "examples" / "tutorial_my_ops.cpp"
OPLIB = ROOT / "examples" / "vector_add.cpp"

TORCH_RUN = """
    import time, json, torch
    t = time.perf_counter()
    from torch.utils.cpp_extension import load
    m = load("my_ops", [{src!r}], build_directory={build!r})
    m.vector_add(torch.ones(4), torch.ones(4))
    print(json.dumps(time.perf_counter() - t))
"""
KLOAD_RUN = """
    import time, json, torch
    t = time.perf_counter()
    import kload
    t_load = time.perf_counter()
    ops = kload.load({src!r})
    ops.vector_add(torch.ones(4), torch.ones(4))
    end = time.perf_counter()
    print(json.dumps([end - t, end - t_load]))
"""
BARE_RUN = """
    import ctypes, time, json, torch
    t = time.perf_counter()
    torch.ops.load_library({so!r})
    ctypes.CDLL({so!r}).kload_register()  # a kload op library registers when asked (kernel.h), not on opening
    getattr(torch.ops, {ns!r}).vector_add(torch.ones(4), torch.ones(4))
    print(json.dumps(time.perf_counter() - t))
"""
PER_CALL = """
    import json, timeit, torch, kload
    ops = kload.load({src!r})
    a, b = torch.ones(4), torch.ones(4)
    direct = getattr(torch.ops, ops.namespace).vector_add
    ops.vector_add(a, b)
    def best(stmt):
        return min(timeit.repeat(stmt, number=20000, repeat=7, globals=dict(ops=ops, direct=direct, a=a, b=b))) / 20000
    print(json.dumps({{"handle": best("ops.vector_add(a, b)"), "direct": best("direct(a, b)"),
                      "namespace": ops.namespace, "so": ops.build()}}))
"""


def run(code: str, env: dict) -> object:
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                          env=env, timeout=900)
    if proc.returncode != 0:
        sys.exit(f"benchmark step failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _list(xs) -> str:
    return ", ".join(f"{x:.1f}" for x in xs) + " s"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=5, help="fresh processes per warm measurement")
    ap.add_argument("--cold-repeat", type=int, default=3, help="cold builds of each (the machine is noisy)")
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="kload-bench-"))
    env = dict(os.environ, KLOAD_CACHE_DIR=str(work / "kload-cache"), TORCH_EXTENSIONS_DIR=str(work / "torch-ext"),
               MAX_JOBS=os.environ.get("MAX_JOBS", "2"), KLOAD_VERBOSE="0",
               TORCH_NO_COMPILER_WRAPPER="1")  # torch would put ccache in front of its own builds
    # torch's modules were byte-compiled when pip installed them; let kload's be too
    # (an editable install under PYTHONDONTWRITEBYTECODE would re-parse them every run)
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    torch_build = str(work / "torch-build")
    try:
        for_torch = work / "my_ops.cpp"
        for_torch.write_text('#include <torch/extension.h>\n'
                             '#define CHECK_INPUT(x) TORCH_CHECK((x).is_contiguous(), #x " must be contiguous")\n'
                             + TUTORIAL.read_text())
        t_code = TORCH_RUN.format(src=str(for_torch), build=torch_build)
        k_code = KLOAD_RUN.format(src=str(OPLIB))
        print(f"cold builds (empty caches, {args.cold_repeat} each, alternating; each after the machine is quiet, "
              "so no background precompile of the last one shares the cores) ...", flush=True)
        colds_torch, colds_kload, colds_whole = [], [], []
        whole_env = dict(env, KLOAD_TRIM="0")  # kload's cold build with ATen's whole API (before trim.py)
        for i in range(args.cold_repeat):
            for d in (torch_build, env["KLOAD_CACHE_DIR"]):
                shutil.rmtree(d, ignore_errors=True)
            os.makedirs(torch_build)
            wait_quiet()
            colds_torch.append(run(t_code, env))
            wait_quiet()
            colds_kload.append(run(k_code, env)[0])
            wait_quiet()
            shutil.rmtree(env["KLOAD_CACHE_DIR"], ignore_errors=True)
            colds_whole.append(run(k_code, whole_env)[0])
        wait_quiet()
        shutil.rmtree(env["KLOAD_CACHE_DIR"], ignore_errors=True)
        started = time.perf_counter()  # what a precompile at install or import would have to finish first
        subprocess.run([sys.executable, "-m", "kload", "build", "--pch"], env=env, check=True, capture_output=True)
        pch_seconds = time.perf_counter() - started
        shutil.rmtree(env["KLOAD_CACHE_DIR"], ignore_errors=True)
        print(f"  torch {_list(colds_torch)}; kload {_list(colds_kload)}; kload, whole ATen {_list(colds_whole)}; "
              f"`kload build --pch` {pch_seconds:.1f} s")
        cold_torch, cold_kload = statistics.median(colds_torch), statistics.median(colds_kload)
        cold_whole = statistics.median(colds_whole)
        calls = run(PER_CALL.format(src=str(OPLIB)), env)
        b_code = BARE_RUN.format(so=calls["so"], ns=calls["namespace"])
        print(f"warm loads ({args.repeat} fresh processes each) ...", flush=True)
        warm_torch = statistics.median(run(t_code, env) for _ in range(args.repeat))
        warm = [run(k_code, env) for _ in range(args.repeat)]
        warm_kload = statistics.median(w[0] for w in warm)        # import kload + load + first call
        warm_kload_load = statistics.median(w[1] for w in warm)   # load + first call
        warm_bare = statistics.median(run(b_code, env) for _ in range(args.repeat))
    finally:
        shutil.rmtree(work, ignore_errors=True)

    import torch

    rows = [
        ("cold first use", cold_torch, cold_kload, cold_kload / cold_torch, "<= 0.25x torch"),
        ("  (kload with ATen's whole API, KLOAD_TRIM=0)", cold_torch, cold_whole, cold_whole / cold_torch, "(info)"),
        ("  (`kload build --pch` alone, as at install)", cold_torch, pch_seconds, pch_seconds / cold_torch, "(info)"),
        ("warm first use (fresh process)", warm_torch, warm_kload, warm_kload / warm_torch, "<= 0.35x torch"),
        ("warm: import kload+load+call vs bare", warm_bare, warm_kload, warm_kload / warm_bare, "<= 1.5x bare"),
        ("  (the same without `import kload`)", warm_bare, warm_kload_load, warm_kload_load / warm_bare, "(info)"),
        ("per call, 4 floats: handle vs torch.ops", calls["direct"], calls["handle"],
         calls["handle"] / calls["direct"], "<= 1.3x direct"),
    ]
    print(f"\nmachine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
          f"torch {torch.__version__}, python {platform.python_version()}, MAX_JOBS={env['MAX_JOBS']}")
    print("warm first use and the floor comparison both time `import kload` (the clock starts after import torch)")
    print(f"{'measurement':46} {'baseline':>12} {'kload':>12} {'ratio':>7}  target")
    for what, base, mine, ratio, target in rows:
        unit = ((lambda s: f"{s * 1e6:9.2f} us") if base < 1e-3 else
                (lambda s: f"{s * 1e3:9.2f} ms") if base < 1 else (lambda s: f"{s:10.3f} s"))
        if target == "(info)":
            print(f"{what:46} {unit(base):>12} {unit(mine):>12} {ratio:6.2f}x")
            continue
        limit = float(target.split()[1].rstrip("x"))
        verdict = "met" if ratio <= limit else "MISSED"
        print(f"{what:46} {unit(base):>12} {unit(mine):>12} {ratio:6.2f}x  {target} ({verdict})")


if __name__ == "__main__":
    main()
