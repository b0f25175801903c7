"""Before torch's loader runs: which .cu sources of a build are
compiled in two halves (cuda_split/split.py says how to split one, cuda_split/units.py compiles it),
and what a failure means. torch's loader then compiles the other sources and links
the halves' objects with them.

A .cu is split when it includes a header of torch's host API, the C++ compiler is GCC
(the host half's #include block is precompiled) and KLOAD_SPLIT_CUDA is not 0. It is
compiled whole, by nvcc as before, and the build line says why, when:

- its text says a split is not safe (split.NotSplit: ``<<<`` in a macro, device code
  in a host function, ``__CUDACC__`` in a condition, an nvcc flag kload does not know);
- its first split does not compile while the file compiles whole: the halves miss
  something the whole file has. This is remembered in the build directory until the
  file's #include lines or the torch names its device code uses change, so later edits
  of the kernel do not try again.

Once a split of a file has compiled, a later failure is the user's own error, shown at
once with the user's file and line, unless its errors name something torch's headers
declare (the device half has only a few of them): then the file is compiled whole to
decide. A split whose halves do not link (a kernel's type seen two ways) is always the
split's fault.
"""
from __future__ import annotations

import hashlib
import os
import re
import subprocess
import threading
from pathlib import Path

from kload.cache.store import Store, read_json, write_json_atomic

from . import split as cusplit
from ...plan import toolchain
from ...errors import CompileError, parse_diagnostics
from ...options import include_dir
from ...plan.plan import Plan
from .units import LINK_MISMATCH, Failed, Tools, Unit, compile_unit, write_if_changed

SPLIT_DIR = "split"
PLACEHOLDER = "_kload_split_.cpp"  # torch's loader wants a source where every one was split
QUIET = "it includes none of torch's host headers"  # (nvcc is fast on it: not worth a word in the build line)


def _memo_key(text: str, device: str) -> str:
    """What a remembered "compile it whole" holds for: the file's #include lines and the
    torch names its device half uses (an edit that drops the name that failed tries again)."""
    names = sorted(set(re.findall(r"\b(?:at|c10|torch)\s*::\s*\w+|\b(?:C10|AT|TORCH)_\w+", device)))
    lines = re.findall(r"(?m)^\s*#\s*include\b.*$", text)
    return hashlib.sha256("\n".join(lines + names).encode()).hexdigest()


class SplitBuild:
    """The split of one build's .cu sources: which are split, which compile whole and why."""

    def __init__(self, plan: Plan, store: Store, ws: Path):
        self.plan, self.store, self.ws = plan, store, ws
        self.dir = ws / SPLIT_DIR
        self.units: list[Unit] = []
        self.whole: dict[str, str] = {}  # source -> why it compiles whole
        self._state = read_json(self.dir / "state.json") or {}
        self._tools: Tools | None = None
        if not plan.cuda_split:
            return
        why = None
        if plan.sources.stable:
            why = "stable-ABI sources compile whole"
        elif not toolchain.is_gcc(plan.cxx):
            why = f"the C++ compiler {plan.cxx['command']} is not GCC"
        dirs = [str(include_dir())] + list(plan.opts.include_paths)
        for src in (s for s in plan.built if s.suffix == ".cu"):
            if why:
                self.whole[str(src)] = why
                continue
            text = src.read_text(encoding="utf-8", errors="replace")
            try:
                sp = cusplit.split(text, str(src), dirs)
            except cusplit.NotSplit as e:
                self.whole[str(src)] = str(e)
                continue
            memo = self._state.get(str(src), {})
            if memo.get("whole") and memo.get("key") == _memo_key(text, sp.device):
                self.whole[str(src)] = memo["whole"]
                continue
            self.units.append(Unit(src, sp, f"{src.stem}-{hashlib.sha256(str(src).encode()).hexdigest()[:6]}"))

    @property
    def active(self) -> bool:
        return bool(self.units)

    def compile(self) -> list[Path]:
        """Compile every unit's halves (side by side, MAX_JOBS compiles at a time).
        Returns the objects to link; a unit whose split is at fault moves to ``whole``.
        Raises CompileError for the user's own errors."""
        self.dir.mkdir(mode=0o700, exist_ok=True)
        try:
            tools = Tools(self.plan, self.store, self.dir, [str(u.source) for u in self.units])
        except cusplit.NotSplit as e:  # an nvcc flag kload cannot carry over to the host half
            self.whole.update((str(u.source), str(e)) for u in self.units)
            self.units = []
            return []
        tools.record = read_json(self.dir / "record.json") or {}
        self._tools = tools
        failures: dict[str, Failed] = {}

        def run(u: Unit) -> None:
            try:
                compile_unit(u, tools)
            except Failed as e:
                failures[str(u.source)] = e

        threads = [threading.Thread(target=run, args=(u,), daemon=True) for u in self.units]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        write_json_atomic(self.dir / "record.json", tools.record)
        try:
            for u in list(self.units):
                f = failures.get(str(u.source))
                if f is None:
                    self._state[str(u.source)] = {"split": True}
                elif self._state.get(str(u.source), {}).get("split") and not _split_at_fault(f.output):
                    raise CompileError(self.plan.name, parse_diagnostics(f.output), f.log, f.output)
                else:
                    reason = f"its split did not compile ({f.half}: {_first_error(f.output)})"
                    self.whole[str(u.source)] = reason
                    text = u.source.read_text(encoding="utf-8", errors="replace")
                    self._state[str(u.source)] = {"whole": reason, "key": _memo_key(text, u.split.device)}
                    self.units.remove(u)
        finally:
            write_json_atomic(self.dir / "state.json", self._state)
        return [o for u in self.units for o in u.objects]

    def others(self, sources: list[str], ws: Path) -> list[str]:
        """What torch's loader still compiles: the sources not split (a placeholder where
        every one was: it wants one)."""
        split = {str(u.source) for u in self.units}
        rest = [s for s in sources if s not in split]
        if not rest:
            placeholder = ws / PLACEHOLDER
            write_if_changed(placeholder, "// kload: every source of this library was compiled in halves\n")
            rest = [str(placeholder)]
        return rest

    # -- what the build reports ---------------------------------------------------------

    def compdb(self, entries: list[dict]) -> list[dict]:
        """The build's compilation database with each split .cu as nvcc would compile it
        whole, in place of the placeholder."""
        if not self.units or self._tools is None:
            return entries
        out = [e for e in entries if not e.get("file", "").endswith(PLACEHOLDER)]
        return out + [{"directory": str(self.ws), "command": self._tools.whole_command(u.source),
                       "file": str(u.source), "output": f"{u.source.stem}.cuda.o"} for u in self.units]

    def deps(self) -> dict[str, list[str]]:
        return {k: v for u in self.units for k, v in u.deps.items()}

    def prefixes(self) -> tuple[str, ...]:
        """The precompiled prefixes' entry directories (their stubs are not the user's headers)."""
        return tuple(os.path.join(str(u.pch.path), "") for u in self.units if u.pch is not None)

    def headers_used(self) -> set[str]:
        """The headers the precompiled prefixes were made from (the host halves' depfiles do
        not list them), so that the library's key covers them."""
        return {p for u in self.units if u.pch is not None for p in u.pch.manifest.get("headers", {})}

    def manifest(self) -> dict[str, str]:
        out = {str(u.source): "split" + (": " + ", ".join(u.notes) if u.notes else "") for u in self.units}
        out.update({p: "whole: " + why for p, why in self.whole.items()})
        return out

    def summary(self) -> str:
        parts = []
        if self.units:
            parts.append("split " + ", ".join(u.source.name for u in self.units)
                         + ": host code by g++, its #include block precompiled; kernels by nvcc")
        parts += [f"{Path(p).name} whole: {why}" for p, why in self.whole.items() if not why.startswith(QUIET)]
        return (" (" + "; ".join(parts) + ")") if parts else ""


def _split_at_fault(output: str) -> bool:
    """Whether a failure of a file whose split compiled before may be the split's (a name
    the device half lacks because torch's headers declare it), not the user's."""
    if output.startswith(LINK_MISMATCH):
        return True
    if any(d.source_line and re.search(r"\b(?:at|c10|torch)\s*::", d.source_line) for d in parse_diagnostics(output)):
        return True  # the failing line names torch ("name followed by '::' must be ...": nvcc names nothing)
    names = set()
    for pattern in (r"[‘'\"](\w+)[’'\"] (?:was not declared|is not a member|does not name a type|"
                    r"has not been declared|is not a template)",
                    r"identifier \"(\w+)\" is undefined", r"has no member \"(\w+)\"",
                    r"there are no arguments to [‘'](\w+)[’']"):
        names.update(re.findall(pattern, output))
    import torch

    root = Path(torch.__file__).parent / "include"
    return any(_in_torch_headers(root, n) for n in sorted(names)[:8])


def _first_error(output: str) -> str:
    d = parse_diagnostics(output)
    if d and d[0].line:
        return f"{Path(d[0].file).name}:{d[0].line}: {d[0].message}"
    lines = output.strip().splitlines()
    return d[0].message if d else (lines[-1][:200] if lines else "no output")


_in_torch: dict[tuple[str, str], bool] = {}


def _in_torch_headers(root: Path, name: str) -> bool:
    """Whether ``name`` is a word of torch's headers (grep stops at the first file: 0.2 s
    for a name that is nowhere)."""
    key = (str(root), name)
    if key not in _in_torch:
        proc = subprocess.run(["grep", "-rqw", "--include=*.h", "--include=*.cuh", "--include=*.hpp", name,
                               str(root)], capture_output=True)
        _in_torch[key] = proc.returncode == 0
    return _in_torch[key]
