"""kload's shipped kernels, compiled on first use from kernels/<op>/ through kload.load.

    from kload import kernels
    kernels.vector_add(a, b)
    kernels.matmul(a, b)                                  # [M, K] @ [K, N]; fp32 follows torch's TF32 setting
    kernels.conv2d(x, w, bias=None, stride=1, padding=0)  # NCHW, as F.conv2d
    kernels.bias_gelu(x, bias)                            # F.gelu(x + bias), fused, with backward

All four are dispatcher ops, so opcheck, autograd and torch.compile see ordinary PyTorch
operators: vector_add, conv2d and bias_gelu are their kernels' ops (``torch.ops.<namespace>.<op>``,
built on first use); matmul is ``torch.ops.kload_kernels.matmul``, a CompositeImplicitAutograd
op that reads torch's TF32 setting (which the kernel's op, on the stable ABI, cannot) and calls
the kernel's op with it. ``kernels.op(name)`` is any kernel's own op.
"""
from __future__ import annotations

import threading
from pathlib import Path

import torch

import kload

__all__ = ["vector_add", "matmul", "conv2d", "bias_gelu"]

_HERE = Path(__file__).resolve().parent
# -O3 -march=native: the inner loops are written for the compiler to vectorize;
# kload keys -march=native builds by the host CPU. OpenMP: openmp_flags().
CFLAGS = ["-O3", "-march=native"]
CUDA_CFLAGS = ["-O3"]
LDFLAGS: list[str] = []

_lock = threading.Lock()
_handles: dict[str, kload.Handle] = {}


def sources(op: str) -> list[Path]:
    """The sources of one shipped op, on torch's stable ABI: <op>.cpp (schema, CPU and Meta
    kernels, and the glue of the CUDA kernels) and <op>.cu (CUDA kernels, no torch header)."""
    folder = _HERE / op
    return sorted(folder.glob("*.cpp")) + sorted(folder.glob("*.cu"))


def openmp_flags() -> tuple[list[str], list[str]]:
    """The C++ and link flags of the kernels' loops, for the compiler ``CXX`` names. g++:
    ``-fopenmp``, which links the libgomp torch already loaded (same soname): one runtime
    in the process. clang: its ``-fopenmp`` emits calls into LLVM's libomp (``__kmpc_*``,
    which libgomp lacks), a second runtime and thread pool beside torch's, and its
    ``-fopenmp=libgomp`` compiles the pragmas away; so ``-fopenmp-simd`` (the simd
    pragmas, no runtime) and the threads of torch's own pool (kload/cpu/parallel.h)."""
    from kload import knobs
    from kload.options import cxx_command
    from kload.plan.toolchain import compiler_identity

    if compiler_identity(cxx_command(), knobs.cache_dir()).get("family") == "gcc":
        return ["-fopenmp"], ["-fopenmp"]
    return ["-fopenmp-simd"], []


def handle(op: str) -> kload.Handle:
    """The loaded library of one shipped op, with its autograd formula registered."""
    with _lock:
        h = _handles.get(op)
        if h is None:
            # reload=False: `kernels.<op>` is bound once, with its autograd registered on
            # that build's namespace; a rebuild would serve neither (and these files ship
            # in the package), so no watcher either
            cflags, ldflags = openmp_flags()
            h = kload.load(*sources(op), name=f"kload_{op}", extra_cflags=CFLAGS + cflags,
                           extra_cuda_cflags=CUDA_CFLAGS, extra_ldflags=LDFLAGS + ldflags, reload=False)
            h.load()
            _AUTOGRAD[op](h)
            _handles[op] = h
        return h


# -- autograd: registered once per build, on its namespace --------------------------
# register_autograd makes the op differentiable *and* keeps it one opaque node under
# torch.compile (the backward formula is traced instead of the C++ body).

def _vector_add_autograd(h: kload.Handle) -> None:
    def backward(ctx, grad):
        return grad, grad

    torch.library.register_autograd(f"{h.namespace}::vector_add", backward)


def _save_inputs(ctx, inputs, output):
    ctx.save_for_backward(*inputs)


def _matmul_autograd(h: kload.Handle) -> None:
    op = h.matmul

    def setup_context(ctx, inputs, output):
        a, b, allow_tf32 = inputs
        ctx.save_for_backward(a, b)
        ctx.allow_tf32 = allow_tf32

    def backward(ctx, grad):
        a, b = ctx.saved_tensors
        ga = op(grad, b.t(), ctx.allow_tf32) if ctx.needs_input_grad[0] else None
        gb = op(a.t(), grad, ctx.allow_tf32) if ctx.needs_input_grad[1] else None
        return ga, gb, None

    torch.library.register_autograd(f"{h.namespace}::matmul", backward, setup_context=setup_context)


def _conv2d_autograd(h: kload.Handle) -> None:
    bwd = h.conv2d_backward

    def setup_context(ctx, inputs, output):
        x, w, bias, stride, padding = inputs
        ctx.save_for_backward(x, w)
        ctx.stride, ctx.padding, ctx.has_bias = stride, padding, bias is not None

    def backward(ctx, grad):
        x, w = ctx.saved_tensors
        gx, gw = bwd(grad, x, w, ctx.stride, ctx.padding)
        gb = grad.sum((0, 2, 3)) if ctx.has_bias and ctx.needs_input_grad[2] else None
        return gx, gw, gb, None, None

    torch.library.register_autograd(f"{h.namespace}::conv2d", backward, setup_context=setup_context)


def _bias_gelu_autograd(h: kload.Handle) -> None:
    bwd = h.bias_gelu_backward

    def backward(ctx, grad):
        return bwd(grad, *ctx.saved_tensors)

    torch.library.register_autograd(f"{h.namespace}::bias_gelu", backward, setup_context=_save_inputs)


_AUTOGRAD = {
    "vector_add": _vector_add_autograd,
    "matmul": _matmul_autograd,
    "conv2d": _conv2d_autograd,
    "bias_gelu": _bias_gelu_autograd,
}


_ops: dict[str, object] = {}


def op(name: str):
    """The dispatcher op of one shipped kernel, ``torch.ops.<namespace>.<name>`` (built and
    loaded on first use): what opcheck and torch.library take."""
    found = _ops.get(name)
    if found is None:
        if name not in _AUTOGRAD:
            raise AttributeError(f"kload.kernels has no kernel {name!r}; it has: {', '.join(__all__)}")
        found = _ops[name] = getattr(handle(name), name)
    return found


# matmul, the public op: torch's TF32 setting is read in Python, since the kernel's op (on the
# stable ABI) cannot read it, and passed on. CompositeImplicitAutograd: it decomposes into the
# kernel's op, which autograd, fake tensors and torch.compile then see; the setting is read where
# it decomposes, at each eager call as torch.matmul reads it, and when torch.compile traces.
_LIB = torch.library.Library("kload_kernels", "FRAGMENT")
_LIB.define("matmul(Tensor a, Tensor b, bool? allow_tf32=None) -> Tensor")


def _matmul(a: torch.Tensor, b: torch.Tensor, allow_tf32: bool | None = None) -> torch.Tensor:
    """a @ b for 2-D a [M, K] and b [K, N], through kload's matmul kernel.

    allow_tf32: whether float32 may run on a GPU's TF32 tensor cores (10-bit mantissa inputs,
    fp32 sums). None: torch's setting (``torch.backends.cuda.matmul.allow_tf32``, which
    ``torch.set_float32_matmul_precision("high")`` sets, or the newer ``fp32_precision =
    "tf32"``); under ``torch.compile``, the setting when the graph was traced. The CPU ignores it.
    """
    return op("matmul")(a, b, _tf32_allowed() if allow_tf32 is None else allow_tf32)


_LIB.impl("matmul", _matmul, "CompositeImplicitAutograd")
matmul = torch.ops.kload_kernels.matmul


def _tf32_allowed() -> bool:
    """Whether torch lets its own float32 matmuls use TF32 on a GPU."""
    cuda_matmul = torch.backends.cuda.matmul
    try:
        return bool(cuda_matmul.allow_tf32)
    except RuntimeError:  # torch >= 2.9 set through fp32_precision: the legacy flag refuses to answer
        return cuda_matmul.fp32_precision == "tf32"


def __getattr__(name: str):
    found = op(name)
    globals()[name] = found  # later lookups skip this function
    return found


def __dir__():
    return sorted(list(globals()) + __all__)
