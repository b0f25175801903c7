"""Live editing, measured in one run: how long an edit takes to run.

    python benchmarks/live.py [--repeat N]
    .venv-next/bin/python benchmarks/live.py --cuda [--repeat N]     (the CUDA rows: live_cuda.py)

Edit-to-new-result: a one-line change is saved to a source that a live handle
watches (reload on save), and the clock runs until a call returns the new value.
Each row runs in a fresh interpreter with the library already built once, and
the edits alternate between rows (a slow spell of this shared machine hits all
of them). Rows: an op library with the lean header of before (KLOAD_LEAN), with
the full ATen API and no precompiled header (KLOAD_PCH=0), and with one; the
tutorial's classic pybind11 style without and with one; the same classic edit
through torch.utils.cpp_extension.load; and two peers on their own styles:
cppimport (a pybind11 .cpp) and apache-tvm-ffi's load_inline. Peak memory is the
largest compiler process of an edit's build (RUSAGE_CHILDREN).

Then the ratios the targets name, each timed in this run: the PCH'd compile of
the op TU against a plain g++ compile of it with no PCH, and a first build with
no PCH yet (which starts one in the background) against the same build with
KLOAD_PCH=0 (each in a fresh cache). The %%kload cell re-run and the watched
handle's per-call cost close the table.
"""
from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common import _wait_background, magic_rerun, py, watched_call

ROOT = Path(__file__).resolve().parent.parent

OP_FULL = """#include <kload/kernel.h>
at::Tensor bump(const at::Tensor& x) { return x * 2 + VALUE; }
KLOAD_LIBRARY(m) { m.def("bump(Tensor x) -> Tensor"); }
KLOAD_IMPL(CPU, m) { m.impl("bump", &bump); }
"""
OP_STABLE = """#include <kload/stable.h>
kload::Tensor bump(const kload::Tensor& x) {
  kload::Tensor out = torch::stable::empty_like(x);
  for (int64_t i = 0; i < x.numel(); ++i) out.mutable_data_ptr<float>()[i] = x.const_data_ptr<float>()[i] * 2 + VALUE;
  return out;
}
KLOAD_LIBRARY(m) { m.def("bump(Tensor x) -> Tensor"); }
KLOAD_IMPL(CPU, m) { m.impl("bump", TORCH_BOX(&bump)); }
"""
OP_LEAN = "#define KLOAD_LEAN\n" + OP_FULL.replace("x * 2 + VALUE", "x.mul(2).add(VALUE)")
CLASSIC = """#include <torch/extension.h>
torch::Tensor bump(torch::Tensor x) { CHECK_INPUT(x); return x * 2 + VALUE; }
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def("bump", &bump); }
"""
CPPIMPORT = """// cppimport
#include <pybind11/pybind11.h>
double bump(double x) { return x * 2 + VALUE; }
PYBIND11_MODULE(MODNAME, m) { m.def("bump", &bump); }
/*
<%
setup_pybind11(cfg)
%>
*/
"""
TVM_FFI = """#include <tvm/ffi/container/tensor.h>
#include <tvm/ffi/function.h>
void bump(tvm::ffi::TensorView x, tvm::ffi::TensorView y) {
  const float* px = static_cast<const float*>(x.data_ptr());
  float* py = static_cast<float*>(y.data_ptr());
  for (int64_t i = 0; i < x.numel(); ++i) py[i] = px[i] * 2 + VALUE;
}
"""

# One interpreter per row: build (or hit), then `edits` timed edits of VALUE.
KLOAD_ROW = """
import json, resource, time, torch, kload
from pathlib import Path
src = Path({src!r})
h = kload.load(src, name={name!r}, reload=True)
x = torch.ones(1)
h.bump(x)
out = []
for value in {values!r}:
    src.write_text({text!r}.replace("VALUE", str(value)))
    t = time.perf_counter()
    while True:
        try:
            if h.bump(x).item() == 2 + value:
                break
        except Exception:
            pass
        time.sleep(0.005)
    out.append(time.perf_counter() - t)
notes = h.build().entry.manifest.get("pch") or {{}}
print(json.dumps({{"times": out, "peak": resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024,
                  "pch": list(notes.values())}}))
"""
TORCH_ROW = """
import json, resource, time, torch
from pathlib import Path
from torch.utils.cpp_extension import load
src = Path({src!r})
flags = ["-include", {checks!r}]  # the CHECK_INPUT that kload supplies, for torch too
m = load({name!r}, [str(src)], build_directory={build!r}, extra_cflags=flags)
x = torch.ones(1)
m.bump(x)
out = []
for value in {values!r}:
    src.write_text({text!r}.replace("VALUE", str(value)))
    t = time.perf_counter()
    m = load({name!r}, [str(src)], build_directory={build!r}, extra_cflags=flags)
    assert m.bump(x).item() == 2 + value
    out.append(time.perf_counter() - t)
print(json.dumps({{"times": out, "peak": resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024}}))
"""
TORCH_PCH_ROW = """
import json, resource, time, torch
from torch.utils.cpp_extension import load_inline, remove_extension_h_precompiler_headers
text = {text!r}  # load_inline puts #include <torch/extension.h> first, where its precompiled file applies
m = load_inline({name!r}, [text.replace("VALUE", "0")], build_directory={build!r}, use_pch=True)  # + the .gch
x = torch.ones(1)
m.bump(x)
out = []
for value in {values!r}:
    t = time.perf_counter()
    m = load_inline({name!r}, [text.replace("VALUE", str(value))], build_directory={build!r}, use_pch=True)
    assert m.bump(x).item() == 2 + value
    out.append(time.perf_counter() - t)
remove_extension_h_precompiler_headers()  # torch's .gch would serve the other rows' compiles of torch/extension.h
print(json.dumps({{"times": out, "peak": resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024}}))
"""
CPPIMPORT_ROW = """
import json, resource, sys, time
from pathlib import Path
import cppimport
src = Path({src!r})
out = []
for i, value in enumerate([None] + {values!r}):
    name = f"bump_{{i}}"   # Python cannot import an extension twice under one name
    text = {text!r}.replace("VALUE", str(value or 0)).replace("MODNAME", name)
    path = src.with_name(name + ".cpp")
    t = time.perf_counter()
    path.write_text(text)
    m = cppimport.imp_from_filepath(str(path))
    assert m.bump(1.0) == 2 + (value or 0)
    if value is not None:
        out.append(time.perf_counter() - t)
print(json.dumps({{"times": out, "peak": resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024}}))
"""
TVM_ROW = """
import json, resource, time, torch
from tvm_ffi import cpp
x, y = torch.ones(1), torch.zeros(1)
out = []
for value in {values!r}:
    t = time.perf_counter()
    m = cpp.load_inline("bump", cpp_sources={text!r}.replace("VALUE", str(value)), functions=["bump"])
    m.bump(x, y)
    assert y.item() == 2 + value
    out.append(time.perf_counter() - t)
print(json.dumps({{"times": out, "peak": resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024}}))
"""
FIRST_BUILD = """
import json, time, torch, kload
t = time.perf_counter()
kload.load({src!r}, name="first", reload=False).bump(torch.ones(1))
print(json.dumps(time.perf_counter() - t))
"""


def gcc_compile(cmd: str, cwd: str) -> tuple[float, int]:
    """Seconds and peak RSS of one compiler command."""
    code = ("import resource, subprocess, sys, time, json\nt = time.perf_counter()\n"
            f"subprocess.run({cmd!r}, shell=True, cwd={cwd!r}, check=True)\n"
            "print(json.dumps([time.perf_counter() - t, "
            "resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024]))")
    return tuple(py(code))


def row_specs(work: Path, cache: str, repeat: int) -> dict:
    """name -> (driver code for one round of edits, env)."""
    specs = {}
    for key, text, env in (("lean", OP_LEAN, {"KLOAD_PCH": "0"}), ("full", OP_FULL, {"KLOAD_PCH": "0"}),
                           ("full_pch", OP_FULL, {}), ("classic", CLASSIC, {"KLOAD_PCH": "0"}),
                           ("classic_pch", CLASSIC, {}), ("stable_nopch", OP_STABLE, {"KLOAD_PCH": "0"}),
                           ("stable", OP_STABLE, {})):
        d = work / key
        d.mkdir()
        src = d / ("bump.cpp")
        src.write_text(text.replace("VALUE", "0"))
        specs[key] = (lambda values, src=src, text=text, key=key: KLOAD_ROW.format(
            src=str(src), name=f"bump_{key}", values=values, text=text), {**env, "KLOAD_CACHE_DIR": cache})
    d = work / "torch"
    d.mkdir()
    (d / "build").mkdir()
    (d / "bump.cpp").write_text(CLASSIC.replace("VALUE", "0"))
    checks = str(ROOT / "kernels" / "include" / "kload" / "checks.h")
    specs["torch"] = (lambda values, d=d: TORCH_ROW.format(src=str(d / "bump.cpp"), name="bump_torch",
                                                           checks=checks, build=str(d / "build"), values=values,
                                                           text=CLASSIC),
                      {"TORCH_NO_COMPILER_WRAPPER": "1"})
    d = work / "torch_pch"
    (d / "build").mkdir(parents=True)
    with_checks = CLASSIC.replace("#include <torch/extension.h>\n", f'#include <torch/extension.h>\n#include "{checks}"\n')
    specs["torch_pch"] = (lambda values, d=d: TORCH_PCH_ROW.format(name="bump_torch_pch", build=str(d / "build"),
                                                                   values=values, text=with_checks),
                          {"TORCH_NO_COMPILER_WRAPPER": "1"})
    d = work / "cppimport"
    d.mkdir()
    specs["cppimport"] = (lambda values, d=d: CPPIMPORT_ROW.format(src=str(d / "x.cpp"), values=values,
                                                                   text=CPPIMPORT), {})
    d = work / "tvm"
    d.mkdir()
    specs["tvm"] = (lambda values: TVM_ROW.format(values=values, text=TVM_FFI), {"TVM_FFI_CACHE_DIR": str(d)})
    return specs


LABELS = {
    "lean": "op library, lean header of before (KLOAD_LEAN)",
    "full": "op library, full ATen API, no PCH",
    "full_pch": "op library, full ATen API, PCH",
    "classic": "classic pybind11 (torch/extension.h), no PCH",
    "classic_pch": "classic pybind11, PCH",
    "torch": "classic, torch.utils.cpp_extension.load",
    "torch_pch": "classic, torch's load_inline(use_pch=True)",
    "cppimport": "cppimport (pybind11 .cpp, no torch)",
    "tvm": "tvm-ffi load_inline (its TensorView style)",
    "stable_nopch": "stable-ABI op library (kload/stable.h), no PCH",
    "stable": "stable-ABI op library (kload/stable.h), PCH",
}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeat", type=int, default=3, help="timed edits per row")
    ap.add_argument("--cuda", action="store_true",
                    help="the CUDA rows instead (live_cuda.py: NVRTC, nvcc with and without ATen, torch's load_inline)")
    ap.add_argument("--rows", default="", help="comma-separated rows only (e.g. classic,classic_pch,torch,torch_pch); "
                    "the ratios below need all")
    args = ap.parse_args()
    if args.cuda:
        import live_cuda

        live_cuda.main(args.repeat)
        return
    import torch

    work = Path(tempfile.mkdtemp(prefix="kload-live-"))
    cache = str(work / "cache")
    print(f"machine: {os.uname().machine}, {os.cpu_count()} cores, torch {torch.__version__}, "
          f"g++ {subprocess.run(['g++', '-dumpfullversion'], capture_output=True, text=True).stdout.strip()}, "
          f"MAX_JOBS={os.environ.get('MAX_JOBS', '-')}, {args.repeat} edits per row")

    # the precompiled headers, built once up front (as `kload build --pch` does for an image)
    specs = row_specs(work, cache, args.repeat)
    if args.rows:
        specs = {k: specs[k] for k in args.rows.split(",")}
    pch_seconds = {}
    for key in [k for k in ("full_pch", "classic_pch", "stable") if k in specs]:
        t = time.perf_counter()
        subprocess.run([sys.executable, "-m", "kload", "build", "--pch", str(work / key / "bump.cpp"),
                        "--name", f"bump_{key}"], check=True, env={**os.environ, "KLOAD_CACHE_DIR": cache},
                       capture_output=True)
        pch_seconds[key] = time.perf_counter() - t
    times: dict[str, list[float]] = {k: [] for k in specs}
    peaks: dict[str, int] = {k: 0 for k in specs}
    notes: dict[str, list] = {}
    # round r edits every row once (VALUE = r + 1): alternating, so drift hits all rows alike
    for r in range(args.repeat):
        for key, (code, env) in specs.items():
            res = py(code([r + 1]), env)
            times[key] += res["times"]
            peaks[key] = max(peaks[key], res["peak"])
            notes[key] = res.get("pch", [])
    for key in [k for k in ("full_pch", "classic_pch", "stable") if k in specs]:
        if not any(str(n).startswith("used the precompiled") for n in notes.get(key, [])):
            print(f"WARNING: row {key} did not use a precompiled header: {notes.get(key)}")

    rows = []
    for key, ts in times.items():
        rows.append((LABELS[key], f"{min(ts):.2f} / {statistics.median(ts):.2f} s", f"{peaks[key] / 2**30:.2f} GB"))
    if args.rows:
        _print_rows(rows)
        for mine, what in (("classic_pch", "classic with kload's PCH"), ("full_pch", "op library with kload's PCH")):
            for key in [k for k in ("torch", "torch_pch") if k in specs and mine in specs]:
                print(f"  {what} vs {LABELS[key]} (medians)  "
                      f"{statistics.median(times[mine]) / statistics.median(times[key]):6.2f}x")
        shutil.rmtree(work, ignore_errors=True)
        return
    full, full_pch = statistics.median(times["full"]), statistics.median(times["full_pch"])
    classic, classic_pch = statistics.median(times["classic"]), statistics.median(times["classic_pch"])

    # the op TU's compile alone, with and without the PCH (from ninja's own command)
    build_dir = next(Path(cache, "build").glob("bump_full_pch-*"))
    cmd = subprocess.run(["ninja", "-t", "commands", "bump.o"], cwd=build_dir, capture_output=True,
                         text=True, check=True).stdout.strip().splitlines()[-1]
    plain_cmd = " ".join(w for w in cmd.split() if not w.startswith("-I" + str(Path(cache, "entries", "pch-"))))
    plain, with_pch = [], []
    plain_peak = pch_peak = 0
    for _ in range(args.repeat):
        s, m = gcc_compile(plain_cmd.replace("-o bump.o", "-o /dev/null"), str(build_dir))
        plain.append(s)
        plain_peak = max(plain_peak, m)
        s, m = gcc_compile(cmd.replace("-o bump.o", "-o /dev/null"), str(build_dir))
        with_pch.append(s)
        pch_peak = max(pch_peak, m)

    # a first build with no PCH yet (it starts one in the background) vs KLOAD_PCH=0, fresh caches
    first = {"pch": [], "off": []}
    for i in range(args.repeat):
        for mode in ("pch", "off"):
            c = work / f"first-{mode}-{i}"
            src = work / f"first-{mode}-{i}.cpp"
            src.write_text(OP_FULL.replace("VALUE", str(i)))
            env = {"KLOAD_CACHE_DIR": str(c)} if mode == "pch" else {"KLOAD_CACHE_DIR": str(c), "KLOAD_PCH": "0"}
            first[mode].append(py(FIRST_BUILD.format(src=str(src)), env))
            if mode == "pch":  # let its background build end before timing the other side
                _wait_background(str(c))

    _print_rows(rows)
    print("targets:")
    for key in ("torch", "torch_pch"):
        print(f"  classic with kload's PCH vs {LABELS[key]} (medians)  {classic_pch / statistics.median(times[key]):6.2f}x")
        print(f"  op library with kload's PCH vs {LABELS[key]} (medians)  {full_pch / statistics.median(times[key]):6.2f}x")

    def target(text, value, limit, unit="x"):
        ok = value <= limit
        print(f"  {text:<62} {value:6.2f}{unit}  (target <= {limit}{unit}: {'met' if ok else 'MISSED'})")

    target("op library, full API, PCH: edit -> result (median)", full_pch, 4.0, " s")
    target("  the same vs a plain g++ compile of its TU, no PCH", full_pch / statistics.median(plain), 0.40)
    print(f"  {'  (compile alone: PCH ' + f'{statistics.median(with_pch):.2f} s vs plain ' + f'{statistics.median(plain):.2f} s' + f' = {statistics.median(with_pch) / statistics.median(plain):.2f}x; peak {pch_peak / 2**30:.2f} vs {plain_peak / 2**30:.2f} GB)'}")
    target("stable-ABI op library, PCH: edit -> result (median)", statistics.median(times["stable"]), 1.5, " s")
    target("classic with PCH vs without (edit -> result, medians)", classic_pch / classic, 0.6)
    target("first build with no PCH yet vs KLOAD_PCH=0 (medians)",
           statistics.median(first["pch"]) / statistics.median(first["off"]), 1.1)
    print(f"    (first builds: {', '.join(f'{t:.1f}' for t in first['pch'])} s with a PCH starting; "
          f"{', '.join(f'{t:.1f}' for t in first['off'])} s with KLOAD_PCH=0)")
    print(f"  op library, full API, PCH vs no PCH (edit -> result, medians)   {full_pch / full:6.2f}x")
    print(f"precompiling (kload build --pch, with its source): <kload/kernel.h> {pch_seconds['full_pch']:.1f} s, "
          f"<torch/extension.h> {pch_seconds['classic_pch']:.1f} s, <kload/stable.h> {pch_seconds['stable']:.1f} s")

    rerun, per_call = magic_rerun(), watched_call(work, cache)
    print(f"%%kload cell, unchanged re-run (median of 9): {rerun * 1e3:.1f} ms  "
          f"(target < 150 ms: {'met' if rerun < 0.15 else 'MISSED'})")
    print(f"per call: watched handle vs torch.ops: {per_call[0] * 1e6:.2f} vs {per_call[1] * 1e6:.2f} us = "
          f"{per_call[0] / per_call[1]:.2f}x (target <= 1.3x: {'met' if per_call[0] / per_call[1] <= 1.3 else 'MISSED'})")
    shutil.rmtree(work, ignore_errors=True)


def _print_rows(rows) -> None:
    w = 46
    print()
    print(f"{'edit -> new result (min / median)':<{w}}  {'time':>16}  {'peak memory':>11}")
    for name, value, peak in rows:
        print(f"{name:<{w}}  {value:>16}  {peak:>11}")
    print()


if __name__ == "__main__":
    os.environ.setdefault("MAX_JOBS", "2")
    main()
