"""Step 8 of a load, the front door: ``kload.load`` (files) and
``kload.load_inline`` (strings, written once into the cache). ``load`` is on the
hit path of a fresh process: it validates (options.py) and returns a Handle;
nothing is hashed or compiled until the first op is used.
"""
from __future__ import annotations

from pathlib import Path

from . import knobs
from .handle import Handle
from .options import check_name, make_options, resolve_paths


def load(*sources, name=None, extra_cflags=(), extra_cuda_cflags=(), extra_ldflags=(),
         extra_include_paths=(), verbose=False, debug=None, reload=None) -> "Handle":
    """A handle to the ops in ``sources`` (.cpp/.cu); nothing compiles until first use.

    ``debug=True`` builds with ``-g -O0`` (CUDA: ``-G``) into an entry of its own
    (default: ``KLOAD_DEBUG``). ``reload=True`` watches the sources and the headers
    they include, and the next access after a save runs the new code (default:
    ``KLOAD_RELOAD``, else on in IPython/Jupyter and interactive sessions).
    Missing files, unsupported suffixes and malformed options raise here, at once.
    """
    if len(sources) == 1 and isinstance(sources[0], (list, tuple)):
        sources = tuple(sources[0])
    paths = resolve_paths(list(sources))
    opts = make_options(name, paths, extra_cflags, extra_cuda_cflags, extra_ldflags,
                        extra_include_paths, verbose, debug, reload)
    return Handle(opts)


def _as_text(value, what: str) -> str:
    if value is None:
        return ""
    if isinstance(value, str):
        return value
    if isinstance(value, (list, tuple)) and all(isinstance(v, str) for v in value):
        return "\n".join(value)
    raise TypeError(f"kload: {what} must be a string or a list of strings, got {type(value).__name__}")


_STABLE_WORDS = ("TORCH_BOX", "torch::stable::", "kload::Tensor", "STABLE_TORCH_LIBRARY")


def default_header(text: str, stable: bool = False) -> str:
    """Like torch's load_inline: a source without a single #include gets the header
    its binding style needs ("" when it has includes of its own): <kload/stable.h>
    when asked for or when the code is written against the stable ABI."""
    if "#include" in text:
        return ""
    if "PYBIND11_MODULE" in text:
        return "#include <torch/extension.h>\n"
    if stable or any(w in text for w in _STABLE_WORDS):
        return "#include <kload/stable.h>\n"
    return "#include <kload/kernel.h>\n"


def inline_folder(name: str, files: dict[str, str]) -> Path:
    """The cache's folder for these source strings (named by their content)."""
    import hashlib

    h = hashlib.sha256()
    for fname, text in sorted(files.items()):
        h.update(fname.encode() + b"\0" + text.encode() + b"\0")
    folder = knobs.cache_dir() / "inline" / f"{name}-{h.hexdigest()[:16]}"
    folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    return folder


def write_files(folder: Path, files: dict[str, str]) -> dict[str, Path]:
    """Write each file unless it holds that text already (atomically: a reader never
    sees half a file)."""
    from kload.cache.store import write_atomic

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
        from .errors import KloadError

        raise KloadError("kload: load_inline() needs cpp_sources or cuda_sources")
    files = {}
    if cpp.strip():
        files[f"{name}.cpp"] = default_header(cpp) + cpp
    if cuda.strip():
        files[f"{name}_cuda.cu"] = default_header(cuda) + cuda
    paths = write_files(inline_folder(name, files), files)
    options.setdefault("reload", False)  # strings do not change on disk
    return load(*paths.values(), name=name, **options)


PCH_CELL = "#include <kload/kernel.h>\nKLOAD_LIBRARY(m) {}\n"
PCH_CELL_STABLE = "#include <kload/stable.h>\nKLOAD_LIBRARY(m) {}\n"


def cell_pch_source(stable: bool = False) -> Path:
    """An empty op library written as a %%kload cell is: what ``%load_ext kload`` and
    ``kload build --pch`` precompile <kload/kernel.h> (or <kload/stable.h>) for (a
    cell's default flags)."""
    fname = "kload_cell_pch_stable.cpp" if stable else "kload_cell_pch.cpp"
    files = {fname: PCH_CELL_STABLE if stable else PCH_CELL}
    return write_files(inline_folder(fname[:-4], files), files)[fname]
