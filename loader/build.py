"""From sources to a cache entry: plan (key inputs), lock, build with
torch.utils.cpp_extension.load, read the header closure, publish.

    plan()  -> Plan      hash sources, classify them, gather the key inputs
    build() -> Entry     lookup -> lock -> lookup again -> compile -> publish
"""
from __future__ import annotations

import importlib.util
import logging
import os
import re
import shlex
import shutil
import subprocess
import sys
import sysconfig
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from kload.cache.key import file_sha256, full_key, source_key, workspace_key
from kload.cache.lock import build_lock
from kload.cache.store import Entry, Store

from . import knobs, toolchain
from .errors import CompileError, KloadError, parse_diagnostics
from .sources import SourceSet, scan

log = logging.getLogger("kload")

_IDENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
NS_SOURCE = "_kload_ns_.cpp"


def include_dir() -> Path:
    """Where <kload/kernel.h> lives (found without importing kload.kernels)."""
    spec = importlib.util.find_spec("kload.kernels")
    return Path(list(spec.submodule_search_locations)[0]) / "include"


@dataclass
class Options:
    name: str
    paths: list[Path]
    cflags: list[str] = field(default_factory=list)
    cuda_cflags: list[str] = field(default_factory=list)
    ldflags: list[str] = field(default_factory=list)
    include_paths: list[str] = field(default_factory=list)
    verbose: bool = False
    debug: bool = False


def check_name(name: str) -> str:
    if not isinstance(name, str) or not _IDENT.fullmatch(name):
        raise ValueError(
            f"kload: name must be a C identifier (letters, digits, underscores; not starting with a digit), got {name!r}"
        )
    return name


def default_name(path: Path) -> str:
    stem = re.sub(r"\W", "_", path.stem)
    return stem if _IDENT.fullmatch(stem) else f"_{stem}"


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
                 verbose, debug) -> Options:
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
    )


@dataclass
class Plan:
    opts: Options
    sources: SourceSet
    built: list[Path]                 # what is compiled (CUDA sources dropped without CUDA)
    with_cuda: bool
    cuda_skipped: str | None          # why .cu sources are not built, or None
    cflags: list[str]
    cuda_cflags: list[str]
    ldflags: list[str]
    inputs: dict
    skey: str

    @property
    def name(self) -> str:
        return self.opts.name


_said_cuda_skip: set[str] = set()


def plan(opts: Options, store: Store) -> Plan:
    sset = scan(opts.paths)
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
    if opts.debug:
        cflags += ["-g", "-O0"]
        cuda_cflags += ["-g", "-G", "-O0"]
    if sset.needs_checks:
        forced = "-include " + shlex.quote(str(include_dir() / "kload" / "checks.h"))
        cflags.append(forced)
        cuda_cflags.append(forced)

    store.prepare()
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
    if with_cuda:
        inputs["nvcc"] = toolchain.compiler_identity(
            str(Path(toolchain.find_cuda_home(), "bin", "nvcc")), store.root)
        inputs["cuda_arch"] = toolchain.cuda_arch_list()
    return Plan(opts, sset, [s.path for s in built], with_cuda, reason, cflags, cuda_cflags, ldflags,
                inputs, source_key(inputs))


# -- building ------------------------------------------------------------------

def _system_prefixes(with_cuda: bool) -> tuple[str, ...]:
    """Headers under these belong to torch, Python, the compiler or CUDA, which the
    key already covers by version; every other header is hashed by content."""
    import torch

    prefixes = [str(Path(torch.__file__).parent / "include"), "/usr/include/", "/usr/lib/"]
    for key in ("include", "platinclude"):
        p = sysconfig.get_paths().get(key)
        if p:
            prefixes.append(p)
    cuda_home = toolchain.find_cuda_home()
    if with_cuda and cuda_home:
        prefixes.append(os.path.realpath(cuda_home))
        prefixes.append(cuda_home)
    return tuple(os.path.join(p, "") for p in prefixes)


def header_closure(ws: Path, plan_: Plan) -> dict[str, str]:
    """Every local header the compiler read, with its content hash, from ninja's
    record of the depfiles (``ninja -t deps``)."""
    proc = subprocess.run(["ninja", "-t", "deps"], cwd=ws, capture_output=True, text=True)
    if proc.returncode != 0:
        raise KloadError(f"kload: could not read the header dependencies in {ws}: {proc.stderr.strip()}")
    skip = {str(p) for p in plan_.built}
    system = _system_prefixes(plan_.with_cuda)
    headers: dict[str, str] = {}
    objects_with_deps = 0
    for line in proc.stdout.splitlines():
        if not line.startswith(" "):
            if "#deps" in line:
                objects_with_deps += 1
            continue
        p = os.path.normpath(os.path.join(ws, line.strip()))
        if p in skip or p.startswith(str(ws) + os.sep) or p.startswith(system):
            continue
        digest = file_sha256(p)
        if digest is None:
            raise KloadError(f"kload: a header the build read is unreadable now: {p}")
        headers[p] = digest
    if objects_with_deps == 0:
        raise KloadError(f"kload: ninja recorded no header dependencies in {ws}; refusing to cache a build "
                         "whose inputs cannot all be seen")
    return dict(sorted(headers.items()))


def _write_if_changed(path: Path, text: str) -> None:
    try:
        if path.read_text() == text:
            return
    except OSError:
        pass
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def _ensure_ninja_on_path() -> None:
    if shutil.which("ninja") is None:
        here = Path(sys.executable).parent
        if (here / "ninja").exists():
            os.environ["PATH"] = f"{here}{os.pathsep}{os.environ.get('PATH', '')}"
        else:
            raise KloadError("kload: ninja is not installed (pip install ninja)")


def compile_plan(plan_: Plan, store: Store) -> tuple[Entry, float]:
    """Compile under the build lock (the caller has looked the key up already).

    Returns the published entry and the seconds the compile took (0.0 when
    another process published it while this one waited for the lock).
    torch.utils.cpp_extension.load also loads the library it built; publishing
    moves that very file (same inode), so loading the entry afterwards finds the
    library already mapped and registers nothing twice.
    """
    name = plan_.name
    wkey = workspace_key(plan_.inputs)
    ws = store.builds / f"{name}-{wkey[:12]}"
    with build_lock(store.locks / f"{name}-{wkey[:12]}.lock", name):
        again = store.lookup(plan_.skey)
        if again is not None:  # another process built it while we waited
            return again, 0.0
        ws.mkdir(mode=0o700, exist_ok=True)
        # torch's own FileBaton; we hold the real (flock) lock, so any baton file is stale
        try:
            os.unlink(ws / "lock")
        except FileNotFoundError:
            pass
        sources = [str(p) for p in plan_.built]
        namespace = None
        if plan_.sources.op_library:
            namespace = f"kload_{name}_{uuid.uuid4().hex[:10]}"
            ns_src = ws / NS_SOURCE
            _write_if_changed(
                ns_src,
                "// Generated by kload: the operator namespace of this build (see kload/kernel.h).\n"
                "namespace kload { namespace detail {\n"
                f'__attribute__((visibility("hidden"))) const char* ns() {{ return "{namespace}"; }}\n'
                "}}\n",
            )
            sources.append(str(ns_src))
        artifact = ws / f"{name}.so"
        started = time.perf_counter()
        _run_torch_build(plan_, ws, sources)
        seconds = time.perf_counter() - started
        headers = header_closure(ws, plan_)
        key = full_key(plan_.skey, headers)
        entry = store.publish(
            name=name, skey=plan_.skey, key=key, headers=headers, built_artifact=artifact,
            manifest={
                "namespace": namespace,
                "style": plan_.sources.style,
                "python_module": plan_.sources.python_module,
                "fixed_namespaces": plan_.sources.fixed_namespaces,
                "cuda_built": plan_.with_cuda,
                "cuda_skipped": plan_.cuda_skipped,
                "build_seconds": round(seconds, 3),
                "inputs": plan_.inputs,
            },
        )
        return entry, seconds


def _run_torch_build(plan_: Plan, ws: Path, sources: list[str]) -> None:
    _ensure_ninja_on_path()
    from torch.utils import cpp_extension

    # torch remembers per process which sources it built under a name and skips
    # the build when they look unchanged; it cannot see headers, so forget that.
    versioner = getattr(cpp_extension, "JIT_EXTENSION_VERSIONER", None)
    if versioner is not None and hasattr(versioner, "entries"):
        versioner.entries.pop(plan_.name, None)
    log_path = ws / "build.log"
    try:
        cpp_extension.load(
            name=plan_.name,
            sources=sources,
            extra_cflags=plan_.cflags,
            extra_cuda_cflags=plan_.cuda_cflags,
            extra_ldflags=plan_.ldflags,
            extra_include_paths=[str(include_dir())] + plan_.opts.include_paths,
            build_directory=str(ws),
            verbose=plan_.opts.verbose,
            with_cuda=plan_.with_cuda,
            is_python_module=False,
        )
    except RuntimeError as e:
        text = str(e)
        if not text.startswith("Error building extension"):
            raise
        output = text.split(":", 1)[1] if ":" in text else text
        if not output.strip() and plan_.opts.verbose:
            # verbose builds print straight to the terminal; capture the failure once more
            proc = subprocess.run(["ninja", "-v"], cwd=ws, capture_output=True, text=True)
            output = proc.stdout + proc.stderr
        log_path.write_text(output)
        raise CompileError(plan_.name, parse_diagnostics(output), log_path, output) from None
    except OSError as e:
        cause = e.__cause__ or e
        hint = ""
        if plan_.cuda_skipped and "undefined symbol" in str(cause):
            hint = f"\n(its CUDA sources were not built: {plan_.cuda_skipped})"
        raise KloadError(f"kload: {plan_.name!r} compiled but cannot be loaded: {cause}{hint}") from None
