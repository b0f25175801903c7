"""Step 2 of a load, on the hit path: the fingerprint of the options, and the facts
of this environment that keys hold (torch's and Python's identity, the compiler on
PATH, the keyed environment variables, the CPU for ``-march=native``).

The fingerprint is everything the hit record (kload/cache/__init__.py) must match
exactly before it may stand in for the full key: the options, the keyed
environment, the compiler command, torch's and Python's identity. It is a
``repr`` of plain values, computed without hashing a single file; the files
whose bytes go into the key are stamped in the record instead, and ``KEY_CODE``
lists kload's own key-making modules among them, so a record is void once the
code that makes keys changes.
"""
from __future__ import annotations

import os
import sys
from functools import lru_cache

import kload.cache as _cache
from kload.cache import SCHEMA

from . import knobs
from .options import LOADER_DIR, KERNELS_DIR, CUDA_SUFFIXES, Options

# kload's own code that turns inputs into a key: a hit record is void once it changes
KEY_CODE = [os.path.join(LOADER_DIR, f) for f in ("options.py", "fingerprint.py", "plan.py", "sources.py",
                                             "toolchain.py", "knobs.py")] + [
    os.path.join(os.path.dirname(os.path.abspath(_cache.__file__)), "key.py")]
HIT_RECORD_FORMAT = 2  # the hit record's own format: a record of another format is void


def fingerprint(opts: Options) -> tuple[str, str] | None:
    """``(fingerprint, compiler path)`` for the hit record of these options, or None
    where the record cannot stand in for the full lookup: CUDA sources (the key
    depends on the GPUs found). ``-march=native`` builds add the CPU model and flags
    (one read of /proc/cpuinfo), as their key does."""
    if any(p.suffix in CUDA_SUFFIXES for p in opts.paths):
        return None
    native = host_cpu() if any("native" in f for f in opts.cflags + opts.ldflags) else None
    command = cxx_command()
    cxx = which(command)
    if cxx is None:
        return None  # the full lookup says what is wrong
    env = keyed_environment()
    env["PATH"] = os.environ.get("PATH", "")
    # repr() of str/bool/list/dict values is unambiguous and cheap (no hashing here)
    return repr((HIT_RECORD_FORMAT, SCHEMA, opts.name, [str(p) for p in opts.paths], opts.cflags, opts.cuda_cflags,
                 opts.ldflags, opts.include_paths, opts.debug, opts.with_cuda, opts.standalone, native,
                 knobs.fast_link(), sorted(env.items()),
                 command, sorted(torch_identity().items()), sorted(python_identity().items()),
                 KERNELS_DIR)), cxx


# -- the facts of this environment that a key holds (no knobs: kload sets none of them) --

def torch_release() -> tuple[int, int]:
    """(major, minor) of the installed torch."""
    import torch

    major, minor = torch.__version__.split("+")[0].split(".")[:2]
    return int(major), int(minor)


# Environment variables that reach a compile and so belong in the cache key.
# (Compilers read CPATH & co. themselves; nvcc reads NVCC_*_FLAGS.)
KEYED_ENV = (
    "CXX",
    "CC",
    "CUDA_HOME",
    "CUDA_PATH",
    "ROCM_HOME",
    "TORCH_CUDA_ARCH_LIST",
    "NVCC_PREPEND_FLAGS",
    "NVCC_APPEND_FLAGS",
    "CPATH",
    "C_INCLUDE_PATH",
    "CPLUS_INCLUDE_PATH",
    "LIBRARY_PATH",
    "_GLIBCXX_USE_CXX11_ABI",
    "CUDAHOSTCXX",
    "NVCC_CCBIN",
)


def keyed_environment() -> dict:
    return {k: os.environ[k] for k in KEYED_ENV if k in os.environ}


def cxx_command() -> str:
    """The C++ compiler torch.utils.cpp_extension will run."""
    return os.environ.get("CXX", "c++")


def which(name: str) -> str | None:
    """``shutil.which`` without its generality (this is the hit path): the first
    executable ``name`` on PATH, or ``name`` itself if it is a path."""
    if os.sep in name:
        return name if os.access(name, os.X_OK) and not os.path.isdir(name) else None
    for d in os.environ.get("PATH", os.defpath).split(os.pathsep):
        p = os.path.join(d or ".", name)
        if os.access(p, os.X_OK) and not os.path.isdir(p):
            return p
    return None


@lru_cache(maxsize=None)
def torch_identity() -> dict:
    import torch

    return {
        "version": torch.__version__,
        "git": getattr(torch.version, "git_version", None),
        "cuda": torch.version.cuda,
        "hip": getattr(torch.version, "hip", None),
        "debug": bool(getattr(torch.version, "debug", False)),
        "cxx11_abi": bool(torch._C._GLIBCXX_USE_CXX11_ABI),
    }


@lru_cache(maxsize=None)
def python_identity() -> dict:
    from importlib.machinery import EXTENSION_SUFFIXES

    return {
        "cache_tag": sys.implementation.cache_tag,
        "ext_suffix": EXTENSION_SUFFIXES[0],
        "abiflags": getattr(sys, "abiflags", ""),
    }


def host_cpu() -> str:
    """The CPU model and feature flags (what -march=native compiles for)."""
    model, flags = "", ""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name") and not model:
                    model = line.split(":", 1)[1].strip()
                elif line.startswith("flags") and not flags:
                    flags = line.split(":", 1)[1].strip()
                if model and flags:
                    break
    except OSError:
        import platform

        return platform.processor() or platform.machine()
    import hashlib

    return f"{model} flags:{hashlib.sha256(flags.encode()).hexdigest()[:16]}"
