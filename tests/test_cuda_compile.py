"""CUDA without a GPU: every shipped .cu must compile with nvcc against torch's
headers (linking needs a CUDA build of torch; on one, kload.load builds them)."""
from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
import torch
from torch.utils.cpp_extension import include_paths

from kload.options import include_dir

ROOT = Path(__file__).resolve().parent.parent
CUDA_SOURCES = sorted((ROOT / "kernels").glob("*/*.cu"))


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc is not installed")
@pytest.mark.parametrize("source", CUDA_SOURCES, ids=lambda p: p.name)
def test_cuda_source_compiles_with_nvcc(source, tmp_path):
    extra = []
    if torch.version.cuda is None:
        # the CPU wheel lacks the one generated c10/cuda header; its content is a single define
        extra = ["-isystem", str(ROOT / "tests" / "data" / "cuda_headers")]
    flags = ["-std=c++20", "-c", str(source), "-o", str(tmp_path / "out.o"), f"-I{include_dir()}",
             "--compiler-options", "-fPIC", "-arch=sm_90"]
    for p in include_paths():
        flags += ["-isystem", p]
    proc = subprocess.run(["nvcc", *flags, *extra], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert (tmp_path / "out.o").stat().st_size > 0


def test_every_shipped_op_has_its_cpu_source():
    from kload import kernels

    for op in kernels.__all__:
        assert (ROOT / "kernels" / op / f"{op}.cpp").is_file()
