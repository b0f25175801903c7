"""The shipped CUDA kernels run, without a GPU, on the CPU emulator in tests/cuda_emu/:
g++ compiles each kernels/<op>/<op>.cu with the PTX instructions (cp.async, ldmatrix,
mma.sync) emulated from the PTX ISA's definitions, and a child process compares every
launcher's results with torch's (tests/cuda_emu/check.py). This checks what a GPU run
would find wrong in the index math (tiles, fragments, the cp.async pipeline, edges,
tails, reductions) on every `make test`; the GPU's speed and its own rounding are
benchmarks/gpu.sh's.

Builds: one library of the four emulated .cu files (about 4 s of g++ on two cores),
shared by the module's three runs; the planted-bug tests build one .cu each with a bug
in it, and the other tile shapes build matmul and conv2d with other constants, so each
needs its own build (about 2-4 s)."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from kload.plan.toolchain import find_cuda_home

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE / "cuda_emu"))
import emu_build  # noqa: E402

_home = find_cuda_home()
CUDA_INCLUDE = Path(_home, "include") if _home else None
pytestmark = pytest.mark.skipif(
    shutil.which("g++") is None or CUDA_INCLUDE is None or not (CUDA_INCLUDE / "cuda_fp16.h").exists(),
    reason="needs g++ and the CUDA toolkit's headers")
OPS = ["vector_add", "matmul", "conv2d", "bias_gelu"]


@pytest.fixture(scope="module")
def emulated(tmp_path_factory) -> Path:
    return emu_build.build(tmp_path_factory.mktemp("cuda_emu"), CUDA_INCLUDE)


def check(lib: Path, *ops: str, cp_async: str = "late", order: str = "lockstep",
          env: dict | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "KLOAD_EMU_CP_ASYNC": cp_async, "KLOAD_EMU_ORDER": order, **(env or {})}
    env.pop("KLOAD_KERNELS_IMPL", None)
    return subprocess.run([sys.executable, str(HERE / "cuda_emu" / "check.py"), str(lib), *ops], env=env,
                          capture_output=True, text=True, timeout=600)


# How a kernel must be right (emu.h): late copies land only at the cp.async.wait_group that must
# see them (a short wait reads a stage's old bytes); eager ones land when issued, and with each warp
# running ahead to its next barrier (warps, in either order) a copy into a stage that a slower warp
# still reads overwrites it (a load issued before the barrier that frees the stage)
MODES = [("late", "lockstep"), ("eager", "warps"), ("eager", "warps-reversed")]


@pytest.mark.parametrize("cp_async, order", MODES)
def test_shipped_cuda_kernels_match_torch_on_the_emulator(emulated, cp_async, order):
    proc = check(emulated, cp_async=cp_async, order=order)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-4000:]
    assert [line.split(":")[0] for line in proc.stdout.splitlines()] == OPS, proc.stdout


# benchmarks/gemm_shapes.py times these beside the default (2 warps along N, 4 stages): the same
# code with other constants, each built on its own to be checked too; check.py asserts the block
# size the knob gives, so a knob that did not take cannot pass for the default
@pytest.mark.parametrize("warps_n, stages", [(4, 3), (2, 3), (4, 4)])
def test_the_gemms_other_tile_shapes_match_torch_on_the_emulator(tmp_path, warps_n, stages):
    lib = emu_build.build(tmp_path, CUDA_INCLUDE, ops=["matmul", "conv2d"],
                          defines=[f"-DKLOAD_GEMM_WARPS_N={warps_n}", f"-DKLOAD_GEMM_STAGES={stages}"])
    for cp_async, order in MODES[:2]:
        proc = check(lib, "matmul", "conv2d", cp_async=cp_async, order=order,
                     env={"KLOAD_EMU_GEMM_WARPS_N": str(warps_n)})
        assert proc.returncode == 0, proc.stdout + proc.stderr[-4000:]


def caught(proc: subprocess.CompletedProcess, what: str) -> None:
    """The check run stopped, saying `what` (a planted bug was seen)."""
    assert proc.returncode != 0 and what in proc.stdout + proc.stderr, proc.stdout + proc.stderr


def planted(tmp_path: Path, op: str, path: str, old: str, new: str) -> Path:
    def edit(out: Path) -> None:
        f = out / path
        text = f.read_text()
        assert text.count(old) == 1, f"{old!r} is not in {path} once: update this test with the kernel"
        f.write_text(text.replace(old, new))

    return emu_build.build(tmp_path, CUDA_INCLUDE, ops=[op], edit=edit)


def test_the_emulator_sees_a_wrong_fragment_layout(tmp_path):
    # ldmatrix's matrices 2 and 3 (k 8-15) taken from lanes 8-15's rows instead of 16-31's
    lib = planted(tmp_path, "matmul", "include/kload/cuda/gemm.cuh", "kk + (lane >> 4) * 8);",
                  "kk + ((lane >> 3) & 1) * 8);")
    caught(check(lib, "matmul"), "MISMATCH matmul")


def test_the_emulator_sees_a_short_cp_async_wait(tmp_path):
    # waiting for all but the newest kStages - 1 groups, one too many: the step computed has not landed
    lib = planted(tmp_path, "matmul", "include/kload/cuda/gemm.cuh", "ptx::cp_async_wait<kStages - 2>();",
                  "ptx::cp_async_wait<kStages - 1>();")
    caught(check(lib, "matmul", cp_async="late"), "MISMATCH matmul")


def test_the_emulator_sees_a_stage_overwritten_before_the_barrier(tmp_path):
    # the next step's copies issued before the __syncthreads that says every warp is done with that
    # stage: a warp that runs ahead overwrites what a slower one still reads (lockstep cannot see it)
    barrier = "    __syncthreads();               // ... and everyone's; and step kt - 1's buffer is free\n"
    load = ("    const int64_t next = kt + kStages - 1;\n"
            "    if (next < ktiles) load_stage(static_cast<int>(next % kStages), next * BK);\n")
    lib = planted(tmp_path, "matmul", "include/kload/cuda/gemm.cuh", barrier + load, load + barrier)
    assert check(lib, "matmul", cp_async="eager", order="lockstep").returncode == 0
    caught(check(lib, "matmul", cp_async="eager", order="warps"), "MISMATCH matmul")


def test_the_emulator_sees_ldmatrix_bank_conflicts(tmp_path):
    # without the 16 bytes of padding, A's rows are 64 bytes apart: the 8 rows of an ldmatrix fall on
    # two groups of banks, four to a group (a speed bug, not a wrong result: only the count shows it)
    lib = planted(tmp_path, "matmul", "include/kload/cuda/gemm.cuh",
                  "static constexpr int kPadA = 8, kPadB = 8;  // 16 bytes",
                  "static constexpr int kPadA = 0, kPadB = 8;")
    caught(check(lib, "matmul"), "ldmatrix bank conflicts")


def test_the_emulator_sees_cp_async_bank_conflicts(tmp_path):
    # a quarter-warp's copies into two adjacent 80-byte rows: its 16-byte stores take two passes
    # (ldmatrix reads are untouched: only the cp.async count can see it)
    lib = planted(tmp_path, "matmul", "include/kload/cuda/gemm.cuh",
                  "int spread_row(int s) { return (s & ~7) | (s & 1) << 2 | (s & 7) >> 1; }",
                  "int spread_row(int s) { return s; }")
    caught(check(lib, "matmul"), "cp.async bank conflicts")


def test_the_emulator_sees_a_read_past_the_end(tmp_path):
    # one 16-byte vector past the last: the page after the buffer is not readable
    lib = planted(tmp_path, "vector_add", "vector_add/vector_add.cu",
                  "for (; i < nvec; i += stride) vo[i] = add(va[i], vb[i]);",
                  "for (; i <= nvec; i += stride) vo[i] = add(va[i], vb[i]);")
    proc = check(lib, "vector_add")
    assert proc.returncode == -11, (proc.returncode, proc.stdout, proc.stderr[-2000:])  # killed by SIGSEGV
