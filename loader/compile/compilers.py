"""The compilers a build runs, set up for it: a
compiler cache in front of g++ or nvcc when the launcher knobs ask for one, and for
CUDA sources the real toolkit and an architecture list. Context managers that compile/pipeline.py enters around torch's loader.
"""
from __future__ import annotations

import hashlib
import os
import shlex
import shutil
from contextlib import contextmanager
from pathlib import Path

from kload.cache.store import Store, write_atomic

from .. import knobs
from ..plan import toolchain
from ..errors import KloadError
from ..options import cxx_command
from ..plan.plan import Plan


@contextmanager
def launchers(store: Store, plan: Plan):
    """Put KLOAD_CXX_LAUNCHER / KLOAD_NVCC_LAUNCHER (ccache, sccache) in front of the
    compilers for this build. torch reads CXX (a command it also runs on its own,
    so it must be one executable: a two-line wrapper script) and PYTORCH_NVCC.
    Recent torch puts ccache/sccache in front on its own whenever one is on PATH;
    kload turns that off (TORCH_NO_COMPILER_WRAPPER), so that a compiler cache is
    used when the launcher knobs ask for one, and only then."""
    # CXX and PYTORCH_NVCC as they are now, back after the build
    with knobs.scoped(TORCH_NO_COMPILER_WRAPPER="1", CXX=os.environ.get("CXX"),
                      PYTORCH_NVCC=os.environ.get("PYTORCH_NVCC")):
        cxx_l = knobs.cxx_launcher()
        if cxx_l:
            real = shutil.which(cxx_command())
            launcher = shutil.which(cxx_l)
            if not real or not launcher:
                raise KloadError(f"KLOAD_CXX_LAUNCHER={cxx_l!r}: not found on PATH" if not launcher
                                 else f"compiler {cxx_command()!r} not found on PATH")
            text = f'#!/bin/sh\nexec {shlex.quote(launcher)} {shlex.quote(real)} "$@"\n'
            d = store.root / "launchers" / hashlib.sha256(text.encode()).hexdigest()[:12]
            wrapper = d / "c++"  # torch accepts a compiler by this name
            if not wrapper.exists():
                d.mkdir(mode=0o700, parents=True, exist_ok=True)
                write_atomic(wrapper, text, mode=0o700)
            os.environ["CXX"] = str(wrapper)
        nvcc_l = knobs.nvcc_launcher()
        if nvcc_l and plan.with_cuda:
            nvcc = os.environ.get("PYTORCH_NVCC") or str(Path(toolchain.find_cuda_home(), "bin", "nvcc"))
            os.environ["PYTORCH_NVCC"] = f"{nvcc_l} {nvcc}"
        yield


@contextmanager
def cuda_toolkit(plan: Plan):
    """For a build with CUDA sources: point torch's loader at the real toolkit (it
    fixes CUDA_HOME at import, from the nvcc on PATH, which may be a wrapper), and
    give it an architecture list where there is no GPU to ask."""
    if not plan.with_cuda:
        yield
        return
    from torch.utils import cpp_extension

    home = toolchain.find_cuda_home()
    saved_home = cpp_extension.CUDA_HOME
    where, archs = plan.cuda_archs.origin, plan.cuda_archs.archs
    try:
        cpp_extension.CUDA_HOME = home
        # torch's loader, left to itself, adds +PTX to what it detects: one cubin for the
        # GPU here is all a JIT build needs (cicc and ptxas run once per target)
        chosen = archs if where in ("default", "detected") else os.environ.get("TORCH_CUDA_ARCH_LIST")
        with knobs.scoped(TORCH_CUDA_ARCH_LIST=chosen):
            if where in ("default", "detected"):
                from ..progress import say

                say(f"TORCH_CUDA_ARCH_LIST is unset: building {plan.name}'s CUDA code for {archs} "
                    + ("only, the GPU here" if where == "detected" else "(no GPU here)")
                    + " (set TORCH_CUDA_ARCH_LIST for other GPUs)")
            yield
    finally:
        cpp_extension.CUDA_HOME = saved_home


# Peak memory of one compile (measured: a <kload/stable.h> TU ~0.3 GB, <kload/kernel.h>
# ~0.5-0.6 GB, <torch/extension.h> and nvcc with torch's headers 1.2-1.6 GB)
_GB = 1 << 30
JOB_MEMORY = {"stable": 0.4 * _GB, "aten": 0.8 * _GB, "full": 1.6 * _GB}


def free_memory() -> int | None:
    """Bytes this process may still use: MemAvailable, or less under a cgroup (container) limit."""
    avail = None
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    avail = int(line.split()[1]) * 1024
                    break
    except OSError:
        pass
    try:
        with open("/sys/fs/cgroup/memory.max") as f:
            limit = f.read().strip()
        if limit != "max":
            with open("/sys/fs/cgroup/memory.current") as f:
                left = int(limit) - int(f.read())
            avail = left if avail is None else min(avail, left)
    except (OSError, ValueError):
        pass
    return avail


def job_memory(plan: Plan) -> float:
    """What one compile of this plan is expected to need at its peak."""
    s = plan.sources
    if s.stable:
        return JOB_MEMORY["stable"]
    if s.python_module or plan.with_cuda or any(h != "kload/kernel.h" for h in s.pch_headers) \
            or not s.pch_headers:
        return JOB_MEMORY["full"]  # torch/extension.h, pybind11, nvcc, or headers we cannot see
    return JOB_MEMORY["aten"]


def choose_jobs(free: int | None, cores: int, per_job: float, units: int) -> int:
    """Parallel compiles that fit: no more than the cores, the translation units, or
    what free memory holds at ``per_job`` each (at least one)."""
    jobs = max(1, min(cores, units))
    if free is not None:
        jobs = max(1, min(jobs, int(free // per_job)))
    return jobs


@contextmanager
def parallel_jobs(plan: Plan, units: int):
    """Set MAX_JOBS (which torch's loader hands to ninja) from free memory and the cores
    when the user has not; yields what the progress line says about it."""
    if knobs.max_jobs():
        yield f"MAX_JOBS={knobs.max_jobs()}"
        return
    free = free_memory()
    jobs = choose_jobs(free, len(os.sched_getaffinity(0)), job_memory(plan), units)
    with knobs.scoped(MAX_JOBS=str(jobs)):  # it was unset, or set empty
        yield f"{jobs} job{'s' if jobs > 1 else ''}" + (f", {free / _GB:.1f} GB free" if free is not None else "")
