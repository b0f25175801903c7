"""Step 2 of a load (the full way): what a set of sources is: its files, its binding style, the macros it relies on.

One read per file: the same bytes are hashed for the cache key and scanned here.
"""
from __future__ import annotations

import hashlib
import os
import re
from pathlib import Path
from typing import NamedTuple

from .errors import KloadError
from .options import CUDA_SUFFIXES

# Patterns as strings: `re` compiles each once, on first use, and only where a
# cheap substring test says the construct may be there (this is the hit path).
_COMMENTS = r"//[^\n]*|/\*.*?\*/"
_OPLIB = r"\bKLOAD_(?:LIBRARY|FRAGMENT|IMPL)\s*\("
_PYBIND = r"\bPYBIND11_MODULE\s*\("
_FIXED_NS = r"\bTORCH_LIBRARY(?:_FRAGMENT|_IMPL)?\s*\(\s*(\w+)\s*,"
_CHECK_USE = r"\b(CHECK_INPUT|CHECK_CUDA|CHECK_CONTIGUOUS)\s*\("
_CHECK_DEF = r"(?m)^\s*#\s*define\s+(CHECK_INPUT|CHECK_CUDA|CHECK_CONTIGUOUS)\b"
_KERNEL_H = r"#\s*include\s*[<\"]kload/kernel\.h[>\"]"


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
        self.fixed_namespaces: list[str] = []  # TORCH_LIBRARY(ns, m)
        self.needs_checks = False          # uses CHECK_* without defining it

    @property
    def style(self) -> str:
        parts = []
        if self.op_library:
            parts.append("op_library")
        if self.python_module:
            parts.append("pybind11")
        if self.fixed_namespaces:
            parts.append("torch_library")
        return "+".join(parts)

    @property
    def has_cuda(self) -> bool:
        return any(s.is_cuda for s in self.sources)


def scan(paths: list[Path], memo: dict | None = None) -> SourceSet:
    """Hash and classify the sources.

    ``memo`` maps a set of content hashes to an earlier scan's findings, so a
    cache hit need not run (or even compile) the regular expressions.
    """
    out = SourceSet([])
    for p in paths:
        data = p.read_bytes()
        out.sources.append(Source(p, hashlib.sha256(data).hexdigest(), p.suffix in CUDA_SUFFIXES))
    memo_key = "scan:" + ",".join(s.sha256 for s in out.sources)
    found = memo.get(memo_key) if memo is not None else None
    if found is None:
        found = _classify([s.path.read_bytes() for s in out.sources], [s.path for s in out.sources])
        if memo is not None:
            memo[memo_key] = found
    out.op_library, out.python_module = found["op_library"], found["python_module"]
    out.fixed_namespaces, out.needs_checks = list(found["fixed_namespaces"]), found["needs_checks"]
    return out


def _classify(blobs: list[bytes], paths: list[Path]) -> dict:
    out = SourceSet([])
    used: set[str] = set()
    defined: set[str] = set()
    includes_kernel_h = False
    for data in blobs:
        code = data.decode("utf-8", errors="replace")
        if "/" in code:
            code = re.sub(_COMMENTS, " ", code, flags=re.S)
        out.op_library |= "KLOAD_" in code and bool(re.search(_OPLIB, code))
        out.python_module |= "PYBIND11_MODULE" in code and bool(re.search(_PYBIND, code))
        if "TORCH_LIBRARY" in code:
            for ns in re.findall(_FIXED_NS, code):
                if ns != "_" and ns not in out.fixed_namespaces:
                    out.fixed_namespaces.append(ns)
        if "CHECK_" in code:
            used.update(re.findall(_CHECK_USE, code))
            defined.update(re.findall(_CHECK_DEF, code))
        includes_kernel_h |= "kload/kernel.h" in code and bool(re.search(_KERNEL_H, code))
    if not (out.op_library or out.python_module or out.fixed_namespaces):
        names = ", ".join(p.name for p in paths)
        raise KloadError(
            f"kload: no bindings found in {names}. Register ops with KLOAD_LIBRARY(m) / KLOAD_IMPL(CPU, m) "
            "(#include <kload/kernel.h>), or write PYBIND11_MODULE(TORCH_EXTENSION_NAME, m), "
            "or TORCH_LIBRARY(namespace, m)."
        )
    return {"op_library": out.op_library, "python_module": out.python_module,
            "fixed_namespaces": out.fixed_namespaces,
            "needs_checks": bool(used - defined) and not includes_kernel_h}
