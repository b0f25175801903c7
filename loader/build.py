"""From a plan to a published cache entry, on a miss: lock, look up again,
compile with torch.utils.cpp_extension.load, read the header closure, publish.
Imported only when something must be compiled.
"""
from __future__ import annotations

import errno
import logging
import os
import shlex
import shutil
import subprocess
import sys
import time
import uuid
from pathlib import Path

from kload.cache.key import file_sha256, full_key, stat_stamp, workspace_key
from kload.cache.lock import build_lock
from kload.cache.store import Entry, Store, read_json, writable_error, write_atomic, write_json_atomic

from . import knobs, pch, toolchain
from .errors import CompileError, KloadError, parse_diagnostics
from .options import include_dir
from .plan import Plan
from .compilers import cuda_toolkit, launchers, parallel_jobs
from .progress import BuildProgress

log = logging.getLogger("kload")

NS_SOURCE = "_kload_ns_.cpp"


def ninja_deps(ws: Path) -> dict[str, list[str]]:
    """object file -> every file its compile read (ninja's record of the depfiles)."""
    proc = subprocess.run(["ninja", "-t", "deps"], cwd=ws, capture_output=True, text=True)
    if proc.returncode != 0:
        raise KloadError(f"kload: could not read the header dependencies in {ws}: {proc.stderr.strip()}")
    deps: dict[str, list[str]] = {}
    current: list[str] | None = None
    for line in proc.stdout.splitlines():
        if not line.strip():
            continue
        if not line.startswith(" "):
            current = deps.setdefault(line.split(":", 1)[0], []) if "#deps" in line else None
        elif current is not None:
            current.append(os.path.normpath(os.path.join(ws, line.strip())))
    return deps


def header_closure(ws: Path, plan_: Plan, deps: dict[str, list[str]], pchs: pch.Use
                   ) -> tuple[dict[str, str], dict[str, list | None]]:
    """Every local header the compiler read, with its content hash and stat stamp.
    A precompiled header's stub and .gch are left out (the PCH key covers them);
    the headers it was made from are in, when a compile used it (its dependency
    file does not list them), so the key is the same with or without it."""
    if not deps:
        raise KloadError(f"kload: ninja recorded no header dependencies in {ws}; refusing to cache a build "
                         "whose inputs cannot all be seen")
    skip = {str(p) for p in plan_.built}
    system = toolchain.system_prefixes(plan_.with_cuda) + pchs.prefixes()
    headers: dict[str, str] = {}
    stamps: dict[str, list | None] = {}
    for p in sorted({p for files in deps.values() for p in files} | pchs.headers_used()):
        if p in skip or p.startswith(str(ws) + os.sep) or p.startswith(system):
            continue
        before = stat_stamp(p)
        digest = file_sha256(p)
        if digest is None:
            raise KloadError(f"kload: a header the build read is unreadable now: {p}")
        headers[p] = digest
        stamps[p] = before if stat_stamp(p) == before else None  # written meanwhile: always hash
    return headers, stamps


COMPDB = "compile_commands.json"


def write_compdb(ws: Path) -> None:
    """ninja's compilation database of this build (the real commands, flags and include
    paths), for editors and clangd; ``kload ide`` copies it beside the sources."""
    proc = subprocess.run(["ninja", "-t", "compdb"], cwd=ws, capture_output=True, text=True)
    if proc.returncode == 0 and proc.stdout.strip().startswith("["):
        write_atomic(ws / COMPDB, proc.stdout)
    else:
        log.warning("kload: could not write %s in %s: %s", COMPDB, ws, proc.stderr.strip())


RECORD = "kload_inputs.json"  # in the build directory: content hashes of the last build's inputs


def forget_stale_objects(ws: Path) -> None:
    """ninja rebuilds by mtime; kload keys by content. Before a build, delete every
    object whose recorded inputs changed content, so an edit whose mtime did not
    move (restored, coarse clock, copied tree) is still compiled."""
    record = read_json(ws / RECORD)
    if not record:
        return
    changed = {p for p, sha in record.items() if file_sha256(p) != sha}
    if not changed:
        return
    for obj, files in ninja_deps(ws).items():
        if changed.intersection(files):
            try:
                os.unlink(ws / obj)
            except FileNotFoundError:
                pass


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
    try:
        return _compile_locked(plan_, store)
    except OSError as e:
        if e.errno in (errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM):
            raise writable_error(store.root, e) from None
        raise


BUILDING = ".kload_building"  # in a build directory while a build runs there


def _reset_interrupted(ws: Path, name: str) -> None:
    """A build killed mid-way (we hold its lock now, so its process is gone) may
    have left orphaned ninja/compiler processes that still write into its
    directory: move the directory aside (their relative writes follow it there)
    and start clean."""
    marker = ws / BUILDING
    if not marker.exists():
        return
    holder = marker.read_text(errors="replace").strip()
    trash = ws.with_name(f".trash-{ws.name}-{uuid.uuid4().hex[:6]}")
    os.replace(ws, trash)
    log.warning("kload: the last build of %s (%s) was interrupted; starting it again from a clean directory",
                name, holder or "unknown process")
    shutil.rmtree(trash, ignore_errors=True)


def workspace(plan_: Plan, store: Store) -> Path:
    """The plan's persistent ninja directory (its objects survive edits); its lock is
    ``locks/<same name>.lock``."""
    return store.builds / f"{plan_.name}-{workspace_key(plan_.inputs)[:12]}"


def _compile_locked(plan_: Plan, store: Store) -> tuple[Entry, float]:
    name = plan_.name
    ws = workspace(plan_, store)
    store.prepare()
    with build_lock(store.locks / f"{ws.name}.lock", name):
        again = store.lookup(plan_.skey)
        if again is not None:  # another process built it while we waited
            return again, 0.0
        if knobs.remote_cache() is None:
            return _build(plan_, store, ws)
        from . import remote  # the shared remote cache (and redis): only when one is set

        return remote.through(plan_, store, lambda: _build(plan_, store, ws))


def _build(plan_: Plan, store: Store, ws: Path) -> tuple[Entry, float]:
    """Compile and publish (the build lock is held)."""
    name = plan_.name
    pchs = pch.Use(plan_, store)  # check the precompiled headers (and say if one is damaged)
    if ws.exists():
        _reset_interrupted(ws, name)
    ws.mkdir(mode=0o700, exist_ok=True)
    write_atomic(ws / BUILDING, f"pid {os.getpid()} on {os.uname().nodename}\n")
    # torch's own FileBaton; we hold the real (flock) lock, so any baton file is stale
    try:
        os.unlink(ws / "lock")
    except FileNotFoundError:
        pass
    sources = [str(p) for p in plan_.built]
    namespace = None
    if plan_.sources.op_library and not plan_.sources.stable:  # stable ones are named at load
        namespace = f"kload_{name}_{uuid.uuid4().hex[:10]}"
        ns_src = ws / NS_SOURCE
        write_atomic(
            ns_src,
            "// Generated by kload: the operator namespace of this build (see kload/kernel.h).\n"
            "namespace kload { namespace detail {\n"
            f'__attribute__((visibility("hidden"))) const char* ns() {{ return "{namespace}"; }}\n'
            "}}\n",
        )
        sources.append(str(ns_src))
    standalone = bool(plan_.inputs.get("standalone"))
    artifact = ws / (name if standalone else f"{name}.so")
    forget_stale_objects(ws)
    started, since = time.perf_counter(), time.time()
    try:
        with parallel_jobs(plan_, len(sources)) as jobs, BuildProgress(name, ws, jobs) as progress, \
                launchers(store, plan_), cuda_toolkit(plan_), pchs.held():
            _run_torch_build(plan_, ws, sources, pchs.cflags())
            seconds = time.perf_counter() - started
            deps = ninja_deps(ws)
            write_compdb(ws)
            notes = pchs.report(deps, ws, since)
            progress.finish(f"kload: built {name} in {seconds:.1f} s{pchs.summary()}")
    except CompileError:
        os.unlink(ws / BUILDING)  # a finished (failed) build; the directory stays valid
        raise
    finally:
        pchs.start_missing()  # the next edit compiles with them
    if plan_.sources.stable:
        check_stable_imports(artifact, name)
    headers, stamps = header_closure(ws, plan_, deps, pchs)
    write_json_atomic(ws / RECORD, {**headers, **{s["path"]: s["sha256"] for s in plan_.inputs["sources"]}})
    key = full_key(plan_.skey, headers)
    os.unlink(ws / BUILDING)
    entry = store.publish(
        name=name, skey=plan_.skey, key=key, headers=headers, stamps=stamps, built_artifact=artifact,
        manifest={
            "namespace": namespace,
            "style": "standalone" if standalone else plan_.sources.style,
            "python_module": plan_.sources.python_module,
            "fixed_namespaces": plan_.sources.fixed_namespaces,
            "fixed_ops": plan_.sources.fixed_ops,
            "cuda_built": plan_.with_cuda,
            "cuda_skipped": plan_.cuda_skipped,
            "build_seconds": round(seconds, 3),
            "stable_target": plan_.inputs["torch"].get("stable_abi"),
            # every source, built or not (a hit record keeps this, not the inputs)
            "source_paths": [str(s.path) for s in plan_.sources.sources],
            "pch": notes,
            "inputs": plan_.inputs,
        },
    )
    return entry, seconds


# Undefined symbols that tie a library to one torch build or one Python (demangled by nm -C)
_VERSIONED_SYMBOL = r"(?:^|[^\w:])(?:at|c10|torch|caffe2|pybind11)::|^_?Py"


def check_stable_imports(artifact: Path, name: str) -> None:
    """A stable-ABI entry is keyed without the torch build and Python: make sure the
    binary imports neither (only the C shims aoti_torch_* / torch_*, libc, libstdc++)."""
    import re

    proc = subprocess.run(["nm", "-D", "-C", "--undefined-only", str(artifact)], capture_output=True, text=True)
    if proc.returncode != 0:
        raise KloadError(f"kload: cannot list the symbols {artifact} imports (nm): {proc.stderr.strip()}")
    bad = [line.split(None, 1)[-1] for line in proc.stdout.splitlines()
           if re.search(_VERSIONED_SYMBOL, line.split(None, 1)[-1])]
    if bad:
        shown = "\n  ".join(bad[:5]) + (f"\n  ... and {len(bad) - 5} more" if len(bad) > 5 else "")
        raise KloadError(
            f"kload: {name!r} is built as a stable-ABI library (it includes kload/stable.h or torch/csrc/stable/), "
            f"but it imports symbols of torch's C++ API or of Python, which would tie it to this torch build:\n  "
            f"{shown}\nInclude only <kload/stable.h>, torch/csrc/stable/ and torch/headeronly/ headers (a header of "
            "ATen, c10, torch/library.h or pybind11 included by one of your own headers does this).")


def _run_torch_build(plan_: Plan, ws: Path, sources: list[str], pch_cflags: list[str]) -> None:
    _ensure_ninja_on_path()
    from torch.utils import cpp_extension

    # torch remembers per process which sources it built under a name and skips
    # the build when they look unchanged; it cannot see headers, so forget that.
    versioner = getattr(cpp_extension, "JIT_EXTENSION_VERSIONER", None)
    if versioner is not None and hasattr(versioner, "entries"):
        versioner.entries.pop(plan_.name, None)
    log_path = ws / "build.log"
    kload_include = "-I" + shlex.quote(str(include_dir()))
    # the CUDA headers of a PyPI torch, after the toolkit's own (not keyed: torch's identity covers them)
    cuda_includes = [f"-isystem {shlex.quote(p)}" for p in toolchain.pip_cuda_includes()] if plan_.with_cuda else []
    # torch's own function, even when kload.patch() (or anything on top of it) replaced the attribute
    torch_load = getattr(cpp_extension, "_kload_torch_load", cpp_extension.load)
    try:
        torch_load(
            name=plan_.name,
            sources=sources,
            # copies: torch appends its own flags to these lists, and the manifest records ours
            # kload's include directory through the flags, so that g++ finds the
            # precompiled headers' directories ahead of it (and nvcc does not)
            extra_cflags=list(plan_.cflags) + pch_cflags + [kload_include] + cuda_includes,
            extra_cuda_cflags=list(plan_.cuda_cflags) + [kload_include] + cuda_includes,
            extra_ldflags=list(plan_.ldflags),
            extra_include_paths=list(plan_.opts.include_paths),
            build_directory=str(ws),
            verbose=plan_.opts.verbose,
            with_cuda=plan_.with_cuda,
            is_python_module=False,
            is_standalone=bool(plan_.inputs.get("standalone")),
        )
    except RuntimeError as e:
        text = str(e)
        if not text.startswith("Error building extension"):
            raise
        output = text.split(":", 1)[1] if ":" in text else text
        if "No space left on device" in output or "Disk quota exceeded" in output:
            raise writable_error(ws.parent.parent, OSError(errno.ENOSPC, "No space left on device", str(ws)))
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
