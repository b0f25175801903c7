"""The shipped CUDA kernels, emulated on the CPU (emu_build.py, emu.h), against torch's
CPU results in float64: every launcher of kernels/*/<op>.cu, the fast and the simple
kernels, their aligned and unaligned paths, odd sizes and tails.

    python tests/cuda_emu/check.py LIB [OP ...]

"Device memory" is host memory that ends at an inaccessible page: a read or write
past the end of a buffer (by more than its last 16-byte slack) is a segfault, so
this runs in a child process (tests/test_cuda_emu.py). Exits non-zero at the first
result out of tolerance, naming the case."""
from __future__ import annotations

import ctypes
import mmap
import os
import sys
import time

import torch
import torch.nn.functional as F

CODES = {torch.float16: 5, torch.float32: 6, torch.float64: 7, torch.bfloat16: 15}
PAGE = mmap.PAGESIZE
_libc = ctypes.CDLL(None, use_errno=True)
_keep: list = []  # the mappings stay for the process (a kernel may have kept a pointer)


class Geometry(ctypes.Structure):
    _fields_ = [(f, ctypes.c_int64) for f in ("N", "C", "H", "W", "OC", "KH", "KW", "SH", "SW", "PH", "PW", "OH", "OW")]


def device(t: torch.Tensor | None = None, *, shape=None, dtype=None, offset: int = 0) -> torch.Tensor:
    """A copy of t (or uninitialised shape/dtype) whose bytes end where an inaccessible page
    starts, give or take the 16-byte alignment of its start (shifted by `offset` elements)."""
    if t is not None:
        shape, dtype = t.shape, t.dtype
    elem = torch.empty((), dtype=dtype).element_size()
    nbytes = elem * max(1, int(torch.Size(shape).numel()))
    size = (nbytes + 32 + PAGE - 1) // PAGE * PAGE
    m = mmap.mmap(-1, size + PAGE)
    base = ctypes.addressof(ctypes.c_char.from_buffer(m))
    if _libc.mprotect(ctypes.c_void_p(base + size), PAGE, 0) != 0:
        raise OSError(ctypes.get_errno(), "mprotect")
    start = (size - nbytes) // 16 * 16 - (16 if offset else 0) + offset * elem
    _keep.append(m)
    view = torch.frombuffer(m, dtype=torch.uint8, count=nbytes, offset=start)
    out = view.view(dtype)[: torch.Size(shape).numel()].view(shape)
    if t is not None:
        out.copy_(t)
    else:
        out.fill_(float("nan") if dtype.is_floating_point else 0)
    return out


def ptr(t: torch.Tensor | None) -> ctypes.c_void_p:
    return ctypes.c_void_p(t.data_ptr() if t is not None else None)


def close(got: torch.Tensor, want: torch.Tensor, rtol: float, atol: float, what: str) -> None:
    try:
        torch.testing.assert_close(got.double(), want.double(), rtol=rtol, atol=atol, equal_nan=True)
    except AssertionError as e:
        sys.exit(f"MISMATCH {what}:\n{e}")


def launched(err) -> None:
    if err:
        sys.exit(f"launcher returned an error: {err.decode()}")


class Kernels:
    def __init__(self, lib: str):
        L = ctypes.CDLL(lib)
        p, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
        sigs = {
            "kload_vector_add_cuda": [i32, p, p, p, i64, p],
            "kload_matmul_cuda": [i32, p, p, p, i64, i64, i64, i32, p],
            "kload_bias_gelu_cuda": [i32, p, p, p, i64, i64, p],
            "kload_bias_gelu_backward_workspace": [i32, p, p, p, p, i64, i64, ctypes.POINTER(i64)],
            "kload_bias_gelu_backward_cuda": [i32, p, p, p, p, p, p, i64, i64, p],
            "kload_conv2d_workspace": [i32, Geometry, ctypes.POINTER(i64)],
            "kload_conv2d_cuda": [i32, p, p, p, p, p, Geometry, p],
            "kload_conv2d_backward_cuda": [i32, p, p, p, p, p, Geometry, p],
        }
        for name, args in sigs.items():  # (a library of some ops has only their launchers)
            f = getattr(L, name, None)
            if f is not None:
                f.argtypes, f.restype = args, ctypes.c_char_p
                setattr(self, name[len("kload_"):], f)
        self._count = L.kload_emu_count
        self._count.argtypes, self._count.restype = [ctypes.c_char_p, ctypes.c_int], ctypes.c_uint64

    def ran(self, what: str) -> int:
        """How many `what` (an instruction, "blocks", ...) ran since the last reset()."""
        return self._count(what.encode(), 0)

    def reset(self) -> None:
        self._count(b"", 1)

    def expect(self, case: str, **counts: bool) -> None:
        """Whether each instruction ran (True) or not (False) since reset(): the path meant;
        and no shared-memory bank conflict (the GEMM's row padding and spread_row serve every
        ldmatrix and every warp's cp.async stores in one pass per 128 bytes: docs/kernels.md)."""
        for what in ("ldmatrix bank conflicts", "cp.async bank conflicts"):
            if self.ran(what):
                sys.exit(f"{case}: {self.ran(what)} {what}")
        for what, want in counts.items():
            if bool(self.ran(what)) != want:
                sys.exit(f"{case}: expected {what} {'to run' if want else 'not to run'}")
        self.reset()


TOL = {torch.float32: 2e-5, torch.float64: 1e-12, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


def check_vector_add(k: Kernels) -> None:
    for dtype in (torch.float32, torch.float16, torch.bfloat16, torch.float64):
        for n in (1, 7, 1000, 20011):
            for offsets in ((0, 0, 0), (1, 1, 1), (1, 0, 0)):  # aligned; the same offset (a head); mixed (scalar)
                a, b = torch.randn(n).to(dtype), torch.randn(n).to(dtype)
                da, db = device(a, offset=offsets[0]), device(b, offset=offsets[1])
                out = device(shape=(n,), dtype=dtype, offset=offsets[2])
                launched(k.vector_add_cuda(CODES[dtype], ptr(da), ptr(db), ptr(out), n, None))
                close(out, (a.double() + b.double()).to(dtype), 0, 0, f"vector_add {dtype} n={n} offsets={offsets}")


MMA = {torch.bfloat16: "mma.m16n8k16.bf16", torch.float16: "mma.m16n8k16.f16", torch.float32: "mma.m16n8k8.tf32"}


def matmul_case(k: Kernels, m: int, kk: int, n: int, dtype, tf32: bool = False, offset: int = 0, *,
                mma: bool, copies: bool) -> None:
    k.reset()
    a, b = torch.randn(m, kk).to(dtype), torch.randn(kk, n).to(dtype)
    da, db = device(a, offset=offset), device(b, offset=offset)
    out = device(shape=(m, n), dtype=dtype)
    launched(k.matmul_cuda(CODES[dtype], ptr(da), ptr(db), ptr(out), m, kk, n, int(tf32), None))
    tol = 5e-3 if tf32 else TOL[dtype]
    case = f"matmul {m}x{kk}x{n} {dtype}{' tf32' if tf32 else ''} offset={offset}"
    close(out, a.double() @ b.double(), tol, tol * max(1.0, kk ** 0.5), case)
    if mma:  # the tile shape built (gemm.cuh's KLOAD_GEMM_WARPS_N): 64 threads per warp along N
        want_threads = 64 * int(os.environ.get("KLOAD_EMU_GEMM_WARPS_N", "2"))
        if k.ran("threads") != want_threads * k.ran("blocks"):
            sys.exit(f"{case}: {k.ran('threads')} threads in {k.ran('blocks')} blocks, not {want_threads} a block")
    k.expect(case, **{MMA.get(dtype, "mma"): mma, "cp.async": copies})


def check_matmul(k: Kernels) -> None:
    for dtype in (torch.bfloat16, torch.float16):  # tensor cores
        # K and N multiples of 8: cp.async tile copies; else element-wise tile loads
        # (K = 264: 9 steps of 32, the ring of stages goes round twice)
        for m, kk, n in [(128, 64, 128), (200, 72, 136), (64, 264, 72), (1, 8, 8), (33, 40, 257), (70, 33, 19)]:
            matmul_case(k, m, kk, n, dtype, mma=True, copies=kk % 8 == 0 and n % 8 == 0)
        matmul_case(k, 64, 40, 24, dtype, offset=1, mma=True, copies=False)  # misaligned pointers
    for m, kk, n in [(130, 36, 72), (40, 100, 24), (17, 9, 5)]:  # TF32 tensor cores, aligned and not
        matmul_case(k, m, kk, n, torch.float32, tf32=True, mma=True, copies=kk % 4 == 0 and n % 4 == 0)
    for m, kk, n in [(130, 24, 132), (33, 17, 5)]:  # fp32 on the CUDA cores, aligned and not
        matmul_case(k, m, kk, n, torch.float32, mma=False, copies=False)
    matmul_case(k, 45, 33, 29, torch.float64, mma=False, copies=False)
    os.environ["KLOAD_KERNELS_IMPL"] = "simple"
    try:
        for dtype in (torch.float32, torch.bfloat16):
            matmul_case(k, 40, 33, 35, dtype, mma=False, copies=False)
    finally:
        del os.environ["KLOAD_KERNELS_IMPL"]


def conv_geometry(x, w, stride, pad) -> Geometry:
    n, c, h, wd = x.shape
    oc, _, kh, kw = w.shape
    oh, ow = (h + 2 * pad - kh) // stride + 1, (wd + 2 * pad - kw) // stride + 1
    return Geometry(n, c, h, wd, oc, kh, kw, stride, stride, pad, pad, oh, ow)


def check_conv2d(k: Kernels) -> None:
    cases = [((2, 16, 9, 11), (24, 3, 3), 1, 1), ((1, 8, 10, 7), (130, 3, 3), 2, 0),
             ((1, 8, 6, 6), (4, 5, 5), 2, 2), ((1, 3, 9, 5), (5, 3, 3), 1, 1)]  # C = 3: the direct kernel
    k.reset()
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        for (n, c, h, w), (oc, kh, kw), s, p in cases:
            x, wt = torch.randn(n, c, h, w).to(dtype), torch.randn(oc, c, kh, kw).to(dtype)
            for bias in (None, torch.randn(oc).to(dtype)):
                g = conv_geometry(x, wt, s, p)
                want = F.conv2d(x.double(), wt.double(), None if bias is None else bias.double(), s, p)
                nbytes = ctypes.c_int64(-1)
                launched(k.conv2d_workspace(CODES[dtype], g, ctypes.byref(nbytes)))
                ws = device(shape=(nbytes.value,), dtype=torch.uint8) if nbytes.value else None
                out = device(shape=want.shape, dtype=dtype)
                launched(k.conv2d_cuda(CODES[dtype], ptr(device(x)), ptr(device(wt)),
                                       ptr(device(bias) if bias is not None else None), ptr(out), ptr(ws), g, None))
                tol = TOL[dtype] if dtype != torch.float32 else 1e-4
                case = (f"conv2d {dtype} x={tuple(x.shape)} w={tuple(wt.shape)} s={s} p={p} bias={bias is not None} "
                        f"workspace={nbytes.value}")
                close(out, want, tol, tol * max(1.0, (c * kh * kw) ** 0.5), case)
                igemm = dtype != torch.float32 and c % 8 == 0  # the implicit GEMM
                k.expect(case, **{MMA[dtype]: igemm, "cp.async": igemm})
    # the backward (direct kernels)
    x, wt = torch.randn(2, 3, 7, 6, dtype=torch.float64), torch.randn(4, 3, 3, 3, dtype=torch.float64)
    g = conv_geometry(x, wt, 2, 1)
    grad = torch.randn(2, 4, g.OH, g.OW, dtype=torch.float64)
    gx, gw = device(shape=x.shape, dtype=x.dtype), device(shape=wt.shape, dtype=wt.dtype)
    launched(k.conv2d_backward_cuda(CODES[x.dtype], ptr(device(grad)), ptr(device(x)), ptr(device(wt)), ptr(gx),
                                    ptr(gw), g, None))
    xr, wr = x.clone().requires_grad_(), wt.clone().requires_grad_()
    ex, ew = torch.autograd.grad(F.conv2d(xr, wr, None, 2, 1), (xr, wr), grad)
    close(gx, ex, 1e-12, 1e-12, "conv2d grad_x")
    close(gw, ew, 1e-12, 1e-12, "conv2d grad_w")


def check_bias_gelu(k: Kernels) -> None:
    tols = {torch.float32: 1e-5, torch.float64: 1e-12, torch.float16: 1e-3, torch.bfloat16: 8e-3}
    for dtype in (torch.float32, torch.bfloat16, torch.float16, torch.float64):
        for rows, d in [(37, 64), (5, 30), (300, 8), (2, 1000)]:
            for offset in (0, 1):  # 16-byte packs; one element per thread
                x, b, gr = torch.randn(rows, d).to(dtype), torch.randn(d).to(dtype), torch.randn(rows, d).to(dtype)
                dx, db, dg = device(x, offset=offset), device(b, offset=offset), device(gr, offset=offset)
                n, tol, what = rows * d, tols[dtype], f"bias_gelu {dtype} {rows}x{d} offset={offset}"
                xr, br = x.double().requires_grad_(), b.double().requires_grad_()
                y = F.gelu(xr + br)
                ex, eb = torch.autograd.grad(y, (xr, br), gr.double())
                out = device(shape=(rows, d), dtype=dtype)
                launched(k.bias_gelu_cuda(CODES[dtype], ptr(dx), ptr(db), ptr(out), n, d, None))
                close(out, y.detach(), tol, tol, what + " forward")
                gx, gb = device(shape=(rows, d), dtype=dtype), device(shape=(d,), dtype=dtype)
                nbytes = ctypes.c_int64(-1)
                launched(k.bias_gelu_backward_workspace(CODES[dtype], ptr(dg), ptr(dx), ptr(db), ptr(gx), n, d,
                                                        ctypes.byref(nbytes)))
                if nbytes.value <= 0:
                    sys.exit(f"{what}: the fast kernels asked for no workspace")
                ws = device(shape=(nbytes.value,), dtype=torch.uint8)
                launched(k.bias_gelu_backward_cuda(CODES[dtype], ptr(dg), ptr(dx), ptr(db), ptr(gx), ptr(gb), ptr(ws),
                                                   n, d, None))
                close(gx, ex, tol, tol, what + " grad_x")
                close(gb, eb, tol * 4, tol * max(1.0, rows ** 0.5), what + " grad_bias")


CHECKS = {"vector_add": check_vector_add, "matmul": check_matmul, "conv2d": check_conv2d,
          "bias_gelu": check_bias_gelu}


def main() -> None:
    lib, ops = sys.argv[1], sys.argv[2:] or list(CHECKS)
    torch.manual_seed(0)
    k = Kernels(lib)
    for op in ops:
        t0 = time.perf_counter()
        CHECKS[op](k)
        print(f"{op}: ok ({time.perf_counter() - t0:.1f} s, cp.async {os.environ.get('KLOAD_EMU_CP_ASYNC', 'late')}, "
              f"order {os.environ.get('KLOAD_EMU_ORDER', 'lockstep')})", flush=True)


if __name__ == "__main__":
    main()
