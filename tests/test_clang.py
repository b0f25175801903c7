"""clang as a first-class compiler (CXX=clang++-19, Debian's clang 19): its own precompiled
<kload/kernel.h> (a .pch beside GCC's .gch in the cache, keyed by the compiler), the
trimmed first build, compile errors at the user's file:line, a .pch clang refuses moved
aside and rebuilt, a %%kload cell, and the shipped kernels on one OpenMP runtime.

Every test here compiles with clang for real. None can share a g++ build (the compiler is
in every key); the tests of this file share one cache, so the notebook's cell and the
kernels find the precompiled header the first test made."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import nbformat
import pytest
import torch

import kload
from kload.cache import MANIFEST, stamp_of
from kload.cache.key import sha256_now
from kload.compile import pch_build

from conftest import run_py
from test_live import run_notebook, texts
from test_pch import FULL_API, expected, pch_entries, source

CLANG = shutil.which("clang++-19")
pytestmark = [pytest.mark.slow, pytest.mark.skipif(CLANG is None, reason="clang++-19 is not installed "
                                                   "(make tools installs Debian's clang-19 as root)")]


@pytest.fixture(scope="module")
def clang_cache(tmp_path_factory):
    return tmp_path_factory.mktemp("clang") / "cache"


@pytest.fixture
def under_clang(clang_cache, monkeypatch):
    monkeypatch.setenv("CXX", "clang++-19")
    monkeypatch.setenv("KLOAD_CACHE_DIR", str(clang_cache))
    return clang_cache


def test_the_edit_loop_under_clang(under_clang, tmp_path, monkeypatch):
    """First build trimmed, with no .pch yet; then each edit loads clang's .pch; an error
    names the user's line and the last good build keeps serving; a .pch clang refuses
    (made for other flags) is moved aside, the build goes on without it, a new one is made."""
    cache = under_clang
    a, b = torch.randn(100), torch.randn(100)

    def build(offset, flags=(), name="clfull"):
        h = kload.load(source(tmp_path, offset), name=name, extra_cflags=list(flags), reload=False)
        torch.testing.assert_close(h.full(a, b), expected(a, b, offset))
        manifest = h.build().entry.manifest
        [note] = manifest["pch"].values()
        return note, manifest

    note, manifest = build(0)
    assert note.startswith("no precompiled <kload/kernel.h> yet"), note
    assert manifest["trimmed"], "clang's first build was not trimmed"
    assert manifest["inputs"]["cxx"]["family"] == "clang"
    assert pch_build.wait(600, root=cache)
    [entry] = pch_entries(cache)
    pch = Path(entry["path"]) / "kload" / "kernel.h.pch"
    assert pch.stat().st_size > 20_000_000 and not pch.with_suffix(".gch").exists()

    note, manifest = build(1)  # an edit: the .pch, no trim
    assert note.startswith("used the precompiled <kload/kernel.h>"), note
    assert not manifest["trimmed"]

    broken = source(tmp_path, 2)
    broken.write_text(broken.read_text().replace("return out +", "return out + undeclared_name +"))
    line = broken.read_text().splitlines().index(next(t for t in broken.read_text().splitlines()
                                                       if "undeclared_name" in t)) + 1
    with pytest.raises(kload.CompileError, match=rf"full\.cpp:{line}:.*undeclared_name"):
        kload.load(broken, name="clfull", reload=False).full  # (a load builds at first use)
    h = kload.load(source(tmp_path, 1), name="clfull", reload=False)  # the last good build, from the cache
    torch.testing.assert_close(h.full(a, b), expected(a, b, 1))

    # a flag clang checks in a .pch (-std=c++17; torch's is c++20) makes a new key; plant the
    # default entry there, as if it were stale or foreign: its manifest verifies, clang refuses it
    from kload.cache.store import Store
    from kload.compile.pch import plans_for
    from kload.options import make_options
    from kload.plan.plan import make_plan

    store = Store(cache)
    opts = make_options("older", [source(tmp_path, 3)], ["-std=c++17"], [], [], [], False, False, False)
    [pp] = plans_for(make_plan(opts, store), store)
    shutil.copytree(entry["path"], pp.path)
    m = json.loads((pp.path / MANIFEST).read_text())
    m.update(key=pp.key, stat=stamp_of(pp.gch.stat()), sha256=sha256_now(pp.gch))
    (pp.path / MANIFEST).write_text(json.dumps(m))
    note, _ = build(3, ["-std=c++17"], name="older")
    assert "was not used: clang refused it" in note and "building a new one" in note and "PCH file" in note, note
    assert pch_build.wait(600, root=cache)
    note, _ = build(4, ["-std=c++17"], name="older")
    assert note.startswith("used the precompiled"), note
    assert len(pch_entries(cache)) == 2  # one per flag set


def test_a_kload_cell_under_clang(under_clang, tmp_path):
    cell = "%%kload clcell\n" + FULL_API.replace("#include <kload/kernel.h>\n", "").replace("OFFSET", "0")
    C = nbformat.v4.new_code_cell
    nb = nbformat.v4.new_notebook()
    nb.cells = [C("import torch, kload\n%load_ext kload"), C(cell),
                C("a = torch.arange(4.0); print('cell', clcell.full(a, a).tolist())\n"
                  "print('family', clcell.build().entry.manifest['inputs']['cxx']['family'])")]
    run_notebook(nb, tmp_path)  # (CXX and the cache reach the kernel through its environment)
    assert "cell [1.0, 5.0, 9.0, 13.0]" in texts(nb.cells[2]) and "family clang" in texts(nb.cells[2])


def test_shipped_kernels_under_clang_one_openmp_runtime(under_clang):
    """clang's -fopenmp would bring LLVM's libomp beside torch's libgomp: the kernels build
    with -fopenmp-simd and torch's thread pool instead, and say nothing of OpenMP."""
    out = run_py("""
        import json, torch
        from kload import kernels
        a, b = torch.randn(256, 192), torch.randn(192, 160)
        close = [torch.allclose(kernels.matmul(a, b), a @ b, rtol=1e-4, atol=1e-4)]
        x, w = torch.randn(4, 3, 12, 12, requires_grad=True), torch.randn(8, 3, 3, 3, requires_grad=True)
        y = kernels.conv2d(x, w)
        ref = torch.nn.functional.conv2d(x, w)
        close.append(torch.allclose(y, ref, rtol=1e-4, atol=1e-4))
        gx, gw = torch.autograd.grad(y.sum(), (x, w))
        rx, rw = torch.autograd.grad(ref.sum(), (x, w))
        close += [torch.allclose(gx, rx, rtol=1e-4, atol=1e-4), torch.allclose(gw, rw, rtol=1e-3, atol=1e-3)]
        with open("/proc/self/maps") as f:
            runtimes = sorted({line.split()[-1].rsplit("/", 1)[-1] for line in f
                               if any(line.split()[-1].rsplit("/", 1)[-1].startswith(p) for p in ("libgomp", "libomp", "libiomp"))})
        print(json.dumps({"runtimes": runtimes, "close": close,
                          "cflags": kernels.handle("matmul").build().entry.manifest["inputs"]["cflags"]}))
    """)
    assert out["close"] == [True] * 4, out
    assert len(out["runtimes"]) == 1 and out["runtimes"][0].startswith("libgomp"), out["runtimes"]
    assert "-fopenmp-simd" in out["cflags"] and "-fopenmp" not in out["cflags"], out["cflags"]


def test_user_openmp_under_clang_is_said(under_clang, tmp_path, monkeypatch, capfd):
    """A user's -fopenmp under clang is told what it costs and what to write instead
    (where LLVM's libomp is not installed, the link then fails: that is the user's to fix)."""
    monkeypatch.setenv("KLOAD_PCH", "0")  # no precompile for a flag set used once
    src = tmp_path / "omp.cpp"
    src.write_text("#include <kload/kernel.h>\n"
                   "at::Tensor twice(const at::Tensor& x) { return x * 2; }\n"
                   'KLOAD_LIBRARY(m) { m.def("twice(Tensor x) -> Tensor"); }\n'
                   'KLOAD_IMPL(CPU, m) { m.impl("twice", &twice); }\n')
    h = kload.load(src, name="clsimd", extra_cflags=["-fopenmp-simd"], reload=False)
    assert h.twice(torch.ones(2)).tolist() == [2.0, 2.0]
    assert "second OpenMP runtime" not in capfd.readouterr().err
    try:
        kload.load(src, name="clomp", extra_cflags=["-fopenmp"], extra_ldflags=["-fopenmp"], reload=False).twice
    except kload.CompileError as e:
        assert "omp" in str(e), e  # no libomp to link
    err = capfd.readouterr().err
    assert "clomp: clang's -fopenmp" in err and "second OpenMP runtime" in err and "at::parallel_for" in err, err
