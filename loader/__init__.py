"""kload: write a C++/CUDA kernel, call it from Python. Compiled at first use,
cached by content, dispatched through PyTorch.

    import kload
    ops = kload.load("my_ops.cpp", "my_ops.cu")   # nothing compiles yet
    c = ops.vector_add(a, b)                      # first use: compile or cache hit, then run
"""
from __future__ import annotations

import logging

from . import messages  # first: its filter gives every record of the kload logger the "kload: " prefix

# A cache hit imports these, what they import (options, reloading, resolve, resolve.library)
# and kload.cache: ten modules (docs/design.md); the rest loads when first needed.
from . import knobs
from .doors import load, load_inline
from .doors.handle import HISTORY, Handle


__all__ = ["load", "load_inline", "cuda_module", "Handle", "CompileError", "KloadError", "RegistrationError", "HISTORY", "kernels",
           "patch", "unpatch", "cpp_extension"]
__version__ = "0.1.0"

logging.getLogger("kload").addHandler(logging.NullHandler())


def patch() -> None:
    """Route every ``torch.utils.cpp_extension.load`` / ``load_inline`` call of this process
    through kload (kload.cpp_extension): same arguments and results, kload's cache."""
    from .cpp_extension import patch as _patch

    _patch()


def unpatch() -> None:
    """Give torch.utils.cpp_extension its own ``load`` and ``load_inline`` back."""
    from .cpp_extension import unpatch as _unpatch

    _unpatch()


if knobs.patch_torch():
    patch()


def load_ipython_extension(ipython):
    """``%load_ext kload``: the ``%%kload`` cell magic and the ``%kload`` line magic."""
    from .doors.magic import load_ipython_extension as register

    register(ipython)


def __getattr__(name):
    # `kload.kernels` (the shipped kernels), `kload.cuda_module` and the exceptions are imported on first use
    if name in ("CompileError", "KloadError", "RegistrationError"):
        from . import errors

        return getattr(errors, name)
    if name == "cuda_module":  # NVRTC and the driver API: imported by its first use only
        from .live.cuda_module import cuda_module

        return cuda_module
    if name in ("kernels", "cpp_extension"):
        import importlib

        return importlib.import_module(f"kload.{name}")
    raise AttributeError(f"module 'kload' has no attribute {name!r}")
