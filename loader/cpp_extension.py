"""A front door for code written against ``torch.utils.cpp_extension``: ``load``
and ``load_inline`` with the installed torch's own signatures and return values,
kload's cache, locks, errors and progress underneath; ``patch()`` routes torch's
functions here for a whole process (``KLOAD_PATCH_TORCH=1`` at ``import kload``).

    from kload.cpp_extension import load          # instead of torch.utils.cpp_extension
    mod = load(name="ext", sources=["ext.cpp"], extra_cflags=["-O3"])

What differs from torch's loader, and why (docs/from-torch.md has the table):
the build runs in kload's content-keyed cache, not in ``build_directory``; given
one, the built library is linked into it under the name torch would give it, and
that path is returned. ``keep_intermediates`` changes nothing (kload keeps its
build directory for incremental rebuilds); ``use_pch`` makes or removes torch's
precompiled ``torch/extension.h`` as torch does, and kload precompiles headers on
its own besides (``KLOAD_PCH``). SYCL and ROCm builds go to torch's loader.
"""
from __future__ import annotations

import inspect
import logging
import os
import shutil
import uuid
from pathlib import Path
from types import ModuleType
from typing import Any

from torch.utils import cpp_extension as _torch_ext

from .doors import inline_folder, write_files
from .doors.handle import Handle
from .options import CPP_SUFFIXES, CUDA_SUFFIXES, check_name, make_options, source_paths

log = logging.getLogger("kload")

# torch's functions as they were before any patch (a re-import must not capture ours)
TORCH_LOAD = getattr(_torch_ext, "_kload_torch_load", None) or getattr(_torch_ext.load, "__kload_wraps__",
                                                                        _torch_ext.load)
TORCH_LOAD_INLINE = getattr(_torch_ext.load_inline, "__kload_wraps__", _torch_ext.load_inline)
_LOAD_SIG = inspect.signature(TORCH_LOAD)
_INLINE_SIG = inspect.signature(TORCH_LOAD_INLINE)


def _bind(sig: inspect.Signature, args, kwargs, what: str) -> dict:
    try:
        bound = sig.bind(*args, **kwargs)
    except TypeError as e:  # the message torch's own function would give
        raise TypeError(f"{what}() {e}") from None
    bound.apply_defaults()
    return dict(bound.arguments)


def _torch_only(a: dict) -> str | None:
    """Why torch's own loader must build this (kload builds C++ and CUDA), or None."""
    import torch

    if a.get("with_sycl") or a.get("extra_sycl_cflags") or a.get("sycl_sources"):
        return "SYCL sources"
    if getattr(torch.version, "hip", None):
        return "a ROCm build of torch (hipified sources)"
    srcs = a.get("sources")
    for s in [srcs] if isinstance(srcs, (str, os.PathLike)) else (srcs or []):
        if not os.fspath(s).lower().endswith(CPP_SUFFIXES + CUDA_SUFFIXES):
            return f"{os.path.splitext(os.fspath(s))[1] or 'suffix-less'} sources ({os.fspath(s)})"
    return None


def _said(reason: str, name: str) -> None:
    log.warning("%r goes to torch's own loader, which builds what kload does not: %s", name, reason)


# load and load_inline take *args/**kwargs bound to the installed torch's signature
# (their __signature__, set below): torch>=2.4 is supported, and later versions insert
# parameters (extra_sycl_cflags before extra_ldflags), so a fixed def would misbind
# positional calls on another torch.

def load(*args: Any, **kwargs: Any) -> ModuleType | Handle | str:
    """torch.utils.cpp_extension.load, through kload: the installed torch's signature
    and result, built (or found) in kload's cache at once, as torch builds.

    The parameters are the installed torch's: one it lacks is refused as torch refuses
    it. SYCL, sources kload does not build, and every call under a ROCm build of torch
    go to torch's own loader unchanged, which raises what it raises.

    Args:
        name: Honoured: the library's name; here it must be a C identifier.
        sources: Honoured: a path or a list of paths (``str`` or ``Path``), .cpp,
            .cc, .cxx, .c++, .c or .cu. A source with another suffix sends the call
            to torch's own loader (one warning).
        extra_cflags: Honoured: a list of strings.
        extra_cuda_cflags: Honoured: a list of strings.
        extra_sycl_cflags: Given, the call goes to torch's own loader (SYCL).
        extra_ldflags: Honoured: a list of strings.
        extra_include_paths: Honoured; a missing directory goes on to the compiler, as
            with torch.
        build_directory: Not where kload builds (its cache): given, the built library
            (executable) is hard-linked there as ``<name>.so`` (``<name>``), and a
            returned path is that one.
        verbose: Honoured: the compile commands and output on the terminal.
        with_cuda: True links CUDA for C++-only sources too; otherwise CUDA when
            there is a .cu source (False does not turn it off).
        with_sycl: True sends the call to torch's own loader.
        is_python_module: Honoured (see Returns).
        is_standalone: Honoured: an executable, built or found, never loaded.
        keep_intermediates: Ignored: kload keeps its build directory for
            incremental rebuilds.

    Returns:
        What torch returns: by default the pybind11 module, or, for sources without
        ``PYBIND11_MODULE`` (where torch raises ImportError), a :class:`kload.Handle`
        whose attributes are the ops; with ``is_python_module=False`` the loaded
        library's path (its ``TORCH_LIBRARY`` ops registered); with
        ``is_standalone=True`` the executable's path.

    Raises:
        TypeError: An argument torch's signature does not bind (torch's message); a
            flag argument that is not a list of strings; a source that is not a
            ``str`` or ``Path``.
        ValueError: ``name`` is not a C identifier.
        FileNotFoundError: A source does not exist.
        KloadError: No source; a source listed twice or sharing its file name with
            another C++ source.
        OSError: CUDA sources (or ``with_cuda=True``) where CUDA cannot be built, as
            torch raises.
        CompileError: The build failed (a RuntimeError, as torch's is).
    """
    a = _bind(_LOAD_SIG, args, kwargs, "load")
    reason = _torch_only(a)
    if reason:
        _said(reason, a["name"])
        return TORCH_LOAD(*args, **kwargs)
    return _build_and_load(a, source_paths(a["sources"]), standalone=bool(a.get("is_standalone")))


def load_inline(*args: Any, **kwargs: Any) -> ModuleType | Handle | str:
    """torch.utils.cpp_extension.load_inline, through kload: the installed torch's
    signature and result; the same main.cpp / cuda.cu torch would write, written into
    kload's cache (``inline/<name>-<hash>/``) and built as :func:`load` builds.
    The parameters are the installed torch's, and calls go to torch's own loader, as
    for :func:`load`.

    Args:
        name: As for :func:`load`.
        cpp_sources: Honoured: a string or a list of strings.
        cuda_sources: Honoured: a string or a list of strings (None: none).
        sycl_sources: Given, the call goes to torch's own loader (SYCL).
        functions: Honoured: a name, a list of names or a dict of name to docstring,
            bound in a generated ``PYBIND11_MODULE``.
        extra_cflags: As for :func:`load`.
        extra_cuda_cflags: As for :func:`load`.
        extra_sycl_cflags: As for :func:`load`.
        extra_ldflags: As for :func:`load`.
        extra_include_paths: As for :func:`load`.
        build_directory: As for :func:`load`.
        verbose: As for :func:`load`.
        with_cuda: As for :func:`load`.
        with_sycl: As for :func:`load`.
        is_python_module: As for :func:`load`.
        with_pytorch_error_handling: Honoured.
        keep_intermediates: Ignored, as for :func:`load`.
        use_pch: Honoured as torch does: True builds torch's precompiled
            ``torch/extension.h`` (and its ``.sign`` file) before the build, False
            removes them. kload precompiles the header a source starts with on its own
            either way (``KLOAD_PCH``).
        no_implicit_headers: Honoured.

    Returns:
        What torch returns, as for :func:`load` (never an executable).

    Raises:
        TypeError: An argument torch's signature does not bind (torch's message); a
            flag argument that is not a list of strings.
        ValueError: ``name`` is not a C identifier; ``functions`` is not a string,
            list or dict.
        OSError: As for :func:`load`.
        CompileError: The build failed.
    """
    a = _bind(_INLINE_SIG, args, kwargs, "load_inline")
    reason = _torch_only(a)
    if reason:
        _said(reason, a["name"])
        return TORCH_LOAD_INLINE(*args, **kwargs)
    files = inline_sources(a)
    folder = inline_folder(check_name(a["name"]), files)
    torch_pch(a)
    paths = write_files(folder, files)
    return _build_and_load(a, [paths[f] for f in files], standalone=False)


def torch_pch(a: dict[str, Any]) -> None:
    """``use_pch`` as torch's load_inline has it: True makes (or keeps, if its signature
    matches) torch's precompiled ``torch/extension.h`` beside the header, with its signature
    file; False removes both. Torch's own functions do it, so the files, their command and
    their checks are torch's; kload's compile may then use that file as torch's would (GCC
    takes it when the flags match, and kload's key does not depend on it: the object code is
    the same)."""
    make = getattr(_torch_ext, "_check_and_build_extension_h_precompiler_headers", None)
    remove = getattr(_torch_ext, "remove_extension_h_precompiler_headers", None)
    if make is None or remove is None:  # a torch without use_pch: nothing to honour
        return
    if a.get("use_pch") is True:
        make(a["extra_cflags"], a["extra_include_paths"])
    else:
        remove()


def inline_sources(a: dict[str, Any]) -> dict[str, str]:
    """The files torch's load_inline writes for these arguments, text for text.

    Args:
        a: load_inline's arguments, bound to torch's signature with its defaults.

    Returns:
        ``{"main.cpp": text}``, and ``"cuda.cu"`` when there are CUDA sources.

    Raises:
        ValueError: ``functions`` is not a string, list or dict (torch's message).
    """
    implicit = not a.get("no_implicit_headers", False)
    cpp = a["cpp_sources"]
    cpp = [cpp] if isinstance(cpp, str) else list(cpp)
    cuda = a.get("cuda_sources") or []
    cuda = [cuda] if isinstance(cuda, str) else list(cuda)
    if implicit:
        cpp.insert(0, "#include <torch/extension.h>")
    functions = a.get("functions")
    if functions is not None:
        if isinstance(functions, str):
            functions = [functions]
        if isinstance(functions, list):
            functions = {f: f for f in functions}
        elif not isinstance(functions, dict):
            raise ValueError(f"Expected 'functions' to be a list or dict, but was {type(functions)}")
        cpp.append("PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {")
        for fname, doc in functions.items():
            if a.get("with_pytorch_error_handling", True):
                cpp.append(f'm.def("{fname}", torch::wrap_pybind_function({fname}), "{doc}");')
            else:
                cpp.append(f'm.def("{fname}", {fname}, "{doc}");')
        cpp.append("}")
    files = {"main.cpp": "\n".join(cpp)}
    if cuda:
        if implicit:
            cuda[:0] = ["#include <torch/types.h>", "#include <cuda.h>", "#include <cuda_runtime.h>"]
        files["cuda.cu"] = "\n".join(cuda)
    return files


def _build_and_load(a: dict, paths: list[Path], standalone: bool):
    opts = make_options(a["name"], paths, a.get("extra_cflags"), a.get("extra_cuda_cflags"),
                        a.get("extra_ldflags"), a.get("extra_include_paths"), a.get("verbose", False),
                        None, reload=False, with_cuda=a.get("with_cuda"), standalone=standalone, as_torch=True)
    handle = Handle(opts)
    build_dir = a.get("build_directory")
    if standalone:  # an executable: built (or found), never loaded
        return _place(handle.build(), build_dir, opts.name, "")
    handle.load()
    path = _place(handle.build(), build_dir, opts.name, ".so")  # found, not built again
    if not a.get("is_python_module", True):
        return path  # the library is loaded and its TORCH_LIBRARY ops registered, as with torch
    module = handle.module
    # a pybind11 module, as torch returns; for an op library (torch raises ImportError
    # there: no PyInit_<name>) the handle, whose attributes are its ops
    return module if module is not None else handle


def _place(artifact: str, build_dir, name: str, suffix: str) -> str:
    """torch's loader leaves ``<build_directory>/<name>.so``; code may look for it
    there. Link kload's artifact in under that name (a hard link: the same file, so
    loading it again maps the library already loaded; a copy across file systems)."""
    if build_dir is None:
        return artifact
    dest = os.path.join(os.fspath(build_dir), name + suffix)
    try:
        if os.path.samefile(artifact, dest):
            return dest
    except OSError:
        pass
    os.makedirs(os.fspath(build_dir), exist_ok=True)
    tmp = f"{dest}.kload-{uuid.uuid4().hex[:8]}"
    try:
        os.link(artifact, tmp)
    except OSError:
        shutil.copy2(artifact, tmp)
    os.replace(tmp, dest)
    return dest


# -- patch: torch's functions, routed here for the whole process ---------------------

def _wrapped(ours, theirs):
    def call(*args, **kwargs):
        return ours(*args, **kwargs)

    call.__name__, call.__qualname__, call.__module__ = theirs.__name__, theirs.__qualname__, __name__
    call.__doc__ = (theirs.__doc__ or "") + "\n\n(Routed through kload: kload.unpatch() restores torch's.)"
    call.__signature__ = inspect.signature(theirs)
    call.__kload_wraps__ = theirs
    return call


def patch() -> None:
    """Route ``torch.utils.cpp_extension.load`` and ``load_inline`` through kload for
    this process: a package that calls torch's loader gets kload's cache, locks and
    errors without a code change. Code that did ``from torch.utils.cpp_extension
    import load`` before this call keeps torch's function: patch first (or set
    KLOAD_PATCH_TORCH=1, read at ``import kload``)."""
    if is_patched():
        return
    _torch_ext._kload_torch_load = TORCH_LOAD  # what kload's own builds call (compile/pipeline.py)
    _torch_ext.load = _wrapped(load, TORCH_LOAD)
    _torch_ext.load_inline = _wrapped(load_inline, TORCH_LOAD_INLINE)


def unpatch() -> None:
    """Give torch its own ``load`` and ``load_inline`` back."""
    _torch_ext.load, _torch_ext.load_inline = TORCH_LOAD, TORCH_LOAD_INLINE


def is_patched() -> bool:
    """Whether ``torch.utils.cpp_extension.load`` is kload's (``patch()`` ran)."""
    return getattr(_torch_ext.load, "__kload_wraps__", None) is TORCH_LOAD


load.__signature__ = _LOAD_SIG
load_inline.__signature__ = _INLINE_SIG
