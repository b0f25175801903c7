"""The compile (kload.resolve.obtain calls it under the build lock): the plan's
persistent build directory, torch.utils.cpp_extension.load on it (torchbuild.py)
with the precompiled headers (pch.py) and the toolchain's link flags (linking.py),
then the header closure and the full key. Publishing is obtain's next call.
Imported only when something must be compiled.
"""
from __future__ import annotations

import logging
import os
import shutil
import time
import uuid
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from kload.cache.key import CHANGED_MARK, full_key
from kload.cache.store import Store, move_aside, write_atomic, write_json_atomic

from . import foreground, linking, pch, registration, torchbuild, trim
from .. import knobs
from .cuda_split import build as split_build
from ..errors import CompileError, KloadError
from ..plan.plan import Plan
from .compilers import cuda_toolkit, launchers, parallel_jobs
from ..progress import BuildProgress
from .inputs import RECORD, changed_during_build, forget_stale_objects, header_closure, write_compdb
from .torchbuild import ninja_deps

log = logging.getLogger("kload")

NS_SOURCE = "_kload_ns_.cpp"
OPENMP_UNDER_CLANG = ("{name}: clang's -fopenmp runs #pragma omp on LLVM's libomp, a second OpenMP runtime "
                      "and thread pool beside the libgomp torch loaded (and -fopenmp=libgomp compiles the "
                      "pragmas away). Under clang, write the loop with at::parallel_for (or "
                      "torch::stable::parallel_for) and keep -fopenmp-simd for the simd pragmas.")


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
    """Compile ``plan`` in its build directory ``ws`` (the build lock is held). Nothing is
    loaded into this process: torch's loader is stopped short of its own load, so the
    first ``dlopen`` is of the published entry (kload.resolve.library)."""
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
    from ..progress import say

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


@dataclass
class _Build:
    """One compile's state, handed from stage to stage (:func:`_compile`)."""

    plan: Plan
    store: Store
    ws: Path
    link: list[str]
    pchs: pch.PrecompiledHeaders
    trimmed: trim.Trim
    split: split_build.SplitBuild | None = None
    sources: list[str] = field(default_factory=list)  # what torch's loader compiles
    objects: list[str] = field(default_factory=list)  # ... and links beside them (the split's halves)
    namespace: str | None = None
    started: float = 0.0
    since: float = 0.0     # time.time() at the start: a PCH made since is not this build's
    since_ns: int = 0      # ... and a source or header written since is changed_during_build
    seconds: float = 0.0
    deps: dict = field(default_factory=dict)  # ninja's header dependencies, per object
    notes: dict = field(default_factory=dict)  # the precompiled headers' notes, per source
    fixed: list | None = None  # the TORCH_LIBRARY namespaces, as the child that opened it saw them
    opened: bool = False
    headers: dict = field(default_factory=dict)
    stamps: dict = field(default_factory=dict)
    changed: list = field(default_factory=list)

    @property
    def artifact(self) -> Path:
        return self.ws / (self.plan.name if self.plan.standalone else f"{self.plan.name}.so")


def _compile(plan: Plan, store: Store, ws: Path, link: list[str]) -> Compiled:
    """The compile, as its stages: checked and prepared before anything runs; then, with
    the cores (background precompiles paused), the split ``.cu`` halves, torch's loader
    (trimmed ATen, or the precompiled header), ninja's dependencies; then the library's
    link and registration checked, and the headers it read recorded."""
    b = _prepare(plan, store, ws, link)
    try:
        with _compiling(b) as progress:
            for stage in (_split_halves, _torch_loader, _dependencies):
                stage(b)
            progress.finish(f"built {plan.name} in {b.seconds:.1f} s{b.pchs.summary()}{b.trimmed.summary()}"
                            f"{b.split.summary()}")
    except KloadError:  # a CompileError, or a library refused before loading (linking.check_artifact)
        os.unlink(ws / BUILDING)  # a finished (failed) build: the directory stays valid
        raise
    finally:
        b.pchs.start_missing()  # the next edit compiles with them
    try:
        for stage in (_check_library, _record_inputs):
            stage(b)
    except (KloadError, OSError):
        os.unlink(ws / BUILDING)  # finished, if not well: the directory is valid (not an interrupted build)
        raise
    os.unlink(ws / BUILDING)
    return _compiled(b)


def _prepare(plan: Plan, store: Store, ws: Path, link: list[str]) -> _Build:
    """Before anything compiles: the schemas read by torch's parser, the precompiled headers
    checked (a damaged one is said), the trim planned, the build directory made ours."""
    if plan.sources.op_library or plan.sources.fixed_namespaces:
        registration.check_schemas(plan.name, list(plan.built), ws / "build.log")
    if plan.cxx.get("family") == "clang" and any(f.startswith("-fopenmp") and f != "-fopenmp-simd"
                                                 for f in plan.opts.cflags + plan.opts.ldflags):
        from ..progress import say

        say(OPENMP_UNDER_CLANG.format(name=plan.name), warning=True)
    pchs = pch.PrecompiledHeaders(plan, store)
    b = _Build(plan, store, ws, link, pchs, trim.Trim(plan, ws, pchs.serves(trim.HEADER)))
    if ws.exists():
        _reset_interrupted(ws, plan.name)
    ws.mkdir(mode=0o700, exist_ok=True)
    write_atomic(ws / BUILDING, f"pid {os.getpid()} on {os.uname().nodename}\n")
    try:  # torch's own FileBaton; we hold the real (flock) lock, so any baton file is stale
        os.unlink(ws / "lock")
    except FileNotFoundError:
        pass
    b.sources = [str(p) for p in plan.built]
    # kernel.h's kload_register() names the namespace even where no KLOAD_LIBRARY block uses it
    kernel_h = "kload/kernel.h" in plan.sources.pch_headers
    if (plan.sources.op_library or kernel_h) and not plan.sources.stable:  # stable ones are named at load
        namespace = f"kload_{plan.name}_{uuid.uuid4().hex[:10]}"
        b.namespace = namespace if plan.sources.op_library else None
        write_atomic(ws / NS_SOURCE, "// Generated by kload: the operator namespace of this build (see "
                     "kload/kernel.h).\nnamespace kload { namespace detail {\n"
                     f'__attribute__((visibility("hidden"))) const char* ns() {{ return "{namespace}"; }}\n'
                     "}}\n")
        b.sources.append(str(ws / NS_SOURCE))
    forget_stale_objects(ws)
    b.split = split_build.SplitBuild(plan, store, ws)
    return b


@contextmanager
def _compiling(b: _Build):
    """What a build holds while it compiles: the foreground (kload's background precompiles
    stop), the job slots, the progress line, the compiler launchers, the CUDA toolkit and
    the precompiled headers (none is evicted meanwhile). Yields the progress line."""
    b.started, b.since, b.since_ns = time.perf_counter(), time.time(), time.time_ns()
    with ExitStack() as held:
        held.enter_context(foreground.held())
        jobs = held.enter_context(parallel_jobs(b.plan, len(b.sources)))
        progress = held.enter_context(BuildProgress(b.plan.name, b.ws, jobs))
        for context in (launchers(b.store, b.plan), cuda_toolkit(b.plan), b.pchs.held()):
            held.enter_context(context)
        yield progress


def _split_halves(b: _Build) -> None:
    """The .cu sources compiled in halves (cuda_split); torch's loader links their objects."""
    if b.split.active:
        b.objects = [str(o) for o in b.split.compile()]
        b.sources = b.split.others(b.sources, b.ws)
        _unlink(b.artifact)  # its new objects are not inputs ninja sees: link again


def _torch_loader(b: _Build) -> None:
    """torch.utils.cpp_extension.load on the directory, ATen trimmed to what the sources name
    (or the precompiled header); a trim the compile refutes is given up, once, and so is a
    ``.pch`` clang refuses."""
    b.trimmed.prepare()
    for _ in range(3):  # as planned; without a .pch clang refused; without the trim
        cflags = b.trimmed.cflags() + b.pchs.cflags()
        try:
            torchbuild.run(b.plan, b.ws, b.sources, cflags, b.link + b.objects, b.artifact)
            break
        except CompileError as e:
            if b.pchs.refused(e.raw):
                continue
            if not b.trimmed.may_explain(e.raw):
                raise
            log.info("%s did not compile with ATen trimmed to the functions it names; compiling it "
                     "with the whole API", b.plan.name)
            b.trimmed.give_up()
    b.seconds = time.perf_counter() - b.started


def _dependencies(b: _Build) -> None:
    """ninja's header dependencies (and the split's), the compilation database, the notes
    on each precompiled header (used, or why not)."""
    b.deps = ninja_deps(b.ws)
    b.deps.update(b.split.deps())
    write_compdb(b.ws, b.split)
    b.notes = b.pchs.report(b.deps, b.ws, b.since)


def _check_library(b: _Build) -> None:
    """The library as a loader will see it: a stable one imports nothing of torch's C++
    API; one that registers as it opens (TORCH_LIBRARY) is opened in a child first."""
    if b.plan.sources.stable:
        torchbuild.check_stable_imports(b.artifact, b.plan.name)
    b.fixed = b.plan.sources.fixed_namespaces
    if b.fixed and not b.plan.standalone:
        b.fixed, b.opened = registration.opens_safely(b.plan.name, str(b.artifact), b.fixed,
                                                      [str(s.path) for s in b.plan.sources.sources])


def _record_inputs(b: _Build) -> None:
    """Every header the compiler read, hashed and stamped; a source or header written during
    the build voids it for everyone but this process (the next build compiles again)."""
    plan = b.plan
    b.headers, b.stamps = header_closure(b.ws, plan, b.deps, b.pchs.headers_used() | b.split.headers_used(),
                                         b.pchs.prefixes() + b.split.prefixes())
    record = {**b.headers, **{str(s.path): s.sha256 for s in plan.sources.sources if s.path in plan.built}}
    b.changed = changed_during_build(plan, b.headers, b.since_ns)
    if b.changed:
        from ..progress import say

        say(f"{', '.join(b.changed)} changed while {plan.name} compiled; this build is not reused (the next "
            "load compiles again)", warning=True)
        mark = CHANGED_MARK + uuid.uuid4().hex
        for p in b.changed:
            b.headers[p] = record[p] = mark
            b.stamps[p] = None
    write_json_atomic(b.ws / RECORD, record)


def _compiled(b: _Build) -> Compiled:
    plan = b.plan
    return Compiled(b.artifact, full_key(plan.skey, b.headers), b.headers, b.stamps, seconds=b.seconds, manifest={
        "namespace": b.namespace,
        "style": "standalone" if plan.standalone else plan.sources.style,
        "python_module": plan.sources.python_module,
        # what torch registered when a child opened the library (a namespace named through a
        # macro is a fact of the library, not of its text); else what the text says
        "fixed_namespaces": b.fixed,
        "def_namespaces": plan.sources.def_namespaces,  # those its TORCH_LIBRARY blocks define
        "opens_checked": b.opened,  # a child opened it and torch refused nothing
        "fixed_ops": plan.sources.fixed_ops,
        "cuda_built": plan.with_cuda,
        "cuda_skipped": plan.cuda_skipped,
        "build_seconds": round(b.seconds, 3),
        "stable_target": plan.stable_target,
        # every source, built or not (a hit record keeps this, not the inputs)
        "source_paths": [str(s.path) for s in plan.sources.sources],
        "pch": b.notes,
        "inputs": plan.key_inputs(),
        "changed_during_build": b.changed,
        "cuda_split": b.split.manifest(),
        "trimmed": b.trimmed.manifest(),  # a trimmed ATen's headers (null: the whole API or the PCH)
    })


def _unlink(path: Path) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
