"""Before the compile: a build that cannot use the precompiled
<kload/kernel.h> (a library's first, on an empty cache; KLOAD_PCH=0; a compiler
other than GCC) parses only the ATen headers its sources need.

<kload/kernel.h> is ATen's whole API; ~40% of its parse is <ATen/Functions.h>,
which declares every at:: function (2,000 operators), and more is headers most
kernels never touch (indexing, printing, the global context). A build with the
precompiled header gets all of it for free; one without parses it. So such a
build puts, ahead of kload's include directory, a generated <kload/kernel.h> that
defines KLOAD_TRIMMED and includes the real one (which then takes Tensor, its
operators and torch/library.h), then each further header of <ATen/ATen.h> whose
names the sources use (``AT_DISPATCH_`` -> <ATen/Dispatch.h>, ``parallel_for`` ->
<ATen/Parallel.h>, ...), then <ATen/ops/NAME.h> for each at:: function they name:
torch's own per-operator headers (AT_PER_OPERATOR_HEADERS), as torch's build uses
them. The sources are the library's C++ files and the local headers they include.

A name is found by its text, so the scan errs on the side of more headers: every
identifier that is not a member (``x.add``), not a qualifier (``std::``) and not
qualified by another namespace (``std::max``) and that names an operator header.
Where a source calls one of the few functions <ATen/Functions.h> defines itself
(``at::var(x, 1)`` has an ``int dim`` overload there, which without it would
silently bind ``1`` to ``bool unbiased``), the build takes the whole header.
Where the trimmed build fails to compile for a reason the missing headers can
explain (a name not declared, no matching overload), the library is compiled again
with the whole API, and only that compile's errors are shown.

Its registration and Tensor's operators skip <torch/library.h> and
<ATen/ops/empty_like.h> where the text allows (registration.py decides, the
generated header says so: KLOAD_LIGHT_REGISTER, KLOAD_TRIM_OPERATORS).

The include directory is on every compile's command line, existing or not, so
ninja sees the same command when the precompiled header takes over; objects that
read the generated header are deleted first (ninja would not know to rebuild them).
"""
from __future__ import annotations

import logging
import os
import re
import shlex
import shutil
from pathlib import Path

from .. import knobs
from . import registration
from ..options import include_dir
from ..plan.plan import Plan
from .torchbuild import forget_objects

log = logging.getLogger("kload")

DIR = "_kload_trim"  # in the build directory
HEADER = "kload/kernel.h"
_COMMENTS = re.compile(r"//[^\n]*|/\*.*?\*/|\"(?:\\.|[^\"\\\n])*\"", re.S)
# an identifier with what surrounds it: member access before, a qualifier before, `::` after, `(` after
_NAME = re.compile(r"(\.|->)?\s*(?:(\w+)\s*::\s*)?([A-Za-z_]\w*)(\s*::)?(\s*\()?")
_QUOTED = re.compile(r"(?m)^\s*#\s*include\s*\"([^\"]+)\"")
_ANGLED = re.compile(r"(?m)^\s*#\s*include\s*<([^>]+)>")
# errors the missing declarations can cause; anything else the whole API would repeat
_MAY_BE_MISSING = ("was not declared", "is not a member of", "no matching function", "no match for",
                   "has no member", "incomplete type", "does not name a type", "could not convert",
                   "cannot convert", "not declared in this scope", "no viable", "undeclared",
                   "redefinition of", "KLOAD_WHOLE_API")
# the rest of <ATen/ATen.h>, each where the sources use what it declares (Tensor, its operators,
# TORCH_CHECK and torch/library.h come always)
_WHEN = [(h, re.compile(p)) for h, p in (
    ("ATen/Dispatch.h", r"\bAT_DISPATCH|\bAT_PRIVATE_"),
    ("ATen/Parallel.h", r"\b(?:parallel_for|parallel_reduce|\w*num_threads|get_thread_num|in_parallel_region|"
                        r"\w*intraop\w*|launch|lazy_init_num_threads|get_parallel_info)\b"),
    ("ATen/TensorIndexing.h", r"\b(?:index\w*|indexing|Slice|Ellipsis|TensorIndex|None)\b"),
    ("ATen/Formatting.h", r"<<|\bprint\b"),
    ("ATen/Context.h", r"\b(?:\w*[cC]ontext\w*|manual_seed|has[A-Z]\w*|get\w*Generator|\w*[Dd]eterministic\w*|"
                       r"\w*[Aa]llow\w*|\w*[Ll]inalg\w*|\w*[Bb]las\w*|\w*precision\w*)\b"),
    ("ATen/core/Generator.h", r"[Gg]enerator"),
    ("ATen/ScalarOps.h", r"\b(?:scalar_to_tensor|wrapped_scalar_tensor|\w*scalar_tensor\w*)\b"),
    ("ATen/DeviceGuard.h", r"Guard"),
    ("ATen/DimVector.h", r"DimVector"),
    ("ATen/TensorGeometry.h", r"TensorGeometry"),
    ("ATen/Version.h", r"\b(?:show_config|get_\w+_version|get_cxx_flags)\b"),
    ("ATen/core/Reduction.h", r"\bReduction\b"),
    ("ATen/core/UnsafeFromTH.h", r"FromTH"),
    ("ATen/core/ivalue.h", r"IValue|ivalue"),
    ("ATen/core/jit_type.h", r"\bTypePtr\b|\w+Type::get\b|jit_type"),
    ("c10/core/InferenceMode.h", r"InferenceMode"),
)]
_OPS: dict[str, frozenset[str]] = {}      # torch's ops directory -> the operator header names in it
_INLINE: dict[str, frozenset[str]] = {}   # torch's Functions.h -> the functions it defines itself


def _torch_include() -> Path:
    import torch

    return Path(torch.__file__).parent / "include"


def _operator_headers(inc: Path) -> frozenset[str]:
    d = str(inc / "ATen" / "ops")
    if d not in _OPS:
        try:
            names = os.listdir(d)
        except OSError:
            names = []
        _OPS[d] = frozenset(n[:-2] for n in names if n.endswith(".h"))
    return _OPS[d]


def _functions_h_own(inc: Path) -> frozenset[str] | None:
    """The functions <ATen/Functions.h> defines beyond its #includes (None: not readable)."""
    p = str(inc / "ATen" / "Functions.h")
    if p not in _INLINE:
        try:
            text = Path(p).read_text(errors="replace")
        except OSError:
            return None
        body = text[text.rfind("#include"):]
        _INLINE[p] = frozenset(re.findall(r"\binline\b[^;{(]*?\b(\w+)\s*\(", body))
    return _INLINE[p]


def aten_headers(texts: list[str]) -> list[str]:
    """The headers of <ATen/ATen.h> beyond the base whose names the texts use."""
    code = "\n".join(_COMMENTS.sub(" ", text) for text in texts)
    return [h for h, pattern in _WHEN if pattern.search(code)]


def names_used(texts: list[str]) -> tuple[set[str], set[str]]:
    """(names that may be at:: functions, names called as functions), from source texts."""
    names, called = set(), set()
    for text in texts:
        for m in _NAME.finditer(_COMMENTS.sub(" ", text)):
            member, qualifier, name, scope, call = m.groups()
            if member or scope or (qualifier and qualifier not in ("at", "torch")):
                continue
            names.add(name)
            if call:
                called.add(name)
    return names, called


def local_texts(plan: Plan) -> list[str]:
    """The text of the library's C++ sources and of the local headers they include, at
    any depth (quoted includes beside the including file or on the include paths;
    angled ones on the user's include paths or kload's, but not <kload/kernel.h> itself).
    System headers are not read."""
    dirs = [Path(p) for p in plan.opts.include_paths] + [include_dir()]
    # <kload/kernel.h> and the headers it picks between are not the user's code
    seen = {os.path.realpath(include_dir() / "kload" / n) for n in ("kernel.h", "register.h", "operators.h")}
    texts = []
    todo = [s.path for s in plan.sources.sources if not s.is_cuda]
    while todo and len(seen) < 500:
        path = todo.pop()
        key = os.path.realpath(path)
        if key in seen:
            continue
        seen.add(key)
        try:
            text = Path(path).read_text(errors="replace")
        except OSError:
            continue
        texts.append(text)
        for rel in _QUOTED.findall(text):
            todo += [p for p in [Path(path).parent / rel] + [d / rel for d in dirs] if p.is_file()][:1]
        for rel in _ANGLED.findall(text):
            todo += [d / rel for d in dirs if (d / rel).is_file()][:1]
    return texts


class Trim:
    """Whether this build parses only the ATen headers its sources name, and the
    generated header that makes it so."""

    def __init__(self, plan: Plan, ws: Path, pch_ready: bool):
        """``pch_ready``: the precompiled <kload/kernel.h> serves this build. The generated
        header's directory is on the command line of every build whose sources include
        <kload/kernel.h>, trimmed or not."""
        self.dir = ws / DIR
        self._ws = ws
        self.applies = HEADER in plan.sources.pch_headers
        self.active = False
        self.headers: list[str] = []     # the operators whose <ATen/ops/NAME.h> it includes
        self.aten: list[str] = []        # the further headers of <ATen/ATen.h> it includes
        self.why_not = ""
        self.kinds: dict[str, str] | None = None  # registration through the C shim: each op's kinds
        self.operators = False                    # <kload/operators.h> for <ATen/TensorOperators.h>
        if not self.applies or pch_ready:
            return
        if not knobs.trim():
            self.why_not = "KLOAD_TRIM=0"
            return
        inc = _torch_include()
        ops, own = _operator_headers(inc), _functions_h_own(inc)
        if not ops or own is None:
            self.why_not = "this torch has no per-operator headers"
            return
        texts = local_texts(plan)
        names, called = names_used(texts)
        whole = sorted(called & own)
        if whole:
            self.why_not = f"it calls {whole[0]}(), which <ATen/Functions.h> defines itself"
            return
        self.headers = sorted(names & ops)
        self.aten = aten_headers(texts)
        if all((inc / h).is_file() for h in registration.HEADERS):
            self.kinds = registration.kinds(texts)
        self.operators = registration.operators_apply(texts)
        self._failed = ws / (DIR + ".failed")  # the trimmed set that did not compile here last time
        try:
            failed_before = self._failed.read_text() == self._signature()
        except OSError:
            failed_before = False
        if failed_before:  # the same names again: do not pay for the failing compile twice
            self.why_not = "the same trimmed headers did not compile it last time"
            return
        self.active = True

    def _signature(self) -> str:
        light = [f"kinds {k} {v}" for k, v in sorted((self.kinds or {}).items())] + ["operators"] * self.operators
        return "\n".join(self.aten + self.headers + light) + "\n"

    def cflags(self) -> list[str]:
        return ["-I" + shlex.quote(str(self.dir))] if self.applies else []

    def prepare(self) -> None:
        """Write the generated header (active), or make sure none is left (the precompiled
        header serves now): the objects compiled with it are compiled again."""
        target = self.dir / HEADER
        if not self.active:
            if self.dir.exists():
                forget_objects(self._ws, {str(target)})
                shutil.rmtree(self.dir, ignore_errors=True)
            return
        lines = ["// Generated by kload: a build without the precompiled <kload/kernel.h> parses the ATen",
                 "// headers whose names its sources use, not ATen's whole API (loader/trim.py).",
                 "#pragma once", "#define KLOAD_TRIMMED 1"]
        if self.kinds is not None:  # <kload/register.h>: m.impl checks each kernel against these
            lines += ["#define KLOAD_LIGHT_REGISTER 1", "#define KLOAD_LIGHT_SCHEMAS " +
                      ", ".join(f'{{"{op}", "{k}"}}' for op, k in sorted(self.kinds.items()))]
        if self.operators:
            lines += ["#define KLOAD_TRIM_OPERATORS 1"]
        lines += [
                 "#ifndef AT_PER_OPERATOR_HEADERS", "#define AT_PER_OPERATOR_HEADERS",
                 "#define KLOAD_TRIM_UNDEF_", "#endif",
                 f'#include "{include_dir() / HEADER}"']
        lines += [f"#include <{h}>" for h in self.aten]
        lines += [f"#include <ATen/ops/{h}.h>" for h in self.headers]
        lines += ["#ifdef KLOAD_TRIM_UNDEF_", "#undef AT_PER_OPERATOR_HEADERS", "#undef KLOAD_TRIM_UNDEF_", "#endif"]
        text = "\n".join(lines) + "\n"
        target.parent.mkdir(parents=True, exist_ok=True)
        try:
            same = target.read_text() == text
        except OSError:
            same = False
        if not same:
            forget_objects(self._ws, {str(target)})
            tmp = target.with_name(f".{target.name}.{os.getpid()}")
            tmp.write_text(text)
            os.replace(tmp, target)

    def may_explain(self, output: str) -> bool:
        """Whether a failed compile with the trimmed headers may have failed for them."""
        return self.active and any(m in output for m in _MAY_BE_MISSING)

    def give_up(self) -> None:
        """Compile again with the whole API: no generated header, no object built with it.
        Until the sources name other functions, later builds here take the whole API at once."""
        try:
            self._failed.write_text(self._signature())
        except OSError:
            pass
        self.active = False
        self.prepare()

    def manifest(self) -> dict | None:
        if not self.active:
            return None
        return {"operators": self.headers, "aten": self.aten,
                "registration": "torch's C shim" if self.kinds is not None else "torch/library.h",
                "tensor_operators": "kload/operators.h" if self.operators else "ATen/TensorOperators.h"}

    def summary(self) -> str:
        if not self.active:
            return ""
        n = len(self.headers)
        shim = "; registered through torch's C shim" if self.kinds is not None else ""
        return f" (ATen trimmed to what it names: {len(self.aten)} headers, {n} function{'s' if n != 1 else ''}{shim})"
