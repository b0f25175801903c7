"""Everything known before compiling: the sources' style, the
flags, the key inputs, and the source key they hash to (kload/cache/key.py).

It runs no subprocess when the key is in the cache (compiler versions come from
the cache's memo); kload.resolve runs it when the hit record does not match.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path

from kload.cache.key import source_key
from kload.cache.store import Store

from .. import knobs
from . import toolchain
from ..errors import KloadError
from ..options import cxx_command, host_cpu, keyed_environment, python_identity, torch_identity, torch_release
from ..options import Options, include_dir
from .sources import SourceSet, no_bindings, scan
from .toolchain import CudaArchs
from ..messages import msg

log = logging.getLogger("kload")


@dataclass(frozen=True, eq=False)
class Plan:
    """The build as kload will run it: every decision made before compiling, typed.

    The cache key's inputs are derived from it (:meth:`key_inputs`): hashed (``skey``, the
    build directory's name), stored in the manifest, compared by ``explain``; every step
    that decides something reads these fields, never that dict.
    """

    opts: Options
    sources: SourceSet
    built: list[Path]               # what compiles: CUDA sources are dropped where CUDA cannot build
    not_built: list[Path]           # those dropped ([a.cpp] and [a.cpp, a.cu] are different libraries)
    cuda_skipped: str | None        # why .cu sources are not built, or None
    with_cuda: bool
    cflags: list[str]
    cuda_cflags: list[str]
    ldflags: list[str]
    kload_include: str              # kload's include directory; "kload" for the stable ABI (keyed by content)
    torch: dict                     # torch's identity; for the stable ABI only the target it builds for
    python: dict | None             # the interpreter's ABI; None for the stable ABI
    cxx: dict                       # the C++ compiler (toolchain.compiler_identity)
    env: dict                       # the keyed environment variables
    stable_target: str | None       # "2.10": the oldest torch a stable-ABI library loads in
    host_cpu: str | None            # -march=native builds: the CPU they run on
    nvcc: dict | None               # CUDA builds: nvcc's identity
    cuda_archs: CudaArchs | None    # CUDA builds: the architectures, and where that list came from
    cuda_split: bool                # CUDA builds: .cu sources with torch's headers compile in halves (cuda_split/build.py)
    skey: str = field(init=False)   # the source key: the hash of key_inputs()

    def __post_init__(self) -> None:
        object.__setattr__(self, "skey", source_key(self.key_inputs()))

    @property
    def name(self) -> str:
        return self.opts.name

    @property
    def standalone(self) -> bool:
        """An executable (torch's is_standalone): linked, never loaded."""
        return self.opts.standalone

    def key_inputs(self) -> dict:
        """The cache key's inputs, as every kload since the cache's SCHEMA wrote them
        (entries written before still hit): what cache/key.py hashes, what a manifest's
        ``inputs`` holds, what ``kload explain`` compares. A fresh dict each call."""
        built = set(self.built)
        inputs = {
            "name": self.name,
            "style": self.sources.style,
            "sources": [{"path": str(s.path), "sha256": s.sha256} for s in self.sources.sources if s.path in built],
            "cflags": self.cflags,
            "cuda_cflags": self.cuda_cflags if self.with_cuda else [],
            "ldflags": self.ldflags,
            "include_paths": self.opts.include_paths,
            "kload_include": self.kload_include,
            "with_cuda": self.with_cuda,
            "torch": self.torch,
            "python": self.python,
            "cxx": self.cxx,
            "env": self.env,
        }
        if self.standalone:
            inputs["standalone"] = True
        if self.not_built:  # paths: editing them here changes nothing
            inputs["not_built"] = [str(p) for p in self.not_built]
        if self.host_cpu is not None:
            inputs["host_cpu"] = self.host_cpu
        if self.with_cuda:
            inputs["nvcc"] = self.nvcc
            inputs["cuda_arch"] = self.cuda_archs.keyed()
            if self.cuda_split:  # (absent where off: entries of the whole-file builds still hit)
                inputs["cuda_split"] = True
        return inputs


_said_cuda_skip: set[str] = set()
# The input checks the classic tutorials use without defining, as kload/checks.h defines them.
CHECK_MACROS = {
    "CHECK_CUDA": 'TORCH_CHECK((x).is_cuda(), #x " must be a CUDA tensor, got a tensor on ", (x).device())',
    "CHECK_CONTIGUOUS": 'TORCH_CHECK((x).is_contiguous(), #x " must be contiguous, got strides ", (x).strides())',
    "CHECK_INPUT": 'do { TORCH_CHECK((x).defined(), #x " must be a defined tensor"); CHECK_CONTIGUOUS(x); } while (0)',
}
GCC_PARSE_FLAGS = ["--param=ggc-min-expand=100", "--param=ggc-min-heapsize=524288"]


def stable_target(name: str) -> tuple[int, int]:
    """The stable ABI version to build for (KLOAD_STABLE_TARGET), checked against this torch."""
    text = knobs.stable_target()
    try:
        major, minor = (int(x) for x in text.split("."))
    except ValueError:
        raise KloadError(f"KLOAD_STABLE_TARGET={text!r} is not a torch release like 2.10") from None
    have = torch_release()
    if (major, minor) < (2, 10):
        raise KloadError(f"KLOAD_STABLE_TARGET={text}: kload's stable-ABI support needs 2.10 or later")
    if have < (major, minor):
        raise KloadError(
            f"{name!r} uses the stable ABI (kload/stable.h or torch/csrc/stable/), built for torch "
            f"{major}.{minor} and later (KLOAD_STABLE_TARGET), but the installed torch is {torch_identity()['version']}"
            + (": torch's stable ABI for extensions starts at 2.10" if have < (2, 10) else
               f"; set KLOAD_STABLE_TARGET={have[0]}.{have[1]} or upgrade torch"))
    return major, minor


def cuda_host_compiler(flags: list[str]) -> list[str]:
    """nvcc's host compiler: torch's loader passes ``-ccbin $CC``; a CUDA image's
    ``CUDAHOSTCXX`` (CMake's name, which nvcc does not read) is honoured the same way
    where CC and NVCC_CCBIN are unset."""
    import os

    host = os.environ.get("CUDAHOSTCXX")
    if host and not os.environ.get("CC") and not os.environ.get("NVCC_CCBIN") \
            and not any(f.startswith(("-ccbin", "--compiler-bindir")) for f in flags):
        return ["-ccbin", host]
    return []


def make_plan(opts: Options, store: Store) -> Plan:
    """Scan the sources and decide the build: style, flags, toolchain identities.
    No subprocess runs when the compilers and the sources' scan are in the cache's memo."""
    sset, built, reason = _sources_to_build(opts, store)
    with_cuda = any(s.is_cuda for s in built) or bool(opts.with_cuda and not reason)
    if reason and opts.name not in _said_cuda_skip:
        _said_cuda_skip.add(opts.name)
        log.warning("building %r for the CPU only: %s", opts.name, reason)
    cxx = toolchain.compiler_identity(cxx_command(), store.root)
    cflags, cuda_cflags, ldflags = _flags(opts, sset, cxx, with_cuda)
    torch_id, python_id, kload_inc, stable = torch_identity(), python_identity(), str(include_dir()), None
    if sset.stable:
        torch_id, python_id, kload_inc, stable = _stable_build(opts, with_cuda, cflags, ldflags, torch_id)
    native = any("native" in f for f in cflags + cuda_cflags)
    return Plan(
        opts=opts, sources=sset, built=[s.path for s in built], not_built=[s.path for s in sset.sources if s not in built],
        cuda_skipped=reason, with_cuda=with_cuda, cflags=cflags, cuda_cflags=cuda_cflags, ldflags=ldflags,
        kload_include=kload_inc, torch=torch_id, python=python_id, cxx=cxx, env=keyed_environment(),
        stable_target=stable, host_cpu=host_cpu() if native else None,
        nvcc=toolchain.compiler_identity(str(Path(toolchain.find_cuda_home(), "bin", "nvcc")), store.root, ask=False)
        if with_cuda else None,
        cuda_archs=toolchain.cuda_archs() if with_cuda else None,
        cuda_split=with_cuda and knobs.split_cuda(),
    )


def _sources_to_build(opts: Options, store: Store):
    """The sources' scan (memoized in the cache), and those that can be built here: a CUDA
    source cannot without a toolkit (then the reason, and the C++ part is built alone)."""
    scans = toolchain.memo(store.root).setdefault("source_scans", {})
    before = (scans.get("version"), len(scans.get("found") or {}))
    sset = scan(opts.paths, scans)
    if (scans["version"], len(scans["found"])) != before:
        toolchain.save_memo(store.root)
    if not (sset.op_library or sset.python_module or sset.fixed_namespaces or opts.standalone or opts.as_torch):
        raise no_bindings(sset)
    # torch's with_cuda=True asks for CUDA headers and libraries for .cpp sources too
    reason = toolchain.cuda_unavailable_reason() if sset.has_cuda or opts.with_cuda else None
    if reason and opts.as_torch:  # torch's loader raises here (OSError: CUDA_HOME ...); callers catch it to fall back
        raise OSError(msg(f"{opts.name!r} has CUDA sources, and they cannot be built here: {reason} "
                      "(kload.load would build the C++ part alone)"))
    built = [s for s in sset.sources if not (s.is_cuda and reason)]
    if not built:
        raise KloadError(f"{opts.name!r} has only CUDA sources, and they cannot be built here: {reason}")
    return sset, built, reason


def _flags(opts: Options, sset: SourceSet, cxx: dict, with_cuda: bool):
    """The C++, CUDA and link flags: kload's before the caller's (so theirs win)."""
    # GCC collects garbage from a small heap up, growing it 30% a time: parsing ATen's
    # headers runs many collections. Starting at 512 MB and doubling takes ~10% off
    # a compile for ~20% more peak memory (473 -> 571 MB for kernel.h); the object
    # code is the same.
    cflags = (GCC_PARSE_FLAGS if toolchain.is_gcc(cxx) else []) + list(opts.cflags)
    cuda_cflags = list(opts.cuda_cflags)
    # Bind each library's calls to its own functions: a process that loaded an
    # older build of the same code must not serve the newer build's calls.
    ldflags = list(opts.ldflags) + ["-Wl,-Bsymbolic-functions"]
    # (the linker, gold where it links, and the shared C++ runtime where -lstdc++ would
    # find only libstdc++.a are the build's business, not the key's: compile/pipeline.py asks
    # linking.py, and checks every artifact's runtime, whatever linked it)
    if with_cuda:
        cuda_cflags = cuda_host_compiler(cuda_cflags) + cuda_cflags
        if sset.cuda_lean_extension and knobs.lean_cuda():  # ahead of torch's include directories
            cuda_cflags.insert(0, "-I" + str(include_dir() / "kload" / "lean"))
    if opts.debug:
        cflags += ["-g", "-O0"]
        cuda_cflags += ["-g", "-G", "-O0"]
    if sset.missing_checks:
        import shlex

        # g++: as -D, not -include: GCC cannot use a precompiled <torch/extension.h>
        # after an -include'd file. (Quoted for the shell that runs torch's ninja file.)
        cflags += [shlex.quote(f"-D{m}(x)={CHECK_MACROS[m]}") for m in sset.missing_checks]
        cuda_cflags.append("-include " + shlex.quote(str(include_dir() / "kload" / "checks.h")))
    return cflags, cuda_cflags, ldflags


def _stable_build(opts: Options, with_cuda: bool, cflags: list, ldflags: list, full: dict):
    """The stable ABI: built for the oldest torch it targets, keyed by that and not by this
    torch build or this Python (compile/pipeline.py checks the binary imports nothing else);
    kload's headers are keyed by content (the header closure). Adds its flags; returns
    (torch identity, Python identity, kload include key, target)."""
    target = stable_target(opts.name)
    cflags.append("-DTORCH_TARGET_VERSION=0x%02x%02x000000000000" % target)
    if with_cuda:
        cflags.append("-DKLOAD_WITH_CUDA=1")  # the .cpp glue registers the CUDA kernels
    ldflags.insert(0, "-Wl,--as-needed")  # no DT_NEEDED on libtorch_python and friends
    torch_id = {"stable_abi": "%d.%d" % target, "cxx11_abi": full["cxx11_abi"]}
    if with_cuda:  # the CUDA runtime the kernels link (PyPI's torch went from 12 to 13 in 2.12)
        torch_id["cuda_major"] = (full["cuda"] or "").split(".")[0]
    return torch_id, None, "kload", "%d.%d" % target
