"""Everything known before compiling: the sources' style, the flags, the key inputs;
and the full lookup that a missing or outdated hit record falls back to.

It runs no subprocess on a hit (compiler versions come from the cache's memo).
"""
from __future__ import annotations

import logging
from pathlib import Path

from kload.cache import Entry
from kload.cache.key import source_key
from kload.cache.store import Store

from . import knobs, toolchain
from .errors import KloadError
from .handle import (KEY_CODE, Options, check_name, default_name, include_dir,  # noqa: F401 (re-exported)
                     make_options)
from .sources import SourceSet, scan

log = logging.getLogger("kload")


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
GCC_PARSE_FLAGS = ["--param=ggc-min-expand=100", "--param=ggc-min-heapsize=524288"]


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

    cxx = toolchain.compiler_identity(toolchain.cxx_command(), store.root)
    # GCC collects garbage from a small heap up, growing it 30% a time: parsing ATen's
    # headers runs many collections. Starting at 512 MB and doubling takes ~10% off
    # a compile for ~20% more peak memory (473 -> 571 MB for kernel.h); the object
    # code is the same. Before the caller's flags, so theirs win.
    cflags = (GCC_PARSE_FLAGS if toolchain.is_gcc(cxx) else []) + list(opts.cflags)
    cuda_cflags = list(opts.cuda_cflags)
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
        "cxx": cxx,
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


def resolve_full(opts: Options, root: Path, fast: tuple[str, str] | None) -> tuple[Entry, str]:
    """``(entry, "cache" | "built")`` the full way: hash the inputs, look the key up,
    else lock and compile. Then write the hit record for ``fast`` (the fingerprint
    and compiler path from handle.fingerprint), so the next process need not."""
    store = Store(root)
    p = plan(opts, store)
    entry = store.lookup(p.skey)
    how = "cache"
    if entry is not None:
        entry.touch()
    else:
        if knobs.disable_jit():
            from .explain import explain_plan

            reasons = explain_plan(p, store).reasons
            raise KloadError(
                f"kload: KLOAD_DISABLE_JIT=1 and the cache at {store.root} has no build of {opts.name!r} for "
                "these inputs, so nothing is compiled" + "".join(f"\n  {r}" for r in reasons)
                + "\nPrebuild it into the cache with `python -m kload build SOURCES...` (same flags), or unset "
                "KLOAD_DISABLE_JIT."
            )
        from .build import compile_plan  # the compile machinery loads on a miss only
        from .runtime import check_fixed_namespaces

        # a fixed TORCH_LIBRARY namespace can be registered once per process: refuse
        # before compiling, since torch loads what it builds
        check_fixed_namespaces(opts.name, p.sources.fixed_namespaces, None)
        entry, seconds = compile_plan(p, store)
        if seconds > 0:
            how = "built"
            try:
                limit = knobs.cache_max_size()
            except ValueError as e:  # a bad KLOAD_CACHE_MAX_SIZE must not fail a build that succeeded
                log.warning("%s; KLOAD_CACHE_MAX_SIZE is ignored", e)
                limit = None
            if limit is not None:
                for gone in store.evict_to(limit, keep={entry.path.name}):
                    log.info("kload: evicted %s (least recently used; KLOAD_CACHE_MAX_SIZE)", gone.path.name)
    if fast is not None:
        fingerprint, cxx = fast
        files: dict[str, str | None] = {str(s.path): s.sha256 for s in p.sources.sources}
        files.update(entry.manifest.get("headers") or {})
        files[cxx] = None  # the compiler binary: its version is remembered by this stamp too
        for code in KEY_CODE:
            files[code] = None
        if "-fuse-ld=gold" in p.ldflags:
            gold = toolchain.which("ld.gold")
            if gold is None:
                return entry, how
            files[gold] = None
        store.write_hit_record(opts.name, fingerprint, cxx, entry, files)
    return entry, how
