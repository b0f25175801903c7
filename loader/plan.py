"""Everything known before compiling: options, the sources' style, the key inputs.

This is the cache-hit path (with cache/store.py and runtime.py): it imports
nothing heavy and runs no subprocess.
"""
from __future__ import annotations

import logging
import os
from pathlib import Path

from kload.cache.key import source_key
from kload.cache.store import Store

from . import knobs, toolchain
from .errors import KloadError
from .sources import SourceSet, scan

log = logging.getLogger("kload")



def _is_c_identifier(name: str) -> bool:
    return name.isidentifier() and name.isascii()  # no regex on the hit path
_HERE = Path(__file__).resolve().parent
# kload/kernels in an installed package; kernels/ beside loader/ in a checkout
_KERNELS = _HERE / "kernels" if (_HERE / "kernels").is_dir() else _HERE.parent / "kernels"


def include_dir() -> Path:
    """Where <kload/kernel.h> lives."""
    return _KERNELS / "include"


class Options:
    """What the caller asked for, validated."""

    __slots__ = ("name", "paths", "cflags", "cuda_cflags", "ldflags", "include_paths", "verbose", "debug",
                 "reload")

    def __init__(self, name, paths, cflags=(), cuda_cflags=(), ldflags=(), include_paths=(), verbose=False,
                 debug=False, reload=False):
        self.name, self.paths = name, list(paths)
        self.cflags, self.cuda_cflags, self.ldflags = list(cflags), list(cuda_cflags), list(ldflags)
        self.include_paths, self.verbose, self.debug = list(include_paths), verbose, debug
        self.reload = reload  # watch the files and rebuild on save (not part of the key)


def check_name(name: str) -> str:
    if not isinstance(name, str) or not _is_c_identifier(name):
        raise ValueError(
            f"kload: name must be a C identifier (letters, digits, underscores; not starting with a digit), got {name!r}"
        )
    return name


def default_name(path: Path) -> str:
    stem = "".join(c if c.isascii() and (c.isalnum() or c == "_") else "_" for c in path.stem)
    return stem if _is_c_identifier(stem) else f"_{stem}"


def _flag_list(value, what: str, kinds=(str,)) -> list:
    if value is None:
        return []
    if isinstance(value, (str, os.PathLike)):
        raise TypeError(f"kload: {what} must be a list of strings, got {value!r} (wrap it in a list)")
    out = list(value)
    for v in out:
        if not isinstance(v, kinds):
            raise TypeError(f"kload: {what} must contain strings, got {type(v).__name__}: {v!r}")
    return out


def make_options(name, paths, extra_cflags, extra_cuda_cflags, extra_ldflags, extra_include_paths,
                 verbose, debug, reload=None) -> Options:
    incs = [str(Path(p).expanduser().absolute()) for p in _flag_list(extra_include_paths, "extra_include_paths", (str, os.PathLike))]
    for inc in incs:
        if not Path(inc).is_dir():
            raise FileNotFoundError(f"kload: include directory not found: {inc}")
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
    )


class Plan:
    """The build as kload will run it, and its source key."""

    __slots__ = ("opts", "sources", "built", "with_cuda", "cuda_skipped", "cflags", "cuda_cflags", "ldflags",
                 "inputs", "skey")

    def __init__(self, opts, sources, built, with_cuda, cuda_skipped, cflags, cuda_cflags, ldflags, inputs, skey):
        self.opts = opts
        self.sources: SourceSet = sources
        self.built: list[Path] = built            # CUDA sources are dropped where CUDA cannot build
        self.with_cuda = with_cuda
        self.cuda_skipped: str | None = cuda_skipped  # why .cu sources are not built, or None
        self.cflags, self.cuda_cflags, self.ldflags = cflags, cuda_cflags, ldflags
        self.inputs, self.skey = inputs, skey

    @property
    def name(self) -> str:
        return self.opts.name


_said_cuda_skip: set[str] = set()


def plan(opts: Options, store: Store) -> Plan:
    known = toolchain.memo(store.root)
    before = len(known)
    sset = scan(opts.paths, known)
    if len(known) != before:
        toolchain.save_memo(store.root)
    reason = toolchain.cuda_unavailable_reason() if sset.has_cuda else None
    built = [s for s in sset.sources if not (s.is_cuda and reason)]
    if not built:
        raise KloadError(f"kload: {opts.name!r} has only CUDA sources, and they cannot be built here: {reason}")
    with_cuda = any(s.is_cuda for s in built)
    if reason and opts.name not in _said_cuda_skip:
        _said_cuda_skip.add(opts.name)
        log.warning("kload: building %r for the CPU only: %s", opts.name, reason)

    cflags, cuda_cflags = list(opts.cflags), list(opts.cuda_cflags)
    # Bind each library's calls to its own functions: a process that loaded an
    # older build of the same code must not serve the newer build's calls.
    ldflags = list(opts.ldflags) + ["-Wl,-Bsymbolic-functions"]
    # gold links against libtorch's large symbol tables ~3x faster than bfd
    if knobs.fast_link() and not any(f.startswith("-fuse-ld") for f in ldflags) and toolchain.has_gold(store.root):
        ldflags.append("-fuse-ld=gold")
    if opts.debug:
        cflags += ["-g", "-O0"]
        cuda_cflags += ["-g", "-G", "-O0"]
    if sset.needs_checks:
        import shlex

        forced = "-include " + shlex.quote(str(include_dir() / "kload" / "checks.h"))
        cflags.append(forced)
        cuda_cflags.append(forced)

    inputs = {
        "name": opts.name,
        "style": sset.style,
        "sources": [{"path": str(s.path), "sha256": s.sha256} for s in built],
        "cflags": cflags,
        "cuda_cflags": cuda_cflags if with_cuda else [],
        "ldflags": ldflags,
        "include_paths": opts.include_paths,
        "kload_include": str(include_dir()),
        "with_cuda": with_cuda,
        "torch": toolchain.torch_identity(),
        "python": toolchain.python_identity(),
        "cxx": toolchain.compiler_identity(toolchain.cxx_command(), store.root),
        "env": toolchain.keyed_environment(),
    }
    if any("native" in f for f in cflags + cuda_cflags):
        inputs["host_cpu"] = toolchain.host_cpu()  # -march=native binaries run only where built
    if with_cuda:
        inputs["nvcc"] = toolchain.compiler_identity(
            str(Path(toolchain.find_cuda_home(), "bin", "nvcc")), store.root)
        inputs["cuda_arch"] = toolchain.cuda_arch_list()
    return Plan(opts, sset, [s.path for s in built], with_cuda, reason, cflags, cuda_cflags, ldflags,
                inputs, source_key(inputs))
