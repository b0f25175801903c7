"""What a set of sources is: its files, its binding style, the macros it relies on.

One read per file: the same bytes are hashed for the cache key and scanned here.
"""
from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass, field
from pathlib import Path

from .errors import KloadError

CPP_SUFFIXES = (".cpp", ".cc", ".cxx", ".c++", ".c")
CUDA_SUFFIXES = (".cu",)

_COMMENTS = re.compile(r"//[^\n]*|/\*.*?\*/", re.S)
_OPLIB = re.compile(r"\bKLOAD_(?:LIBRARY|FRAGMENT|IMPL)\s*\(")
_PYBIND = re.compile(r"\bPYBIND11_MODULE\s*\(")
_FIXED_NS = re.compile(r"\bTORCH_LIBRARY(?:_FRAGMENT|_IMPL)?\s*\(\s*(\w+)\s*,")
_CHECK_USE = re.compile(r"\b(CHECK_INPUT|CHECK_CUDA|CHECK_CONTIGUOUS)\s*\(")
_CHECK_DEF = re.compile(r"^\s*#\s*define\s+(CHECK_INPUT|CHECK_CUDA|CHECK_CONTIGUOUS)\b", re.M)
_KERNEL_H = re.compile(r"#\s*include\s*[<\"]kload/kernel\.h[>\"]")


@dataclass(frozen=True)
class Source:
    path: Path
    sha256: str
    is_cuda: bool


@dataclass
class SourceSet:
    sources: list[Source]
    op_library: bool = False          # KLOAD_LIBRARY / KLOAD_IMPL: kload supplies the namespace
    python_module: bool = False       # PYBIND11_MODULE(TORCH_EXTENSION_NAME, m)
    fixed_namespaces: list[str] = field(default_factory=list)  # TORCH_LIBRARY(ns, m)
    needs_checks: bool = False        # uses CHECK_* without defining it

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


def resolve_paths(sources) -> list[Path]:
    """Absolute paths of the given sources; a clear error for a missing or odd one."""
    if isinstance(sources, (str, Path)):
        sources = [sources]
    paths = []
    for s in sources:
        if not isinstance(s, (str, Path)):
            raise TypeError(f"kload: a source must be a path, got {type(s).__name__}: {s!r}")
        p = Path(s).expanduser().absolute()
        if p.suffix.lower() not in CPP_SUFFIXES + CUDA_SUFFIXES:
            raise KloadError(
                f"kload: unsupported source type {p.suffix or '(no suffix)'!r} for {p}; "
                f"expected one of {', '.join(CPP_SUFFIXES + CUDA_SUFFIXES)} (headers are found through #include)"
            )
        if not p.is_file():
            raise FileNotFoundError(f"kload: source file not found: {p}")
        if p in paths:
            raise KloadError(f"kload: source listed twice: {p}")
        paths.append(p)
    if not paths:
        raise KloadError("kload: load() needs at least one source file")
    stems = [p.stem for p in paths if p.suffix not in CUDA_SUFFIXES]
    dup = {s for s in stems if stems.count(s) > 1}
    if dup:
        # torch names object files after the stem: two a.cpp would overwrite each other's a.o
        raise KloadError(f"kload: two C++ sources share the file name {sorted(dup)[0]!r}; rename one")
    return paths


def scan(paths: list[Path]) -> SourceSet:
    """Hash and classify the sources."""
    out = SourceSet(sources=[])
    used: set[str] = set()
    defined: set[str] = set()
    includes_kernel_h = False
    for p in paths:
        data = p.read_bytes()
        out.sources.append(Source(p, hashlib.sha256(data).hexdigest(), p.suffix in CUDA_SUFFIXES))
        text = data.decode("utf-8", errors="replace")
        code = _COMMENTS.sub(" ", text)
        out.op_library |= bool(_OPLIB.search(code))
        out.python_module |= bool(_PYBIND.search(code))
        for ns in _FIXED_NS.findall(code):
            if ns != "_" and ns not in out.fixed_namespaces:
                out.fixed_namespaces.append(ns)
        used.update(_CHECK_USE.findall(code))
        defined.update(_CHECK_DEF.findall(code))
        includes_kernel_h |= bool(_KERNEL_H.search(code))
    if not (out.op_library or out.python_module or out.fixed_namespaces):
        names = ", ".join(p.name for p in paths)
        raise KloadError(
            f"kload: no bindings found in {names}. Register ops with KLOAD_LIBRARY(m) / KLOAD_IMPL(CPU, m) "
            "(#include <kload/kernel.h>), or write PYBIND11_MODULE(TORCH_EXTENSION_NAME, m), "
            "or TORCH_LIBRARY(namespace, m)."
        )
    out.needs_checks = bool(used - defined) and not includes_kernel_h
    return out
