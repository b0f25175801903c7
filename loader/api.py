"""The public entry points: ``load`` (files; in handle.py, the hit path) and
``load_inline`` (strings)."""
from __future__ import annotations

import hashlib
from pathlib import Path

from kload.cache.store import write_atomic

from . import knobs
from .errors import KloadError
from .handle import Handle, check_name, load  # noqa: F401 (load is re-exported)


def _as_text(value, what: str) -> str:
    if value is None:
        return ""
    if isinstance(value, str):
        return value
    if isinstance(value, (list, tuple)) and all(isinstance(v, str) for v in value):
        return "\n".join(value)
    raise TypeError(f"kload: {what} must be a string or a list of strings, got {type(value).__name__}")


def default_header(text: str) -> str:
    """Like torch's load_inline: a source without a single #include gets the header
    its binding style needs ("" when it has includes of its own)."""
    if "#include" in text:
        return ""
    return "#include <torch/extension.h>\n" if "PYBIND11_MODULE" in text else "#include <kload/kernel.h>\n"


def inline_folder(name: str, files: dict[str, str]) -> Path:
    """The cache's folder for these source strings (named by their content)."""
    h = hashlib.sha256()
    for fname, text in sorted(files.items()):
        h.update(fname.encode() + b"\0" + text.encode() + b"\0")
    folder = knobs.cache_dir() / "inline" / f"{name}-{h.hexdigest()[:16]}"
    folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    return folder


def write_files(folder: Path, files: dict[str, str]) -> dict[str, Path]:
    """Write each file unless it holds that text already (atomically: a reader never
    sees half a file)."""
    out = {}
    for fname, text in files.items():
        path = folder / fname
        if not path.exists() or path.read_text() != text:
            write_atomic(path, text)
        out[fname] = path
    return out


def load_inline(name, cpp_sources, cuda_sources=None, **options) -> Handle:
    """A handle to ops given as source strings (written once into the cache)."""
    check_name(name)
    cpp = _as_text(cpp_sources, "cpp_sources")
    cuda = _as_text(cuda_sources, "cuda_sources")
    if not cpp.strip() and not cuda.strip():
        raise KloadError("kload: load_inline() needs cpp_sources or cuda_sources")
    files = {}
    if cpp.strip():
        files[f"{name}.cpp"] = default_header(cpp) + cpp
    if cuda.strip():
        files[f"{name}_cuda.cu"] = default_header(cuda) + cuda
    paths = write_files(inline_folder(name, files), files)
    options.setdefault("reload", False)  # strings do not change on disk
    return load(*paths.values(), name=name, **options)
