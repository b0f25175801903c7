"""Where the seconds of one edit go: edit -> new result, phase by phase, in a fresh
process and in a running one (as a notebook has it).

    python benchmarks/edit_breakdown.py [--repeat 5] [--cases oplib,stable] [--cxx clang++-19]

Each case is one small library in a cache of its own, built once and with its
precompiled header ready before anything is timed (not timed). Then ``--repeat``
edits, each changing the constant the op adds, so each result is new:

- fresh: a new interpreter per edit: ``import torch``, ``import kload``, ``load()`` and
  the first call of the edited library;
- running: one interpreter, loaded once, then per edit ``handle.reload()`` and a call.

The phases (median, min in brackets, in ms), read with kload's own functions wrapped
in timers (nothing is replaced: each wrapper calls the real function):

    import torch, import kload   the interpreter's imports (fresh only)
    key and plan                 kload.plan.plan.make_plan: the sources hashed, the plan
    compile: PCH load            the build's own compile command on a file holding only its
                                 first #include (the precompiled header's load, and the
                                 compiler's start), timed once per case after the edits
    compile: the rest            ninja's compile edges (.ninja_log) less the PCH load: the
                                 user's code parsed, instantiated, optimized, emitted
    link                         ninja's link edge
    build overhead               the rest of kload.compile.pipeline.compile: torch's loader
                                 writing build.ninja and starting ninja, the header
                                 closure, the record; and the publish
    dlopen                       ctypes.CDLL of the artifact (static initializers included)
    registration                 kload.resolve.library.load_entry less its dlopen
    first call                   the op's first call
    other                        what the total has beyond these (the lookup, Python)

(The split .cu's host half is not a case yet: it needs a CUDA build of torch and its own
phases, the halves' compiles, which ninja does not run.)
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
from pathlib import Path

from common import wait_quiet

ROOT = Path(__file__).resolve().parent.parent

OPLIB = """#include <kload/kernel.h>
at::Tensor bump(const at::Tensor& x) { return x + OFFSET; }
KLOAD_LIBRARY(m) { m.def("bump(Tensor x) -> Tensor"); }
KLOAD_IMPL(CPU, m) { m.impl("bump", &bump); }
"""
STABLE = """#include <kload/stable.h>
kload::Tensor bump(const kload::Tensor& x) {
  kload::Tensor out = torch::stable::empty_like(x);
  const float* px = x.const_data_ptr<float>();
  float* po = out.mutable_data_ptr<float>();
  for (int64_t i = 0; i < x.numel(); ++i) po[i] = px[i] + OFFSET;
  return out;
}
KLOAD_LIBRARY(m) { m.def("bump(Tensor x) -> Tensor"); }
KLOAD_IMPL(CPU, m) { m.impl("bump", TORCH_BOX(&bump)); }
"""

# the timers, installed in the child before kload loads anything
TIMERS = r"""
import ctypes, json, sys, time
T = {}
def timed(owner, name, key):
    real = getattr(owner, name)
    def wrapper(*a, **k):
        t = time.perf_counter()
        try:
            return real(*a, **k)
        finally:
            T[key] = T.get(key, 0.0) + time.perf_counter() - t
    setattr(owner, name, wrapper)
class TimedCDLL(ctypes.CDLL):
    def __init__(self, *a, **k):
        t = time.perf_counter()
        super().__init__(*a, **k)
        T["dlopen"] = T.get("dlopen", 0.0) + time.perf_counter() - t
def install():
    import kload.plan.plan, kload.compile.pipeline, kload.doors.handle, kload.resolve.obtain as obtain
    ctypes.CDLL = TimedCDLL
    timed(kload.plan.plan, "make_plan", "plan")
    timed(kload.compile.pipeline, "compile", "build")
    timed(obtain, "publish_artifact", "publish")
    timed(kload.doors.handle, "load_entry", "load")
def ninja(build_dir):
    # (compile, link) seconds of ninja's newest run in build_dir: .ninja_log's rows are
    # "start end mtime output hash", in ms from their run's start, appended as edges end;
    # the newest run is the longest tail whose end times do not go down
    rows = [l.split("\t") for l in open(build_dir + "/.ninja_log").read().splitlines()[1:] if l.strip()]
    run = [rows[-1]]
    for r in reversed(rows[:-1]):
        if int(r[1]) > int(run[-1][1]):
            break
        run.append(r)
    edge = lambda r: (int(r[1]) - int(r[0])) / 1e3
    return (sum(edge(r) for r in run if r[3].endswith(".o")), sum(edge(r) for r in run if not r[3].endswith(".o")))
"""

FRESH = TIMERS.replace("{", "{{").replace("}", "}}") + r"""
t0 = time.perf_counter()
import torch
t1 = time.perf_counter()
import kload
t2 = time.perf_counter()
install()
h = kload.load({src!r}, reload=False, extra_cflags={cflags!r}).load()
t3 = time.perf_counter()
y = h.bump(torch.zeros(2)).tolist()
t4 = time.perf_counter()
T.update({{"import torch": t1 - t0, "import kload": t2 - t1, "total": t4 - t1, "first call": t4 - t3}})
bd = str(h.build().build_dir)
T["compile"], T["link"] = ninja(bd)
print(json.dumps({{"T": T, "y": y, "how": kload.HISTORY[-1]["how"], "build_dir": bd,
                  "pch": h.build().entry.manifest.get("pch")}}))
"""

RUNNING = TIMERS.replace("{", "{{").replace("}", "}}") + r"""
import torch, kload
install()
h = kload.load({src!r}, reload=False, extra_cflags={cflags!r})
h.bump(torch.zeros(2))
out = []
for n in range({repeat}):
    text = open({src!r}).read()
    with open({src!r}, "w") as f:
        f.write(text.replace("+ {{}};".format({offset0} + n), "+ {{}};".format({offset0} + n + 1)))
    T.clear()
    t = time.perf_counter()
    assert h.reload()
    t3 = time.perf_counter()
    y = h.bump(torch.zeros(2)).tolist()
    t4 = time.perf_counter()
    T["total"] = t4 - t
    T["first call"] = t4 - t3
    T["compile"], T["link"] = ninja(str(h.build().build_dir))
    out.append({{"T": dict(T), "y": y, "build_dir": str(h.build().build_dir), "pch": h.build().entry.manifest.get("pch")}})
print(json.dumps(out))
"""


def child(code: str, env: dict) -> object:
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=1800)
    if proc.returncode != 0:
        sys.exit(f"a step failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def pch_load_seconds(build_dir: str, source: str) -> float | None:
    """The build's own compile command of ``source`` run on a file with only its first
    #include (min of 3): the precompiled header's load and the compiler's start."""
    import shlex
    import time

    db = json.loads(Path(build_dir, "compile_commands.json").read_text())
    entry = next((e for e in db if os.path.realpath(e["file"]) == os.path.realpath(source)), None)
    if entry is None:
        return None
    first = next(line for line in Path(source).read_text().splitlines() if line.startswith("#include"))
    probe = Path(build_dir, "_kload_pch_probe.cpp")
    probe.write_text(first + "\n")
    args = entry["arguments"] if "arguments" in entry else shlex.split(entry["command"])
    cmd = []
    it = iter(args)
    for a in it:
        if a in ("-o", "-MF"):
            cmd += [a, "/dev/null"]
            next(it, None)
        elif os.path.realpath(os.path.join(entry.get("directory", build_dir), a)) == os.path.realpath(source):
            cmd.append(str(probe))
        else:
            cmd.append(a)
    times = []
    for _ in range(3):
        t = time.perf_counter()
        proc = subprocess.run(" ".join(cmd), shell=True, cwd=entry.get("directory", build_dir),
                              capture_output=True, text=True)  # (the command is quoted for a shell, as ninja runs it)
        times.append(time.perf_counter() - t)
        if proc.returncode != 0:
            print(f"  (the PCH probe did not compile: {proc.stderr.strip()[:300]})")
            return None
    probe.unlink()
    return min(times)


PHASES = ["import torch", "import kload", "key and plan", "compile: PCH load", "compile: the rest", "link",
          "build overhead", "dlopen", "registration", "first call", "other", "total"]


def phases(rec: dict, pch_load: float | None) -> dict[str, float]:
    T = rec["T"]
    comp, link = T["compile"], T["link"]
    out = {"import torch": T.get("import torch", 0.0), "import kload": T.get("import kload", 0.0),
           "key and plan": T.get("plan", 0.0)}
    out["compile: PCH load"] = min(pch_load or 0.0, comp)
    out["compile: the rest"] = comp - out["compile: PCH load"]
    out["link"] = link
    out["build overhead"] = max(T.get("build", 0.0) - comp - link, 0.0) + T.get("publish", 0.0)
    out["dlopen"] = T.get("dlopen", 0.0)
    out["registration"] = max(T.get("load", 0.0) - T.get("dlopen", 0.0), 0.0)
    out["first call"] = T["first call"]
    out["total"] = T["total"] + out["import torch"]
    out["other"] = out["total"] - sum(v for k, v in out.items() if k not in ("other", "total"))
    return out


def run_case(case: str, repeat: int, cflags: list[str], work: Path, env: dict) -> dict:
    if case not in ("oplib", "stable"):
        sys.exit(f"no case {case!r}: oplib, stable")
    src = work / case / "bump.cpp"
    src.parent.mkdir(parents=True)
    offset0 = 1
    src.write_text((OPLIB if case == "oplib" else STABLE).replace("OFFSET", f"{offset0};").replace(";;", ";"))
    # built once, its precompiled header made (not timed)
    child(textwrap.dedent(f"""
        import json, torch, kload
        from kload.compile import pch_build
        h = kload.load({str(src)!r}, reload=False, extra_cflags={cflags!r}); h.bump(torch.zeros(2))
        assert pch_build.wait(1200)
        print(json.dumps(1))"""), env)
    wait_quiet()
    fresh, n = [], offset0
    for _ in range(repeat):
        text = src.read_text()
        src.write_text(text.replace(f"+ {n};", f"+ {n + 1};"))
        n += 1
        wait_quiet()
        rec = child(FRESH.format(src=str(src), cflags=cflags), env)
        assert rec["y"] == [float(n)] * 2 and rec["how"] == "built", rec
        fresh.append(rec)
    wait_quiet()
    running = child(RUNNING.format(src=str(src), cflags=cflags, repeat=repeat, offset0=n), env)
    for i, rec in enumerate(running):
        assert rec["y"] == [float(n + i + 1)] * 2, rec
    pch_load = pch_load_seconds(fresh[-1]["build_dir"], str(src))
    return {"fresh": [phases(r, pch_load) for r in fresh], "running": [phases(r, pch_load) for r in running],
            "pch": fresh[-1]["pch"], "pch_load": pch_load}


def show(case: str, res: dict) -> None:
    print(f"\n{case}: {next(iter(res['pch'].values()))}")
    print(f"  {'phase':<20} {'fresh process':>22} {'running process':>22}")
    for ph in PHASES:
        cells = []
        for mode in ("fresh", "running"):
            xs = [r[ph] * 1e3 for r in res[mode]]
            cells.append(f"{statistics.median(xs):9.1f} [{min(xs):7.1f}]")
        if ph.startswith("import") and all(r[ph] == 0 for r in res["running"]):
            cells[1] = f"{'-':>19}"
        print(f"  {ph:<20} {cells[0]:>22} {cells[1]:>22}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--cases", default="oplib,stable")
    ap.add_argument("--cxx", default=None, help="CXX for the builds (default: as the environment has it)")
    ap.add_argument("--cflags", default="", help="extra C++ flags of the library (space-separated)")
    args = ap.parse_args()
    import torch

    work = Path(tempfile.mkdtemp(prefix="kload-edit-"))
    env = dict(os.environ, KLOAD_CACHE_DIR=str(work / "cache"), KLOAD_VERBOSE="0")
    if args.cxx:
        env["CXX"] = args.cxx
    cflags = args.cflags.split()
    cxx = subprocess.run([env.get("CXX", "c++"), "--version"], capture_output=True, text=True).stdout.splitlines()[0]
    print(f"edit -> new result, by phase: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
          f"torch {torch.__version__}, {cxx}; median [min] of {args.repeat} edits, ms")
    try:
        for case in args.cases.split(","):
            show(case, run_case(case, args.repeat, cflags, work, env))
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
