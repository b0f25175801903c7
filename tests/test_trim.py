"""A build that cannot use the precompiled <kload/kernel.h> (the first one, on an
empty cache; here KLOAD_PCH=0, which makes every build one) parses ATen without
<ATen/Functions.h>, plus the operator headers its sources name (loader/trim.py).
Each test compiles its own source for real: what is tested is what one source's
text makes the trimmed header hold, so no two can share a build."""
from __future__ import annotations

import logging
import subprocess
from pathlib import Path

import pytest
import torch

import kload
from kload.errors import CompileError

from conftest import write

# operators, at:: functions, AT_DISPATCH, parallel_for, and a local header that names one more
ORDINARY = """\
    #include <kload/kernel.h>
    #include "helper.h"
    at::Tensor ordinary(const at::Tensor& a, const at::Tensor& b) {
      auto out = at::empty_like(a);
      AT_DISPATCH_FLOATING_TYPES(a.scalar_type(), "ordinary", [&] {
        const auto src = a.contiguous();
        const scalar_t* pa = src.data_ptr<scalar_t>();
        scalar_t* po = out.data_ptr<scalar_t>();
        at::parallel_for(0, src.numel(), 2048, [&](int64_t begin, int64_t end) {
          for (int64_t i = begin; i < end; ++i) po[i] = pa[i] * 2 + 1;
        });
      });
      TORCH_CHECK(at::allclose(out, a * 2 + 1), "the loop and ATen disagree");
      return out + (a - b) + at::zeros(a.sizes(), a.options()) + plus_one(a);
    }
    KLOAD_LIBRARY(m) { m.def("ordinary(Tensor a, Tensor b) -> Tensor"); }
    KLOAD_IMPL(CPU, m) { m.impl("ordinary", &ordinary); }
"""
HELPER = """\
    #pragma once
    inline at::Tensor plus_one(const at::Tensor& x) { return at::ones_like(x) + x; }
"""


@pytest.fixture
def no_pch(monkeypatch, caplog):
    monkeypatch.setenv("KLOAD_PCH", "0")
    caplog.set_level(logging.INFO, logger="kload")
    return caplog


def generated(cache: Path, name: str) -> str:
    """The trimmed <kload/kernel.h> of a library's build directory."""
    [ws] = (cache / "build").glob(f"{name}-*")
    return (ws / "_kload_trim" / "kload" / "kernel.h").read_text()


def symbols(cache: Path, name: str) -> list[str]:
    [obj] = (cache / "build").glob(f"{name}-*/ordinary.o")
    out = subprocess.run(["nm", "-S", "--defined-only", "--extern-only", str(obj)], capture_output=True, text=True,
                         check=True).stdout
    return sorted(" ".join(line.split()[1:]) for line in out.splitlines())  # size, type, name


def test_ordinary_aten_code_builds_trimmed_and_runs(tmp_path, no_pch, kload_cache, monkeypatch):
    write(tmp_path / "helper.h", HELPER)
    h = kload.load(write(tmp_path / "ordinary.cpp", ORDINARY), name="trim_ordinary", reload=False)
    for dtype in (torch.float32, torch.float64):
        a, b = torch.randn(5000, dtype=dtype), torch.randn(5000, dtype=dtype)
        torch.testing.assert_close(h.ordinary(a, b), (a * 2 + 1) + (a - b) + torch.ones_like(a) + a)
    trimmed = h.build().entry.manifest["trimmed"]
    ops = set(trimmed["operators"])
    assert {"empty_like", "allclose", "zeros", "ones_like"} <= ops  # ones_like: from helper.h
    assert "ordinary" not in ops and "a" not in ops
    assert {"ATen/Dispatch.h", "ATen/Parallel.h"} <= set(trimmed["aten"])  # AT_DISPATCH_, parallel_for
    assert not {"ATen/Formatting.h", "ATen/TensorIndexing.h"} & set(trimmed["aten"])
    header = generated(kload_cache, "trim_ordinary")
    assert "#define KLOAD_TRIMMED" in header and "#include <ATen/ops/ones_like.h>" in header
    assert "#include <ATen/Parallel.h>" in header
    assert "#include <ATen/Functions.h>" not in header
    assert "ATen trimmed to what it names" in no_pch.text and "did not compile with ATen trimmed" not in no_pch.text

    # the same source with the whole API (a second build: the point is to compare the two): the
    # same kernel and inline functions, of the same sizes (their order in the object follows the
    # headers' order; a header's internal constants are there where the header was parsed)
    no_pch.clear()
    monkeypatch.setenv("KLOAD_TRIM", "0")
    whole = kload.load(tmp_path / "ordinary.cpp", name="trim_whole", reload=False)
    assert whole.build().entry.manifest["trimmed"] is None and "ATen trimmed" not in no_pch.text
    # registered through torch's C shim, the trimmed object lacks torch::Library's boxing templates
    # (and has the few std::string members the shim's registration uses); ATen's are the same
    trimmed_syms, whole_syms = symbols(kload_cache, "trim_ordinary"), symbols(kload_cache, "trim_whole")
    aten = lambda syms: {s for s in syms if " _ZN2at" in s or " _ZNK2at" in s}  # noqa: E731
    assert aten(trimmed_syms) <= aten(whole_syms) and len(aten(trimmed_syms)) > 20
    assert [s for s in trimmed_syms if "ordinary" in s] == [s for s in whole_syms if "ordinary" in s] != []


def test_a_function_functions_h_defines_itself_gets_the_whole_api(tmp_path, no_pch):
    """at::var(x, 1): <ATen/Functions.h>'s own `int dim` overload. Without it the 1
    would bind to `bool unbiased` and the answer would be silently wrong."""
    h = kload.load(write(tmp_path / "var.cpp", """\
        #include <kload/kernel.h>
        at::Tensor var1(const at::Tensor& x) { return at::var(x, 1); }
        KLOAD_LIBRARY(m) { m.def("var1(Tensor x) -> Tensor"); }
        KLOAD_IMPL(CPU, m) { m.impl("var1", &var1); }
    """), name="trim_var", reload=False)
    x = torch.randn(4, 6)
    torch.testing.assert_close(h.var1(x), torch.var(x, 1))
    assert h.build().entry.manifest["trimmed"] is None


def test_a_name_the_scan_cannot_see_compiles_with_the_whole_api(tmp_path, no_pch):
    """A function named only through token pasting: the trimmed compile fails, the
    whole API compiles it, and the user sees one build that worked."""
    h = kload.load(write(tmp_path / "pasted.cpp", """\
        #include <kload/kernel.h>
        #define LIKE(kind, x) at::kind##_like(x)
        at::Tensor pasted(const at::Tensor& x) { return LIKE(ones, x) + x; }
        KLOAD_LIBRARY(m) { m.def("pasted(Tensor x) -> Tensor"); }
        KLOAD_IMPL(CPU, m) { m.impl("pasted", &pasted); }
    """), name="trim_pasted", reload=False)
    x = torch.randn(7)
    torch.testing.assert_close(h.pasted(x), x + 1)
    assert "trim_pasted did not compile with ATen trimmed" in no_pch.text
    assert h.build().entry.manifest["trimmed"] is None
    # an edit that names the same functions: the whole API at once, no failing compile first
    no_pch.clear()
    src = tmp_path / "pasted.cpp"
    src.write_text(src.read_text().replace("+ x;", "+ 2 * x;"))
    h2 = kload.load(src, name="trim_pasted", reload=False)
    torch.testing.assert_close(h2.pasted(x), 2 * x + 1)
    assert "did not compile with ATen trimmed" not in no_pch.text


def test_errors_are_the_whole_apis_and_a_syntax_error_compiles_once(tmp_path, no_pch):
    src = write(tmp_path / "typo.cpp", """\
        #include <kload/kernel.h>
        at::Tensor typo(const at::Tensor& x) {
          return x.add(not_declared_anywhere);
        }
        KLOAD_LIBRARY(m) { m.def("typo(Tensor x) -> Tensor"); }
        KLOAD_IMPL(CPU, m) { m.impl("typo", &typo); }
    """)
    with pytest.raises(CompileError, match=r"typo\.cpp:3") as e:
        kload.load(src, name="trim_typo", reload=False).build()
    assert "not_declared_anywhere" in str(e.value)
    assert "trim_typo did not compile with ATen trimmed" in no_pch.text  # may have been the trim: once more
    no_pch.clear()
    src.write_text(src.read_text().replace("x.add(not_declared_anywhere);", "x.add(x)"))  # no semicolon
    with pytest.raises(CompileError, match=r"typo\.cpp:[34]"):
        kload.load(src, name="trim_typo", reload=False).build()
    assert "did not compile with ATen trimmed" not in no_pch.text   # a syntax error: the trim cannot explain it


SHIM = """\
    #include <kload/kernel.h>
    at::Tensor axpy(const at::Tensor& x, at::Tensor y, double a, int64_t k, bool neg) {
      CHECK_INPUT(x);
      auto r = x * a + y * k;
      return neg ? -r : r;
    }
    std::tuple<at::Tensor, at::Tensor> two(const at::Tensor& x) { return {1 - x, x / 2}; }
    void fill_(at::Tensor& x, double v) { x.fill_(v); }
    KLOAD_LIBRARY(m) {
      m.def("axpy(Tensor x, Tensor y, float a, int k, bool neg) -> Tensor");
      m.def("two(Tensor x) -> (Tensor, Tensor)");
      m.def("fill_(Tensor(a!) x, float v) -> ()");
    }
    KLOAD_IMPL(CPU, m) {
      m.impl("axpy", &axpy);
      m.impl("two", two);
      m.impl("fill_", &fill_);
    }
"""


def test_registration_through_torchs_c_shim_boxes_each_kind(tmp_path, no_pch):
    """A first build registers through torch's stable C shim, not <torch/library.h>
    (registration.py, <kload/register.h>): Tensor, int, float and bool arguments, a
    Tensor, a tuple or nothing returned, an in-place op, an error from the kernel."""
    h = kload.load(write(tmp_path / "shim.cpp", SHIM), name="trim_shim", reload=False)
    trimmed = h.build().entry.manifest["trimmed"]
    assert trimmed["registration"] == "torch's C shim" and trimmed["tensor_operators"] == "kload/operators.h"
    assert "registered through torch's C shim" in no_pch.text
    x, y = torch.randn(6), torch.randn(6)
    torch.testing.assert_close(h.axpy(x, y, 2.5, 3, True), -(x * 2.5 + y * 3))
    torch.testing.assert_close(h.axpy(x, y, 0.5, -1, False), x * 0.5 - y)
    a, b = h.two(x)
    torch.testing.assert_close(a, 1 - x)
    torch.testing.assert_close(b, x / 2)
    z = torch.zeros(3)
    assert h.fill_(z, 7.0) is None and z.tolist() == [7.0, 7.0, 7.0]
    with pytest.raises(RuntimeError, match="x must be contiguous"):
        h.axpy(torch.randn(8)[::2], torch.randn(4), 1.0, 1, False)
    assert torch.library.opcheck(h.axpy, (x, y, 2.0, 1, False), test_utils=("test_schema",)) == {
        "test_schema": "SUCCESS"}


def test_a_kernel_that_does_not_match_its_schema_is_refused_and_an_unboxed_type_takes_the_whole_api(
        tmp_path, no_pch):
    """The C shim checks only counts at a call; m.impl checks the kinds when it compiles, so an
    int kernel for a float schema is a compile error at the user's m.impl line (torch::Library
    refuses it when the library loads), not bits read as the wrong type. A kernel type the shim
    path does not box (SymInt) compiles with <torch/library.h>. A second def of one op, which
    torch::Library would throw while the library opens (an abort), is a KloadError. Three sources:
    three builds."""
    src = write(tmp_path / "mismatch.cpp", """\
        #include <kload/kernel.h>
        at::Tensor scale(const at::Tensor& x, int64_t s) { return x * s; }
        KLOAD_LIBRARY(m) { m.def("scale(Tensor x, float s) -> Tensor"); }
        KLOAD_IMPL(CPU, m) { m.impl("scale", &scale); }
    """)
    with pytest.raises(CompileError, match=r"mismatch\.cpp:4") as e:
        kload.load(src, name="trim_mismatch", reload=False).build()
    assert "the_kernels_cpp_types_do_not_match_the_kinds_of_its_schema" in e.value.raw
    assert "did not compile with ATen trimmed" not in no_pch.text
    src.write_text(src.read_text().replace("int64_t s", "double s"))  # the fix: a new build that works
    h = kload.load(src, name="trim_mismatch", reload=False)
    torch.testing.assert_close(h.scale(torch.ones(2), 1.5), torch.full((2,), 1.5))

    # what torch refuses while registering (a second def of one op) is an exception, not an abort
    dup = write(tmp_path / "dup.cpp", """\
        #include <kload/kernel.h>
        at::Tensor twice(const at::Tensor& x) { return x * 2; }
        KLOAD_LIBRARY(m) { m.def("twice(Tensor x) -> Tensor"); m.def("twice(Tensor x) -> Tensor"); }
        KLOAD_IMPL(CPU, m) { m.impl("twice", &twice); }
    """)
    with pytest.raises(kload.RegistrationError, match=r"'trim_dup' did not register: .*dup\.cpp:3: m\.def\(\"twice\"\).* failed: "
                                                      r".*multiple times"):
        kload.load(dup, name="trim_dup", reload=False).load()  # registration is at load

    no_pch.clear()
    sym = write(tmp_path / "symint.cpp", """\
        #include <kload/kernel.h>
        at::Tensor shift(const at::Tensor& x, c10::SymInt s) { return x + s.expect_int(); }
        KLOAD_LIBRARY(m) { m.def("shift(Tensor x, SymInt s) -> Tensor"); }
        KLOAD_IMPL(CPU, m) { m.impl("shift", &shift); }
    """)
    h = kload.load(sym, name="trim_symint", reload=False)
    torch.testing.assert_close(h.shift(torch.zeros(2), 3), torch.full((2,), 3.0))
    trimmed = h.build().entry.manifest["trimmed"]
    assert trimmed["registration"] == "torch/library.h" and "registered through" not in no_pch.text
