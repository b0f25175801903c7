"""``use_pch`` through the drop-in, as torch's own test_gen_extension_h_pch checks it: torch's
precompiled ``torch/extension.h`` and its signature file appear beside the header with True and
go with False.

These files live in torch's install, which every other test's compile reads: made there while
the main suite's workers compile, a half-written ``extension.h.gch`` could meet their GCC. So this
file runs alone, in ``make upgrade-check``'s sequence (KLOAD_TORCH_FILES_TESTS=1), and compiles its
own source: the point is a build made while torch's file exists, which no shared build is.
"""
from __future__ import annotations

import os

import pytest
from conftest import last_json, run_code

pytestmark = pytest.mark.skipif(os.environ.get("KLOAD_TORCH_FILES_TESTS") != "1",
                                reason="writes into torch's install: make upgrade-check runs it alone")

CODE = """\
    import json, os, sys, torch
    from torch.utils.cpp_extension import _TORCH_PATH, remove_extension_h_precompiler_headers
    from kload import cpp_extension as ce
    gch = os.path.join(_TORCH_PATH, "include", "torch", "extension.h.gch")
    sign = os.path.join(_TORCH_PATH, "include", "torch", "extension.h.sign")
    src = "at::Tensor sin_add(at::Tensor x, at::Tensor y) { return x.sin() + y.sin(); }"
    remove_extension_h_precompiler_headers()
    seen = {"before": [os.path.exists(gch), os.path.exists(sign)]}
    m = ce.load_inline(name="inline_extension_with_pch", cpp_sources=[src], functions=["sin_add"], use_pch=True)
    seen["with"] = [os.path.exists(gch), os.path.exists(sign)]
    seen["sign"] = open(sign).read()
    x = torch.randn(5)
    seen["right"] = torch.allclose(m.sin_add(x, x), 2 * x.sin())
    ce.load_inline(name="inline_extension_with_pch", cpp_sources=[src], functions=["sin_add"], use_pch=False)
    seen["without"] = [os.path.exists(gch), os.path.exists(sign)]
    print(json.dumps(seen))
"""


def test_use_pch_makes_and_removes_torchs_precompiled_extension_h():
    seen = last_json(run_code(CODE))
    assert seen["before"] == [False, False]
    assert seen["with"] == [True, True]  # torch's files, as its test checks (GCC is the compiler here)
    assert "-x_c++-header" in seen["sign"] and "extension.h.gch" in seen["sign"]  # torch's own signature
    assert seen["right"]
    assert seen["without"] == [False, False]
