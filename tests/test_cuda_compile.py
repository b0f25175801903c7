"""CUDA without a GPU: every shipped .cu must compile with nvcc alone. The .cu
files hold only kernels and extern "C" launchers and include no torch header
(their glue is in the .cpp, on the stable ABI), so no torch include path is given:
a torch include that crept in fails here. Linking needs a CUDA build of torch; on
one, kload.load builds them."""
from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest
from torch.utils.cpp_extension import COMMON_NVCC_FLAGS

from kload.options import include_dir

ROOT = Path(__file__).resolve().parent.parent
CUDA_SOURCES = sorted((ROOT / "kernels").glob("*/*.cu"))
ARCH_FLAGS = ["-gencode", "arch=compute_80,code=sm_80", "-gencode", "arch=compute_90,code=sm_90"]
TORCH_HEADER = re.compile(
    r"#\s*include\s*[<\"](torch/|ATen/|c10/|kload/(stable|kernel|checks)\.h|Python\.h|pybind11/)")


def includes(path: Path) -> list[str]:
    return re.findall(r"^\s*#\s*include\s*[<\"]([^>\"]+)[>\"]", path.read_text(), flags=re.M)


def local_closure(path: Path) -> list[Path]:
    """path and the headers of its folder it includes, transitively."""
    seen, todo = [], [path]
    while todo:
        p = todo.pop()
        if p in seen:
            continue
        seen.append(p)
        todo += [p.parent / h for h in includes(p) if (p.parent / h).is_file()]
    return seen


def resource_usage(ptxas: str) -> dict[tuple[str, str], dict]:
    """{(arch, kernel): {"registers": n, "spill": bytes stored + loaded}} from nvcc --resource-usage."""
    usage, arch, kernel = {}, None, None
    for line in ptxas.splitlines():
        if m := re.search(r"Compiling entry function '(\w+)' for '(sm_\d+)'", line):
            kernel, arch = m[1], m[2]
        elif m := re.search(r"Function properties for (\w+)", line):
            kernel = m[1]
        elif kernel and (m := re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", line)):
            usage.setdefault((arch, kernel), {})["spill"] = int(m[1]) + int(m[2])
        elif kernel and (m := re.search(r"Used (\d+) registers", line)):
            usage.setdefault((arch, kernel), {}).setdefault("spill", 0)
            usage[(arch, kernel)]["registers"] = int(m[1])
    return usage


def test_there_is_a_cuda_source_per_op():
    from kload import kernels

    assert sorted((p.parent.name, p.stem) for p in CUDA_SOURCES) == sorted((op, op) for op in kernels.__all__)


@pytest.mark.parametrize("source", CUDA_SOURCES, ids=lambda p: p.name)
def test_cuda_source_includes_no_torch_header(source):
    cuda_headers = sorted((include_dir() / "kload" / "cuda").glob("*.cuh"))  # launch.cuh, gemm.cuh, ...
    for path in local_closure(source) + [p for h in cuda_headers for p in local_closure(h)]:
        text = path.read_text()
        assert not TORCH_HEADER.search(text), f"{path.name} includes a torch header"
        for inc in includes(path):  # of kload's headers, only the torch-free CUDA ones
            assert not inc.startswith("kload/") or inc.startswith("kload/cuda/"), (path.name, inc)


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc is not installed")
@pytest.mark.parametrize("source", CUDA_SOURCES, ids=lambda p: p.name)
def test_cuda_source_compiles_with_nvcc(source, tmp_path):
    # kload's include dir only, and torch's nvcc flags (no implicit half conversions); for
    # Ampere and Hopper in one call (the tensor-core kernels need sm_80's cp.async, ldmatrix
    # and bf16/tf32 mma; an older target would compile them empty)
    flags = ["-std=c++17", "-c", str(source), "-o", str(tmp_path / "out.o"), f"-I{include_dir()}",
             "--compiler-options", "-fPIC", "--resource-usage", *ARCH_FLAGS, *COMMON_NVCC_FLAGS]
    proc = subprocess.run(["nvcc", *flags], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    warnings = [line for line in proc.stderr.splitlines() if "warning #" in line]  # the source's, not nvcc's own
    assert not warnings, "\n".join(warnings[:20])
    # ptxas's resource usage, per kernel and architecture: no kernel spills registers to local
    # memory (a spilling GEMM loses much of its speed; the tensor-core GEMM's 128 accumulators
    # per thread leave it near the 255-register limit)
    usage = resource_usage(proc.stderr)
    assert usage, proc.stderr[-2000:]
    spilling = {k: u for k, u in usage.items() if u["spill"]}
    assert not spilling, spilling
    assert (tmp_path / "out.o").stat().st_size > 0
    # the launchers the .cpp glue declares are defined, extern "C"
    glue = (source.with_suffix(".cpp")).read_text()
    declared = set(re.findall(r"KLOAD_LAUNCHER const char\* (kload_\w+)\(", glue))
    assert declared, f"{source.with_suffix('.cpp').name} declares no launcher"
    nm = shutil.which("nm")
    if nm:
        symbols = subprocess.run([nm, str(tmp_path / "out.o")], capture_output=True, text=True).stdout
        defined = {line.split()[-1] for line in symbols.splitlines() if " T " in line}
        assert declared <= defined, declared - defined


def test_every_shipped_op_has_its_cpu_source():
    from kload import kernels

    for op in kernels.__all__:
        assert (ROOT / "kernels" / op / f"{op}.cpp").is_file()
