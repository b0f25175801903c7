"""The loader core: lazy builds, the content-hashed cache, binding styles, errors.

Every build here is a real compile through torch.utils.cpp_extension; compiler
invocations are counted with a CXX wrapper, never mocked.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

import kload
from kload.cache.store import Store

from conftest import (EXAMPLES, VECTOR_ADD, compiles, invocations, kload_cli, last_json, raises_in_child, run_code,
                      run_py, write)


def entries(cache: Path) -> set[str]:
    """The library entries of the cache. Precompiled headers (``pch-*``) are left out: an earlier
    test's background precompile may publish one at any moment."""
    d = cache / "entries"
    return {p.name for p in d.iterdir() if not p.name.startswith((".", "pch-"))} if d.exists() else set()


# -- laziness, hits, keys ------------------------------------------------------------

def test_load_is_lazy_and_first_use_compiles(vadd_dir, kload_cache):
    before = entries(kload_cache)
    ops = kload.load(vadd_dir / "vadd.cpp")
    assert entries(kload_cache) == before, "load() must not compile"
    a, b = torch.arange(5.0), torch.full((5,), 2.0)
    torch.testing.assert_close(ops.vector_add(a, b), a + b)
    assert len(entries(kload_cache) - before) == 1
    # the handle's op is the dispatcher op itself
    assert ops.vector_add is getattr(torch.ops, ops.namespace).vector_add
    assert "vector_add" in repr(ops)


HIT_PROBE = """
    import json, subprocess, sys, time, torch
    real_popen = subprocess.Popen.__init__
    def no_subprocess(self, *a, **k):
        raise AssertionError(f"a cache hit ran a subprocess: {{a}}")
    subprocess.Popen.__init__ = no_subprocess
    import kload
    ops = kload.load({src!r})
    out = ops.vector_add(torch.ones(3), torch.ones(3))
    got = ops.build()  # the path, and how it was found
    print(json.dumps({{"out": out.tolist(), "path": got, "how": got.how, "planned": got.plan is not None,
                      "build_dir": str(got.build_dir), "sources": got.sources,
                      "cpp_extension_imported": "torch.utils.cpp_extension" in sys.modules}}))
"""


def test_fresh_process_hit_runs_no_compiler(vadd_dir, cxx_wrapper, tmp_path):
    cxx, log = cxx_wrapper
    src = str(vadd_dir / "vadd.cpp")
    env = {"CXX": str(cxx)}
    before = compiles(log, "vadd.cpp")  # the wrapper's log is the session's: count from here
    cold = run_py(HIT_PROBE.replace("no_subprocess\n", "real_popen\n").format(src=src), env=env)
    assert compiles(log, "vadd.cpp") == before + 1
    calls = invocations(log)
    # a different working directory, a fresh process: the same entry, zero compiler runs
    warm = run_py(HIT_PROBE.format(src=src), env=env, cwd=tmp_path)
    assert invocations(log) == calls
    assert warm["out"] == [2.0, 2.0, 2.0]
    assert warm["path"] == cold["path"]
    assert warm["cpp_extension_imported"] is False
    # build() is the artifact's path (a str), and says how it was found: compiled, then the hit record
    assert (cold["how"], cold["planned"], warm["how"], warm["planned"]) == ("built", True, "cache", False)
    assert warm["build_dir"] == cold["build_dir"] and Path(cold["build_dir"], "compile_commands.json").is_file()
    assert warm["sources"] == cold["sources"] == [src]


def test_header_edit_rebuilds_and_revert_finds_old_entry(vadd_dir, cxx_wrapper):
    cxx, log = cxx_wrapper
    src = str(vadd_dir / "vadd.cpp")
    env = {"CXX": str(cxx)}
    probe = """
        import json, torch, kload
        ops = kload.load({src!r})
        print(json.dumps({{"out": ops.vector_add(torch.ones(2), torch.ones(2)).tolist(), "path": ops.build()}}))
    """.format(src=src)
    first = run_py(probe, env=env)
    n = compiles(log, "vadd.cpp")
    (vadd_dir / "scale.h").write_text("#define SCALE 10.0f\n")
    edited = run_py(probe, env=env)
    assert edited["out"] == [20.0, 20.0], "a header edit must reach the binary"
    assert compiles(log, "vadd.cpp") == n + 1
    assert edited["path"] != first["path"]
    (vadd_dir / "scale.h").write_text("#define SCALE 1.0f\n")
    reverted = run_py(probe, env=env)
    assert reverted == first, "reverting the edit finds the earlier entry"
    assert compiles(log, "vadd.cpp") == n + 1, "and compiles nothing"


def test_flag_change_is_a_different_entry(vadd_dir):
    a = kload.load(vadd_dir / "vadd.cpp")
    b = kload.load(vadd_dir / "vadd.cpp", extra_cflags=["-O2"])
    assert a.build() != b.build()
    assert Path(a.build()).parent.name != Path(b.build()).parent.name
    torch.testing.assert_close(b.vector_add(torch.ones(3), torch.ones(3)), torch.full((3,), 2.0))


def test_key_covers_toolchain_and_environment(vadd_dir, kload_cache, monkeypatch):
    from kload.options import Options
    from kload.plan.plan import make_plan

    store = Store(kload_cache)
    opts = Options(name="vadd", paths=[vadd_dir / "vadd.cpp"])
    base = make_plan(opts, store)
    inputs = base.key_inputs()
    for key in ("torch", "python", "cxx", "env", "cflags", "include_paths", "sources", "style"):
        assert key in inputs
    assert inputs["torch"]["version"] == base.torch["version"] == torch.__version__
    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", "9.0")
    assert make_plan(opts, store).skey != base.skey
    monkeypatch.delenv("TORCH_CUDA_ARCH_LIST")
    assert make_plan(opts, store).skey == base.skey


def test_gcc_gets_its_parse_flags_before_the_callers(vadd_dir, kload_cache):
    from kload.plan import toolchain
    from kload.options import Options
    from kload.plan.plan import GCC_PARSE_FLAGS, make_plan

    # GCC is what the compiler says it is (its predefined macros), not what its file is called
    d = kload_cache.parent / "compilers"
    d.mkdir(exist_ok=True)
    plain = write(d / "site-cxx", '#!/bin/sh\nexec g++ "$@"\n')    # a wrapper whose name says nothing
    liar = write(d / "g++", '#!/bin/sh\necho "g++ (GCC) 13.2.1"\n')  # named g++, prints a GCC banner
    for f in (plain, liar):
        f.chmod(0o755)
    assert toolchain.is_gcc(toolchain.compiler_identity(str(plain), d))
    assert toolchain.compiler_identity(str(plain), d)["version"] == toolchain.compiler_identity("g++", d)["version"]
    assert not toolchain.is_gcc(toolchain.compiler_identity(str(liar), d))

    opts = Options(name="vadd", paths=[vadd_dir / "vadd.cpp"], cflags=["--param=ggc-min-heapsize=65536"])
    p = make_plan(opts, Store(kload_cache))
    assert toolchain.is_gcc(p.cxx)  # this machine's c++
    assert p.cflags[: len(GCC_PARSE_FLAGS) + 1] == GCC_PARSE_FLAGS + ["--param=ggc-min-heapsize=65536"]
    assert p.cuda_cflags == []  # nvcc gets none of it


def test_knobs_scoped_sets_for_a_block_and_restores(monkeypatch):
    from kload import knobs

    monkeypatch.setenv("KLOAD_PCH", "1")
    monkeypatch.delenv("KLOAD_DEBUG", raising=False)
    with pytest.raises(RuntimeError, match="inside"):
        with knobs.scoped(KLOAD_PCH="0", KLOAD_DEBUG="1"):
            assert (knobs.pch(), knobs.debug()) == (False, True)
            raise RuntimeError("inside")
    assert (knobs.pch(), knobs.debug()) == (True, False) and "KLOAD_DEBUG" not in os.environ
    with knobs.scoped(KLOAD_PCH=None):
        assert "KLOAD_PCH" not in os.environ and knobs.pch()  # unset: the default
    assert os.environ["KLOAD_PCH"] == "1"


def test_what_build_returns_is_the_path_pickled_and_copied(tmp_path):
    import copy
    import pickle

    from kload.cache import Entry
    from kload.resolve import Resolved

    got = Resolved(Entry(tmp_path / "e", {"artifact": "x.so", "name": "x"}), "cache", 0.001)
    assert got == str(tmp_path / "e" / "x.so") and got.how == "cache" and got.plan is None
    for back in (pickle.loads(pickle.dumps(got)), copy.copy(got), copy.deepcopy(got)):
        assert back == got and type(back) is str  # the path, as build() returned before


def test_half_published_directories_are_swept_once_old(tmp_path):
    """A process killed between staging an entry and renaming it leaves a hidden directory
    that no lookup or eviction sees: old ones go at the next build and `cache clear`; a
    publish in progress (a fresh one) is left alone."""
    from kload.cache.publish import sweep

    store = Store(tmp_path / "cache")
    store.prepare()
    old = [store.entries / ".staging-lib-0123456789abcdef-a1b2c3", store.entries / ".trash-lib-x-d4e5f6"]
    fresh = store.entries / ".staging-lib-fedcba9876543210-0f0f0f"
    for d in old + [fresh]:
        (d / "sub").mkdir(parents=True)
        (d / "sub" / "lib.so").write_bytes(b"x" * 100)
    for d in old:
        os.utime(d, (time.time() - 3600, time.time() - 3600))
    assert sweep(store) == 2
    assert fresh.is_dir() and not any(d.exists() for d in old)


def test_cache_location_rules(monkeypatch, tmp_path):
    from kload import knobs

    monkeypatch.delenv("KLOAD_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert knobs.cache_dir() == tmp_path / "xdg" / "kload"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert knobs.cache_dir() == tmp_path / "home" / ".cache" / "kload"
    monkeypatch.setenv("KLOAD_CACHE_DIR", str(tmp_path / "mine"))
    assert knobs.cache_dir() == tmp_path / "mine"
    Store(knobs.cache_dir()).prepare()
    assert (tmp_path / "mine").stat().st_mode & 0o777 == 0o700


# -- errors ------------------------------------------------------------------------

def test_compile_error_is_short_caches_nothing_and_fix_compiles(tmp_path, kload_cache):
    src = write(tmp_path / "broken.cpp", VECTOR_ADD.replace("po[i] = SCALE", "po[i] = SCALE * undefined_thing"))
    write(tmp_path / "scale.h", "#define SCALE 1.0f\n")
    before = entries(kload_cache)
    ops = kload.load(src)
    with pytest.raises(kload.CompileError) as info:
        ops.vector_add
    message = str(info.value)
    lineno = VECTOR_ADD.splitlines().index(
        next(l for l in VECTOR_ADD.splitlines() if "po[i] = SCALE" in l)) + 1
    assert f"broken.cpp:{lineno}:" in message
    assert "undefined_thing" in message and "was not declared" in message
    assert "full log:" in message and info.value.log_path.exists()
    assert len(message.splitlines()) <= 12
    assert entries(kload_cache) == before, "a failed build leaves no entry"
    write(src, VECTOR_ADD)
    fixed = kload.load(src)
    torch.testing.assert_close(fixed.vector_add(torch.ones(2), torch.ones(2)), torch.full((2,), 2.0))


def test_bad_arguments_are_clear(tmp_path, vadd_dir):
    with pytest.raises(FileNotFoundError, match="nope.cpp"):
        kload.load(tmp_path / "nope.cpp")
    write(tmp_path / "x.py", "")
    with pytest.raises(kload.KloadError, match="unsupported source type '.py'"):
        kload.load(tmp_path / "x.py")
    with pytest.raises(ValueError, match="C identifier"):
        kload.load(vadd_dir / "vadd.cpp", name="my-ops")
    with pytest.raises(TypeError, match="list of strings"):
        kload.load(vadd_dir / "vadd.cpp", extra_cflags="-O3")
    with pytest.raises(FileNotFoundError, match="include directory"):
        kload.load(vadd_dir / "vadd.cpp", extra_include_paths=[tmp_path / "missing"])
    with pytest.raises(kload.KloadError, match="at least one source"):
        kload.load()
    write(tmp_path / "nobind.cpp", "int f() { return 1; }\n")
    with pytest.raises(kload.KloadError, match="no bindings found"):
        kload.load(tmp_path / "nobind.cpp").f


def test_unknown_op_lists_what_exists(vadd_dir):
    ops = kload.load(vadd_dir / "vadd.cpp")
    with pytest.raises(AttributeError, match=r"has no op or function 'vector_mul'.*vector_add"):
        ops.vector_mul


def test_op_checks_raise_python_errors(vadd_dir):
    ops = kload.load(vadd_dir / "vadd.cpp")
    ops.load()  # each check runs in a fork of this process (a crash fails the check, not the run)
    raises_in_child(lambda: ops.vector_add(torch.ones(3), torch.ones(4)), RuntimeError, "shapes differ")
    raises_in_child(lambda: ops.vector_add(torch.ones(4, 4).t(), torch.ones(4, 4)), RuntimeError, "must be contiguous")


# -- binding styles ------------------------------------------------------------------

@pytest.mark.slow
def test_tutorial_pybind_code_runs_as_written(tmp_path):
    """Section 3.2 of the tutorial: torch/extension.h, PYBIND11_MODULE, undefined CHECK_INPUT."""
    src = tmp_path / "my_ops.cpp"
    src.write_text((EXAMPLES / "tutorial_my_ops.cpp").read_text())
    ext = kload.load(src)
    a, b = torch.randn(17), torch.randn(17)
    torch.testing.assert_close(ext.vector_add(a, b), a + b)
    assert ext.module is not None and ext.names() == ["vector_add"]
    raises_in_child(lambda: ext.vector_add(torch.ones(3, 3).t(), torch.ones(3, 3)), RuntimeError, "must be contiguous")


@pytest.mark.slow
def test_plain_torch_library_loads_and_refuses_rebuild_in_process(tmp_path):
    code = """\
        #include <torch/library.h>
        #include <ATen/ops/mul.h>
        at::Tensor twice(const at::Tensor& x) { return at::mul(x, %s); }
        TORCH_LIBRARY(kload_test_fixed, m) { m.def("twice(Tensor x) -> Tensor"); }
        TORCH_LIBRARY_IMPL(kload_test_fixed, CPU, m) { m.impl("twice", &twice); }
    """
    src = write(tmp_path / "fixed.cpp", code % "2")
    ops = kload.load(src)
    torch.testing.assert_close(ops.twice(torch.ones(2)), torch.full((2,), 2.0))
    assert ops.twice is torch.ops.kload_test_fixed.twice
    # the same build again: fine (memoized)
    assert kload.load(src).twice(torch.ones(1)).item() == 2.0
    write(src, code % "3")
    with pytest.raises(kload.KloadError, match="registers TORCH_LIBRARY.*restart the process"):
        kload.load(src).twice
    # the process is alive and the loaded build still works
    assert ops.twice(torch.ones(1)).item() == 2.0
    # a fresh process gets the new build
    out = run_py(f"""
        import json, torch, kload
        print(json.dumps(kload.load({str(src)!r}).twice(torch.ones(1)).tolist()))
    """)
    assert out == [3.0]


def test_several_translation_units_share_one_library(tmp_path):
    write(tmp_path / "defs.cpp", """\
        #include <kload/kernel.h>
        KLOAD_LIBRARY(m) {
          m.def("neg(Tensor x) -> Tensor");
          m.def("plus_one(Tensor x) -> Tensor");
        }
    """)
    write(tmp_path / "neg.cpp", """\
        #include <kload/kernel.h>
        #include <ATen/ops/neg.h>
        static at::Tensor neg_cpu(const at::Tensor& x) { return at::neg(x); }
        KLOAD_IMPL(CPU, m) { m.impl("neg", &neg_cpu); }
    """)
    write(tmp_path / "plus.cpp", """\
        #include <kload/kernel.h>
        #include <ATen/ops/add.h>
        static at::Tensor plus_cpu(const at::Tensor& x) { return at::add(x, 1); }
        KLOAD_IMPL(CPU, m) { m.impl("plus_one", &plus_cpu); }
    """)
    ops = kload.load(tmp_path / "defs.cpp", tmp_path / "neg.cpp", tmp_path / "plus.cpp", name="multi")
    x = torch.arange(3.0)
    torch.testing.assert_close(ops.neg(x), -x)
    torch.testing.assert_close(ops.plus_one(x), x + 1)
    assert ops.names() == ["neg", "plus_one"]


def test_load_inline_same_entry_from_anywhere(tmp_path):
    src = VECTOR_ADD.replace('#include "scale.h"', "#define SCALE 1.0f")
    src = textwrap.dedent(src)
    ops = kload.load_inline(name="inline_vadd", cpp_sources=src)
    torch.testing.assert_close(ops.vector_add(torch.ones(2), torch.ones(2)), torch.full((2,), 2.0))
    out = run_py(f"""
        import json, kload
        print(json.dumps(kload.load_inline(name="inline_vadd", cpp_sources={src!r}).build()))
    """, cwd=tmp_path)
    assert out == ops.build()


def test_cuda_sources_without_cuda_build_cpu_part(tmp_path, caplog):
    if torch.version.cuda is not None:
        pytest.skip("this torch has CUDA: the .cu is built, covered by benchmarks/gpu.sh")
    write(tmp_path / "scale.h", "#define SCALE 1.0f\n")
    write(tmp_path / "dual.cpp", VECTOR_ADD)
    write(tmp_path / "dual_cuda.cu", """\
        #include <kload/kernel.h>
        __global__ void k(float* x) { x[threadIdx.x] = 0; }
        at::Tensor vector_add_cuda(const at::Tensor& a, const at::Tensor& b) { return a; }
        KLOAD_IMPL(CUDA, m) { m.impl("vector_add", &vector_add_cuda); }
    """)
    ops = kload.load(tmp_path / "dual.cpp", tmp_path / "dual_cuda.cu")
    with caplog.at_level("WARNING", logger="kload"):
        torch.testing.assert_close(ops.vector_add(torch.ones(2), torch.ones(2)), torch.full((2,), 2.0))
    assert any("CPU only" in r.message and "without CUDA" in r.message for r in caplog.records)
    qual = f"{ops.namespace}::vector_add"
    assert torch._C._dispatch_has_kernel_for_dispatch_key(qual, "CUDA"), "a CUDA kernel that explains"
    manifest = json.loads((Path(ops.build()).parent / "manifest.json").read_text())
    assert manifest["cuda_built"] is False and "without CUDA" in manifest["cuda_skipped"]


# -- concurrency and reload -------------------------------------------------------------

def test_two_processes_racing_on_a_cold_entry_compile_once(tmp_path, cxx_wrapper):
    cxx, log = cxx_wrapper
    write(tmp_path / "scale.h", "#define SCALE 3.0f\n")
    src = write(tmp_path / "race.cpp", VECTOR_ADD)
    code = textwrap.dedent(f"""
        import json, torch, kload
        ops = kload.load({str(src)!r})
        print(json.dumps({{"out": ops.vector_add(torch.ones(2), torch.ones(2)).tolist(), "path": ops.build()}}))
    """)
    env = dict(os.environ, CXX=str(cxx))
    before = compiles(log, "race.cpp")  # the wrapper's log is the session's: count from here
    procs = [subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True, env=env) for _ in range(2)]
    results = []
    for p in procs:
        out, err = p.communicate(timeout=600)
        assert p.returncode == 0, err
        results.append(json.loads(out.strip().splitlines()[-1]))
    assert results[0] == results[1] and results[0]["out"] == [6.0, 6.0]
    assert compiles(log, "race.cpp") == before + 1


def test_reload_op_library_in_one_process(vadd_dir):
    src = vadd_dir / "vadd.cpp"
    first = kload.load(src)
    x = torch.ones(2)
    assert first.vector_add(x, x).tolist() == [2.0, 2.0]
    write(src, VECTOR_ADD.replace("SCALE * (pa[i] + pb[i])", "SCALE * (pa[i] - pb[i]) + 7"))
    second = kload.load(src)
    assert second.vector_add(x, x).tolist() == [7.0, 7.0]
    assert second.namespace != first.namespace
    assert first.vector_add(x, x).tolist() == [2.0, 2.0], "the old build keeps working"


def test_reload_pybind_module_in_one_process(tmp_path):
    code = """\
        #include <pybind11/pybind11.h>
        int answer() { return %d; }
        PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def("answer", &answer); }
    """
    src = write(tmp_path / "answer.cpp", code % 1)
    assert kload.load(src).answer() == 1
    write(src, code % 2)
    assert kload.load(src).answer() == 2


def test_kernel_header_is_aten_without_python(tmp_path):
    """<kload/kernel.h> is ATen's whole C++ API, but not torch/extension.h, pybind11 or
    Python (those cost another ~20 s a compile and are not needed for an op)."""
    from torch.utils.cpp_extension import include_paths

    from kload.options import include_dir

    probe = write(tmp_path / "probe.cpp", "#include <kload/kernel.h>\n")
    flags = ["-std=c++20", "-M", f"-I{include_dir()}"] + [f"-I{p}" for p in include_paths()]
    deps = subprocess.run(["c++", *flags, str(probe)], capture_output=True, text=True, check=True).stdout
    assert "torch/extension.h" not in deps and "pybind11" not in deps and "Python.h" not in deps
    assert "torch/library.h" in deps and "ATen/ATen.h" in deps and "ATen/Parallel.h" in deps


def test_header_rewrite_with_same_size_and_mtime_is_still_seen(vadd_dir):
    """The stat fast path must not trust mtime: a same-size edit with its mtime put
    back changes ctime, so the header is hashed and the edit is seen."""
    src = str(vadd_dir / "vadd.cpp")
    probe = """
        import json, torch, kload
        print(json.dumps(kload.load({src!r}).vector_add(torch.ones(1), torch.ones(1)).tolist()))
    """.format(src=src)
    header = vadd_dir / "scale.h"
    assert run_py(probe) == [2.0]
    st = header.stat()
    header.write_text("#define SCALE 5.0f\n")  # same length as "1.0f"
    os.utime(header, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert header.stat().st_size == st.st_size and header.stat().st_mtime_ns == st.st_mtime_ns
    assert run_py(probe) == [10.0]


RACY = """\
    #include <kload/stable.h>
    #include "factor.h"
    kload::Tensor racy(const kload::Tensor& x) {
      kload::Tensor xc = kload::as_contiguous(x), out = kload::empty_like(xc);
      for (int64_t i = 0; i < xc.numel(); ++i) out.mutable_data_ptr<float>()[i] = FACTOR * xc.const_data_ptr<float>()[i];
      return out;
    }
    KLOAD_LIBRARY(m) { m.def("racy(Tensor x) -> Tensor"); }
    KLOAD_IMPL(CPU, m) { m.impl("racy", TORCH_BOX(&racy)); }
"""


def test_a_header_saved_during_the_build_is_not_cached_under_its_new_bytes(tmp_path):
    # Its own builds: a compiler that saves the header right after it read it (a user's save
    # during a build) cannot be shared. Without the "too new" rule the entry's key said 3.0
    # (the header hashed after the build) and its code 2.0: every later process got 2.0. The
    # header lives in an -I directory, which a first build does not watch: the handle learns
    # of the save from its build alone.
    inc, header = tmp_path / "inc", tmp_path / "inc" / "factor.h"
    write(header, "#define FACTOR 2.0f\n")
    src = write(tmp_path / "src" / "racy.cpp", RACY)
    flag, log = tmp_path / "save-now", tmp_path / "calls.log"
    cxx = write(tmp_path / "saving-c++", f"""\
        #!/bin/sh
        echo "$*" >> "{log}"
        c++ "$@"; rc=$?
        case "$*" in *racy.cpp*) if [ -e "{flag}" ]; then rm "{flag}"
          if [ -n "$SAVE" ]; then echo "$SAVE" > "{header}"; else rm "{header}"; fi; fi ;; esac
        exit $rc
    """)
    cxx.chmod(0o755)
    flag.touch()
    env = {"CXX": str(cxx), "KLOAD_CACHE_DIR": str(tmp_path / "cache"), "SAVE": "#define FACTOR 3.0f"}
    probe = f"""
        import json, torch, kload
        ops = kload.load({str(src)!r}, extra_include_paths=[{str(inc)!r}], reload=True)
        first, path = ops.racy(torch.ones(2)).tolist(), ops.build()
        print(json.dumps({{"out": [first, ops.racy(torch.ones(2)).tolist()], "path": [path, ops.build()]}}))
    """
    proc = run_code(probe, env=env)
    during = last_json(proc)
    assert not flag.exists(), "the compiler saved the header"
    # what it compiled ran first; the handle knew the build stood for no file's bytes and built again
    assert during["out"] == [[2.0, 2.0], [3.0, 3.0]]
    assert "factor.h changed while racy compiled; this build is not reused" in proc.stderr, proc.stderr
    assert compiles(log, "racy.cpp") == 2
    after = run_py(probe, env=env)  # a fresh process: the second build, from the cache
    assert after["out"] == [[3.0, 3.0], [3.0, 3.0]], "the header's new bytes must reach the binary"
    assert after["path"] == [during["path"][1]] * 2 and compiles(log, "racy.cpp") == 2
    # a prebuild during which the header is saved caches nothing usable: it fails, and says why
    write(header, "#define FACTOR 4.0f\n")
    flag.touch()
    cli = kload_cli("build", src, "-I", inc, env={**env, "SAVE": "#define FACTOR 5.0f"})
    assert cli.returncode == 1 and "factor.h changed while it compiled; nothing usable was cached" in cli.stderr
    # no new compile: the flagged builds as explain and export see them. explain names the file
    # saved mid-build (the nearest build is that one); export takes the one good build only
    why = kload_cli("explain", src, "-I", inc, env=env)
    assert why.returncode == 0 and f"{header} was saved while the last build compiled" in why.stdout, why.stdout
    bundle = tmp_path / "racy.tar"
    good = Path(during["path"][1]).parent.name
    for which in ("racy", "--all"):  # (cache push takes entries the same way)
        out = kload_cli("cache", "export", which, "-o", bundle, env=env)
        assert out.returncode == 0 and out.stdout.count("exported ") == 1, out.stdout + out.stderr
        assert f"exported {good} " in out.stdout, out.stdout
    # a header deleted during the build (a branch switch): the compiler read it, no file has those
    # bytes now; the build says so and caches nothing usable (one more ~1.5 s stable-ABI compile,
    # into a cache of its own, where racy then has no build to export)
    write(header, "#define FACTOR 6.0f\n")
    flag.touch()
    alone = {**env, "KLOAD_CACHE_DIR": str(tmp_path / "alone")}
    gone = kload_cli("build", src, "-I", inc, env={**alone, "SAVE": ""})
    assert not header.exists(), "the compiler deleted the header"
    assert gone.returncode == 1 and "factor.h changed while it compiled" in gone.stderr, gone.stdout + gone.stderr
    none = kload_cli("cache", "export", "racy", "-o", bundle, env=alone)
    assert none.returncode != 0 and "every build of racy" in none.stderr, none.stdout + none.stderr
    none = kload_cli("cache", "export", "--all", "-o", bundle, env=alone)
    assert none.returncode != 0 and "no library entry to export" in none.stderr, none.stdout + none.stderr


def test_a_function_aten_lacks_is_a_compile_error_at_its_line(tmp_path):
    src = write(tmp_path / "needs_ops.cpp", """\
        #include <kload/kernel.h>
        at::Tensor twin(const at::Tensor& a) { return at::no_such_function(a); }
        KLOAD_LIBRARY(m) { m.def("twin(Tensor a) -> Tensor"); }
        KLOAD_IMPL(CPU, m) { m.impl("twin", &twin); }
    """)
    with pytest.raises(kload.CompileError, match=r"needs_ops.cpp:2:.*no_such_function.*\n.*return at::no_such") as e:
        kload.load(src).twin
    assert "hint" not in str(e.value)  # kernel.h has the whole API: nothing to add


@pytest.mark.slow
def test_hit_record_serves_fresh_processes_and_any_edit_voids_it(vadd_dir, kload_cache):
    """A fresh process finds its entry through the hit record (nothing of kload but
    the hit path is imported); a same-size edit with its mtime put back, or a
    damaged record, goes the full way and still gives the right answer."""
    src = str(vadd_dir / "vadd.cpp")
    probe = """
        import json, sys, torch, kload
        out = kload.load({src!r}).vector_add(torch.ones(1), torch.ones(1)).tolist()
        print(json.dumps({{"out": out, "full": "kload.plan" in sys.modules,
                           "modules": sorted(m for m in sys.modules if m.startswith("kload"))}}))
    """.format(src=src)
    hits = kload_cache / "hits"
    before = set(hits.glob("vadd-*.json")) if hits.exists() else set()
    first = run_py(probe)  # builds, then records it (if the files are past the racy window by then)
    assert first["out"] == [2.0] and first["full"]
    time.sleep(2.2)  # past the racy window (RACY_NS) in any case
    second = run_py(probe)  # the record, or the full lookup, which then writes it
    assert second["out"] == [2.0]
    records = set(hits.glob("vadd-*.json")) - before
    assert len(records) == 1
    third = run_py(probe)
    assert third["out"] == [2.0] and not third["full"], "the record serves a fresh process"
    assert third["modules"] == ["kload", "kload.cache", "kload.doors", "kload.doors.handle", "kload.knobs",
                                "kload.messages", "kload.options", "kload.reloading", "kload.resolve",
                                "kload.resolve.library"]  # 10, as before the folders (docs/design.md)

    header = vadd_dir / "scale.h"
    st = header.stat()
    header.write_text("#define SCALE 5.0f\n")  # same length as "1.0f", mtime put back
    os.utime(header, ns=(st.st_atime_ns, st.st_mtime_ns))
    edited = run_py(probe)
    assert edited["out"] == [10.0] and edited["full"], "a changed ctime voids the record"

    time.sleep(2.2)
    run_py(probe)  # the record for the edited header exists after this run at the latest
    record = records.pop()
    good = json.loads(record.read_text())
    assert not run_py(probe)["full"]
    for bad in ("{not json", json.dumps({**good, "files": 3}), json.dumps({**good, "entry": "../../x"}),
                json.dumps({**good, "files": [["/nonexistent", [1, 2]]]})):
        record.write_text(bad)
        damaged = run_py(probe)
        assert damaged["out"] == [10.0] and damaged["full"], bad
