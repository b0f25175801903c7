"""What loading needs beyond the hit path (handle.load_entry): listing a
namespace's ops, the once-per-process rule of fixed TORCH_LIBRARY namespaces,
and stand-in CUDA kernels for a library built without its CUDA sources.
"""
from __future__ import annotations

import logging

from .errors import KloadError
from .handle import Loaded, load_entry  # noqa: F401 (re-exported)

log = logging.getLogger("kload")

_fixed_owner: dict[str, str] = {}          # TORCH_LIBRARY namespace -> key of the build that owns it


def ops_in_namespace(ns: str) -> set[str]:
    import torch

    prefix = ns + "::"
    try:
        all_names = torch._C._dispatch_get_all_op_names()
    except AttributeError:  # older torch
        all_names = [s.name for s in torch._C._jit_get_all_schemas()]
    return {n[len(prefix):].split(".", 1)[0] for n in all_names if n.startswith(prefix)}


def check_fixed_namespaces(name: str, namespaces: list[str], key: str | None) -> None:
    """Refuse to load a TORCH_LIBRARY namespace that this process already has.

    PyTorch aborts the whole process when a second library registers a
    namespace; this turns that into an exception before anything is loaded.
    """
    for ns in namespaces:
        owner = _fixed_owner.get(ns)
        if owner is not None and owner == key:
            continue
        if owner is not None or ops_in_namespace(ns):
            raise KloadError(
                f"kload: {name!r} registers TORCH_LIBRARY({ns}, ...), and this process already has "
                f"operators in namespace {ns!r}"
                + (" from an earlier build of it" if owner else "")
                + ". PyTorch registers a namespace once per process, so this build cannot be loaded "
                "here: restart the process (the new build is then a cache hit), or register with "
                "KLOAD_LIBRARY(m) so that kload gives every build its own namespace."
            )


def claim_fixed_namespaces(namespaces: list[str], key: str) -> None:
    for ns in namespaces:
        _fixed_owner[ns] = key


def register_cuda_stubs(loaded: Loaded, name: str, reason: str):
    """Give each op without a CUDA kernel one that says why it has none."""
    import torch

    libs = []
    for ns in loaded.namespaces:
        lib = None
        for op in sorted(ops_in_namespace(ns)):
            qual = f"{ns}::{op}"
            if any(torch._C._dispatch_has_kernel_for_dispatch_key(qual, k)
                   for k in ("CUDA", "CompositeImplicitAutograd", "CompositeExplicitAutograd")):
                continue
            if lib is None:
                lib = torch.library.Library(ns, "IMPL")
                libs.append(lib)

            def _no_cuda(*args, _op=op, **kwargs):
                raise KloadError(
                    f"kload: {name}.{_op} was called with CUDA tensors, but {name!r} was built without "
                    f"its CUDA sources: {reason}"
                )

            lib.impl(op, _no_cuda, "CUDA")
    return libs
