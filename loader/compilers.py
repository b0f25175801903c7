"""The compilers a build runs, set up for it: a compiler cache in front of g++ or
nvcc when the launcher knobs ask for one, and for CUDA sources the real toolkit and
an architecture list. Context managers that build.py enters around torch's loader.
"""
from __future__ import annotations

import hashlib
import os
import shlex
import shutil
from contextlib import contextmanager
from pathlib import Path

from kload.cache.store import Store, write_atomic

from . import knobs, toolchain
from .errors import KloadError
from .plan import Plan


@contextmanager
def launchers(store: Store, plan_: Plan):
    """Put KLOAD_CXX_LAUNCHER / KLOAD_NVCC_LAUNCHER (ccache, sccache) in front of the
    compilers for this build. torch reads CXX (a command it also runs on its own,
    so it must be one executable: a two-line wrapper script) and PYTORCH_NVCC.
    Recent torch puts ccache/sccache in front on its own whenever one is on PATH;
    kload turns that off (TORCH_NO_COMPILER_WRAPPER), so that a compiler cache is
    used when the launcher knobs ask for one, and only then."""
    saved = {k: os.environ.get(k) for k in ("CXX", "PYTORCH_NVCC", "TORCH_NO_COMPILER_WRAPPER")}
    try:
        os.environ["TORCH_NO_COMPILER_WRAPPER"] = "1"
        cxx_l = knobs.cxx_launcher()
        if cxx_l:
            real = shutil.which(toolchain.cxx_command())
            launcher = shutil.which(cxx_l)
            if not real or not launcher:
                raise KloadError(f"kload: KLOAD_CXX_LAUNCHER={cxx_l!r}: not found on PATH" if not launcher
                                 else f"kload: compiler {toolchain.cxx_command()!r} not found on PATH")
            text = f'#!/bin/sh\nexec {shlex.quote(launcher)} {shlex.quote(real)} "$@"\n'
            d = store.root / "launchers" / hashlib.sha256(text.encode()).hexdigest()[:12]
            wrapper = d / "c++"  # torch accepts a compiler by this name
            if not wrapper.exists():
                d.mkdir(mode=0o700, parents=True, exist_ok=True)
                write_atomic(wrapper, text, mode=0o700)
            os.environ["CXX"] = str(wrapper)
        nvcc_l = knobs.nvcc_launcher()
        if nvcc_l and plan_.with_cuda:
            nvcc = os.environ.get("PYTORCH_NVCC") or str(Path(toolchain.find_cuda_home(), "bin", "nvcc"))
            os.environ["PYTORCH_NVCC"] = f"{nvcc_l} {nvcc}"
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@contextmanager
def cuda_toolkit(plan_: Plan):
    """For a build with CUDA sources: point torch's loader at the real toolkit (it
    fixes CUDA_HOME at import, from the nvcc on PATH, which may be a wrapper), and
    give it an architecture list where there is no GPU to ask."""
    if not plan_.with_cuda:
        yield
        return
    from torch.utils import cpp_extension

    home = toolchain.find_cuda_home()
    saved_home, saved_arch = cpp_extension.CUDA_HOME, os.environ.get("TORCH_CUDA_ARCH_LIST")
    arch = plan_.inputs.get("cuda_arch", "")
    try:
        cpp_extension.CUDA_HOME = home
        if arch.startswith("default:"):
            os.environ["TORCH_CUDA_ARCH_LIST"] = arch.split(":", 1)[1]
            from .progress import say

            say(f"kload: no GPU here and TORCH_CUDA_ARCH_LIST is unset: building {plan_.name}'s CUDA code for "
                f"{os.environ['TORCH_CUDA_ARCH_LIST']} (set TORCH_CUDA_ARCH_LIST for other GPUs)")
        yield
    finally:
        cpp_extension.CUDA_HOME = saved_home
        if saved_arch is None:
            os.environ.pop("TORCH_CUDA_ARCH_LIST", None)
        else:
            os.environ["TORCH_CUDA_ARCH_LIST"] = saved_arch
