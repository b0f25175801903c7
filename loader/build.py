"""Step 6 of a load, the compile (obtain.py calls it under the build lock): the
plan's persistent build directory, torch.utils.cpp_extension.load on it (torchbuild.py)
with the precompiled headers (pch.py) and the toolchain's link flags (linking.py),
then the header closure and the full key. Publishing (step 7) is obtain.py's next call.
Imported only when something must be compiled.
"""
from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

from kload.cache.key import CHANGED_MARK, file_sha256, full_key, settled, stamp_of, stat_stamp, written_since
from kload.cache.store import Store, move_aside, read_json, write_atomic, write_json_atomic

from . import foreground, knobs, linking, pch, registration, split_build, toolchain, torchbuild, trim
from .errors import CompileError, KloadError
from .plan import Plan
from .compilers import cuda_toolkit, launchers, parallel_jobs
from .progress import BuildProgress
from .torchbuild import forget_objects, ninja_deps

log = logging.getLogger("kload")

NS_SOURCE = "_kload_ns_.cpp"


def header_closure(ws: Path, plan: Plan, deps: dict[str, list[str]], pch_headers: set[str],
                   pch_dirs: tuple[str, ...]) -> tuple[dict[str, str], dict[str, list | None]]:
    """Every local header the compiler read, with its content hash and stat stamp.
    A precompiled header's stub and .gch are left out (the PCH key covers them);
    the headers it was made from are in, when a compile used it (its dependency
    file does not list them), so the key is the same with or without it."""
    if not deps:
        raise KloadError(f"ninja recorded no header dependencies in {ws}; refusing to cache a build "
                         "whose inputs cannot all be seen")
    skip = {str(p) for p in plan.built}
    system = toolchain.system_prefixes(plan.with_cuda) + pch_dirs
    headers: dict[str, str] = {}
    stamps: dict[str, list | None] = {}
    for p in sorted({p for files in deps.values() for p in files} | pch_headers):
        if p in skip or p.startswith(str(ws) + os.sep) or p.startswith(system):
            continue
        try:
            st = os.stat(p)
        except OSError:
            st = None
        digest = file_sha256(p)
        if st is None or digest is None:  # deleted (or made unreadable) since: changed_during_build says so
            headers[p], stamps[p] = "", None
            continue
        headers[p] = digest
        # written meanwhile, or too recently for a stamp to stand for its bytes: lookups hash it
        stamps[p] = stamp_of(st) if settled(st) and stat_stamp(p) == stamp_of(st) else None
    return headers, stamps


def changed_during_build(plan: Plan, headers: dict[str, str], since_ns: int) -> list[str]:
    """The sources and headers written or deleted after the build started (``written_since``):
    the compiler may have read either version, so the build stands for neither. A source is
    also compared with the bytes its key was made of (hashed before the compile)."""
    shas = {str(s.path): s.sha256 for s in plan.sources.sources if s.path in plan.built}
    now_ns = time.time_ns()
    return [p for p in sorted(set(headers) | set(shas))
            if written_since(p, since_ns, now_ns) or not headers.get(p, "-")
            or (p in shas and file_sha256(p) != shas[p])]


COMPDB = "compile_commands.json"


def write_compdb(ws: Path, split: split_build.SplitBuild) -> None:
    """ninja's compilation database of this build (the real commands, flags and include
    paths; a split .cu as nvcc compiles it whole), for editors and clangd; ``kload ide``
    copies it beside the sources."""
    proc = subprocess.run(["ninja", "-t", "compdb"], cwd=ws, capture_output=True, text=True)
    if proc.returncode == 0 and proc.stdout.strip().startswith("["):
        write_atomic(ws / COMPDB, json.dumps(split.compdb(json.loads(proc.stdout)), indent=2))
    else:
        log.warning("could not write %s in %s: %s", COMPDB, ws, proc.stderr.strip())


RECORD = "kload_inputs.json"  # in the build directory: content hashes of the last build's inputs


def forget_stale_objects(ws: Path) -> None:
    """ninja rebuilds by mtime; kload keys by content. Before a build, delete every
    object whose recorded inputs changed content, so an edit whose mtime did not
    move (restored, coarse clock, copied tree) is still compiled."""
    record = read_json(ws / RECORD)
    if not record:
        return
    changed = {p for p, sha in record.items() if file_sha256(p) != sha}
    if changed:
        forget_objects(ws, changed)


@dataclass(frozen=True)
class Compiled:
    """A finished compile, ready to publish: the artifact in the build directory, the
    header closure it read, its full key and its manifest."""

    artifact: Path
    key: str
    headers: dict[str, str]
    stamps: dict[str, list | None]
    manifest: dict
    seconds: float


def compile(plan: Plan, store: Store, ws: Path) -> Compiled:
    """Compile ``plan`` in its build directory ``ws`` (the build lock is held).

    torch.utils.cpp_extension.load also loads the library it built; publishing moves
    that very file (same inode), so loading the entry afterwards finds the library
    already mapped and registers nothing twice."""
    link = link_flags(plan, store)
    try:
        return _compile(plan, store, ws, link)
    except CompileError as e:
        if not _fast_link_failed(plan, link, e):
            raise
        error = _link_error(e)
    # gold passed the toolchain probe but failed this link: once more without it (ninja
    # relinks only: the linker is not in the key), before any error is shown, and never
    # with gold again for this toolchain
    from .progress import say

    linking.forget_fast_linker(plan.cxx, list(plan.opts.ldflags), store.root)
    say(f"gold failed to link {plan.name} ({error}); linking again with the "
        "compiler's default linker, and without gold from now on", warning=True)
    return _compile(plan, store, ws, link_flags(plan, store))


def link_flags(plan: Plan, store: Store) -> list[str]:
    """What this toolchain's link needs beyond the plan's flags (linking.py: gold where it
    links, the shared C++ runtime where -lstdc++ would find only libstdc++.a); probed once
    per toolchain, when something is compiled (a lookup, even a full one, probes nothing)."""
    picked = any(f.startswith("-fuse-ld") for f in plan.opts.ldflags)
    link = linking.link_facts(plan.cxx, list(plan.opts.ldflags), store.root,
                              knobs.fast_link() and not picked)
    return link.runtime_flags + ([linking.FAST_LINKER] if link.fast_linker else [])


def _fast_link_failed(plan: Plan, link: list[str], e: CompileError) -> bool:
    """Whether a failed build got as far as its link, with gold, and gold failed it."""
    return (linking.FAST_LINKER in link and f"FAILED: {plan.name}" in e.raw
            and ("ld.gold" in e.raw or "gold:" in e.raw))


def _link_error(e: CompileError) -> str:
    lines = [t.strip() for t in e.raw.splitlines() if "error" in t and ("gold" in t or "ld" in t)]
    return lines[0] if lines else "see " + str(e.log_path)


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
    trash = move_aside(ws)
    log.warning("the last build of %s (%s) was interrupted; starting it again from a clean directory",
                name, holder or "unknown process")
    shutil.rmtree(trash, ignore_errors=True)


def _compile(plan: Plan, store: Store, ws: Path, link: list[str]) -> Compiled:
    name = plan.name
    if plan.sources.op_library or plan.sources.fixed_namespaces:  # before anything compiles or opens
        registration.check_schemas(name, list(plan.built), ws / "build.log")
    pchs = pch.PrecompiledHeaders(plan, store)  # check the precompiled headers (and say if one is damaged)
    trimmed = trim.Trim(plan, ws, trim.HEADER in pchs.ready)
    if ws.exists():
        _reset_interrupted(ws, name)
    ws.mkdir(mode=0o700, exist_ok=True)
    write_atomic(ws / BUILDING, f"pid {os.getpid()} on {os.uname().nodename}\n")
    # torch's own FileBaton; we hold the real (flock) lock, so any baton file is stale
    try:
        os.unlink(ws / "lock")
    except FileNotFoundError:
        pass
    sources = [str(p) for p in plan.built]
    namespace = None
    if plan.sources.op_library and not plan.sources.stable:  # stable ones are named at load
        namespace = f"kload_{name}_{uuid.uuid4().hex[:10]}"
        ns_src = ws / NS_SOURCE
        write_atomic(ns_src, "// Generated by kload: the operator namespace of this build (see kload/kernel.h).\n"
                             'namespace kload { namespace detail {\n'
                             f'__attribute__((visibility("hidden"))) const char* ns() {{ return "{namespace}"; }}\n'
                             "}}\n")
        sources.append(str(ns_src))
    artifact = ws / (name if plan.standalone else f"{name}.so")
    forget_stale_objects(ws)
    split = split_build.SplitBuild(plan, store, ws)
    started, since, since_ns = time.perf_counter(), time.time(), time.time_ns()
    try:
        # (foreground.held: kload's background precompiles stop while this build compiles)
        with foreground.held(), parallel_jobs(plan, len(sources)) as jobs, BuildProgress(name, ws, jobs) as progress, \
                launchers(store, plan), cuda_toolkit(plan), pchs.held():
            objects = []
            if split.active:  # the .cu sources compiled in halves; torch's loader links their objects
                objects = [str(o) for o in split.compile()]
                sources = split.others(sources, ws)
                _unlink(artifact)  # its new objects are not inputs ninja sees: link again
            trimmed.prepare()
            cflags = trimmed.cflags() + pchs.cflags()
            try:
                torchbuild.run(plan, ws, sources, cflags, link + objects, artifact)
            except CompileError as e:
                if not trimmed.may_explain(e.raw):
                    raise
                log.info("%s did not compile with ATen trimmed to the functions it names; compiling it "
                         "with the whole API", name)
                trimmed.give_up()
                torchbuild.run(plan, ws, sources, cflags, link + objects, artifact)
            seconds = time.perf_counter() - started
            deps = ninja_deps(ws)
            deps.update(split.deps())
            write_compdb(ws, split)
            notes = pchs.report(deps, ws, since)
            progress.finish(f"built {name} in {seconds:.1f} s{pchs.summary()}{trimmed.summary()}"
                            f"{split.summary()}")
    except KloadError:  # a CompileError, or a library refused before loading (linking.check_artifact)
        os.unlink(ws / BUILDING)  # a finished (failed) build; the directory stays valid
        raise
    finally:
        pchs.start_missing()  # the next edit compiles with them
    try:
        if plan.sources.stable:
            torchbuild.check_stable_imports(artifact, name)
        fixed, opened = plan.sources.fixed_namespaces, False
        if fixed and not plan.standalone:  # it registers as it opens: opened in a child first
            fixed, opened = registration.opens_safely(name, str(artifact), fixed,
                                                      [str(s.path) for s in plan.sources.sources])
        headers, stamps = header_closure(ws, plan, deps, pchs.headers_used() | split.headers_used(),
                                         pchs.prefixes() + split.prefixes())
        record = {**headers, **{str(s.path): s.sha256 for s in plan.sources.sources if s.path in plan.built}}
        changed = changed_during_build(plan, headers, since_ns)
        if changed:  # this process runs the build; no later lookup finds it, the next build recompiles
            from .progress import say

            say(f"{', '.join(changed)} changed while {name} compiled; this build is not reused (the next "
                "load compiles again)", warning=True)
            mark = CHANGED_MARK + uuid.uuid4().hex
            for p in changed:
                headers[p] = record[p] = mark
                stamps[p] = None
        write_json_atomic(ws / RECORD, record)
    except (KloadError, OSError):
        os.unlink(ws / BUILDING)  # finished, if not well: the directory is valid (not an interrupted build)
        raise
    os.unlink(ws / BUILDING)
    inputs = plan.key_inputs()
    return Compiled(artifact, full_key(plan.skey, headers), headers, stamps, seconds=seconds, manifest={
        "namespace": namespace,
        "style": "standalone" if plan.standalone else plan.sources.style,
        "python_module": plan.sources.python_module,
        # what torch registered when a child opened the library (a namespace named through a
        # macro is a fact of the library, not of its text); else what the text says
        "fixed_namespaces": fixed,
        "def_namespaces": plan.sources.def_namespaces,  # those its TORCH_LIBRARY blocks define
        "opens_checked": opened,  # a child opened it and torch refused nothing
        "fixed_ops": plan.sources.fixed_ops,
        "cuda_built": plan.with_cuda,
        "cuda_skipped": plan.cuda_skipped,
        "build_seconds": round(seconds, 3),
        "stable_target": plan.stable_target,
        # every source, built or not (a hit record keeps this, not the inputs)
        "source_paths": [str(s.path) for s in plan.sources.sources],
        "pch": notes,
        "inputs": inputs,
        "changed_during_build": changed,
        "cuda_split": split.manifest(),
        "trimmed": trimmed.manifest(),  # a trimmed ATen's headers (null: the whole API or the PCH)
    })


def _unlink(path: Path) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
