"""The shipped kernels on a GPU (skipped without one; run by benchmarks/gpu.sh)."""
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


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_conv2d_cuda(dtype):
    x = torch.randn(2, 3, 17, 9, device="cuda", dtype=dtype)
    w = torch.randn(5, 3, 3, 3, device="cuda", dtype=dtype)
    b = torch.randn(5, device="cuda", dtype=dtype)
    torch.testing.assert_close(kernels.conv2d(x, w, b, 2, 1), F.conv2d(x, w, b, 2, 1), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_bias_gelu_cuda(dtype):
    x, b = torch.randn(33, 255, device="cuda", dtype=dtype), torch.randn(255, device="cuda", dtype=dtype)
    torch.testing.assert_close(kernels.bias_gelu(x, b), F.gelu(x + b), rtol=TOL[dtype] * 10, atol=TOL[dtype] * 10)


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
