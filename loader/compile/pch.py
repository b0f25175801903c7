"""Before the compile: which precompiled headers a build uses.

A source whose first #include is <kload/kernel.h>, <kload/stable.h> or
<torch/extension.h> can be
compiled with that header precompiled (pch_build.py makes and checks one per
compiler and flag set). kload puts each such entry's directory on g++'s include
path ahead of its own, whether the entry exists yet or not, so the command line
(and with it ninja's view of the build) does not change when it appears. GCC
looks for ``kload/kernel.h.gch`` there first and loads it when it may (same
compiler binary, flags and macros); else, or when the directory does not exist
yet, it opens the stub beside it, which includes the real header. The real header
is therefore in a compile's dependency file exactly when the precompiled header
was not used (a second #include of it after the .gch opens only the stub, which
is guarded like the header): that is how kload knows, and says, which.

The key holds everything that decides whether GCC may use the file: the
compiler's identity, the flags, include paths and macros of the compile, torch's
and Python's identity, the keyed environment, and the content of kload's headers.
GCC itself refuses a file that another compiler or other flags made
(``-Winvalid-pch`` says why), and the object code is the same either way.
With no entry yet, the build compiles without one while the entry is built in
the background (nice 19: a foreground compile keeps its cores).
"""
from __future__ import annotations

import logging
import os
import shlex
from pathlib import Path

from kload.cache import SCHEMA, Entry
from kload.cache.key import digest, file_sha256
from kload.cache.store import Store

from .. import knobs
from . import pch_build
from ..plan import toolchain
from ..options import torch_identity, which
from ..options import CUDA_SUFFIXES, include_dir
from ..plan.plan import Plan
from .pch_build import PchPlan, check, entry_dir, start

log = logging.getLogger("kload")
# flags after which GCC cannot use a precompiled header, or that make no object file
_NO_PCH_FLAGS = ("-E", "-fsyntax-only", "-save-temps", "-traditional-cpp", "-fdirectives-only", "-H")
_NO_PCH_PREFIXES = ("-include", "-imacros", "-fpch", "-fno-pch", "-x")


def not_applicable(plan: Plan) -> str | None:
    """Why no precompiled header can serve this build, or None."""
    if not knobs.pch():
        return "KLOAD_PCH=0"
    if plan.cxx.get("family") not in ("gcc", "clang"):
        return (f"the compiler {plan.cxx['command']} is neither GCC nor clang (its macros say "
                f"{plan.cxx.get('family', 'other')})")
    for f in plan.opts.cflags:
        if f in _NO_PCH_FLAGS or f.startswith(_NO_PCH_PREFIXES):
            return f"the flag {f} rules it out"
    return None


def plans_for(plan: Plan, store: Store) -> list[PchPlan]:
    """The precompiled headers this build's sources include, with their keys; []
    where none can apply. (GCC can use one where a source includes it first; where
    one is included later, its directory is on the include path all the same, so
    that GCC says why it cannot be used.)"""
    wanted = plan.sources.pch_headers
    if not wanted or not_applicable(plan) is not None:
        return []
    # what decides whether GCC may use the file: the library's key inputs but its sources
    base = {"cflags": plan.cflags, "include_paths": plan.opts.include_paths, "kload_include": plan.kload_include,
            "with_cuda": plan.with_cuda, "torch": plan.torch, "python": plan.python, "cxx": plan.cxx,
            "env": plan.env}
    if plan.host_cpu is not None:
        base["host_cpu"] = plan.host_cpu
    kload_headers = {n: file_sha256(str(include_dir() / "kload" / n)) for n in ("kernel.h", "stable.h", "checks.h")}
    if plan.sources.stable:  # the library's key names only the stable ABI; a PCH holds this torch's headers
        base["torch_build"] = torch_identity()
    out = []
    for header in wanted:
        inputs = dict(base, header=header, kload_headers=kload_headers)
        key = digest({"schema": SCHEMA, "kind": "pch", "inputs": inputs})
        spec = {"key": key, "header": header, "root": str(store.root), "inputs": inputs,
                "cxx": which(plan.cxx["command"]) or plan.cxx["command"],
                "cflags": list(plan.cflags),
                "include_paths": [str(include_dir())] + list(plan.opts.include_paths),
                "with_cuda": plan.with_cuda, "clang": plan.cxx.get("family") == "clang"}
        out.append(PchPlan(header, key, entry_dir(store, header, key), spec))
    return out


def _opened_real_header(header: str, files: list[str]) -> bool:
    real = os.path.realpath(pch_build.header_file(header))
    return any(os.path.realpath(f) == real for f in files)


# Below this many cores a missing precompiled header is built after the compile
# that found it missing, not beside it: on 2 cores two compiles share the caches
# and memory bandwidth, and the foreground one ran 1.07-1.17x slower (measured
# with kernel.h; docs/benchmarks.md). Built after, it is ready about as soon.
PARALLEL_CORES = 4
# how clang's refusals of a .pch begin ("... since the precompiled header was built", "C++20 was
# enabled in PCH file but is currently disabled", "malformed or corrupted AST file")
_CLANG_PCH_SAYS = ("precompiled header", "PCH file", "AST file")
_refused: set[str] = set()  # keys of entries GCC refused in this process (rebuilt once)


class PrecompiledHeaders:
    """The precompiled headers one build may use: checked before the compile,
    held while it runs, reported after; missing ones are built in the background,
    beside the compile where cores allow, else right after it."""

    def __init__(self, plan: Plan, store: Store):
        self.why_not = not_applicable(plan)
        self.plans = plans_for(plan, store)
        self.ready: dict[str, Entry] = {}
        self.started: list[str] = []
        self.used: set[str] = set()
        self._clang_refused: dict[str, str] = {}  # header -> why clang refused its .pch in this build
        self._firsts = plan.sources.first_includes
        self._store = store
        self.clang = plan.cxx.get("family") == "clang"
        self._missing = []
        for pp in self.plans:
            entry = check(pp, store)
            if entry is not None:
                entry.touch()
                self.ready[pp.header] = entry
            else:
                self._missing.append(pp)
        self.given = self._one_for_clang() if self.clang else None
        if (os.cpu_count() or 1) >= PARALLEL_CORES:
            self.start_missing()

    def _one_for_clang(self) -> str | None:
        """clang loads one precompiled header a compile, named on its command line
        (``-include-pch``), and loads it before anything of the source: the header that
        every C++ source of the build starts with, when its entry is ready."""
        firsts = {h for src, h in self._firsts.items() if os.path.splitext(src)[1] not in CUDA_SUFFIXES}
        header = next(iter(firsts)) if len(firsts) == 1 else None
        return header if header in self.ready else None

    def serves(self, header: str) -> bool:
        """Whether the precompiled ``header`` is ready for this build's compiles."""
        return self.given == header if self.clang else header in self.ready

    def start_missing(self) -> None:
        """Start the background builds of the missing ones (once)."""
        for pp in self._missing:
            if start(pp, self._store):
                self.started.append(pp.header)
        self._missing = []

    def cflags(self) -> list[str]:
        """For g++ (nvcc has no PCH): each entry's directory, existing or not, so
        that the command line, and with it ninja's view of the build, stays the same
        when the entry appears; ahead of kload's own include directory. For clang: the
        ready ``.pch`` every C++ source starts with, checked by content where a header's
        mtime differs from the one it was made from (its command line changes when it appears)."""
        if not self.plans:
            return []
        if self.clang:
            pp = next((pp for pp in self.plans if pp.header == self.given), None)
            return [] if pp is None else ["-include-pch", shlex.quote(str(pp.gch)), "-fpch-validate-input-files-content"]
        return ["-Winvalid-pch"] + ["-I" + shlex.quote(str(pp.path)) for pp in self.plans]

    def held(self):
        """Shared locks on the entries in use: eviction and ``cache clear`` wait."""
        from contextlib import ExitStack

        from kload.cache import entry_in_use

        stack = ExitStack()
        for entry in self.ready.values():
            stack.enter_context(entry_in_use(entry.path))
        return stack

    def prefixes(self) -> tuple[str, ...]:
        return tuple(os.path.join(str(pp.path), "") for pp in self.plans)

    def report(self, deps: dict[str, list[str]], ws: Path, since: float) -> dict[str, str]:
        """For each C++ source: whether its compile used a precompiled header, and
        if not, why. A compile opened the real header exactly when GCC did not use the
        .gch (a second #include opens the stub, whose guard then skips the header).
        ``since``: the build's start (time.time()); older objects were not recompiled."""
        notes = {}
        plans = {pp.header: pp for pp in self.plans}
        for src, header in self._firsts.items():
            base = os.path.basename(src)
            obj = os.path.splitext(base)[0] + ".o"
            try:
                fresh = os.stat(ws / obj).st_mtime >= since - 1.0
            except OSError:
                fresh = True
            if not fresh:
                notes[base] = "unchanged: its object was not recompiled"
            elif self.why_not is not None:
                notes[base] = f"no precompiled header: {self.why_not}"
            elif header is None:
                notes[base] = ("no precompiled header: it does not start with #include <kload/kernel.h>, <kload/stable.h> or "
                               "<torch/extension.h> (only comments, blank lines and #line may come before)")
            elif header not in self.ready:
                notes[base] = f"no precompiled <{header}> yet (it is built in the background)"
            elif self.clang:
                notes[base] = self._clang_note(header)
            elif _opened_real_header(header, deps.get(obj, [])):
                notes[base] = self._refused(plans[header])
            else:
                notes[base] = f"used the precompiled <{header}> ({self.ready[header].path.name})"
                self.used.add(header)
        for text in notes.values():
            log.info("%s", text)
        return notes

    def _clang_note(self, header: str) -> str:
        if self.given == header:
            self.used.add(header)
            return f"used the precompiled <{header}> ({self.ready[header].path.name})"
        if header in self._clang_refused:
            return self._clang_refused[header]
        return (f"no precompiled header: clang loads one per compile, and not every C++ source of this "
                f"build starts with <{header}>")

    def refused(self, output: str) -> bool:
        """Whether a failed compile failed on the ``.pch`` clang was given (made by another
        clang, a header under it changed, a damaged file): then it is moved aside and built
        again in the background, and the build goes on without it. True: compile again."""
        pp = next((pp for pp in self.plans if pp.header == self.given), None) if self.clang else None
        if pp is None:
            return False
        said = [line.strip() for line in output.splitlines()  # (not the command line ninja echoes)
                if "error: " in line and any(m in line for m in _CLANG_PCH_SAYS)]
        if not said:
            return False
        self._clang_refused[pp.header] = f"{self._refused(pp)} ({said[0]})"
        log.info("%s", self._clang_refused[pp.header])
        self.given = None
        return True

    def _refused(self, pp: PchPlan) -> str:
        """The compiler would not use an entry that matched its key and manifest: it is stale
        or foreign (nothing a source may put before its first #include, as sources.py
        reads it, makes GCC refuse one). Move it aside and build a new one, once
        per process and key."""
        text = (f"the precompiled <{pp.header}> was not used: clang refused it" if pp.clang else
                f"the precompiled <{pp.header}> was not used: GCC refused it (a verbose build shows "
                "-Winvalid-pch's reason)")
        if pp.key in _refused:
            return text
        _refused.add(pp.key)
        self._store.quarantine(pp.path, f"precompiled <{pp.header}>: {'clang' if pp.clang else 'GCC'} refused to use it")
        start(pp, self._store)
        return text + "; moved it aside and building a new one in the background"

    def headers_used(self) -> set[str]:
        """The headers the used precompiled headers were made from."""
        return {p for h in self.used for p in self.ready[h].manifest.get("headers", {})}

    def summary(self) -> str:
        if self.why_not and self.why_not != "KLOAD_PCH=0" and any(self._firsts.values()):
            return f" (no precompiled header: {self.why_not})"  # kload gave it up: the build line says why
        if self.used:
            return " (precompiled " + ", ".join(f"<{h}>" for h in sorted(self.used)) + ")"
        missing = sorted({h for h in self._firsts.values() if h} - set(self.ready)) if self.plans else []
        if missing:
            return " (precompiling " + ", ".join(f"<{h}>" for h in missing) + " in the background)"
        return ""


def prebuild(opts, store: Store) -> list[PchPlan]:
    """Start background builds of the precompiled headers ``opts`` would use (for
    ``%load_ext kload``: before the first cell). Returns those started."""
    from ..plan.plan import make_plan

    started = []
    p = make_plan(opts, store)
    for pp in plans_for(p, store):
        if check(pp, store) is None and start(pp, store):
            started.append(pp)
    return started
