"""What a set of sources is: its files, its binding
style, the macros it relies on.

One read per file: the same bytes are hashed for the cache key and scanned here.
"""
from __future__ import annotations

import hashlib
import re
from pathlib import Path
from typing import NamedTuple

from ..errors import KloadError
from ..options import CUDA_SUFFIXES

# Patterns as strings: `re` compiles each once, on first use, and only where a
# cheap substring test says the construct may be there (this is the hit path).
_COMMENTS = r"//[^\n]*|/\*.*?\*/"
_OPLIB = r"\bKLOAD_(?:LIBRARY|FRAGMENT|IMPL)\s*\("
_PYBIND = r"\bPYBIND11_MODULE\s*\("
_FIXED_NS = r"\b(?:STABLE_)?TORCH_LIBRARY(?:_FRAGMENT|_IMPL)?\s*\(\s*(\w+)\s*,"
_DEF_NS = r"\b(?:STABLE_)?TORCH_LIBRARY\s*\(\s*(\w+)\s*,"
# the op names a TORCH_LIBRARY block defines: m.def("name(...) -> ...") or m.def("name", &fn)
_FIXED_DEF = r"\.def\(\s*(?:TORCH_SELECTIVE_SCHEMA\(\s*)?\"(?:\w+::)?(\w+)"
# the older registration API: torch::RegisterOperators("ns::op", &fn) / RegisterOperators().op("ns::op(...)")
_REGISTERED = r"(?:\bRegisterOperators\s*\(\s*\)?\s*|\.op\s*\(\s*)\"(\w+)::(\w+)"
# the stable ABI's headers (kload/stable.h, torch/csrc/stable/, torch/headeronly/) and
# the headers that tie a binary to one torch build; a set is "stable" when it
# includes the first kind and none of the second
_STABLE_INC = r"#\s*include\s*[<\"](?:kload/stable\.h|torch/csrc/stable/|torch/headeronly/)"
_VERSIONED_INC = (r"#\s*include\s*[<\"](?:kload/kernel\.h|torch/extension\.h|torch/torch\.h|torch/library\.h|"
                  r"torch/script\.h|torch/python\.h|torch/all\.h|ATen/|c10/|pybind11/|Python\.h)")
_CHECK_USE = r"\b(CHECK_INPUT|CHECK_CUDA|CHECK_CONTIGUOUS)\s*\("
_CHECK_DEF = r"(?m)^\s*#\s*define\s+(CHECK_INPUT|CHECK_CUDA|CHECK_CONTIGUOUS)\b"
_KERNEL_H = r"#\s*include\s*[<\"]kload/(?:kernel|stable)\.h[>\"]"  # both define the CHECK_* macros
# headers kload can precompile (pch.py), when a source includes one first
PCH_HEADERS = ("kload/kernel.h", "kload/stable.h", "torch/extension.h")
_INCLUDE = r"#\s*include\s*[<\"]([^>\"]+)[>\"]"
_EXTENSION_H = r"#\s*include\s*[<\"]torch/extension\.h[>\"]"
# torch's C++ frontend beyond torch/types.h (tensors, factories, TORCH_CHECK): a .cu
# that names one of these keeps the whole <torch/extension.h>
_FRONTEND = (r"\btorch\s*::\s*(?:nn|optim|data|jit|autograd|serialize|cuda|fft|linalg|special|nested|python|"
             r"Library|CppFunction|save|load|manual_seed)\b|\bpybind11\b|\bpy\s*::|\bPy[A-Z_]\w*\s*\(")


class Source(NamedTuple):
    path: Path
    sha256: str
    is_cuda: bool


class SourceSet:
    """The sources and what scanning them found."""

    def __init__(self, sources: list[Source]):
        self.sources = sources
        self.op_library = False            # KLOAD_LIBRARY / KLOAD_IMPL: kload supplies the namespace
        self.python_module = False         # PYBIND11_MODULE(TORCH_EXTENSION_NAME, m)
        self.fixed_namespaces: list[str] = []  # TORCH_LIBRARY(ns, m) / STABLE_TORCH_LIBRARY(ns, m) / RegisterOperators
        self.fixed_ops: list[str] = []     # the op names those blocks define (what a load checks is free)
        self.def_namespaces: list[str] = []  # the namespaces of TORCH_LIBRARY / STABLE_TORCH_LIBRARY (DEF) blocks
        self.stable = False                # only stable-ABI headers (kload/stable.h, torch/csrc/stable/)
        self.missing_checks: list[str] = []  # CHECK_* used but not defined (kload supplies them)
        self.first_includes: dict[str, str | None] = {}  # source -> the PCH_HEADERS header it starts with
        self.pch_headers: list[str] = []   # the PCH_HEADERS that any source includes, first or not
        # CUDA sources include <torch/extension.h> and need none of its Python half (no
        # PYBIND11_MODULE, no pybind11, no torch:: frontend namespace): nvcc gets a lean one
        self.cuda_lean_extension = False

    @property
    def style(self) -> str:
        parts = []
        if self.op_library:
            parts.append("op_library")
        if self.python_module:
            parts.append("pybind11")
        if self.fixed_namespaces:
            parts.append("torch_library")
        if self.stable:
            parts.append("stable")
        return "+".join(parts)

    @property
    def has_cuda(self) -> bool:
        return any(s.is_cuda for s in self.sources)


SCAN_VERSION = 10  # of _classify's findings: scans remembered by another version are not used


def scan(paths: list[Path], scans: dict | None = None) -> SourceSet:
    """Hash and classify the sources.

    ``scans`` (the cache's memo of earlier scans, ``{"version", "found"}``) maps a set
    of content hashes to their findings, so a cache hit need not run (or even
    compile) the regular expressions; a new scan is added to it.
    """
    out = SourceSet([])
    for p in paths:
        data = p.read_bytes()
        out.sources.append(Source(p, hashlib.sha256(data).hexdigest(), p.suffix in CUDA_SUFFIXES))
    if scans is not None and scans.get("version") != SCAN_VERSION:
        scans.clear()
        scans.update(version=SCAN_VERSION, found={})
    shas = ",".join(s.sha256 for s in out.sources)
    found = scans["found"].get(shas) if scans is not None else None
    if found is None:
        found = _classify([s.path.read_bytes() for s in out.sources], [s.path for s in out.sources])
        if scans is not None:
            scans["found"][shas] = found
    out.op_library, out.python_module = found["op_library"], found["python_module"]
    out.fixed_namespaces, out.missing_checks = list(found["fixed_namespaces"]), list(found["missing_checks"])
    out.fixed_ops = list(found["fixed_ops"])
    out.def_namespaces = list(found.get("def_namespaces") or ())
    out.first_includes = {str(s.path): h for s, h in zip(out.sources, found["first_includes"])}
    out.pch_headers = list(found["pch_headers"])
    out.stable = found["stable"]
    out.cuda_lean_extension = found["cuda_lean_extension"]
    return out


def first_include(code: str) -> str | None:
    """The header a (comment-free) source includes before any other token or
    directive, if kload can precompile it; None otherwise. Blank lines, ``#line``
    and ``#pragma once`` may come first: GCC can still use a precompiled header
    after them, but not after a ``#define`` or any code."""
    for line in code.splitlines():
        text = line.strip()
        if not text or re.match(r"#\s*(line\b|pragma\s+once\b|\d)", text):
            continue
        m = re.match(_INCLUDE, text)
        return m[1] if m and m[1] in PCH_HEADERS else None
    return None


def _classify(blobs: list[bytes], paths: list[Path]) -> dict:
    out = SourceSet([])
    used: set[str] = set()
    defined: set[str] = set()
    includes_kernel_h = False
    firsts: list[str | None] = []
    pch_headers: set[str] = set()
    stable_inc = versioned_inc = False
    cuda_extension_h, cuda_frontend = False, False
    for data, path in zip(blobs, paths):
        code = data.decode("utf-8", errors="replace")
        if "/" in code:
            code = re.sub(_COMMENTS, " ", code, flags=re.S)
        if path.suffix not in CUDA_SUFFIXES:
            firsts.append(first_include(code))
            if "#" in code:
                pch_headers.update(h for h in re.findall(_INCLUDE, code) if h in PCH_HEADERS)
        else:
            firsts.append(None)
            if "torch/extension.h" in code and re.search(_EXTENSION_H, code):
                cuda_extension_h = True
            cuda_frontend |= "PYBIND11_MODULE" in code or bool(re.search(_FRONTEND, code))
        out.op_library |= "KLOAD_" in code and bool(re.search(_OPLIB, code))
        out.python_module |= "PYBIND11_MODULE" in code and bool(re.search(_PYBIND, code))
        if "TORCH_LIBRARY" in code:
            for ns in re.findall(_FIXED_NS, code):
                if ns != "_" and ns not in out.fixed_namespaces:
                    out.fixed_namespaces.append(ns)
            out.fixed_ops.extend(n for n in re.findall(_FIXED_DEF, code) if n not in out.fixed_ops)
            out.def_namespaces.extend(n for n in re.findall(_DEF_NS, code) if n not in out.def_namespaces)
        if "RegisterOperators" in code:  # each op once per process, like a TORCH_LIBRARY namespace
            for ns, op in re.findall(_REGISTERED, code):
                if ns not in out.fixed_namespaces:
                    out.fixed_namespaces.append(ns)
                if op not in out.fixed_ops:
                    out.fixed_ops.append(op)
        if "CHECK_" in code:
            used.update(re.findall(_CHECK_USE, code))
            defined.update(re.findall(_CHECK_DEF, code))
        includes_kernel_h |= "kload/" in code and bool(re.search(_KERNEL_H, code))
        if "#" in code:
            stable_inc |= bool(re.search(_STABLE_INC, code))
            versioned_inc |= bool(re.search(_VERSIONED_INC, code))
    return {"op_library": out.op_library, "python_module": out.python_module,
            "fixed_namespaces": out.fixed_namespaces, "fixed_ops": out.fixed_ops if out.fixed_namespaces else [],
            "def_namespaces": out.def_namespaces,
            "missing_checks": [] if includes_kernel_h else _missing_checks(used, defined), "first_includes": firsts,
            "pch_headers": sorted(pch_headers),
            "stable": stable_inc and not versioned_inc and not out.python_module,
            "cuda_lean_extension": cuda_extension_h and not cuda_frontend}


def binding_style(code: str) -> str:
    """The binding style of one source text ("op_library", "pybind11", "torch_library",
    joined by "+"; "" for none: device code alone, say)."""
    found = _classify([code.encode()], [Path("code.cpp")])
    return "+".join(style for style, on in (("op_library", found["op_library"]), ("pybind11", found["python_module"]),
                                            ("torch_library", bool(found["fixed_namespaces"]))) if on)


def no_bindings(sset: SourceSet) -> KloadError:
    names = ", ".join(s.path.name for s in sset.sources)
    return KloadError(
        f"no bindings found in {names}. Register ops with KLOAD_LIBRARY(m) / KLOAD_IMPL(CPU, m) "
        "(#include <kload/kernel.h>, or <kload/stable.h> for the stable ABI), or write "
        "PYBIND11_MODULE(TORCH_EXTENSION_NAME, m), TORCH_LIBRARY(namespace, m) or STABLE_TORCH_LIBRARY(namespace, m)."
    )


def _missing_checks(used: set[str], defined: set[str]) -> list[str]:
    """The CHECK_* macros to supply: those used and not defined, and CHECK_CONTIGUOUS
    with CHECK_INPUT (whose body uses it) unless the sources define it."""
    missing = used - defined
    if "CHECK_INPUT" in missing and "CHECK_CONTIGUOUS" not in defined:
        missing.add("CHECK_CONTIGUOUS")
    return sorted(missing)
