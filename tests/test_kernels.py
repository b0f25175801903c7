"""The shipped kernels against pure-torch references: odd sizes, non-contiguous
views, opcheck, float64 gradcheck, torch.compile, bad inputs, one OpenMP runtime."""
from __future__ import annotations

import itertools
import platform

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

import kload
from conftest import raises_in_child
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


def check_bias_gelu_extremes(forward, backward, dtype=torch.float32):
    """What eager gives, NaN where it gives NaN: no approximation's residue scaled by a huge z."""
    # 159 elements: the row loops' blocks, single vectors and scalar tail at 4, 8 and 16 lanes
    z = torch.tensor(EXTREMES * 9 + EXTREMES[:15], dtype=dtype)
    zero, grad = torch.zeros(z.shape[-1], dtype=dtype), torch.ones(z.shape[-1], dtype=dtype)
    torch.testing.assert_close(forward(z, zero), F.gelu(z), rtol=1e-5, atol=1e-6, equal_nan=True)
    torch.testing.assert_close(backward(grad, z, zero)[0], torch.ops.aten.gelu_backward(grad, z), rtol=1e-5,
                               atol=1e-6, equal_nan=True)


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


@pytest.mark.skipif(platform.machine() != "x86_64", reason="builds for the x86-64 baseline ISA")
def test_every_vector_width_matches_reference():
    """The shipped kernels build with -march=native, so a suite runs one vector
    width (kload/cpu/vec.h): 16 lanes on AVX-512, 8 on AVX2. This builds matmul and
    bias_gelu for baseline x86-64 too (SSE2: 4 lanes, a 6x8 GEMM tile), so the
    narrower tiles and their tails are tested on any x86 machine."""
    flags = ["-O3", "-march=x86-64", "-fopenmp"]
    cpp = {op: [s for s in kernels.sources(op) if s.suffix == ".cpp"] for op in ("matmul", "bias_gelu")}
    mm = kload.load(*cpp["matmul"], name="matmul_sse2", extra_cflags=flags, extra_ldflags=["-fopenmp"])
    bg = kload.load(*cpp["bias_gelu"], name="bias_gelu_sse2", extra_cflags=flags, extra_ldflags=["-fopenmp"])
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
    op = getattr(kernels, name)
    for args in SAMPLES[name]():
        torch.library.opcheck(op, args)


@pytest.mark.parametrize("name", sorted(SAMPLES))
def test_gradcheck_float64(name):
    op = getattr(kernels, name)
    for args in SAMPLES[name]():
        assert torch.autograd.gradcheck(lambda *a: op(*a), args, eps=1e-6, atol=1e-5)


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


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, 5), min_size=0, max_size=3), st.lists(st.integers(0, 5), min_size=0, max_size=3),
       st.sampled_from([torch.float32, torch.float64, torch.int64]))
def test_fuzz_vector_add_and_matmul_shapes(sa, sb, dtype):
    a, b = torch.zeros(sa, dtype=dtype), torch.ones(sb, dtype=dtype)
    for op, ref in ((kernels.vector_add, torch.add), (kernels.matmul, torch.matmul)):
        try:
            got = op(a, b)
        except RuntimeError:
            continue  # rejected with a Python exception: fine; a wrong answer or a crash is not
        torch.testing.assert_close(got, ref(a, b))


def test_one_openmp_runtime_and_torch_threads():
    kernels.matmul(torch.randn(64, 64), torch.randn(64, 64))
    with open("/proc/self/maps") as f:
        runtimes = {line.split()[-1] for line in f if "gomp" in line.split("/")[-1] or "libiomp" in line}
    assert len(runtimes) == 1, runtimes
    old = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        a, b = torch.randn(128, 96), torch.randn(96, 80)
        torch.testing.assert_close(kernels.matmul(a, b), a @ b, rtol=1e-4, atol=1e-4)
    finally:
        torch.set_num_threads(old)
