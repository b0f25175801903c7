"""The shipped kernels on a GPU (skipped without one; run by benchmarks/gpu.sh). Their
CUDA kernels are torch-free .cu launchers called by glue in the .cpp (stable ABI):
dtype codes, the current stream, the device guard and launch errors cross that line."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

from kload import kernels  # noqa: E402

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
        torch.testing.assert_close(kernels.matmul(a, b), want, rtol=TOL[dtype] * 10, atol=TOL[dtype] * 10)


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
    torch.testing.assert_close(kernels.matmul(a, b), a @ b, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(kernels.vector_add(a, a), a + a)


def test_other_dtypes_are_rejected():
    i = torch.ones(3, device="cuda", dtype=torch.int32)
    with pytest.raises(RuntimeError, match=r"vector_add \(CUDA\): expected float32, float64, float16 or bfloat16, "
                                           "got Int"):
        kernels.vector_add(i, i)


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
    op = getattr(kernels, name)
    torch.library.opcheck(op, args)
    assert torch.autograd.gradcheck(lambda *a: op(*a), args, eps=1e-6, atol=1e-5)


def test_mixed_devices_are_rejected():
    with pytest.raises(RuntimeError, match="same device|CUDA tensor"):
        kernels.vector_add(torch.ones(3, device="cuda"), torch.ones(3))
    with pytest.raises(RuntimeError, match="same device|CUDA tensor"):
        kernels.matmul(torch.ones(2, 2, device="cuda"), torch.ones(2, 2))


def test_runs_on_the_current_stream():
    s = torch.cuda.Stream()
    a, b = torch.randn(1 << 20, device="cuda"), torch.randn(1 << 20, device="cuda")
    with torch.cuda.stream(s):
        out = kernels.vector_add(a, b)
    s.synchronize()
    torch.testing.assert_close(out, a + b)
