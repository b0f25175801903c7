"""What a load is given: the caller's options, validated, and the facts of this
environment that a key holds.

``kload.load`` turns its arguments into an :class:`Options` here: absolute paths
of existing sources with a known suffix, a C-identifier name, flag lists. Bad
input raises at once, before anything is hashed or compiled. The facts (torch's
and Python's identity, the compiler on PATH, the keyed environment variables, the
CPU for ``-march=native``) are read here too, for the hit record's fingerprint
(kload.resolve) and the plan's key (kload.plan). This is on the hit path of a
fresh process, so it uses ``os.path`` on strings and imports nothing heavy.
"""
from __future__ import annotations

import os
import sys
from functools import lru_cache
from pathlib import Path

from . import knobs
from .messages import msg

CPP_SUFFIXES = (".cpp", ".cc", ".cxx", ".c++", ".c")
CUDA_SUFFIXES = (".cu",)

LOADER_DIR = os.path.dirname(os.path.abspath(__file__))
# kload/kernels in an installed package; kernels/ beside loader/ in a checkout
KERNELS_DIR = os.path.join(LOADER_DIR, "kernels")
if not os.path.isdir(KERNELS_DIR):
    KERNELS_DIR = os.path.join(os.path.dirname(LOADER_DIR), "kernels")


def include_dir() -> Path:
    """Where <kload/kernel.h> lives."""
    return Path(KERNELS_DIR, "include")


def _error(text: str):
    from .errors import KloadError  # only when there is something to refuse

    return KloadError(text)


def _is_c_identifier(name: str) -> bool:
    return name.isidentifier() and name.isascii()  # no regex on the hit path


def check_name(name: str) -> str:
    if not isinstance(name, str) or not _is_c_identifier(name):
        raise ValueError(msg(
            f"name must be a C identifier (letters, digits, underscores; not starting with a digit), got {name!r}"
        ))
    return name


def default_name(path: Path) -> str:
    stem = "".join(c if c.isascii() and (c.isalnum() or c == "_") else "_" for c in path.stem)
    return stem if _is_c_identifier(stem) else f"_{stem}"


def source_paths(sources) -> list[Path]:
    """Absolute paths of the given sources; a clear error for a missing or odd one.
    (os.path on strings, Path objects at the end: this runs on every load().)"""
    if isinstance(sources, (str, Path)):
        sources = [sources]
    texts: list[str] = []
    for s in sources:
        if not isinstance(s, (str, Path)):
            raise TypeError(msg(f"a source must be a path, got {type(s).__name__}: {s!r}"))
        text = os.fspath(s)
        if text.startswith("~"):
            text = os.path.expanduser(text)
        text = os.path.normpath(text if os.path.isabs(text) else os.path.join(os.getcwd(), text))
        suffix = os.path.splitext(text)[1]
        if suffix.lower() not in CPP_SUFFIXES + CUDA_SUFFIXES:
            raise _error(
                f"unsupported source type {suffix or '(no suffix)'!r} for {text}; "
                f"expected one of {', '.join(CPP_SUFFIXES + CUDA_SUFFIXES)} (headers are found through #include)"
            )
        if not os.path.isfile(text):
            raise FileNotFoundError(msg(f"source file not found: {text}"))
        if text in texts:
            raise _error(f"source listed twice: {text}")
        texts.append(text)
    if not texts:
        raise _error("load() needs at least one source file")
    stems = [os.path.splitext(os.path.basename(t))[0] for t in texts if not t.endswith(CUDA_SUFFIXES)]
    dup = {s for s in stems if stems.count(s) > 1}
    if dup:
        # torch names object files after the stem: two a.cpp would overwrite each other's a.o
        raise _error(f"two C++ sources share the file name {sorted(dup)[0]!r}; rename one")
    return [Path(t) for t in texts]


class Options:
    """What the caller asked for, validated."""

    __slots__ = ("name", "paths", "cflags", "cuda_cflags", "ldflags", "include_paths", "verbose", "debug",
                 "reload", "with_cuda", "standalone", "as_torch", "device_code")

    def __init__(self, name, paths, cflags=(), cuda_cflags=(), ldflags=(), include_paths=(), verbose=False,
                 debug=False, reload=False, with_cuda=None, standalone=False, as_torch=False, device_code=None):
        self.name, self.paths = name, list(paths)
        self.cflags, self.cuda_cflags, self.ldflags = list(cflags), list(cuda_cflags), list(ldflags)
        self.include_paths, self.verbose, self.debug = list(include_paths), verbose, debug
        self.reload = reload  # watch the files and rebuild on save (not part of the key)
        # torch's loader options (kload.cpp_extension): True links CUDA without .cu sources;
        # standalone builds an executable (no bindings, nothing loaded)
        self.with_cuda, self.standalone = with_cuda, standalone
        self.as_torch = as_torch  # torch's loader builds sources whose bindings kload cannot see: so does this
        # a file of device code whose kernels the glue launches by name (kload/live.h): compiled by
        # NVRTC and bound after the library loads (live/glue.py); not part of the library's key
        self.device_code = device_code


def _flag_list(value, what: str, kinds=(str,)) -> list:
    if value is None:
        return []
    if isinstance(value, (str, os.PathLike)):
        raise TypeError(msg(f"{what} must be a list of strings, got {value!r} (wrap it in a list)"))
    out = list(value)
    for v in out:
        if not isinstance(v, kinds):
            raise TypeError(msg(f"{what} must contain strings, got {type(v).__name__}: {v!r}"))
    return out


def make_options(name, paths, extra_cflags, extra_cuda_cflags, extra_ldflags, extra_include_paths,
                 verbose, debug, reload=None, with_cuda=None, standalone=False, as_torch=False,
                 device_code=None) -> Options:
    incs = [os.path.abspath(os.path.expanduser(os.fspath(p)))
            for p in _flag_list(extra_include_paths, "extra_include_paths", (str, os.PathLike))]
    for inc in incs:
        if not os.path.isdir(inc) and not as_torch:  # torch's loader passes a missing one on to the compiler
            raise FileNotFoundError(msg(f"include directory not found: {inc}"))
    if device_code is not None:
        if not isinstance(device_code, (str, os.PathLike)):
            raise TypeError(msg(f"device_code must be a path, got {type(device_code).__name__}: {device_code!r}"))
        device_code = os.path.abspath(os.path.expanduser(os.fspath(device_code)))
        if not os.path.isfile(device_code):
            raise FileNotFoundError(msg(f"device code file not found: {device_code}"))
    return Options(
        name=check_name(name if name is not None else default_name(paths[0])),
        paths=paths,
        cflags=_flag_list(extra_cflags, "extra_cflags"),
        cuda_cflags=_flag_list(extra_cuda_cflags, "extra_cuda_cflags"),
        ldflags=_flag_list(extra_ldflags, "extra_ldflags"),
        include_paths=incs,
        verbose=bool(verbose),
        debug=knobs.debug() if debug is None else bool(debug),
        reload=knobs.reload() if reload is None else bool(reload),
        with_cuda=None if with_cuda is None else bool(with_cuda),
        standalone=bool(standalone),
        as_torch=bool(as_torch),
        device_code=device_code,
    )


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
