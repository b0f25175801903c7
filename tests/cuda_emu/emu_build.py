"""Builds the shipped CUDA kernels for the CPU emulator (emu.h): a copy of each
kernels/<op>/<op>.cu and of kload/cuda/'s headers, rewritten where g++ cannot read
CUDA (kernel<<<...>>>(...) launches; __shared__ and extern __shared__ declarations,
which become the emulator's poisoned shared memory), with the launchers exported and
kload/cuda/ptx.cuh replaced by the emulated instructions; compiled by g++ into one
shared library whose launchers (kload_<op>_cuda, ...) take host pointers."""
from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path
from typing import Callable

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
KERNELS = ROOT / "kernels"

# name<<<config>>>(  ->  ::kload_emu::launch(name, config)(
LAUNCH = re.compile(r"([\w:]+(?:<[^<>;()]*>)?)\s*<<<(.+?)>>>", re.S)
# extern __shared__ [__align__(n)] T name[];  ->  T* name = (T*)::kload_emu::dynamic_shared();
EXTERN_SHARED = re.compile(r"extern\s+__shared__\s+(?:__align__\(\d+\)\s+)?([\w ]+?)\s+(\w+)\[\];")
# __shared__ [__align__(n)] T name[dims];  ->  T (&name)[dims] = ::kload_emu::static_shared<T[dims], site>();
SHARED = re.compile(r"__shared__\s+(?:__align__\(\d+\)\s+)?((?:[\w:]+\s+)*?[\w:]+)\s+(\w+)((?:\[[^\]\n]+\])*)\s*;")
# what torch passes nvcc (COMMON_NVCC_FLAGS): no implicit half / bfloat16 conversions in the kernels
NO_CONVERSIONS = ["-D__CUDA_NO_HALF_OPERATORS__", "-D__CUDA_NO_HALF_CONVERSIONS__",
                  "-D__CUDA_NO_BFLOAT16_CONVERSIONS__", "-D__CUDA_NO_HALF2_OPERATORS__"]


# the launchers are hidden in a real build (the glue in the same library calls them); here ctypes does
HIDDEN_LAUNCHER = '#define KLOAD_LAUNCHER extern "C" __attribute__((visibility("hidden")))'


def rewrite(text: str) -> str:
    text = text.replace(HIDDEN_LAUNCHER, '#define KLOAD_LAUNCHER extern "C"')
    text = LAUNCH.sub(lambda m: f"::kload_emu::launch({m[1]}, {m[2]})", text)
    text = EXTERN_SHARED.sub(lambda m: f"{m[1]}* {m[2]} = reinterpret_cast<{m[1]}*>(::kload_emu::dynamic_shared());",
                             text)
    return SHARED.sub(lambda m: f"{m[1]} (&{m[2]}){m[3]} = ::kload_emu::static_shared<{m[1]}{m[3]}, __COUNTER__>();",
                      text)


def copy_sources(out: Path, ops: list[str] | None = None) -> list[Path]:
    """The rewritten tree under out; returns its .cu files (of `ops`, or every op's)."""
    cuda = out / "include" / "kload" / "cuda"
    cuda.mkdir(parents=True, exist_ok=True)
    for header in (KERNELS / "include" / "kload" / "cuda").iterdir():
        if header.suffix in (".cuh", ".h") and header.name != "ptx.cuh":
            (cuda / header.name).write_text(rewrite(header.read_text()))
    shutil.copy(HERE / "ptx.cuh", cuda / "ptx.cuh")
    units = []
    for cu in sorted(KERNELS.glob("*/*.cu")):
        if ops is not None and cu.parent.name not in ops:
            continue
        d = out / cu.parent.name
        d.mkdir(exist_ok=True)
        for h in cu.parent.glob("*.h"):
            shutil.copy(h, d / h.name)
        (d / cu.name).write_text(rewrite(cu.read_text()))
        units.append(d / cu.name)
    return units


def build(out: Path, cuda_include: Path, *, ops: list[str] | None = None, defines: list[str] = (),
          edit: Callable[[Path], None] | None = None, opt: str = "-O1") -> Path:
    """The emulator library of the shipped .cu files (of `ops`, or all), built under out, two
    compilers at a time, with `defines` (-DNAME=VALUE: e.g. kload/cuda/gemm.cuh's tile knobs).
    edit(out), if given, may change the copied sources first (a test that plants a bug to see
    it caught)."""
    units = copy_sources(out, ops)
    if edit is not None:
        edit(out)
    common = ["g++", "-std=c++17", opt, "-fPIC", "-g0", f"-I{out / 'include'}", f"-I{cuda_include}", f"-I{HERE}",
              *NO_CONVERSIONS, *defines]
    jobs, objects = [], []
    for src in [*units, HERE / "runtime.cpp"]:
        obj = out / f"{src.stem}.o"
        cmd = [*common, "-include", str(HERE / "emu.h"), "-x", "c++", "-c", str(src), "-o", str(obj)]
        jobs.append((src, subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)))
        objects.append(obj)
        if len([j for j in jobs if j[1].poll() is None]) >= 2:
            jobs[-2][1].wait()
    for src, proc in jobs:
        log = proc.communicate()[0]
        if proc.returncode != 0:
            raise RuntimeError(f"g++ failed on the emulated {src.name}:\n{log[-6000:]}")
    lib = out / "libkload_emu.so"
    subprocess.run(["g++", "-shared", "-o", str(lib), *map(str, objects)], check=True)
    return lib
