"""Every knob kload reads (its ``KLOAD_*`` environment variables), each read here
only, grouped by concern; README lists them all.

Each knob is read when it is used, not at import, so a test or a notebook can
change it for a block (:func:`scoped`) or with ``os.environ`` and see the effect at
the next build. The facts of the environment that keys hold (torch's identity, the
compiler on PATH) are not knobs: options.py has them.
"""
from __future__ import annotations

import os
import sys
from contextlib import contextmanager
from pathlib import Path
from .messages import msg


@contextmanager
def scoped(**values: str | None):
    """Set knobs (or the variables torch's loader reads) for a block:
    ``with knobs.scoped(KLOAD_PCH="0", KLOAD_CACHE_DIR=d):``. None unsets one; every
    value is restored afterwards, also on an exception."""
    saved = {k: os.environ.get(k) for k in values}
    try:
        for k, v in values.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = str(v)
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _flag(name: str, default: bool = False) -> bool:
    value = os.environ.get(name)
    if value is None or value.strip() == "":
        return default
    return value.strip().lower() not in ("0", "false", "no", "off")


DEFAULT_MAX_SIZE = "10G"
# torch 2.10 is the first release whose stable ABI has everything <kload/stable.h>
# uses (torch_library_impl, empty, parallel_for, the headeronly dispatch)
DEFAULT_STABLE_TARGET = "2.10"


# -- the cache: where, how big, whether a miss may compile ---------------------------------

def cache_root() -> str:
    """``KLOAD_CACHE_DIR``, else ``$XDG_CACHE_HOME/kload``, else ``~/.cache/kload``
    (an absolute path; a string, for the hit path)."""
    explicit = os.environ.get("KLOAD_CACHE_DIR")
    if explicit:
        return os.path.abspath(os.path.expanduser(explicit))
    try:
        from platformdirs import user_cache_dir  # the XDG rules, done right
    except ImportError:  # a bare image (a GPU box without a registry): the same rule on Linux
        base = os.environ.get("XDG_CACHE_HOME", "").strip() or os.path.join(os.path.expanduser("~"), ".cache")
        return os.path.abspath(os.path.join(base, "kload"))
    return os.path.abspath(user_cache_dir("kload", appauthor=False))


def cache_dir() -> Path:
    """:func:`cache_root` as a Path."""
    return Path(cache_root())


def cache_max_size() -> str:
    """``KLOAD_CACHE_MAX_SIZE`` (default 10G; ``0``/``none``: no limit), as written: after a
    build, least-recently-used entries are evicted until the entries fit (the cache parses
    it, and says once if it cannot)."""
    return os.environ.get("KLOAD_CACHE_MAX_SIZE") or DEFAULT_MAX_SIZE


def disable_jit() -> bool:
    """``KLOAD_DISABLE_JIT=1``: load cached builds only; a miss is an error and nothing compiles."""
    return _flag("KLOAD_DISABLE_JIT")


# -- what a build compiles (each is in the key, or changes no output) ----------------------

def debug() -> bool:
    """``KLOAD_DEBUG=1``: build every library with -g -O0 (CUDA: -G) into entries of its own."""
    return _flag("KLOAD_DEBUG")


def pch() -> bool:
    """``KLOAD_PCH`` (default 1): precompile <kload/kernel.h> and <torch/extension.h>
    into the cache (GCC only) and compile every source that includes one first with
    it. 0: parse the headers in every compile."""
    return _flag("KLOAD_PCH", True)


def trim() -> bool:
    """``KLOAD_TRIM`` (default 1): a build that cannot use the precompiled
    <kload/kernel.h> (the first, before it exists; KLOAD_PCH=0; not GCC) parses ATen
    without <ATen/Functions.h>, plus the operator headers its sources name (trim.py).
    0: the whole API."""
    return _flag("KLOAD_TRIM", True)


def lean_cuda() -> bool:
    """``KLOAD_LEAN_CUDA`` (default 1): a .cu that includes <torch/extension.h> but
    needs none of its Python half (no PYBIND11_MODULE, pybind11 or torch:: frontend
    namespace) is compiled with kload's lean one (torch/types.h). 0: torch's own."""
    return _flag("KLOAD_LEAN_CUDA", True)


def split_cuda() -> bool:
    """``KLOAD_SPLIT_CUDA`` (default 1): a .cu that includes torch's headers is compiled in
    two halves (cuda_split/build.py): its host code by g++ with its #include block precompiled,
    its kernels by nvcc without torch's host headers. 0: nvcc compiles it whole."""
    return _flag("KLOAD_SPLIT_CUDA", True)


def fast_link() -> bool:
    """``KLOAD_FAST_LINK`` (default 1): link with gold where ``ld.gold`` exists
    (never when the caller's ldflags choose a linker). 0 keeps the compiler's default."""
    return _flag("KLOAD_FAST_LINK", True)


def stable_target() -> str:
    """``KLOAD_STABLE_TARGET`` (default 2.10): the oldest torch a stable-ABI library
    is built for (``-DTORCH_TARGET_VERSION``). Its cache entry loads in that release
    and every later one; a newer target may use newer stable ops."""
    return (os.environ.get("KLOAD_STABLE_TARGET") or DEFAULT_STABLE_TARGET).strip()


def cxx_launcher() -> str | None:
    """``KLOAD_CXX_LAUNCHER`` (e.g. ``ccache``, ``sccache``): run in front of the C++ compiler."""
    return os.environ.get("KLOAD_CXX_LAUNCHER") or None


def nvcc_launcher() -> str | None:
    """``KLOAD_NVCC_LAUNCHER``: the same in front of nvcc."""
    return os.environ.get("KLOAD_NVCC_LAUNCHER") or None


def max_jobs() -> str | None:
    """``MAX_JOBS``: parallel compile jobs (read by torch.utils.cpp_extension)."""
    return os.environ.get("MAX_JOBS")


# -- what the user sees, and how kload joins in --------------------------------------------

def verbose() -> bool | None:
    """``KLOAD_VERBOSE``: 1 forces progress output, 0 silences it (log records only);
    unset means: show progress when stderr is a terminal or in a notebook."""
    value = os.environ.get("KLOAD_VERBOSE")
    if value is None or value.strip() == "":
        return None
    return _flag("KLOAD_VERBOSE")


def output_mode() -> str | None:
    """Where progress goes: ``"notebook"``, ``"terminal"`` or None (log records only)."""
    forced = verbose()
    if forced is False:
        return None
    if "IPython" in sys.modules:  # never import IPython just to ask
        try:
            shell = sys.modules["IPython"].get_ipython()
        except Exception:  # noqa: BLE001 - a half-initialized IPython is not a notebook
            shell = None
        if shell is not None and type(shell).__name__ == "ZMQInteractiveShell":
            return "notebook"
    try:
        tty = sys.stderr.isatty()
    except (AttributeError, ValueError):
        tty = False
    return "terminal" if (tty or forced) else None


def reload() -> bool:
    """``KLOAD_RELOAD``: 1 watches every handle's files and rebuilds on save, 0 never;
    unset: on in IPython/Jupyter and ``python -i``, off in scripts."""
    value = os.environ.get("KLOAD_RELOAD")
    if value is not None and value.strip() != "":
        return _flag("KLOAD_RELOAD")
    if "IPython" in sys.modules:
        try:
            if sys.modules["IPython"].get_ipython() is not None:
                return True
        except Exception:  # noqa: BLE001
            pass
    return bool(sys.flags.interactive) or hasattr(sys, "ps1")


def patch_torch() -> bool:
    """``KLOAD_PATCH_TORCH=1``: ``import kload`` routes torch.utils.cpp_extension.load and
    load_inline through kload (kload.patch()) for the whole process."""
    return _flag("KLOAD_PATCH_TORCH")


# -- the remote cache (docs/cache.md#remote-cache) -----------------------------------------

def remote_cache() -> str | None:
    """``KLOAD_REMOTE_CACHE`` (``redis://[:PASSWORD@]HOST:PORT/DB``, ``rediss://``, ``unix://``):
    a Redis server shared by a cluster; unset: none (docs/cache.md#remote-cache)."""
    return os.environ.get("KLOAD_REMOTE_CACHE", "").strip() or None


def remote_password() -> str | None:
    """``KLOAD_REMOTE_CACHE_PASSWORD``: the server's password, when not in the URL."""
    return os.environ.get("KLOAD_REMOTE_CACHE_PASSWORD") or None


def remote_secret() -> bytes | None:
    """``KLOAD_REMOTE_CACHE_KEY``: the shared secret that signs uploads (HMAC-SHA256); with it
    set, an unsigned or wrongly signed remote entry is refused. Unset: trusted by hash only."""
    value = os.environ.get("KLOAD_REMOTE_CACHE_KEY")
    return value.encode() if value else None


def _seconds(name: str, default: str) -> float | None:
    """A duration knob: ``30``, ``90s``, ``15m``, ``12h``, ``7d``; ``0``/``none``: None."""
    text = (os.environ.get(name) or default).strip().lower()
    if text in ("0", "none", "off"):
        return None
    unit = {"s": 1, "m": 60, "h": 3600, "d": 86400}.get(text[-1:], None)
    try:
        value = float(text[:-1] if unit else text) * (unit or 1)
    except ValueError:
        value = -1.0
    if not 0 < value < 1e9:  # also nan and inf
        raise ValueError(msg(f"{name}={text!r} is not a duration (use seconds, or e.g. 90s, 15m, 7d)"))
    return value


def remote_ttl() -> int | None:
    """``KLOAD_REMOTE_CACHE_TTL`` (default 7d; ``0``: none): every remote key expires this long
    after its upload or its last download."""
    value = _seconds("KLOAD_REMOTE_CACHE_TTL", "7d")
    return None if value is None else max(1, int(value))


def remote_timeout() -> float:
    """``KLOAD_REMOTE_CACHE_TIMEOUT`` (default 5 s): the limit of every call to the server."""
    return _seconds("KLOAD_REMOTE_CACHE_TIMEOUT", "5") or 5.0


def remote_wait() -> float:
    """``KLOAD_REMOTE_CACHE_WAIT`` (default 15m): how long to wait for another node's build
    of the same key before building here."""
    return _seconds("KLOAD_REMOTE_CACHE_WAIT", "15m") or 0.0


def remote_lease() -> float:
    """``KLOAD_REMOTE_CACHE_LEASE`` (default 30s): a build lease whose holder died expires
    after this (the holder renews it every third of it)."""
    return max(_seconds("KLOAD_REMOTE_CACHE_LEASE", "30s") or 30.0, 1.0)


def remote_chunk() -> int:
    """``KLOAD_REMOTE_CACHE_CHUNK`` (default 4M): artifacts travel in values of this size."""
    from kload.cache.store import parse_size

    return parse_size(os.environ.get("KLOAD_REMOTE_CACHE_CHUNK") or "4M") or (4 << 20)
