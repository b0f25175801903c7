"""The upgrade check (`make upgrade-check`): one cache, two real torch releases.

    python tests/upgrade_check.py OLD_PYTHON NEW_PYTHON

OLD_PYTHON and NEW_PYTHON are the interpreters of two virtual environments with
kload installed, e.g. .venv (torch 2.13.0, CPU) and .venv-next (torch 2.14.1, a
CUDA build that runs on the CPU). It checks, with a compiler wrapper that counts
every compile:

1. a stable-ABI op library built under OLD loads and runs under NEW with zero compiles;
2. the reverse: one built under NEW loads and runs under OLD with zero compiles
   (both target the stable ABI of torch 2.10, kload's default);
3. one built under NEW for KLOAD_STABLE_TARGET=2.14 is refused under OLD with a
   one-line KloadError, before anything compiles;
4. a classic <kload/kernel.h> op library built under OLD is not reused under NEW:
   with KLOAD_DISABLE_JIT=1 the error says why (torch differs).

Then, under NEW (a CUDA build of torch, no GPU here), the .cu sources of every
binding style build with nvcc and load (tests/cuda_check.py).
Prints one line per check; exits non-zero on the first failure.
"""
from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

STABLE = """\
#include <kload/stable.h>
using kload::Tensor;

Tensor upgrade_op(const Tensor& x) {
  KLOAD_CHECK_CPU(x);
  Tensor xc = torch::stable::contiguous(x);
  Tensor out = torch::stable::empty_like(xc);
  KLOAD_DISPATCH_FLOATING(xc.scalar_type(), "upgrade_op", [&] {
    const scalar_t* px = xc.const_data_ptr<scalar_t>();
    scalar_t* po = out.mutable_data_ptr<scalar_t>();
    for (int64_t i = 0; i < xc.numel(); ++i) po[i] = px[i] * FACTOR;
  });
  return out;
}

KLOAD_LIBRARY(m) { m.def("upgrade_op(Tensor x) -> Tensor"); }
KLOAD_IMPL(CPU, m) { m.impl("upgrade_op", TORCH_BOX(&upgrade_op)); }
"""

CLASSIC = """\
#include <kload/kernel.h>
at::Tensor classic_op(const at::Tensor& x) { return x * 3; }
KLOAD_LIBRARY(m) { m.def("classic_op(Tensor x) -> Tensor"); }
KLOAD_IMPL(CPU, m) { m.impl("classic_op", &classic_op); }
"""

RUN = """\
import json, torch, kload
from kload.doors.handle import HISTORY
out = {"torch": torch.__version__}
try:
    h = kload.load(SRC, name=NAME, reload=False).load()
    x = torch.arange(5.0)
    y = getattr(h, OP)(x)
    out.update(ok=bool(torch.equal(y, x * FACTOR)), how=HISTORY[-1]["how"], key=h._loaded.entry.key[:16],
               style=h._loaded.entry.manifest["style"])
except kload.KloadError as e:
    out.update(error=str(e))
print(json.dumps(out))
"""


def counting_cxx(folder: Path) -> tuple[Path, Path]:
    log = folder / "compiles.log"
    script = folder / "c++"
    script.write_text(f'#!/bin/sh\ncase "$*" in *c++-header*) ;; *) echo "$*" >> "{log}" ;; esac\nexec g++ "$@"\n')
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    return script, log


def run(python: str, src: Path, name: str, op: str, factor: int, env: dict) -> dict:
    code = RUN.replace("SRC", repr(str(src))).replace("NAME", repr(name)).replace("OP", repr(op)).replace(
        "FACTOR", str(factor))
    proc = subprocess.run([python, "-c", code], capture_output=True, text=True, env=env, timeout=900)
    lines = [t for t in proc.stdout.splitlines() if t.startswith("{")]
    if proc.returncode != 0 or not lines:
        raise SystemExit(f"upgrade-check: {python} failed (exit {proc.returncode}):\n{proc.stdout}\n{proc.stderr}")
    return json.loads(lines[-1])


def compiles(log: Path) -> int:
    return sum(1 for t in log.read_text().splitlines() if " -c " in f" {t} ") if log.exists() else 0


def check(what: str, ok: bool, detail: str) -> None:
    print(f"{'PASS' if ok else 'FAIL'}  {what}: {detail}", flush=True)
    if not ok:
        raise SystemExit(1)


def main(old: str, new: str) -> None:
    work = Path(tempfile.mkdtemp(prefix="kload-upgrade-"))
    cxx, log = counting_cxx(work)
    env = dict(os.environ, KLOAD_CACHE_DIR=str(work / "cache"), CXX=str(cxx), MAX_JOBS=os.environ.get("MAX_JOBS", "2"),
               KLOAD_VERBOSE="0")
    env.pop("KLOAD_STABLE_TARGET", None)
    versions = {}
    for py in (old, new):
        versions[py] = subprocess.run([py, "-c", "import torch; print(torch.__version__)"], capture_output=True,
                                      text=True, check=True).stdout.strip()
    print(f"old: {versions[old]} ({old})\nnew: {versions[new]} ({new})", flush=True)

    def source(name: str, text: str, factor: int) -> Path:
        path = work / name / f"{name}.cpp"
        path.parent.mkdir()
        path.write_text(textwrap.dedent(text).replace("FACTOR", str(factor)))
        return path

    # 1. old -> new, 2. new -> old (the reverse)
    for name, factor, (first, then), (a, b) in (("up_a", 2, (old, new), ("old", "new")),
                                                ("up_b", 5, (new, old), ("new", "old"))):
        src = source(name, STABLE, factor)
        built = run(first, src, name, "upgrade_op", factor, env)
        n = compiles(log)
        check(f"stable build under {a}", built.get("ok") and built["how"] == "built", json.dumps(built))
        loaded = run(then, src, name, "upgrade_op", factor, env)
        check(f"same entry under {b}, zero compiles",
              loaded.get("ok") and loaded["how"] == "cache" and loaded["key"] == built["key"] and compiles(log) == n,
              f"{json.dumps(loaded)}, compiles {compiles(log) - n}")

    # 3. a newer target is refused by the older torch, before compiling
    src = source("up_c", STABLE, 7)
    major_minor = ".".join(versions[new].split("+")[0].split(".")[:2])
    built = run(new, src, "up_c", "upgrade_op", 7, dict(env, KLOAD_STABLE_TARGET=major_minor))
    check(f"stable build under new for KLOAD_STABLE_TARGET={major_minor}", built.get("ok"), json.dumps(built))
    n = compiles(log)
    refused = run(old, src, "up_c", "upgrade_op", 7, dict(env, KLOAD_STABLE_TARGET=major_minor))
    check("refused under old with a clear error, zero compiles",
          "error" in refused and f"built for torch {major_minor} and later" in refused["error"] and compiles(log) == n,
          refused.get("error", json.dumps(refused)))

    # 4. a classic library is tied to its torch build
    src = source("up_d", CLASSIC, 3)
    built = run(old, src, "up_d", "classic_op", 3, env)
    check("classic build under old", built.get("ok"), json.dumps(built))
    n = compiles(log)
    refused = run(new, src, "up_d", "classic_op", 3, dict(env, KLOAD_DISABLE_JIT="1"))
    check("classic entry not reused under new (KLOAD_DISABLE_JIT=1 says why)",
          "error" in refused and "torch" in refused["error"] and compiles(log) == n,
          refused.get("error", json.dumps(refused)).replace("\n", " | "))


if __name__ == "__main__":
    if len(sys.argv) != 3:
        raise SystemExit(__doc__)
    main(sys.argv[1], sys.argv[2])
