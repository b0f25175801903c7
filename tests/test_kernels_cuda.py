"""The shipped kernels on a GPU (skipped without one; run by benchmarks/gpu.sh). Their
CUDA kernels are torch-free .cu launchers called by glue in the .cpp (stable ABI):
dtype codes, the current stream, the device guard and launch errors cross that line.

Why this file is long: it is every GPU test of the four shipped kernels (fast and simple
paths, dtypes, edges, bad inputs in fresh processes, autograd, opcheck), which run
together only where a GPU is (benchmarks/gpu.sh); split, each part would repeat the
skip and the helpers."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

from kload import kernels  # noqa: E402

from conftest import raises_in_fresh_process  # noqa: E402

DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16]
TOL = {torch.float32: 1e-4, torch.float64: 1e-10, torch.float16: 2e-2, torch.bfloat16: 8e-2}


@pytest.mark.parametrize("dtype", DTYPES)
def test_vector_add_cuda(dtype):
    for n in (1, 17, 989, 1 << 20):
        a, b = torch.randn(n, device="cuda", dtype=dtype), torch.randn(n, device="cuda", dtype=dtype)
        torch.testing.assert_close(kernels.vector_add(a, b), a + b, rtol=TOL[dtype], atol=TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
def test_matmul_cuda(dtype):
    for m, k, n in [(1, 1, 1), (3, 17, 5), (70, 255, 129)]:
        a, b = torch.randn(m, k, device="cuda", dtype=dtype), torch.randn(k, n, device="cuda", dtype=dtype)
        want = (a.double() @ b.double()).to(dtype)
        torch.testing.assert_close(kernels.matmul(a, b, False), want, rtol=TOL[dtype] * 10, atol=TOL[dtype] * 10)


@pytest.mark.parametrize("dtype", DTYPES)
def test_conv2d_cuda(dtype):
    x = torch.randn(2, 3, 17, 9, device="cuda", dtype=dtype)
    w = torch.randn(5, 3, 3, 3, device="cuda", dtype=dtype)
    b = torch.randn(5, device="cuda", dtype=dtype)
    want = F.conv2d(x.double(), w.double(), b.double(), 2, 1).to(dtype)
    tol = max(1e-4, TOL[dtype] * 10)
    torch.testing.assert_close(kernels.conv2d(x, w, b, 2, 1), want, rtol=tol, atol=tol)
    grad = torch.randn_like(want)
    gx, gw = kernels.handle("conv2d").conv2d_backward(grad, x, w, [2, 2], [1, 1])
    xr, wr = x.double().requires_grad_(), w.double().requires_grad_()
    ex, ew = torch.autograd.grad(F.conv2d(xr, wr, None, 2, 1), (xr, wr), grad.double())
    torch.testing.assert_close(gx, ex.to(dtype), rtol=tol, atol=tol)
    torch.testing.assert_close(gw, ew.to(dtype), rtol=tol * 10, atol=tol * 10)  # sums over N*OH*OW


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_bias_gelu_cuda(dtype):
    x, b = torch.randn(33, 255, device="cuda", dtype=dtype), torch.randn(255, device="cuda", dtype=dtype)
    torch.testing.assert_close(kernels.bias_gelu(x, b), F.gelu(x + b), rtol=TOL[dtype] * 10, atol=TOL[dtype] * 10)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_bias_gelu_backward_cuda(dtype):
    x, b = torch.randn(33, 255, device="cuda", dtype=dtype), torch.randn(255, device="cuda", dtype=dtype)
    grad = torch.randn_like(x)
    gx, gb = kernels.handle("bias_gelu").bias_gelu_backward(grad, x, b)
    xr, br = x.double().requires_grad_(), b.double().requires_grad_()
    ex, eb = torch.autograd.grad(F.gelu(xr + br), (xr, br), grad.double())
    torch.testing.assert_close(gx, ex.to(dtype), rtol=TOL[dtype] * 10, atol=TOL[dtype] * 10)
    torch.testing.assert_close(gb, eb.to(dtype), rtol=TOL[dtype] * 10, atol=TOL[dtype] * 100)  # 33-row sums


def test_empty_and_non_contiguous_cuda():
    z = torch.ones(0, device="cuda")
    assert kernels.vector_add(z, z).shape == (0,)
    torch.testing.assert_close(kernels.matmul(torch.ones(3, 0, device="cuda"), torch.ones(0, 2, device="cuda")),
                               torch.zeros(3, 2, device="cuda"))
    x, w = torch.ones(0, 2, 5, 5, device="cuda"), torch.ones(3, 2, 3, 3, device="cuda")
    assert kernels.conv2d(x, w).shape == (0, 3, 3, 3)
    assert kernels.bias_gelu(torch.ones(0, 4, device="cuda"), torch.ones(4, device="cuda")).shape == (0, 4)
    a, b = torch.randn(9, 7, device="cuda").t(), torch.randn(9, 4, device="cuda")
    torch.testing.assert_close(kernels.matmul(a, b, False), a @ b, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(kernels.vector_add(a, a), a + a)


# Error paths run in a fresh process each (a forked child cannot use CUDA): a crash, as every
# stable-ABI error was on the first GPU image, fails the one check. SETUP makes the inputs.
SETUP = "import torch\nfrom kload import kernels\n"


def test_other_dtypes_are_rejected():
    raises_in_fresh_process(SETUP + "i = torch.ones(3, device='cuda', dtype=torch.int32)\nkernels.vector_add(i, i)",
                            RuntimeError, r"vector_add \(CUDA\): expected float32, float64, float16 or bfloat16, got Int")
    for call, message in [
        ("kernels.vector_add(torch.ones(3, device='cuda'), torch.ones(4, device='cuda'))", r"same shape"),
        ("kernels.matmul(torch.ones(2, 3, device='cuda'), torch.ones(4, 5, device='cuda'))", "inner dimensions"),
        ("kernels.conv2d(torch.ones(1, 3, 5, 5, device='cuda'), torch.ones(1, 2, 3, 3, device='cuda'))",
         "3 channels but w expects 2"),
        ("kernels.bias_gelu(torch.ones(2, 3, device='cuda', dtype=torch.int32), torch.ones(3, device='cuda'))",
         "dtype|Int"),
    ]:
        raises_in_fresh_process(SETUP + call, RuntimeError, message)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_runs_on_the_inputs_device():
    a = torch.randn(1 << 16, device="cuda:1")
    with torch.cuda.device(0):
        out = kernels.vector_add(a, a)
        y = kernels.bias_gelu(a.view(256, 256), a[:256])
    assert out.device == a.device and y.device == a.device
    torch.testing.assert_close(out, a + a)
    torch.testing.assert_close(y, F.gelu(a.view(256, 256) + a[:256]), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("name", ["vector_add", "matmul", "conv2d", "bias_gelu"])
def test_gradcheck_and_opcheck_cuda(name):
    kw = dict(device="cuda", dtype=torch.float64, requires_grad=True)
    args = {
        "vector_add": lambda: (torch.randn(7, **kw), torch.randn(7, **kw)),
        "matmul": lambda: (torch.randn(5, 4, **kw), torch.randn(4, 3, **kw)),
        "conv2d": lambda: (torch.randn(2, 2, 5, 5, **kw), torch.randn(3, 2, 3, 3, **kw), torch.randn(3, **kw), 1, 1),
        "bias_gelu": lambda: (torch.randn(4, 6, **kw), torch.randn(6, **kw)),
    }[name]()
    op = kernels.op(name)
    torch.library.opcheck(op, args)
    assert torch.autograd.gradcheck(lambda *a: op(*a), args, eps=1e-6, atol=1e-5)


def test_mixed_devices_are_rejected():
    raises_in_fresh_process(SETUP + "kernels.vector_add(torch.ones(3, device='cuda'), torch.ones(3))",
                            RuntimeError, "same device|CUDA tensor")
    raises_in_fresh_process(SETUP + "kernels.matmul(torch.ones(2, 2, device='cuda'), torch.ones(2, 2))",
                            RuntimeError, "same device|CUDA tensor")


def test_runs_on_the_current_stream():
    s = torch.cuda.Stream()
    a, b = torch.randn(1 << 20, device="cuda"), torch.randn(1 << 20, device="cuda")
    with torch.cuda.stream(s):
        out = kernels.vector_add(a, b)
    s.synchronize()
    torch.testing.assert_close(out, a + b)


# -- the fast kernels (issue 28): vector loads, tensor cores, implicit GEMM, fused backward --
# Each fast path has a fallback for odd sizes and misaligned pointers; these tests reach
# both, and compare with the simple kernels (KLOAD_KERNELS_IMPL=simple) where results
# must agree exactly or nearly.

SIZES = (1, 17, 989, 4099, (1 << 20) + 3)


def misaligned(shape, dtype, offset=1):
    """A contiguous tensor whose data starts `offset` elements past a 16-byte boundary."""
    n = 1
    for s in shape:
        n *= s
    return torch.randn(n + offset, device="cuda", dtype=dtype)[offset:].view(shape)


@pytest.fixture
def simple_kernels(monkeypatch):
    """Run the body with KLOAD_KERNELS_IMPL=simple (read by the launchers at each call)."""
    monkeypatch.setenv("KLOAD_KERNELS_IMPL", "simple")


@pytest.mark.parametrize("dtype", DTYPES)
def test_vector_add_fast_paths(dtype):
    for n in SIZES:
        a, b = torch.randn(n, device="cuda", dtype=dtype), torch.randn(n, device="cuda", dtype=dtype)
        torch.testing.assert_close(kernels.vector_add(a, b), a + b, rtol=0, atol=0)  # same fp32 math as torch
        # all three at the same offset from 16 bytes (a head, then vectors), and different offsets (scalar)
        a1, b1 = a[1:], b[1:]
        torch.testing.assert_close(kernels.vector_add(a1, b1), a1 + b1, rtol=0, atol=0)
        c = misaligned((n,), dtype, offset=3)
        torch.testing.assert_close(kernels.vector_add(c, b), c + b, rtol=0, atol=0)
    x = torch.randn(33, 65, device="cuda", dtype=dtype)
    torch.testing.assert_close(kernels.vector_add(x.t(), x.t()), x.t() + x.t(), rtol=0, atol=0)  # non-contiguous
    z = torch.empty(0, device="cuda", dtype=dtype)
    assert kernels.vector_add(z, z).shape == (0,)


def test_vector_add_simple_kernels_agree(simple_kernels):
    a, b = torch.randn(4099, device="cuda"), torch.randn(4099, device="cuda")
    torch.testing.assert_close(kernels.vector_add(a, b), a + b, rtol=0, atol=0)


def test_kernels_impl_rejects_an_unknown_value():
    env = {"KLOAD_KERNELS_IMPL": "fastest"}
    raises_in_fresh_process(SETUP + "a = torch.ones(3, device='cuda')\nkernels.vector_add(a, a)", RuntimeError,
                            "KLOAD_KERNELS_IMPL must be", env)
    raises_in_fresh_process(SETUP + "a = torch.ones(3, device='cuda')\nkernels.matmul(a.view(3, 1), a.view(1, 3))",
                            RuntimeError, "KLOAD_KERNELS_IMPL must be", env)


MM_SHAPES = [(1, 1, 1), (17, 989, 33), (128, 128, 128), (256, 512, 384), (129, 4099, 257), (300, 40, 8), (5, 0, 7)]


def check_matmul(a, b, dtype, allow_tf32=False):
    k = a.shape[1]
    want = a.double() @ b.double()
    got = kernels.matmul(a, b, allow_tf32)
    assert got.dtype == dtype and got.shape == want.shape
    # per dtype: the inputs' and the output's rounding, and fp32 sums over k products of N(0, 1) values
    tol = {torch.float16: 2e-3, torch.bfloat16: 1.6e-2, torch.float64: 1e-12,
           torch.float32: 5e-3 if allow_tf32 else 2e-5}[dtype]
    scale = max(1.0, k ** 0.5)
    torch.testing.assert_close(got.double(), want, rtol=tol, atol=tol * scale)


@pytest.mark.parametrize("dtype, allow_tf32", [(torch.float16, False), (torch.bfloat16, False),
                                               (torch.float32, False), (torch.float32, True),
                                               (torch.float64, False)])
def test_matmul_fast_paths(dtype, allow_tf32):
    for m, k, n in MM_SHAPES:
        a, b = torch.randn(m, k, device="cuda", dtype=dtype), torch.randn(k, n, device="cuda", dtype=dtype)
        check_matmul(a, b, dtype, allow_tf32)
    # 16-byte copies need aligned pointers: one element off takes the element-wise loads
    check_matmul(misaligned((64, 136), dtype), misaligned((136, 72), dtype), dtype, allow_tf32)
    # non-contiguous inputs (the glue makes them contiguous)
    a, b = torch.randn(200, 96, device="cuda", dtype=dtype), torch.randn(80, 96, device="cuda", dtype=dtype)
    check_matmul(a, b.t(), dtype, allow_tf32)


def test_matmul_tf32_flag_is_what_changes_fp32():
    # fp32 without TF32 is exact to fp32 rounding; with it, inputs lose 13 mantissa bits (like torch's)
    a, b = torch.randn(256, 1024, device="cuda"), torch.randn(1024, 256, device="cuda")
    want = a.double() @ b.double()
    exact = (kernels.matmul(a, b, False).double() - want).abs().max().item()
    tf32 = (kernels.matmul(a, b, True).double() - want).abs().max().item()
    assert exact < 1e-3 and tf32 < 0.5, (exact, tf32)
    if torch.cuda.get_device_capability() >= (8, 0):
        assert tf32 > exact  # the TF32 tensor cores did run
    saved = torch.backends.cuda.matmul.allow_tf32
    try:  # no argument: torch's setting
        torch.backends.cuda.matmul.allow_tf32 = True
        assert torch.equal(kernels.matmul(a, b), kernels.matmul(a, b, True))
        torch.backends.cuda.matmul.allow_tf32 = False
        assert torch.equal(kernels.matmul(a, b), kernels.matmul(a, b, False))
    finally:
        torch.backends.cuda.matmul.allow_tf32 = saved


def test_matmul_grad_passes_the_tf32_flag():
    a = torch.randn(33, 40, device="cuda", requires_grad=True)
    b = torch.randn(40, 17, device="cuda", requires_grad=True)
    kernels.matmul(a, b, True).sum().backward()
    torch.testing.assert_close(a.grad, torch.ones(33, 17, device="cuda") @ b.t(), rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(b.grad, a.t() @ torch.ones(33, 17, device="cuda"), rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_matmul_simple_kernels_agree(dtype, simple_kernels):
    a, b = torch.randn(70, 255, device="cuda", dtype=dtype), torch.randn(255, 129, device="cuda", dtype=dtype)
    check_matmul(a, b, dtype)


CONV_CASES = [  # (N, C, H, W), (OC, KH, KW), stride, padding
    ((2, 8, 17, 9), (5, 3, 3), 2, 1),      # C % 8 == 0: 16-byte copies
    ((2, 16, 14, 14), (64, 3, 3), 1, 1),   # the benchmark's shape, smaller
    ((1, 3, 17, 9), (5, 3, 3), 1, 0),      # C = 3: the direct kernel
    ((3, 24, 7, 11), (130, 1, 1), 1, 0),   # OC > one 128-wide tile
    ((1, 8, 9, 9), (4, 5, 5), 2, 2),
    ((1, 64, 1, 1), (3, 1, 1), 1, 0),
]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_conv2d_implicit_gemm(dtype):
    for (n, c, h, w), (oc, kh, kw), s, p in CONV_CASES:
        x = torch.randn(n, c, h, w, device="cuda", dtype=dtype)
        wt = torch.randn(oc, c, kh, kw, device="cuda", dtype=dtype)
        for bias in (None, torch.randn(oc, device="cuda", dtype=dtype)):
            want = F.conv2d(x.double(), wt.double(), None if bias is None else bias.double(), s, p)
            got = kernels.conv2d(x, wt, bias, s, p)
            assert got.shape == want.shape and got.dtype == dtype
            tol = 2e-3 if dtype == torch.float16 else 1.6e-2
            scale = max(1.0, (c * kh * kw) ** 0.5)
            torch.testing.assert_close(got.double(), want, rtol=tol, atol=tol * scale)
    x = torch.randn(2, 8, 9, 9, device="cuda", dtype=dtype).permute(0, 1, 3, 2)  # non-contiguous
    wt = torch.randn(4, 8, 3, 3, device="cuda", dtype=dtype)
    want = F.conv2d(x.double(), wt.double(), None, 1, 1)
    torch.testing.assert_close(kernels.conv2d(x, wt, None, 1, 1).double(), want, rtol=2e-2, atol=2e-1)
    assert kernels.conv2d(torch.ones(0, 8, 5, 5, device="cuda", dtype=dtype),
                          torch.ones(3, 8, 3, 3, device="cuda", dtype=dtype)).shape == (0, 3, 3, 3)


def test_conv2d_simple_kernels_agree(simple_kernels):
    x = torch.randn(2, 8, 17, 9, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(5, 8, 3, 3, device="cuda", dtype=torch.bfloat16)
    want = F.conv2d(x.double(), w.double(), None, 2, 1)
    torch.testing.assert_close(kernels.conv2d(x, w, None, 2, 1).double(), want, rtol=1.6e-2, atol=0.15)


GELU_SHAPES = [(1, 1), (17, 989), (4099, 8), (3, 5, 64), (2, 4099), (1000, 256)]


def eager_bias_gelu(x, b, grad):
    x, b = x.detach().clone().requires_grad_(), b.detach().clone().requires_grad_()
    y = F.gelu(x + b)
    gx, gb = torch.autograd.grad(y, (x, b), grad)
    return y, gx, gb


@pytest.mark.parametrize("dtype", DTYPES)
def test_bias_gelu_fast_paths(dtype):
    bwd = kernels.handle("bias_gelu").bias_gelu_backward
    tol = {torch.float32: 1e-5, torch.float64: 1e-12, torch.float16: 1e-3, torch.bfloat16: 8e-3}[dtype]
    for shape in GELU_SHAPES:
        for offset in (0, 1):  # aligned: 16-byte packs; one element off: one element per thread
            x = misaligned(shape, dtype, offset) if offset else torch.randn(shape, device="cuda", dtype=dtype)
            b = misaligned(shape[-1:], dtype, offset) if offset else torch.randn(shape[-1], device="cuda", dtype=dtype)
            g = torch.randn(shape, device="cuda", dtype=dtype)
            y, gx, gb = eager_bias_gelu(x, b, g)
            torch.testing.assert_close(kernels.bias_gelu(x, b), y, rtol=tol, atol=tol)
            kx, kb = bwd(g, x, b)
            torch.testing.assert_close(kx, gx, rtol=tol, atol=tol)
            rows = x.numel() // shape[-1]
            torch.testing.assert_close(kb, gb, rtol=tol * 4, atol=tol * max(1.0, rows ** 0.5))  # sums of `rows`
    x, b = torch.randn(64, 48, device="cuda", dtype=dtype), torch.randn(48, device="cuda", dtype=dtype)
    g = torch.randn(48, 64, device="cuda", dtype=dtype).t()  # non-contiguous grad
    _, gx, gb = eager_bias_gelu(x, b, g)
    kx, kb = bwd(g, x, b)
    torch.testing.assert_close(kx, gx, rtol=tol, atol=tol)
    torch.testing.assert_close(kb, gb, rtol=tol * 4, atol=tol * 8)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_bias_gelu_cuda_huge_infinite_and_nan_inputs_match_the_mathematics(dtype):
    """Eager's values, except at the infinities: their limits (test_kernels.gelu_exact), as on the CPU."""
    from test_kernels import gelu_exact

    big = 3e38 if dtype == torch.float32 else 1e300
    vals = [float("inf"), float("-inf"), float("nan"), big, -big, 1e30, -1e30, 0.0, -0.0, 8.0, -8.0, 1e-30,
            -40.0, 40.0, 10.0, -10.0]
    x = torch.tensor(vals, device="cuda", dtype=dtype).repeat(3, 1)  # 16 columns: the packed path too
    b = torch.zeros(x.shape[-1], device="cuda", dtype=dtype)
    g = torch.ones_like(x)
    y, gx = (t.to("cuda") for t in gelu_exact(x.cpu()))
    atol = 1e-6 if dtype == torch.float32 else 1e-14
    torch.testing.assert_close(kernels.bias_gelu(x, b), y, equal_nan=True, rtol=1e-5, atol=atol)
    kx, _ = kernels.handle("bias_gelu").bias_gelu_backward(g, x, b)
    torch.testing.assert_close(kx, gx, equal_nan=True, rtol=1e-5, atol=atol)


def test_bias_gelu_grad_bias_is_deterministic_and_matches_the_simple_kernels(monkeypatch):
    bwd = kernels.handle("bias_gelu").bias_gelu_backward
    x, b = torch.randn(8192, 96, device="cuda"), torch.randn(96, device="cuda")
    g = torch.randn_like(x)
    first, second = bwd(g, x, b), bwd(g, x, b)
    assert torch.equal(first[1], second[1])  # a fixed reduction order: the same bits every run
    monkeypatch.setenv("KLOAD_KERNELS_IMPL", "simple")
    gx, gb = bwd(g, x, b)
    torch.testing.assert_close(first[0], gx, rtol=0, atol=0)
    torch.testing.assert_close(first[1], gb, rtol=1e-5, atol=1e-3)


def test_bias_gelu_empty_rows_give_zero_grad_bias():
    x, b = torch.ones(0, 5, device="cuda"), torch.ones(5, device="cuda")
    gx, gb = kernels.handle("bias_gelu").bias_gelu_backward(torch.ones(0, 5, device="cuda"), x, b)
    assert gx.shape == (0, 5)
    torch.testing.assert_close(gb, torch.zeros(5, device="cuda"))


def test_matmul_allow_tf32_argument_passes_opcheck():
    a = torch.randn(33, 40, device="cuda", requires_grad=True)
    b = torch.randn(40, 17, device="cuda", requires_grad=True)
    torch.library.opcheck(kernels.op("matmul"), (a, b, True))
    torch.library.opcheck(kernels.op("matmul"), (a.detach().half(), b.detach().half(), False))
