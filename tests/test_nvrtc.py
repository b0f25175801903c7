"""CUDA device code through NVRTC (kload.cuda_module): compile, cache, key, errors, swap.

Without a GPU the NVRTC tests need libnvrtc, which a CUDA build of torch brings
(`.venv-next`: `.venv-next/bin/python -m pytest -q tests/test_nvrtc.py`); in a CPU-only
venv they are skipped and the rest still runs (the CPU-only path, the launch checks).
The GPU tests at the end run where torch sees a CUDA device. NVRTC compiles for real.
"""
from __future__ import annotations

import importlib.util
import logging
import os
import time

import pytest
import torch

import kload
from kload.live import cudadrv

from conftest import kload_cli, run_py, write


def _has_nvrtc() -> bool:
    try:
        from kload.live import nvrtc

        nvrtc.library()
    except kload.KloadError:
        return False
    return True


needs_nvrtc = pytest.mark.skipif(not _has_nvrtc(), reason="no NVRTC (a CUDA build of torch brings it)")
needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
# reload on save needs watchdog (a dependency; a bare GPU image may lack it, and benchmarks/gpu.sh goes on)
needs_watchdog = pytest.mark.skipif(importlib.util.find_spec("watchdog") is None, reason="needs watchdog")

SAXPY = """\
    #include "scale.cuh"
    template <typename T>
    __global__ void saxpy(T* out, const T* x, const T* y, float a, long long n) {
      long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
      if (i < n) out[i] = T(SCALE * a * float(x[i]) + float(y[i]));
    }
    extern "C" __global__ void fill(float* out, float v, int n) {
      int i = blockIdx.x * blockDim.x + threadIdx.x;
      if (i < n) out[i] = v;
    }
"""


HALF = '#include <cuda_fp16.h>\n#include <cuda_bf16.h>\n#define SCALE 1.0f\n'


@pytest.fixture
def kdir(tmp_path):
    write(tmp_path / "scale.cuh", "#define SCALE 1.0f\n")
    write(tmp_path / "saxpy.cu", SAXPY)
    return tmp_path


def module(kdir, **kw):
    kw.setdefault("names", ["saxpy<float>", "fill"])
    return kload.cuda_module(kdir / "saxpy.cu", reload=kw.pop("reload", False), **kw)


# -- no NVRTC needed ------------------------------------------------------------------

def test_cpu_only_path_imports_nothing_of_cuda(tmp_path):
    src = write(tmp_path / "twice_cpu.cpp", """\
        #include <kload/stable.h>
        kload::Tensor twice_cpu(const kload::Tensor& x) {
          kload::Tensor out = kload::empty_like(x), xc = kload::as_contiguous(x);
          for (int64_t i = 0; i < x.numel(); ++i) out.mutable_data_ptr<float>()[i] = 2 * xc.const_data_ptr<float>()[i];
          return out;
        }
        KLOAD_LIBRARY(m) { m.def("twice_cpu(Tensor x) -> Tensor"); }
        KLOAD_IMPL(CPU, m) { m.impl("twice_cpu", TORCH_BOX(&twice_cpu)); }
        """)
    out = run_py(f"""
        import json, sys, torch
        before, nvrtc_before = set(sys.modules), "libnvrtc" in open("/proc/self/maps").read()  # torch's own
        import kload
        y = kload.load({str(src)!r}).twice_cpu(torch.ones(2)).tolist()
        new = [m for m in set(sys.modules) - before if m in ("kload.live.nvrtc", "kload.live.cudadrv", "kload.live.cuda_module")
               or m.startswith("cuda.")]
        print(json.dumps({{"y": y, "mods": new,
                           "nvrtc": "libnvrtc" in open("/proc/self/maps").read() and not nvrtc_before}}))
    """, env={"KLOAD_PCH": "0"})
    assert out == {"y": [2.0, 2.0], "mods": [], "nvrtc": False}


@pytest.mark.parametrize("config, why", [
    ((1, 2048), "block.x = 2048"), ((1, (32, 32, 2)), "2048 threads"), ((0, 256), "grid.x = 0"),
    ((1, (1, 1, 65)), "block.z = 65"), ((1, 256, -1), "shared_bytes"), ((1,), "[grid, block]"),
    ((1.5, 256), "grid must be"), ((1, 256, 0, 0), "[grid, block]")])
def test_bad_launch_configuration_is_a_python_error(config, why):
    with pytest.raises(kload.KloadError, match=why.replace("[", r"\[").replace("]", r"\]")):
        cudadrv.launch_config("saxpy", config)


def test_launch_configuration_fills_three_dimensions():
    assert cudadrv.launch_config("k", (4, 256)) == ((4, 1, 1), (256, 1, 1), 0)
    assert cudadrv.launch_config("k", ((2, 3), (16, 16), 4096)) == ((2, 3, 1), (16, 16, 1), 4096)


def test_options_are_checked_at_creation(tmp_path):
    src = write(tmp_path / "k.cu", 'extern "C" __global__ void k() {}\n')
    with pytest.raises(kload.KloadError, match="the target is each device's own"):
        kload.cuda_module(src, options=["-arch=sm_80"], reload=False)
    with pytest.raises(kload.KloadError, match="names must be"):
        kload.cuda_module(src, names=[3], reload=False)
    with pytest.raises(kload.KloadError, match="no such kernel file"):
        kload.cuda_module(tmp_path / "nope.cu", reload=False)


def test_device_code_is_checked_at_load(tmp_path):
    src = write(tmp_path / "glue.cpp", "#include <kload/live.h>\n")
    with pytest.raises(FileNotFoundError, match="device code file not found"):
        kload.load(src, device_code=tmp_path / "nope.cu")
    with pytest.raises(TypeError, match="device_code must be a path"):
        kload.load(src, device_code=3)


@pytest.mark.parametrize("fast", [False, True], ids=["pack", "Packer"])
def test_arguments_are_packed_by_the_kernels_parameters(fast):
    import ctypes
    import struct

    x = torch.ones(3)
    params = [["u", 8], ["f", 4], ["f", 8], ["u", 4], ["u", 8], ["u", 1], ["b", 8]]
    packer = cudadrv.Packer("k", params) if fast else (lambda args: cudadrv.pack("k", params, args))
    ptrs, keep = packer((x, 2.5, 3, -1, 7, True, b"12345678"))
    sizes = [8, 4, 8, 4, 8, 1, 8]
    raw = [ctypes.string_at(ptrs[i], n) for i, n in enumerate(sizes)]
    assert raw == [struct.pack("Q", x.data_ptr()), struct.pack("f", 2.5), struct.pack("d", 3.0),
                   struct.pack("i", -1), struct.pack("q", 7), b"\x01", b"12345678"]
    for args, why in [((x,), "takes 7 arguments"), ((1.0, 2.5, 3, -1, 7, True, b"12345678"), "not a float"),
                      ((x, x, 3, -1, 7, True, b"12345678"), "not a pointer"),
                      ((x, 2.5, 3, 1 << 32, 7, True, b"12345678"), "does not fit"),
                      ((x, 2.5, 3, -1, 7, True, b"1234"), "4 bytes for a 8-byte"),
                      ((x, 2.5, 3, -1, 7, "s", b"12345678"), "tensors, floats")]:
        with pytest.raises(kload.KloadError, match=why):
            packer(args)


# -- NVRTC, no GPU --------------------------------------------------------------------

@needs_nvrtc
def test_compiles_to_cubin_and_ptx_with_lowered_names_and_parameters(kdir):
    mod = module(kdir)
    cubin = mod.compile("sm_90")
    assert cubin.manifest["kind"] == "cubin" and cubin.artifact.read_bytes()[:4] == b"\x7fELF"
    k = cubin.manifest["kernels"]
    assert k["saxpy<float>"]["lowered"] == "_Z5saxpyIfEvPT_PKS0_S3_fx" and k["fill"]["lowered"] == "fill"
    assert k["saxpy<float>"]["params"] == [["u", 8], ["u", 8], ["u", 8], ["f", 4], ["s", 8]] or \
        k["saxpy<float>"]["params"] == [["u", 8], ["u", 8], ["u", 8], ["f", 4], ["u", 8]]
    assert k["fill"]["params"] == [["u", 8], ["f", 4], ["u", 4]]
    ptx = mod.compile("compute_90")
    assert ptx.artifact.suffix == ".ptx" and ".entry fill(" in ptx.artifact.read_text()
    assert mod.compiles == 2 and ptx.key != cubin.key


@needs_nvrtc
def test_half_types_compile_as_the_gpu_tests_use_them(kdir):
    write(kdir / "scale.cuh", HALF)
    entry = module(kdir, names=["saxpy<__half>", "saxpy<__nv_bfloat16>"]).compile("sm_90")
    assert entry.manifest["kernels"]["saxpy<__half>"]["params"][3] == ["f", 4]


@needs_nvrtc
def test_the_example_compiles():
    from conftest import EXAMPLES

    names = ["saxpy<float>", "saxpy<__half>", "saxpy<__nv_bfloat16>"]
    entry = kload.cuda_module(EXAMPLES / "saxpy.cu", names=names, reload=False).compile("sm_90")
    assert sorted(entry.manifest["kernels"]) == sorted(names)


@needs_nvrtc
def test_a_fresh_process_hits_with_zero_nvrtc_compiles(kdir):
    entry = module(kdir).compile("sm_90")
    out = run_py(f"""
        import json, kload
        from kload.live import nvrtc
        mod = kload.cuda_module({str(kdir / "saxpy.cu")!r}, names=["saxpy<float>", "fill"], reload=False)
        print(json.dumps({{"path": str(mod.compile("sm_90").path), "compiles": nvrtc.COMPILES}}))
    """)
    assert out == {"path": str(entry.path), "compiles": 0}


@needs_nvrtc
def test_header_edit_makes_a_new_entry_and_revert_finds_the_old(kdir):
    from kload.live import nvrtc

    mod = module(kdir)
    first = mod.compile("sm_90")
    write(kdir / "scale.cuh", "#define SCALE 3.0f\n")
    assert mod.reload() is True
    second = mod.compile("sm_90")
    assert second.key != first.key and second.path != first.path
    before = nvrtc.COMPILES
    write(kdir / "scale.cuh", "#define SCALE 1.0f\n")
    assert mod.reload() is True
    assert mod.compile("sm_90").path == first.path and nvrtc.COMPILES == before  # a hit, no compile
    img = mod.image("sm_90")
    (kdir / "scale.cuh").write_text((kdir / "scale.cuh").read_text())  # saved, unchanged
    assert mod.reload() is False and mod.image("sm_90") is img  # the loaded image stays


@needs_nvrtc
def test_a_header_saved_after_the_key_was_made_is_not_cached_under_it(kdir):
    """The key hashes the files before NVRTC reads them: a save in between (an editor's
    second write) compiled the new bytes, and without the too-new rule they were cached
    under the old bytes' key, so undoing the edit loaded the edited code. PTX, to read
    which constant each image holds (SCALE * a: 3.0 is 0f40400000; 1.0 folds away)."""
    from kload.live import cubin, nvrtc

    mod, src = module(kdir), str(kdir / "saxpy.cu")
    plan = cubin.Plan(mod.store, src, mod.names(), mod.options, mod.include_paths, "compute_90")
    write(kdir / "scale.cuh", "#define SCALE 3.0f\n")  # after the key, before the compile
    racy = cubin.build(mod.store, plan, src)
    assert racy.changed_during_build == [str(kdir / "scale.cuh")]
    assert "0f40400000" in racy.artifact.read_text()  # NVRTC read the new bytes
    assert cubin.lookup(mod.store, plan) is None  # ... which the old bytes' key does not find
    write(kdir / "scale.cuh", "#define SCALE 1.0f\n")  # the edit undone
    before = nvrtc.COMPILES
    undone = mod.compile("compute_90")
    assert nvrtc.COMPILES == before + 1 and undone.path != racy.path and not undone.changed_during_build
    assert "0f40400000" not in undone.artifact.read_text()


@needs_nvrtc
def test_syntax_error_gives_file_line_col_of_the_kernel_file(kdir):
    write(kdir / "bad.cu", """\
        extern "C" __global__ void fill(float* out, float v, int n) {
          int i = blockIdx.x * blockDim.x + threadIdx.x;
          if (i < n) out[i] = v +;
        }
        """)
    with pytest.raises(kload.CompileError) as e:
        kload.cuda_module(kdir / "bad.cu", names=["fill"], reload=False).compile("sm_90")
    text = str(e.value)
    assert f"{kdir / 'bad.cu'}:3:26: error: expected an expression" in text, text
    assert "if (i < n) out[i] = v +;" in text and "full log:" in text
    assert os.path.isfile(e.value.log_path)
    # an error in an included header names the header; an unknown kernel says so
    write(kdir / "scale.cuh", "#define SCALE 1.0f\nstatic __device__ float broken = ;\n")
    with pytest.raises(kload.CompileError, match=r"scale\.cuh:2:\d+: error"):
        module(kdir).compile("sm_90")
    write(kdir / "scale.cuh", "#define SCALE 1.0f\n")
    with pytest.raises(kload.CompileError, match=r"no __global__ function here matches 'nope<float>'"):
        module(kdir, names=["nope<float>"]).compile("sm_90")


@needs_nvrtc
def test_a_failed_edit_keeps_the_last_good_kernels(kdir, caplog):
    mod = module(kdir)
    good = mod.compile("sm_90")
    text = (kdir / "saxpy.cu").read_text()
    (kdir / "saxpy.cu").write_text(text.replace("if (i < n) out[i] = v;", "if (i < n) out[i] = v +;"))
    with caplog.at_level(logging.WARNING, logger="kload"):
        assert mod.reload() is False
        assert mod.reload() is False
    assert mod.compile("sm_90").path == good.path
    said = [r for r in caplog.records if "last good build keeps serving" in r.getMessage()]
    assert len(said) == 1 and "saxpy.cu:9:" in said[0].getMessage()
    (kdir / "saxpy.cu").write_text(text.replace("out[i] = v;", "out[i] = 2 * v;"))
    assert mod.reload() is True and mod.compile("sm_90").path != good.path


@needs_nvrtc
def test_a_new_kernel_name_compiles_once_more(kdir):
    mod = module(kdir, names=["fill"])
    first = mod.compile("sm_90")
    img = mod._need("saxpy<double>", "sm_90")  # what a first launch of mod["saxpy<double>"] does
    assert set(img.kernels) == {"fill", "saxpy<double>"} and img.entry.path != first.path
    with pytest.raises(kload.CompileError):
        mod._need("saxpy<not_a_type>", "sm_90")
    assert set(mod.image("sm_90").kernels) == {"fill", "saxpy<double>"}


@needs_nvrtc
@needs_watchdog
def test_save_marks_the_module_stale(kdir):
    mod = module(kdir, reload=True)
    first = mod.compile("sm_90")
    write(kdir / "scale.cuh", "#define SCALE 2.0f\n")  # a header: watched after the first compile
    deadline = time.monotonic() + 120
    while not mod._reload.stale:
        assert time.monotonic() < deadline, "the watcher never saw the save"
        time.sleep(0.02)
    assert mod.compile("sm_90").path != first.path


CELL = """
    import io, json, contextlib
    from IPython.core.interactiveshell import InteractiveShell
    from kload.doors.magic import CellError, KloadMagics
    shell = InteractiveShell.instance()
    shell.register_magics(KloadMagics)  # what %load_ext kload registers, without its background precompiles
    good = 'extern "C" __global__ void fill(float* out, float v, int n) {\\n  int i = threadIdx.x;\\n  if (i < n) out[i] = v;\\n}\\n'
    shell.run_cell_magic("kload", "fill_cell --cuda", good)
    mod = shell.user_ns["fill_cell"]
    entry = mod.compile()  # compiled by the cell already: the same entry, no second compile
    out = {"type": type(mod).__name__, "compiles": mod.compiles, "kind": entry.manifest["kind"]}
    try:
        shell.run_cell_magic("kload", "bad_cell --cuda", 'extern "C" __global__ void k(float* o) {\\n  o[0] = not_declared;\\n}\\n')
    except CellError as e:
        out["err"] = str(e)
    print(json.dumps(out))
"""


@needs_nvrtc
def test_a_device_code_cell_compiles_with_nvrtc(tmp_path):
    """``%%kload NAME --cuda`` with device code alone (no bindings): NVRTC compiles it when
    the cell runs (no GPU needed) and NAME is its module; a syntax error is a short cell
    error at the cell's line. In an IPython shell of its own process, as the other magic tests."""
    pytest.importorskip("IPython")
    out = run_py(CELL, env={"KLOAD_CACHE_DIR": str(tmp_path / "cache")})
    assert out["type"] == "CudaModule" and out["compiles"] == 1 and out["kind"] == "cubin"
    assert out["err"].startswith("kload: cell 'bad_cell' did not compile") and "line 3" in out["err"], out["err"]


@needs_nvrtc
def test_entries_are_listed_and_verified_like_the_others(kdir):
    entry = module(kdir).compile("sm_90")
    listed = kload_cli("cache", "list")
    row = [line for line in listed.stdout.splitlines() if entry.key[:16] in line]
    assert listed.returncode == 0 and len(row) == 1 and row[0].split()[:2] == ["cubin:saxpy", "cubin"], listed.stdout
    assert "NVRTC libnvrtc.so" in row[0]
    verify = kload_cli("cache", "verify")
    assert verify.returncode == 0, verify.stdout + verify.stderr


# -- C++ glue that launches the kernels by name (kload/live.h, device_code=) -------------

# One glue library for every test here (one build: its key is the glue's text, not the device code's,
# which each test keeps in its own folder). `how` picks a launch, right or wrong on purpose.
GLUE = """\
    #include <kload/kernel.h>
    #include <kload/live.h>
    static kload::live::Kernel saxpy_f("saxpy<float>");
    static kload::live::Kernel fill("fill");
    at::Tensor run(const at::Tensor& x, double a, int64_t how) {
      auto out = at::empty_like(x);
      const int64_t n = x.numel();
      const kload::live::Config one_per_element{(n + 255) / 256, 256};
      switch (how) {
        case 0: saxpy_f[one_per_element](out, x, x, float(a), n); break;
        case 1: saxpy_f[one_per_element](out, x, x, a, n); break;            // a double for `float a`
        case 2: saxpy_f[one_per_element](out, x, x, float(a)); break;        // one argument short
        case 3: saxpy_f[{0, 256}](out, x, x, float(a), n); break;            // an empty grid
        case 4: saxpy_f[{1, {32, 32, 2}}](out, x, x, float(a), n); break;    // 2048 threads
        case 5: fill[{(n + 255) / 256, 256}](out, float(a), int(n)); break;
        case 6: fill[{1, 32, 1 << 24}](out, float(a), int(n)); break;       // 16 MiB of shared memory
      }
      return out;
    }
    KLOAD_LIBRARY(m) { m.def("run(Tensor x, float a, int how) -> Tensor"); }
    KLOAD_IMPL(CPU, m) { m.impl("run", &run); }
    KLOAD_IMPL(CUDA, m) { m.impl("run", &run); }
"""


@pytest.fixture(scope="module")
def glue_file(tmp_path_factory):
    return write(tmp_path_factory.mktemp("glue") / "glue.cpp", GLUE)


def _glue(glue_file, kdir):
    return kload.load(glue_file, device_code=kdir / "saxpy.cu", reload=False)


@needs_nvrtc
def test_glue_binds_its_kernels_by_name_and_checks_each_launch(glue_file, kdir):
    ops = _glue(glue_file, kdir)
    x = torch.ones(4)
    ops.load()
    assert ops._device.module.compiles == 1 and sorted(ops._device.module.names()) == ["fill", "saxpy<float>"]
    # the kernels' parameters came with the binding: a launch is checked before any device is asked for
    with pytest.raises(TypeError, match=r"saxpy<float> \(saxpy.cu\): argument 3 is a double, the kernel takes "
                                        r"a float there"):
        ops.run(x, 2.0, 1)
    with pytest.raises(TypeError, match=r"saxpy<float> \(saxpy.cu\) takes 5 arguments, the launch passes 4"):
        ops.run(x, 2.0, 2)
    with pytest.raises(ValueError, match=r"saxpy<float>: grid.x = 0; CUDA allows 1 to 2147483647"):
        ops.run(x, 2.0, 3)
    with pytest.raises(ValueError, match="a block of 2048 threads; CUDA allows at most 1024"):
        ops.run(x, 2.0, 4)
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="argument 0 is a tensor on cpu; the kernel runs on a CUDA device"):
            ops.run(x, 2.0, 0)


@needs_nvrtc
def test_an_edit_of_the_device_code_rebinds_without_rebuilding_the_glue(glue_file, kdir, caplog):
    from kload.live import nvrtc

    ops = _glue(glue_file, kdir)
    glue_path = ops.build()
    ops.load()
    mod = ops._device.module
    target = next(iter(mod._images))  # the GPU's architecture; sm_90 without one
    first = mod.image(target).entry
    x = torch.ones(4)
    text = (kdir / "saxpy.cu").read_text()
    (kdir / "saxpy.cu").write_text(text.replace("float a", "double a"))  # the slots' parameters change
    assert ops.reload() is True
    assert ops.build() == glue_path  # the same glue library; only the device code compiled
    assert mod.image(target).entry.key != first.key and mod.compiles == 2
    with pytest.raises(TypeError, match="argument 3 is a float, the kernel takes a double"):  # rebound
        ops.run(x, 2.0, 0)
    (kdir / "saxpy.cu").write_text(text.replace("out[i] = v;", "out[i] = v +;"))
    with caplog.at_level(logging.WARNING, logger="kload"):
        assert ops.reload() is False  # reported once; the last good kernels stay bound
    assert any("saxpy.cu:9:" in r.getMessage() and "last good build keeps serving" in r.getMessage() for r in caplog.records)
    with pytest.raises(TypeError, match="the kernel takes a double"):
        ops.run(x, 2.0, 0)
    (kdir / "saxpy.cu").write_text(text)
    before = nvrtc.COMPILES
    assert ops.reload() is True and mod.image(target).entry.key == first.key and nvrtc.COMPILES == before
    with pytest.raises(TypeError, match="argument 3 is a double, the kernel takes a float"):  # the revert, bound
        ops.run(x, 2.0, 1)
    # a fresh process: the glue and the device code are both cache hits, zero NVRTC compiles
    out = run_py(f"""
        import json, kload
        from kload.live import nvrtc
        ops = kload.load({str(glue_file)!r}, device_code={str(kdir / "saxpy.cu")!r}, reload=False)
        print(json.dumps({{"how": ops.build().how, "loaded": bool(ops.load()), "compiles": nvrtc.COMPILES}}))
    """)
    assert out == {"how": "cache", "loaded": True, "compiles": 0}


@needs_nvrtc
@needs_watchdog
def test_a_save_rebinds_the_glue_from_the_watcher(glue_file, kdir):
    ops = kload.load(glue_file, device_code=kdir / "saxpy.cu", reload=True).load()
    text = (kdir / "saxpy.cu").read_text()
    (kdir / "saxpy.cu").write_text(text.replace("float a", "double a"))  # saved: no reload() call
    deadline, err = time.monotonic() + 120, None  # the watcher, 50 ms, an NVRTC compile beside the other worker
    while time.monotonic() < deadline:
        try:
            ops.run(torch.ones(4), 2.0, 0)
        except TypeError as e:  # the slots now hold the new kernel's parameters
            err = e
            break
        except (RuntimeError, ValueError):
            time.sleep(0.05)
    assert err is not None and "the kernel takes a double" in str(err)


@needs_nvrtc
def test_a_renamed_kernel_follows_the_glue_and_the_device_code_in_either_order(kdir, tmp_path):
    # the stable glue (GLUE_STABLE, below): it must be built twice here, and builds in ~1.5 s, not ~7 s
    glue = write(tmp_path / "renamed" / "glue_renamed.cpp", GLUE_STABLE)
    ops = kload.load(glue, device_code=kdir / "saxpy.cu", reload=False).load()
    text, cpp = (kdir / "saxpy.cu").read_text(), glue.read_text()
    # the glue first: its new build asks for `fill2`, which the device code lacks yet
    glue.write_text(cpp.replace('Kernel fill("fill")', 'Kernel fill("fill2")'))
    assert ops.reload() is False  # said: the last good build keeps serving
    with pytest.raises(RuntimeError, match="argument 0 is a tensor on cpu"):
        ops.fill_like(torch.ones(4), 2.0, 1)  # the new build, in place (stable): its slot unchecked
    (kdir / "saxpy.cu").write_text(text.replace("void fill(", "void fill2("))
    assert ops.reload() is True  # now both agree: the new build is bound, with `fill2`
    assert sorted(ops._device.module.names()) == ["fill2"]
    with pytest.raises(RuntimeError, match="fill2 \\(saxpy.cu\\): argument 1 is a double"):
        ops.fill_like(torch.ones(4), 2.0, 1)


@needs_nvrtc
def test_the_last_load_of_a_glue_binds_its_slots(glue_file, kdir):
    other = kdir / "other"  # the same kernels, but `double a`: which file is bound shows in the argument check
    write(other / "scale.cuh", "#define SCALE 1.0f\n")
    write(other / "saxpy.cu", SAXPY.replace("float a", "double a"))
    first = _glue(glue_file, kdir).load()
    second = kload.load(glue_file, device_code=other / "saxpy.cu", reload=False).load()  # a cell run again
    x = torch.ones(4)
    with pytest.raises(TypeError, match="argument 3 is a float, the kernel takes a double"):
        second.run(x, 2.0, 0)
    write(kdir / "scale.cuh", "#define SCALE 3.0f\n")
    assert first.reload() is True  # the first handle's device code compiles, and leaves the slots alone
    with pytest.raises(TypeError, match="argument 3 is a float, the kernel takes a double"):
        second.run(x, 2.0, 0)


@needs_nvrtc
def test_a_second_load_whose_device_code_fails_leaves_the_first_bound(glue_file, kdir):
    first = _glue(glue_file, kdir).load()
    write(kdir / "broken" / "saxpy.cu", SAXPY.replace("out[i] = v;", "out[i] = v +;"))
    write(kdir / "broken" / "scale.cuh", "#define SCALE 1.0f\n")
    second = kload.load(glue_file, device_code=kdir / "broken" / "saxpy.cu", reload=False)
    with pytest.raises(kload.CompileError, match=r"saxpy\.cu:9:"):
        second.load()
    with pytest.raises(TypeError, match="argument 3 is a double, the kernel takes a float"):  # still bound
        first.run(torch.ones(4), 2.0, 1)


# The same on the stable ABI (a second glue build, ~3 s: the ABI changes the header's tensor, guard
# and stream, which the op library above cannot show)
GLUE_STABLE = """\
    #include <kload/stable.h>
    #include <kload/live.h>
    static kload::live::Kernel fill("fill");
    kload::Tensor fill_like(const kload::Tensor& x, double v, int64_t how) {
      kload::Tensor out = kload::empty_like(x);
      const int n = static_cast<int>(x.numel());
      if (how == 0) fill[{(n + 255) / 256, 256}](out, float(v), n);
      else fill[{(n + 255) / 256, 256}](out, v, n);  // a double for `float v`
      return out;
    }
    KLOAD_LIBRARY(m) { m.def("fill_like(Tensor x, float v, int how) -> Tensor"); }
    KLOAD_IMPL(CPU, m) { m.impl("fill_like", TORCH_BOX(&fill_like)); }
    KLOAD_IMPL(CUDA, m) { m.impl("fill_like", TORCH_BOX(&fill_like)); }
"""


@needs_nvrtc
def test_stable_abi_glue_binds_and_checks_the_same_way(kdir):
    ops = kload.load(write(kdir / "glue_stable.cpp", GLUE_STABLE), device_code=kdir / "saxpy.cu", reload=False)
    x = torch.ones(4, device="cuda" if torch.cuda.is_available() else "cpu")
    with pytest.raises(RuntimeError, match=r"fill \(saxpy.cu\): argument 1 is a double, the kernel takes a float"):
        ops.fill_like(x, 2.0, 1)
    if torch.cuda.is_available():
        assert ops.fill_like(x, 2.0, 0).tolist() == [2.0] * 4
        text = (kdir / "saxpy.cu").read_text()
        (kdir / "saxpy.cu").write_text(text.replace("out[i] = v;", "out[i] = 2 * v;"))
        assert ops.reload() is True and ops.fill_like(x, 2.0, 0).tolist() == [4.0] * 4  # same op, new kernel
    else:
        with pytest.raises(RuntimeError, match="argument 0 is a tensor on cpu; the kernel runs on a CUDA device"):
            ops.fill_like(x, 2.0, 0)


@pytest.mark.skipif(_has_nvrtc(), reason="checks a torch without NVRTC (the CPU venv of make test)")
def test_glue_loads_where_there_is_no_nvrtc(kdir, monkeypatch):
    # a CPU build of torch: the glue builds and loads, its slots are bound to a reason, nothing raises
    # until a launch, which says what is wrong with its tensors first (the stable glue: a ~3 s build)
    monkeypatch.setenv("KLOAD_PCH", "0")  # no precompiled stable.h for one build
    ops = kload.load(write(kdir / "glue_stable.cpp", GLUE_STABLE), device_code=kdir / "saxpy.cu", reload=False)
    with pytest.raises(RuntimeError, match="argument 0 is a tensor on cpu; the kernel runs on a CUDA device"):
        ops.fill_like(torch.ones(4), 2.0, 1)  # unchecked (no parameters without NVRTC): the device check
    assert ops._device.module.compiles == 0


# -- on a GPU ---------------------------------------------------------------------------

def _op(mod, opname: str):
    """A dispatcher op whose CUDA kernel is the NVRTC-built saxpy (what the README shows)."""
    @torch.library.custom_op(f"kload_nvrtc_test::{opname}", mutates_args=())
    def saxpy(x: torch.Tensor, y: torch.Tensor, a: float) -> torch.Tensor:
        out = torch.empty_like(y)
        n = out.numel()
        name = {torch.float32: "saxpy<float>", torch.float16: "saxpy<__half>",
                torch.bfloat16: "saxpy<__nv_bfloat16>"}[x.dtype]
        mod[name][max(1, (n + 255) // 256), 256](out, x.contiguous(), y.contiguous(), a, n)
        return out

    saxpy.register_fake(lambda x, y, a: torch.empty_like(y))
    return getattr(torch.ops.kload_nvrtc_test, opname)


@needs_gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_results_match_torch(kdir, dtype):
    write(kdir / "scale.cuh", HALF)
    op = _op(module(kdir), f"saxpy_{str(dtype)[6:]}")
    for n in (1, 17, 989, 1 << 20):
        x, y = torch.randn(n, device="cuda", dtype=dtype), torch.randn(n, device="cuda", dtype=dtype)
        tol = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}[dtype]
        torch.testing.assert_close(op(x, y, 2.0), (2.0 * x.float() + y.float()).to(dtype), rtol=tol, atol=tol)


@needs_gpu
def test_an_edit_swaps_the_kernel_under_the_same_op_name(kdir):
    mod = module(kdir)
    op = _op(mod, "saxpy_swap")
    x = torch.ones(1000, device="cuda")
    assert op(x, x, 1.0).tolist() == [2.0] * 1000
    write(kdir / "scale.cuh", "#define SCALE 3.0f\n")
    assert mod.reload() is True
    assert op(x, x, 1.0).tolist() == [4.0] * 1000  # same torch.ops name, the new kernel


@needs_gpu
def test_bad_launches_are_python_errors(kdir):
    mod = module(kdir)
    x = torch.ones(4, device="cuda")
    with pytest.raises(kload.KloadError, match="2048 threads"):
        mod.fill[1, 2048](x, 1.0, 4)
    with pytest.raises(kload.KloadError, match="shared memory|CUDA_ERROR"):
        mod.fill[1, 32, 1 << 24](x, 1.0, 4)  # 16 MiB of shared memory: the driver refuses
    with pytest.raises(kload.KloadError, match="one CUDA device"):
        mod.fill[1, 32](torch.ones(4), 1.0, 4)
    mod.fill[1, 32](x, 5.0, 4)
    assert x.tolist() == [5.0] * 4  # the module still works after the refusals


@needs_gpu
def test_opcheck_and_torch_compile(kdir):
    op = _op(module(kdir), "saxpy_check")
    x, y = torch.randn(33, device="cuda"), torch.randn(33, device="cuda")
    torch.library.opcheck(op, (x, y, 2.0))
    compiled = torch.compile(lambda a, b: op(a, b, 2.0) * 2, fullgraph=True)
    torch.testing.assert_close(compiled(x, y), (2 * x + y) * 2)


@needs_gpu
def test_glue_launches_on_the_gpu_and_an_edit_swaps_the_kernel(glue_file, kdir):
    ops = _glue(glue_file, kdir)
    op = ops.run  # torch.ops.<ns>.run, fetched once
    x = torch.arange(1000.0, device="cuda")
    torch.testing.assert_close(op(x, 2.0, 0), 2 * x + x)
    assert op(x, 7.0, 5).tolist() == [7.0] * 1000
    with pytest.raises(RuntimeError, match="shared memory|CUDA_ERROR"):
        op(x, 1.0, 6)
    write(kdir / "scale.cuh", "#define SCALE 3.0f\n")
    assert ops.reload() is True
    torch.testing.assert_close(op(x, 2.0, 0), 3 * 2 * x + x)  # the same op, the new kernel
    import threading  # a thread that made no CUDA call yet gets the device's context

    got = []
    t = threading.Thread(target=lambda: got.append(op(x, 1.0, 5).cpu()))
    t.start()
    t.join()
    assert got[0].tolist() == [1.0] * 1000


@needs_gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_the_glue_example_matches_torch_and_passes_opcheck(dtype):
    from conftest import EXAMPLES

    ops = kload.load(EXAMPLES / "saxpy_op.cpp", device_code=EXAMPLES / "saxpy.cu", reload=False)
    tol = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}[dtype]
    for n in (1, 17, 989, 1 << 20):
        x, y = torch.randn(n, device="cuda", dtype=dtype), torch.randn(n, device="cuda", dtype=dtype)
        torch.testing.assert_close(ops.saxpy(x, y, 2.0), (2.0 * x.float() + y.float()).to(dtype), rtol=tol, atol=tol)
    x, y = torch.randn(33, device="cuda", dtype=dtype), torch.randn(33, device="cuda", dtype=dtype)
    torch.library.opcheck(ops.saxpy, (x, y, 2.0))
    compiled = torch.compile(lambda a, b: ops.saxpy(a, b, 2.0) * 2, fullgraph=True)
    torch.testing.assert_close(compiled(x, y), ops.saxpy(x, y, 2.0) * 2)
