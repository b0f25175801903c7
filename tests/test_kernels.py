"""The shipped kernels against pure-torch references: odd sizes, non-contiguous
views, opcheck, float64 gradcheck, torch.compile, bad inputs, one OpenMP runtime."""
from __future__ import annotations

import itertools
import math
import platform

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

import kload
from conftest import raises_in_child, run_py
from kload import kernels


def reference_vector_add(a, b):
    return a + b


def reference_matmul(a, b):
    return a @ b


def reference_conv2d(x, w, bias=None, stride=1, padding=0):
    return F.conv2d(x, w, bias, stride, padding)


def reference_bias_gelu(x, bias):
    return F.gelu(x + bias)


SIZES = (1, 3, 17, 255, 989)


def sample_vector_add(dtype=torch.float32, requires_grad=False):
    for n in SIZES:
        yield torch.randn(n, dtype=dtype, requires_grad=requires_grad), torch.randn(n, dtype=dtype,
                                                                                    requires_grad=requires_grad)
    base = torch.randn(6, 10, dtype=dtype)
    yield base.t(), torch.randn(10, 6, dtype=dtype)  # non-contiguous


def sample_matmul(dtype=torch.float32, requires_grad=False):
    for m, k, n in [(1, 1, 1), (3, 17, 5), (17, 255, 33), (70, 3, 129), (255, 300, 40)]:
        yield (torch.randn(m, k, dtype=dtype, requires_grad=requires_grad),
               torch.randn(k, n, dtype=dtype, requires_grad=requires_grad))
    yield torch.randn(9, 7, dtype=dtype).t(), torch.randn(9, 4, dtype=dtype)


def sample_conv2d(dtype=torch.float32, requires_grad=False):
    for (n, c, h, w, oc, k, s, p, bias) in [(1, 1, 3, 3, 1, 3, 1, 0, False), (2, 3, 17, 9, 5, 3, 2, 1, True),
                                            (3, 4, 8, 11, 6, 1, 1, 0, True), (1, 2, 5, 5, 3, 5, 1, 2, False)]:
        x = torch.randn(n, c, h, w, dtype=dtype, requires_grad=requires_grad)
        wt = torch.randn(oc, c, k, k, dtype=dtype, requires_grad=requires_grad)
        b = torch.randn(oc, dtype=dtype, requires_grad=requires_grad) if bias else None
        yield x, wt, b, s, p


def sample_bias_gelu(dtype=torch.float32, requires_grad=False):
    for shape in [(1,), (3, 17), (17, 255), (2, 3, 33)]:
        yield (torch.randn(*shape, dtype=dtype, requires_grad=requires_grad) * 3,
               torch.randn(shape[-1], dtype=dtype, requires_grad=requires_grad))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_vector_add_matches_reference(dtype):
    for a, b in sample_vector_add(dtype):
        torch.testing.assert_close(kernels.vector_add(a, b), reference_vector_add(a, b))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_matmul_matches_reference(dtype):
    for a, b in sample_matmul(dtype):
        torch.testing.assert_close(kernels.matmul(a, b), reference_matmul(a, b), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_conv2d_matches_reference(dtype):
    for x, w, b, s, p in sample_conv2d(dtype):
        torch.testing.assert_close(kernels.conv2d(x, w, b, s, p), reference_conv2d(x, w, b, s, p),
                                   rtol=1e-4, atol=1e-4)
    x = torch.randn(2, 3, 8, 8, dtype=dtype)
    w = torch.randn(4, 3, 3, 3, dtype=dtype)
    torch.testing.assert_close(kernels.conv2d(x, w, stride=(2, 1), padding=(0, 1)),
                               F.conv2d(x, w, stride=(2, 1), padding=(0, 1)), rtol=1e-4, atol=1e-4)
    # many row bands with a partial last one; one row per band (OW > 256); strides in width
    for xs, ws, stride, padding in [((1, 2, 70, 70), (3, 2, 3, 3), 1, 1),
                                    ((1, 1, 5, 300), (2, 1, 3, 3), (1, 2), (1, 2)),
                                    ((2, 3, 9, 11), (4, 3, 2, 5), (3, 3), (2, 3))]:
        x, w = torch.randn(*xs, dtype=dtype), torch.randn(*ws, dtype=dtype)
        torch.testing.assert_close(kernels.conv2d(x, w, stride=stride, padding=padding),
                                   F.conv2d(x, w, stride=stride, padding=padding), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_bias_gelu_matches_reference(dtype):
    for x, b in sample_bias_gelu(dtype):
        torch.testing.assert_close(kernels.bias_gelu(x, b), reference_bias_gelu(x, b), rtol=1e-5, atol=1e-5)


# Huge, infinite and NaN inputs; 3 x 16 of them fill whole vectors of any width,
# the 15 after that land in the scalar tail of a 16-lane build
EXTREMES = [float("inf"), -float("inf"), float("nan"), 3e38, -3e38, 1e30, -1e30, 1e6, -1e6, 50.0, -50.0, 6.0,
            -6.0, 5.6, -5.7, 0.0]


def gelu_exact(z: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """GELU and its derivative from the mathematics, not from eager: z * Phi(z) and
    Phi(z) + z * phi(z), in float64, rounded once to z's dtype. At the extremes: the
    limits (gelu(+inf) = +inf, gelu(-inf) = 0, gelu'(+inf) = 1, gelu'(-inf) = 0), a
    huge z gives z or -0, NaN stays NaN. (Eager float32 F.gelu depends on the CPU's
    vector unit: on AVX-512 it gives gelu(inf) = nan and gelu(3e38) = inf, on AVX2
    the values above; kload gives the values above on both.)"""
    z64 = z.double()
    cdf = torch.special.ndtr(z64)
    pdf = torch.exp(-0.5 * z64 * z64) / math.sqrt(2 * math.pi)
    value = torch.where(torch.isinf(z64), torch.where(z64 > 0, z64, 0.0), z64 * cdf)
    slope = torch.where(torch.isinf(z64), (z64 > 0).double(), cdf + z64 * pdf)
    return value.to(z.dtype), slope.to(z.dtype)


def check_bias_gelu_extremes(forward, backward, dtype=torch.float32):
    """The mathematical values, NaN where the input is NaN: no approximation's residue scaled by a huge z."""
    # 159 elements: the row loops' blocks, single vectors and scalar tail at 4, 8 and 16 lanes
    z = torch.tensor(EXTREMES * 9 + EXTREMES[:15], dtype=dtype)
    zero, grad = torch.zeros(z.shape[-1], dtype=dtype), torch.ones(z.shape[-1], dtype=dtype)
    value, slope = gelu_exact(z)
    torch.testing.assert_close(forward(z, zero), value, rtol=1e-5, atol=1e-6, equal_nan=True)
    torch.testing.assert_close(backward(grad, z, zero)[0], slope, rtol=1e-5, atol=1e-6, equal_nan=True)


def check_bias_gelu_grads(gx, gb, x, b, grad):
    """(gx, gb) against eager's gradients of F.gelu(x + b) for ``grad``."""
    xr, br = x.detach().requires_grad_(), b.detach().requires_grad_()
    ex, eb = torch.autograd.grad(reference_bias_gelu(xr, br), (xr, br), grad)
    torch.testing.assert_close(gx, ex, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(gb, eb, rtol=1e-4, atol=1e-4)  # a sum over rows


def bias_gelu_backward():
    return kernels.handle("bias_gelu").bias_gelu_backward


def test_bias_gelu_extreme_inputs_match_eager():
    check_bias_gelu_extremes(kernels.bias_gelu, bias_gelu_backward())
    check_bias_gelu_extremes(kernels.bias_gelu, bias_gelu_backward(), torch.float64)


def test_bias_gelu_float32_gradients_match_eager():
    # float64 gradcheck exercises the double path; this covers the float32 vector
    # math (normal CDF and density from one polynomial exp), tails included
    for x, b in sample_bias_gelu(torch.float32, requires_grad=True):
        grad = torch.randn(x.shape)
        check_bias_gelu_grads(*torch.autograd.grad(kernels.bias_gelu(x, b), (x, b), grad), x, b, grad)
    z = torch.linspace(-12, 12, 4099)  # both tails, every vector lane and the scalar tail
    zero = torch.zeros(z.shape[-1])
    torch.testing.assert_close(kernels.bias_gelu(z, zero), F.gelu(z), rtol=1e-5, atol=1e-6)


def cpu_flags() -> set[str]:
    with open("/proc/cpuinfo") as f:
        return next((set(line.split(":", 1)[1].split()) for line in f if line.startswith("flags")), set())


# x86-64 levels and the vector width kload/cpu/vec.h gives each: 4 lanes (SSE2), 8 (AVX2), 16 (AVX-512)
WIDTHS = {4: ("x86-64", set()), 8: ("x86-64-v3", {"avx2", "fma"}), 16: ("x86-64-v4", {"avx512f", "avx512bw"})}
NATIVE_LANES = 16 if {"avx512f"} <= cpu_flags() else 8 if {"avx"} <= cpu_flags() else 4


@pytest.mark.skipif(platform.machine() != "x86_64", reason="builds for x86-64 levels")
@pytest.mark.parametrize("lanes", sorted(WIDTHS))
def test_every_vector_width_matches_reference_cpu_dependent(lanes):
    """The shipped kernels build with -march=native, so the suite's main build runs one
    vector width (kload/cpu/vec.h): 16 lanes on AVX-512, 8 on AVX2. This builds matmul
    and bias_gelu for each other width this CPU can run (x86-64: 4 lanes and a 6x8 GEMM
    tile; x86-64-v3: 8; x86-64-v4: 16), so every width's tiles and tails are tested on a
    machine that has it. CPU-dependent: a width the CPU lacks is skipped, named."""
    march, needs = WIDTHS[lanes]
    if lanes == NATIVE_LANES:
        pytest.skip(f"{lanes} lanes is this CPU's native width: the suite's -march=native build tests it")
    if not needs <= cpu_flags():
        pytest.skip(f"this CPU lacks {', '.join(sorted(needs - cpu_flags()))}: the {lanes}-lane code cannot run here")
    flags = ["-O3", f"-march={march}", "-fopenmp"]
    cpp = {op: [s for s in kernels.sources(op) if s.suffix == ".cpp"] for op in ("matmul", "bias_gelu")}
    mm = kload.load(*cpp["matmul"], name=f"matmul_{lanes}", extra_cflags=flags, extra_ldflags=["-fopenmp"])
    bg = kload.load(*cpp["bias_gelu"], name=f"bias_gelu_{lanes}", extra_cflags=flags, extra_ldflags=["-fopenmp"])
    for a, b in sample_matmul():
        torch.testing.assert_close(mm.matmul(a, b), reference_matmul(a, b), rtol=1e-4, atol=1e-4)
    for x, b in sample_bias_gelu():
        grad = torch.randn(x.shape)
        torch.testing.assert_close(bg.bias_gelu(x, b), reference_bias_gelu(x, b), rtol=1e-5, atol=1e-5)
        check_bias_gelu_grads(*bg.bias_gelu_backward(grad, x, b), x, b, grad)
    check_bias_gelu_extremes(bg.bias_gelu, bg.bias_gelu_backward)


def test_empty_tensors():
    assert kernels.vector_add(torch.ones(0), torch.ones(0)).shape == (0,)
    torch.testing.assert_close(kernels.matmul(torch.ones(3, 0), torch.ones(0, 2)), torch.zeros(3, 2))
    assert kernels.matmul(torch.ones(0, 4), torch.ones(4, 2)).shape == (0, 2)
    assert kernels.conv2d(torch.ones(0, 2, 5, 5), torch.ones(3, 2, 3, 3)).shape == (0, 3, 3, 3)
    assert kernels.bias_gelu(torch.ones(0, 4), torch.ones(4)).shape == (0, 4)


SAMPLES = {
    "vector_add": lambda: [(a, b) for a, b in itertools.islice(sample_vector_add(torch.float64, True), 3)],
    "matmul": lambda: [(a, b) for a, b in itertools.islice(sample_matmul(torch.float64, True), 3)],
    "conv2d": lambda: [(x, w, b, s, p) for x, w, b, s, p in sample_conv2d(torch.float64, True)][:2],
    "bias_gelu": lambda: list(itertools.islice(sample_bias_gelu(torch.float64, True), 3)),
}


@pytest.mark.parametrize("name", sorted(SAMPLES))
def test_opcheck(name):
    """From the public names (each one a dispatcher op), and each kernel's own op."""
    public = getattr(kernels, name)
    assert isinstance(public, torch._ops.OpOverloadPacket), type(public)  # as torch.ops.aten.mm
    for op in {public, kernels.op(name)}:
        for args in SAMPLES[name]():
            torch.library.opcheck(op, args + ((False,) if op is not public and name == "matmul" else ()))


@pytest.mark.parametrize("name", sorted(SAMPLES))
def test_gradcheck_float64(name):
    op = getattr(kernels, name)
    for args in SAMPLES[name]():
        assert torch.autograd.gradcheck(lambda *a: op(*a), args, eps=1e-6, atol=1e-5)


def test_matmul_follows_torchs_tf32_setting():
    # the op cannot read torch's flag (stable ABI): kernels.matmul passes it, read at each call
    from torch.utils._python_dispatch import TorchDispatchMode

    class Seen(TorchDispatchMode):
        flags: list = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if "matmul" in str(func):
                # (an argument equal to the schema's default, False, arrives omitted)
                self.flags.append(args[2] if len(args) > 2 else (kwargs or {}).get("allow_tf32", False))
            return func(*args, **(kwargs or {}))

    a = torch.randn(4, 3)
    saved = torch.backends.cuda.matmul.allow_tf32
    try:
        with Seen():
            for setting in (True, False):
                torch.backends.cuda.matmul.allow_tf32 = setting
                kernels.matmul(a, a.t())
            kernels.matmul(a, a.t(), True)  # an explicit value wins over the setting
    finally:
        torch.backends.cuda.matmul.allow_tf32 = saved
    assert Seen.flags == [True, False, True]


def test_matmul_follows_torchs_newer_tf32_setting_too():
    # torch >= 2.9's fp32_precision: once set, reading the legacy flag raises, for the rest of the
    # process (so a fresh one)
    if not hasattr(torch.backends, "fp32_precision"):
        pytest.skip(f"torch {torch.__version__} has no fp32_precision")
    out = run_py("""
        import json, torch
        from torch.utils._python_dispatch import TorchDispatchMode
        from kload import kernels

        seen = []

        class Seen(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                if "matmul" in str(func):
                    seen.append(args[2] if len(args) > 2 else False)
                return func(*args, **(kwargs or {}))

        a = torch.randn(4, 3)
        with Seen():
            torch.backends.fp32_precision = "tf32"
            kernels.matmul(a, a.t())
            torch.backends.cuda.matmul.fp32_precision = "ieee"
            kernels.matmul(a, a.t())
        torch.backends.cuda.matmul.fp32_precision = "tf32"

        from torch._dynamo.backends.common import aot_autograd

        def forward(gm, example_inputs):  # the traced graph's kernel calls (decomposed): their allow_tf32
            seen.extend(n.args[2] for n in gm.graph.nodes if n.op == "call_function" and "matmul" in str(n.target))
            return gm.forward

        compiled = torch.compile(lambda x: kernels.matmul(x, x.t()), fullgraph=True,
                                 backend=aot_autograd(fw_compiler=forward))
        compiled(a)  # traced: reading the legacy flag there would raise
        print(json.dumps({"seen": seen}))
    """)
    assert out["seen"] == [True, False, True]


def test_torch_compile_fullgraph_has_no_graph_break():
    def f(x, w, bias, a, b):
        y = kernels.conv2d(x, w, bias, 1, 1)
        z = kernels.bias_gelu(y.flatten(1), torch.zeros(y.flatten(1).shape[1]))
        return kernels.vector_add(kernels.matmul(a, b), a @ b), z.sum()

    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    args = (torch.randn(2, 3, 6, 6), torch.randn(4, 3, 3, 3), torch.randn(4), torch.randn(5, 7), torch.randn(7, 5))
    for got, want in zip(compiled(*args), f(*args)):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("call, message", [
    (lambda: kernels.vector_add(torch.ones(3), torch.ones(4)), r"same shape, got \[3\] and \[4\]"),
    (lambda: kernels.vector_add(torch.ones(3), torch.ones(3, dtype=torch.float64)), "same dtype, got Float and Double"),
    (lambda: kernels.vector_add(torch.ones(3, dtype=torch.int32), torch.ones(3, dtype=torch.int32)), "got Int"),
    (lambda: kernels.matmul(torch.ones(3), torch.ones(3, 3)), "2-D tensors"),
    (lambda: kernels.matmul(torch.ones(2, 3), torch.ones(4, 5)), "inner dimensions differ"),
    (lambda: kernels.matmul(torch.ones(2, 3), torch.ones(3, 2, dtype=torch.float64)), "same dtype"),
    (lambda: kernels.conv2d(torch.ones(1, 2, 3, 3), torch.ones(1, 2, 5, 5)), "larger than the padded input"),
    (lambda: kernels.conv2d(torch.ones(2, 3, 3), torch.ones(1, 2, 3, 3)), "x must be 4-D"),
    (lambda: kernels.conv2d(torch.ones(1, 3, 5, 5), torch.ones(1, 2, 3, 3)), "3 channels but w expects 2"),
    (lambda: kernels.conv2d(torch.ones(1, 2, 5, 5), torch.ones(1, 2, 3, 3), torch.ones(2)), "bias must have shape"),
    (lambda: kernels.conv2d(torch.ones(1, 2, 5, 5), torch.ones(1, 2, 3, 3), stride=0), "stride must be >= 1"),
    (lambda: kernels.bias_gelu(torch.ones(2, 3), torch.ones(4)), r"bias must have shape \[3\]"),
    (lambda: bias_gelu_backward()(torch.ones(2, 4), torch.ones(2, 3), torch.ones(3)),
     r"grad has shape \[2, 4\], expected \[2, 3\]"),
    (lambda: bias_gelu_backward()(torch.ones(2, 3, dtype=torch.float64), torch.ones(2, 3), torch.ones(3)),
     "grad and x must have the same dtype, got Double and Float"),
    (lambda: bias_gelu_backward()(*(torch.ones(s, device="meta") for s in ((2, 4), (2, 3), (3,)))),
     "grad has shape"),  # the fake kernel rejects what the real one does
])
def test_bad_inputs_raise_clear_errors(call, message):
    for op in kernels.__all__:  # loaded here: each child is a fork, and shares them
        kernels.handle(op).load()
    raises_in_child(call, RuntimeError, message)


def valid_for(op: str, a: torch.Tensor, b: torch.Tensor) -> bool:
    """What the kernels accept (docs/kernels.md: float32/float64; vector_add same shapes;
    matmul 2-D with matching inner dimensions), decided before the call."""
    if a.dtype != b.dtype or a.dtype not in (torch.float32, torch.float64):
        return False
    if op == "vector_add":
        return a.shape == b.shape
    return a.dim() == 2 and b.dim() == 2 and a.shape[1] == b.shape[0]


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, 5), min_size=0, max_size=3), st.lists(st.integers(0, 5), min_size=0, max_size=3),
       st.sampled_from([torch.float32, torch.float64, torch.int64]), st.integers(0, 2**31 - 1))
def test_fuzz_vector_add_and_matmul_shapes(sa, sb, dtype, seed):
    for name in ("vector_add", "matmul"):  # loaded here (once): a child compiling would race its time limit
        kernels.handle(name).load()
    g = torch.Generator().manual_seed(seed)
    a, b = (torch.randn(s, generator=g).mul(8).to(dtype) for s in (sa, sb))
    for name, ref in (("vector_add", torch.add), ("matmul", torch.matmul)):
        op = getattr(kernels, name)
        if valid_for(name, a, b):  # valid: the right answer, never an exception
            torch.testing.assert_close(op(a, b), ref(a, b), rtol=1e-4, atol=1e-4)
        else:  # invalid: a Python exception, never a crash (checked in a child) or an answer
            raises_in_child(lambda: op(a, b), RuntimeError)


def test_one_openmp_runtime_and_torch_threads():
    # a fresh process: this one's memory maps hold whatever earlier tests loaded
    out = run_py("""
        import json, torch
        from kload import kernels
        kernels.matmul(torch.randn(64, 64), torch.randn(64, 64))
        with open("/proc/self/maps") as f:
            runtimes = sorted({line.split()[-1] for line in f  # GCC's, LLVM's, Intel's
                               if line.split()[-1].rsplit("/", 1)[-1].startswith(("libgomp", "libomp", "libiomp"))})
        torch.set_num_threads(1)
        a, b = torch.randn(128, 96), torch.randn(96, 80)
        print(json.dumps({"runtimes": runtimes, "close": torch.allclose(kernels.matmul(a, b), a @ b, rtol=1e-4,
                                                                         atol=1e-4)}))
    """)
    assert len(out["runtimes"]) == 1, out["runtimes"]
    assert out["close"]
