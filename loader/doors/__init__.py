"""The front doors: take what a user writes, give a Handle (or a CudaModule, a magic's
cell, a CLI command's work). Here: ``kload.load`` (files) and ``kload.load_inline``
(strings, written once into the cache). ``load`` is on the hit path of a fresh
process: it validates (kload.options) and returns a Handle; nothing is hashed or
compiled until the first op is used.

- ``handle``: the Handle: ops found, loaded and reloaded at first use;
- ``magic``: ``%%kload`` and ``%kload`` in IPython and Jupyter;
- ``ide``: ``compile_commands.json`` for clangd;
- ``cli``, ``cli_cache``, ``cli_remote``: ``python -m kload`` and its commands.
"""
from __future__ import annotations

import os
from collections.abc import Sequence  # already imported by the interpreter; typing is not
from pathlib import Path

from .. import knobs
from .handle import Handle
from ..options import check_name, make_options, source_paths
from ..messages import msg


def load(
    *sources: str | Path | Sequence[str | Path],
    name: str | None = None,
    extra_cflags: Sequence[str] | None = (),
    extra_cuda_cflags: Sequence[str] | None = (),
    extra_ldflags: Sequence[str] | None = (),
    extra_include_paths: Sequence[str | os.PathLike] | None = (),
    verbose: bool = False,
    debug: bool | None = None,
    reload: bool | None = None,
    device_code: str | os.PathLike | None = None,
) -> Handle:
    """A handle to the ops in ``sources`` (.cpp/.cu); nothing compiles until first use.

    Missing files, unsupported suffixes and malformed options raise here, at once;
    a compile error (:class:`kload.CompileError`) raises at the first use.

    Args:
        *sources: The source files, each a ``str`` or ``pathlib.Path``, relative to
            the working directory or absolute (``~`` expanded); one list or tuple of
            them is accepted as the only argument. Suffixes: .cpp, .cc, .cxx, .c++,
            .c, .cu (headers are found through ``#include``).
        name: The library's name, a C identifier. Default: the first source's file
            stem, with characters that are not letters, digits or ``_`` made ``_``.
        extra_cflags: Flags for the C++ compiler. None: none.
        extra_cuda_cflags: Flags for nvcc. None: none.
        extra_ldflags: Flags for the linker. None: none.
        extra_include_paths: Directories to search for headers, each a ``str`` or
            ``os.PathLike`` (made absolute, ``~`` expanded). None: none.
        verbose: Pass the compile commands and compiler output through to the terminal.
        debug: Build with ``-g -O0`` (CUDA: ``-G``), into a cache entry of its own.
            None: ``KLOAD_DEBUG``.
        reload: Watch the sources and the headers they include; the next access after
            a save runs the new code. None: ``KLOAD_RELOAD``, else on in
            IPython/Jupyter and interactive sessions.
        device_code: A file of CUDA device code (``__global__`` functions, no host code)
            whose kernels the sources launch by name through ``kload::live::Kernel``
            (``<kload/live.h>``). NVRTC compiles it when the library loads (a cache hit
            after the first time), and again after each edit: the same ops then launch
            the new kernels, and the sources are not rebuilt. None: no device code.

    Returns:
        A :class:`kload.Handle`, nothing hashed or compiled yet: the first op access
        (or ``.load()``, ``.build()``) builds or finds the library in the cache.

    Raises:
        FileNotFoundError: A source file, an include directory or ``device_code`` does not exist.
        KloadError: A source has an unsupported suffix, is listed twice, or shares
            its file name with another C++ source; or no source was given.
        TypeError: A source is not a ``str`` or ``Path``; a flag argument is a
            string rather than a list, or holds something other than strings.
        ValueError: ``name`` (given or derived) is not a C identifier.

    Example::

        >>> ops = kload.load("kernels/vector_add/vector_add.cpp")   # nothing compiles yet
        >>> ops.vector_add(torch.ones(3), torch.ones(3))             # built, or found in the cache
        tensor([2., 2., 2.])
    """
    if len(sources) == 1 and isinstance(sources[0], (list, tuple)):
        sources = tuple(sources[0])
    paths = source_paths(list(sources))
    opts = make_options(name, paths, extra_cflags, extra_cuda_cflags, extra_ldflags,
                        extra_include_paths, verbose, debug, reload, device_code=device_code)
    return Handle(opts)


def _as_text(value: str | Sequence[str] | None, what: str) -> str:
    if value is None:
        return ""
    if isinstance(value, str):
        return value
    if isinstance(value, (list, tuple)) and all(isinstance(v, str) for v in value):
        return "\n".join(value)
    raise TypeError(msg(f"{what} must be a string or a list of strings, got {type(value).__name__}"))


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


def load_inline(
    name: str,
    cpp_sources: str | Sequence[str] | None,
    cuda_sources: str | Sequence[str] | None = None,
    *,
    extra_cflags: Sequence[str] | None = (),
    extra_cuda_cflags: Sequence[str] | None = (),
    extra_ldflags: Sequence[str] | None = (),
    extra_include_paths: Sequence[str | os.PathLike] | None = (),
    verbose: bool = False,
    debug: bool | None = None,
    reload: bool | None = False,  # strings do not change on disk
) -> Handle:
    """A handle to ops given as source strings (written once into the cache).

    The strings are written, unless already there, to ``<cache>/inline/<name>-<hash>/``
    as ``<name>.cpp`` and ``<name>_cuda.cu``; a source without any ``#include`` gets
    ``<kload/kernel.h>`` (``<kload/stable.h>`` for stable-ABI code,
    ``<torch/extension.h>`` if it has ``PYBIND11_MODULE``). Then as :func:`load`.

    Args:
        name: The library's name, a C identifier (also names the files).
        cpp_sources: C++ source: a string, or a list or tuple of strings joined by
            newlines. None or blank: no C++ file.
        cuda_sources: CUDA source, the same way. None or blank: no .cu file.
        extra_cflags: As for :func:`load`.
        extra_cuda_cflags: As for :func:`load`.
        extra_ldflags: As for :func:`load`.
        extra_include_paths: As for :func:`load`.
        verbose: As for :func:`load`.
        debug: As for :func:`load`.
        reload: As for :func:`load`, but off by default. None: ``KLOAD_RELOAD``.

    Returns:
        A :class:`kload.Handle`, nothing compiled yet (the files are written).

    Raises:
        ValueError: ``name`` is not a C identifier.
        TypeError: A source is neither a string nor a list of strings; or a flag
            argument is malformed, as for :func:`load`.
        KloadError: Both ``cpp_sources`` and ``cuda_sources`` are empty.
        FileNotFoundError: An include directory does not exist.

    Example::

        >>> ops = kload.load_inline("twice", '''
        ... at::Tensor twice(const at::Tensor& x) { return x * 2; }
        ... KLOAD_LIBRARY(m) { m.def("twice(Tensor x) -> Tensor"); }
        ... KLOAD_IMPL(CPU, m) { m.impl("twice", &twice); }''')
        >>> ops.twice(torch.ones(2))
        tensor([2., 2.])
    """
    check_name(name)
    cpp = _as_text(cpp_sources, "cpp_sources")
    cuda = _as_text(cuda_sources, "cuda_sources")
    if not cpp.strip() and not cuda.strip():
        from ..errors import KloadError

        raise KloadError("load_inline() needs cpp_sources or cuda_sources")
    files = {}
    if cpp.strip():
        files[f"{name}.cpp"] = default_header(cpp) + cpp
    if cuda.strip():
        files[f"{name}_cuda.cu"] = default_header(cuda) + cuda
    paths = write_files(inline_folder(name, files), files)
    return load(*paths.values(), name=name, extra_cflags=extra_cflags, extra_cuda_cflags=extra_cuda_cflags,
                extra_ldflags=extra_ldflags, extra_include_paths=extra_include_paths, verbose=verbose,
                debug=debug, reload=reload)


PCH_CELL = "#include <kload/kernel.h>\nKLOAD_LIBRARY(m) {}\n"
PCH_CELL_STABLE = "#include <kload/stable.h>\nKLOAD_LIBRARY(m) {}\n"


def cell_pch_source(stable: bool = False) -> Path:
    """An empty op library written as a %%kload cell is: what ``%load_ext kload`` and
    ``kload build --pch`` precompile <kload/kernel.h> (or <kload/stable.h>) for (a
    cell's default flags)."""
    fname = "kload_cell_pch_stable.cpp" if stable else "kload_cell_pch.cpp"
    files = {fname: PCH_CELL_STABLE if stable else PCH_CELL}
    return write_files(inline_folder(fname[:-4], files), files)[fname]
