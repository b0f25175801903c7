"""Every environment variable kload reads, in one place (README lists them all).

Each knob is read when it is used, not at import, so a test or a notebook can
change it with ``os.environ`` and see the effect at the next build.
"""
from __future__ import annotations

import os
from pathlib import Path


def _flag(name: str, default: bool = False) -> bool:
    value = os.environ.get(name)
    if value is None or value.strip() == "":
        return default
    return value.strip().lower() not in ("0", "false", "no", "off")


def cache_dir() -> Path:
    """``KLOAD_CACHE_DIR``, else ``$XDG_CACHE_HOME/kload``, else ``~/.cache/kload``."""
    explicit = os.environ.get("KLOAD_CACHE_DIR")
    if explicit:
        return Path(explicit).expanduser().absolute()
    from platformdirs import user_cache_dir  # the XDG rules, done right

    return Path(user_cache_dir("kload", appauthor=False)).absolute()


def verbose() -> bool | None:
    """``KLOAD_VERBOSE``: 1 forces progress output, 0 silences it (log records only);
    unset means: show progress when stderr is a terminal or in a notebook."""
    value = os.environ.get("KLOAD_VERBOSE")
    if value is None or value.strip() == "":
        return None
    return _flag("KLOAD_VERBOSE")


def debug() -> bool:
    """``KLOAD_DEBUG=1``: build every library with -g -O0 (CUDA: -G) into entries of its own."""
    return _flag("KLOAD_DEBUG")


def reload() -> bool:
    """``KLOAD_RELOAD``: 1 watches every handle's files and rebuilds on save, 0 never;
    unset: on in IPython/Jupyter and ``python -i``, off in scripts."""
    value = os.environ.get("KLOAD_RELOAD")
    if value is not None and value.strip() != "":
        return _flag("KLOAD_RELOAD")
    import sys

    if "IPython" in sys.modules:
        try:
            if sys.modules["IPython"].get_ipython() is not None:
                return True
        except Exception:  # noqa: BLE001
            pass
    return bool(sys.flags.interactive) or hasattr(sys, "ps1")


def fast_link() -> bool:
    """``KLOAD_FAST_LINK`` (default 1): link with gold where ``ld.gold`` exists
    (never when the caller's ldflags choose a linker). 0 keeps the compiler's default."""
    return _flag("KLOAD_FAST_LINK", True)


DEFAULT_MAX_SIZE = "10G"


def cache_max_size() -> int | None:
    """``KLOAD_CACHE_MAX_SIZE`` (default 10G; ``0``/``none``: no limit): after a build,
    least-recently-used entries are evicted until the entries fit."""
    from kload.cache.store import parse_size

    return parse_size(os.environ.get("KLOAD_CACHE_MAX_SIZE") or DEFAULT_MAX_SIZE)


def disable_jit() -> bool:
    """``KLOAD_DISABLE_JIT=1``: load cached builds only; a miss is an error and nothing compiles."""
    return _flag("KLOAD_DISABLE_JIT")


def cxx_launcher() -> str | None:
    """``KLOAD_CXX_LAUNCHER`` (e.g. ``ccache``, ``sccache``): run in front of the C++ compiler."""
    return os.environ.get("KLOAD_CXX_LAUNCHER") or None


def nvcc_launcher() -> str | None:
    """``KLOAD_NVCC_LAUNCHER``: the same in front of nvcc."""
    return os.environ.get("KLOAD_NVCC_LAUNCHER") or None


def max_jobs() -> str | None:
    """``MAX_JOBS``: parallel compile jobs (read by torch.utils.cpp_extension)."""
    return os.environ.get("MAX_JOBS")


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
)
