"""kload.cpp_extension: torch.utils.cpp_extension's load / load_inline, through kload.
Every build is real; the comparisons run torch's own loader on the same sources.
Precompiled headers are off in the subprocesses here (KLOAD_PCH=0): these tests are
about the front door, and a background <torch/extension.h> PCH would only compete
for the two cores."""
from __future__ import annotations

import inspect
import json
import os
import re

import pytest
import torch.utils.cpp_extension as torch_ext

import kload
import kload.cpp_extension as kce

from conftest import EXAMPLES, compiler_running, compiles, run_py, write

NO_PCH = {"KLOAD_PCH": "0"}

MULADD = """\
    // after pytorch/extension-cpp's muladd.cpp, CPU part (plain TORCH_LIBRARY; at::empty for
    // torch::empty, which needs <torch/all.h>)
    #include <ATen/Operators.h>
    #include <ATen/ops/empty.h>
    #include <torch/library.h>
    #include <Python.h>
    namespace extension_cpp {
    at::Tensor mymuladd_cpu(const at::Tensor& a, const at::Tensor& b, double c) {
      TORCH_CHECK(a.sizes() == b.sizes());
      at::Tensor a_contig = a.contiguous(), b_contig = b.contiguous();
      at::Tensor result = at::empty(a_contig.sizes(), a_contig.options());
      const float* a_ptr = a_contig.data_ptr<float>();
      const float* b_ptr = b_contig.data_ptr<float>();
      float* result_ptr = result.data_ptr<float>();
      for (int64_t i = 0; i < result.numel(); i++) result_ptr[i] = a_ptr[i] * b_ptr[i] + c;
      return result;
    }
    TORCH_LIBRARY(NS, m) { m.def("mymuladd(Tensor a, Tensor b, float c) -> Tensor"); }
    TORCH_LIBRARY_IMPL(NS, CPU, m) { m.impl("mymuladd", &mymuladd_cpu); }
    }
"""

INLINE_CPP = """\
at::Tensor sin_add(at::Tensor x, at::Tensor y) {
  TORCH_CHECK(x.sizes() == y.sizes(), "sin_add: shapes differ");
  return x.sin() + y.sin();
}
"""


def test_signatures_are_the_installed_torchs():
    assert inspect.signature(kce.load) == inspect.signature(torch_ext.load)
    assert inspect.signature(kce.load_inline) == inspect.signature(torch_ext.load_inline)
    with pytest.raises(TypeError, match="load\\(\\) got an unexpected keyword argument 'extra_cxxflags'"):
        kce.load(name="x", sources=["x.cpp"], extra_cxxflags=["-O3"])
    with pytest.raises(TypeError, match="missing a required argument: 'sources'"):
        kce.load("x")


def test_patch_and_unpatch_swap_torchs_functions():
    original = torch_ext.load
    kload.patch()
    try:
        assert torch_ext.load is not original and kce.is_patched()
        assert torch_ext.load.__kload_wraps__ is original
        assert torch_ext._kload_torch_load is original  # what kload's builds call, whatever wraps load
        assert inspect.signature(torch_ext.load) == inspect.signature(original)
        kload.patch()  # twice: still one layer
        assert torch_ext.load.__kload_wraps__ is original
    finally:
        kload.unpatch()
    assert torch_ext.load is original and torch_ext.load_inline is kce.TORCH_LOAD_INLINE


COMPARE = """
    import json, os, sys, torch
    import torch.utils.cpp_extension as ext
    if {use_kload}:
        import kload.cpp_extension as ext
    out = {{}}
    m = ext.load_inline(name="sin_add_ext", cpp_sources={inline!r}, functions={{"sin_add": "sine sum"}},
                        build_directory={bd1!r})
    x = torch.arange(4.)
    out["inline_type"] = type(m).__name__
    out["inline_value"] = m.sin_add(x, x).tolist()
    out["inline_doc"] = m.sin_add.__doc__.strip().splitlines()[-1]
    out["inline_file"] = os.path.basename(m.__file__)
    try:
        m.sin_add(x, torch.ones(2))
    except Exception as e:
        out["inline_error"] = [type(e).__name__, "sin_add: shapes differ" in str(e)]
    path = ext.load(name="muladd_ext", sources=[{src!r}], is_python_module=False, build_directory={bd2!r})
    out["path_type"] = type(path).__name__
    out["path"] = path
    out["path_exists"] = os.path.isfile(path)
    out["op"] = torch.ops.kload_cmp.mymuladd(x, x, 1.0).tolist()
    # loading the returned path again, as some code does, is harmless (torch's loader does the same)
    torch.ops.load_library(path)
    out["op_again"] = torch.ops.kload_cmp.mymuladd(x, x, 2.0).tolist()
    print(json.dumps(out))
"""


@pytest.mark.slow
def test_is_python_module_false_and_functions_behave_as_torchs(tmp_path):
    src = write(tmp_path / "muladd.cpp", MULADD.replace("NS", "kload_cmp"))
    results = {}
    for who in ("torch", "kload"):
        bd1, bd2 = tmp_path / who / "inline", tmp_path / who / "muladd"
        bd1.mkdir(parents=True), bd2.mkdir(parents=True)  # torch's loader wants them to exist
        code = COMPARE.format(use_kload=who == "kload", inline=INLINE_CPP, bd1=str(bd1), bd2=str(bd2), src=str(src))
        results[who] = run_py(code, env={**NO_PCH, "TORCH_EXTENSIONS_DIR": str(tmp_path / "torch_ext"),
                                         "TORCH_NO_COMPILER_WRAPPER": "1"})
    t, k = results["torch"], results["kload"]
    assert t["path"] == str(tmp_path / "torch" / "muladd" / "muladd_ext.so")
    assert k["path"] == str(tmp_path / "kload" / "muladd" / "muladd_ext.so")  # placed where torch puts it
    for r in (t, k):
        r.pop("path")
    assert k == t
    assert t["inline_type"] == "module" and t["inline_doc"] == "sine sum" and t["path_type"] == "str"
    assert t["inline_error"] == ["RuntimeError", True]  # with_pytorch_error_handling: c10::Error -> RuntimeError


@pytest.mark.slow
def test_patched_torch_loader_gets_kloads_cache_hits_edits_and_errors(tmp_path, cxx_wrapper):
    """kload's own loader checks, for the classic style, through an unmodified call of
    torch.utils.cpp_extension.load (the tutorial's code; torch's own loader cannot even
    compile it: CHECK_INPUT is not defined)."""
    script, log = cxx_wrapper
    src = tmp_path / "my_ops.cpp"
    src.write_text((EXAMPLES / "tutorial_my_ops.cpp").read_text().replace(
        "#include <torch/extension.h>", '#include <torch/extension.h>\n#include "scale.h"'
    ).replace("return a + b;", "return (a + b) * SCALE;"))
    write(tmp_path / "scale.h", "#define SCALE 1\n")
    code = f"""
        import json, torch, kload
        from torch.utils.cpp_extension import load   # bound after the patch: KLOAD_PATCH_TORCH=1
        m = load(name="my_ops", sources=[{str(src)!r}], extra_cflags=["-O2"])
        print(json.dumps({{"out": m.vector_add(torch.ones(3), torch.ones(3)).tolist(),
                          "how": [h["how"] for h in kload.HISTORY], "patched": kload.cpp_extension.is_patched()}}))
    """
    env = {**NO_PCH, "KLOAD_PATCH_TORCH": "1", "CXX": str(script)}
    before = compiles(log, str(src))  # the wrapper's log is the session's: count from here
    first = run_py(code, env=env)
    assert first == {"out": [2.0, 2.0, 2.0], "how": ["built"], "patched": True}
    n = compiles(log, str(src))
    assert n == before + 1
    # a fresh process: a cache hit, no compiler run
    assert run_py(code, env=env) == {"out": [2.0, 2.0, 2.0], "how": ["cache"], "patched": True}
    assert compiles(log, str(src)) == n
    # a header edit (torch's loader rebuilds only on the sources' own hashes): rebuilt
    write(tmp_path / "scale.h", "#define SCALE 3\n")
    assert run_py(code, env=env)["out"] == [6.0, 6.0, 6.0]
    # a compile error: kload's CompileError, a RuntimeError as torch's is, with file:line; nothing cached
    good = src.read_text()
    src.write_text(good.replace("return (a + b) * SCALE;", "return a.no_such_method(b);"))
    bad = run_py(code.replace('m = load(', 'try:\n            m = load(').replace(
        'extra_cflags=["-O2"])', 'extra_cflags=["-O2"])\n        except RuntimeError as e:\n'
        '            print(json.dumps({"error": type(e).__name__, "text": str(e)})); raise SystemExit\n'
    ), env=env)
    assert bad["error"] == "CompileError" and "my_ops.cpp:" in bad["text"] and "no_such_method" in bad["text"]
    src.write_text(good)
    assert run_py(code, env=env)["how"] == ["cache"]  # the good build is still there


@pytest.mark.slow
def test_build_then_load_works_for_every_style(tmp_path):
    """handle.build() compiles (and, as torch's loader does, leaves the library loaded);
    load() afterwards binds the ops, in one process, for every binding style."""
    write(tmp_path / "oplib.cpp", """\
        #include <kload/kernel.h>
        at::Tensor twice(const at::Tensor& x) { return x * 2; }
        KLOAD_LIBRARY(m) { m.def("twice(Tensor x) -> Tensor"); }
        KLOAD_IMPL(CPU, m) { m.impl("twice", &twice); }
    """)
    write(tmp_path / "pybind.cpp", (EXAMPLES / "tutorial_my_ops.cpp").read_text())
    write(tmp_path / "fixed.cpp", MULADD.replace("NS", "kload_btl"))
    write(tmp_path / "stable.cpp", """\
        #include <kload/stable.h>
        using kload::Tensor;
        Tensor twice(const Tensor& x) {
          Tensor out = torch::stable::empty_like(x);
          for (int64_t i = 0; i < x.numel(); ++i) out.mutable_data_ptr<float>()[i] = 2 * x.const_data_ptr<float>()[i];
          return out;
        }
        KLOAD_LIBRARY(m) { m.def("twice(Tensor x) -> Tensor"); }
        KLOAD_IMPL(CPU, m) { m.impl("twice", TORCH_BOX(&twice)); }
    """)
    write(tmp_path / "stable_fixed.cpp", """\
        #include <torch/csrc/stable/library.h>
        #include <torch/csrc/stable/ops.h>
        using torch::stable::Tensor;
        Tensor same(const Tensor& x) { Tensor out = torch::stable::empty_like(x); torch::stable::copy_(out, x); return out; }
        STABLE_TORCH_LIBRARY(kload_btl_st, m) { m.def("same(Tensor x) -> Tensor"); }
        STABLE_TORCH_LIBRARY_IMPL(kload_btl_st, CPU, m) { m.impl("same", TORCH_BOX(&same)); }
    """)
    out = run_py(f"""
        import json, os, torch, kload
        x, res = torch.arange(3.), {{}}
        calls = {{"oplib": lambda h: h.twice(x), "pybind": lambda h: h.vector_add(x, x),
                 "fixed": lambda h: h.mymuladd(x, x, 0.0), "stable": lambda h: h.twice(x),
                 "stable_fixed": lambda h: h.same(x)}}
        for style, call in calls.items():
            h = kload.load(os.path.join({str(tmp_path)!r}, style + ".cpp"), reload=False)
            path = h.build()
            how = kload.HISTORY[-1]["how"]
            h.load()
            res[style] = [how, os.path.isfile(path), call(h).tolist()]
        # a second library defining an op of a namespace this process has: refused, no crash
        other = os.path.join({str(tmp_path)!r}, "again", "fixed.cpp")
        os.makedirs(os.path.dirname(other))
        open(other, "w").write(open(os.path.join({str(tmp_path)!r}, "fixed.cpp")).read().replace("* b_ptr", "+ b_ptr"))
        try:
            kload.load(other, reload=False).load()
            res["second_owner"] = None
        except kload.KloadError as e:
            res["second_owner"] = "kload_btl" in str(e)
        print(json.dumps(res))
    """, env=NO_PCH)
    want = [0.0, 2.0, 4.0]
    for style in ("oplib", "pybind", "fixed", "stable", "stable_fixed"):
        assert out[style][:2] == ["built", True], style
    assert out["oplib"][2] == out["pybind"][2] == out["stable"][2] == want
    assert out["fixed"][2] == [0.0, 1.0, 4.0] and out["stable_fixed"][2] == [0.0, 1.0, 2.0]
    assert out["second_owner"] is True


STANDALONE = """\
    #include <ATen/ATen.h>
    #include <iostream>
    int main() { std::cout << at::arange(4).sum().item<int64_t>() << std::endl; return 0; }
"""


def test_is_standalone_builds_an_executable_in_the_cache(tmp_path):
    import subprocess

    src = write(tmp_path / "tool.cpp", STANDALONE)
    path = kce.load(name="tool", sources=[str(src)], is_standalone=True, build_directory=str(tmp_path / "bd"))
    assert path == str(tmp_path / "bd" / "tool") and os.access(path, os.X_OK)
    assert subprocess.run([path], capture_output=True, text=True, check=True).stdout.strip() == "6"
    # again: found in the cache, not built
    before = len(kload.HISTORY)
    assert kce.load(name="tool", sources=[str(src)], is_standalone=True).endswith("/tool")
    assert [h["how"] for h in kload.HISTORY[before:]] == ["cache"]


def test_unsupported_sources_go_to_torchs_loader(tmp_path, caplog):
    src = write(tmp_path / "k.sycl", "int main() {}\n")
    with pytest.raises(OSError, match="SYCL runtime"):  # torch's own answer on a machine without SYCL
        kce.load(name="sy", sources=[str(src)])
    assert "'sy' goes to torch's own loader, which builds what kload does not: .sycl sources" in caplog.text


def test_max_jobs_follow_free_memory_and_cores():
    from kload.compile.compilers import JOB_MEMORY, choose_jobs

    gb = 1 << 30
    assert choose_jobs(64 * gb, 16, JOB_MEMORY["full"], 40) == 16          # cores bound
    assert choose_jobs(3.5 * gb, 16, JOB_MEMORY["full"], 40) == 2          # memory bound: 3.5 / 1.6
    assert choose_jobs(0.5 * gb, 16, JOB_MEMORY["full"], 40) == 1          # never zero
    assert choose_jobs(None, 4, JOB_MEMORY["full"], 2) == 2                # no more than the sources
    assert choose_jobs(3.5 * gb, 16, JOB_MEMORY["stable"], 40) == 8        # light TUs: more at once


def test_unset_max_jobs_is_chosen_and_said(tmp_path):
    src = write(tmp_path / "jobs.cpp", """\
        #include <kload/kernel.h>
        at::Tensor thrice(const at::Tensor& x) { return x * 3; }
        KLOAD_LIBRARY(m) { m.def("thrice(Tensor x) -> Tensor"); }
        KLOAD_IMPL(CPU, m) { m.impl("thrice", &thrice); }
    """)
    out = run_py(f"""
        import json, logging, os, torch, kload
        said = []
        class Keep(logging.Handler):
            def emit(self, record):
                said.append(record.getMessage())
        logging.getLogger("kload").addHandler(Keep())
        logging.getLogger("kload").setLevel(logging.INFO)
        h = kload.load({str(src)!r}, reload=False)
        print(json.dumps({{"out": h.thrice(torch.ones(1)).tolist(), "max_jobs": os.environ.get("MAX_JOBS"),
                          "said": [s for s in said if s.startswith("kload: building jobs")]}}))
    """, env={"MAX_JOBS": "", **NO_PCH})  # empty: unset for kload and torch
    assert out["out"] == [3.0] and out["max_jobs"] == ""  # chosen for the build only
    assert len(out["said"]) == 1
    # two translation units (the source and kload's namespace file), two cores here
    m = re.fullmatch(r"kload: building jobs \((\d+) jobs?, [0-9.]+ GB free\)", out["said"][0])
    assert m and 1 <= int(m[1]) <= min(2, len(os.sched_getaffinity(0)))


@pytest.mark.slow
def test_kload_ide_lets_clangd_resolve_kernel_and_torch_headers(tmp_path):
    import shutil
    import subprocess
    import sys

    clangd = shutil.which("clangd")
    if clangd is None:
        pytest.skip("clangd is not installed (make test installs Debian's clangd when it runs as root)")
    src = tmp_path / "vector_add.cpp"
    src.write_text((EXAMPLES / "vector_add.cpp").read_text())
    env = dict(os.environ, KLOAD_PCH="0")
    # no compilation database yet: clangd cannot find <kload/kernel.h>
    before = subprocess.run([clangd, f"--check={src}"], capture_output=True, text=True, cwd=tmp_path, timeout=300)
    assert "'kload/kernel.h' file not found" in before.stderr
    cli = subprocess.run([sys.executable, "-m", "kload", "ide", str(src)], capture_output=True, text=True, env=env,
                         timeout=600)
    assert cli.returncode == 0, cli.stderr
    db = json.loads((tmp_path / "compile_commands.json").read_text())
    assert [c["file"] for c in db] == [str(src)]
    assert not any("--param" in a or "/entries/pch-" in a for a in db[0]["arguments"])
    after = subprocess.run([clangd, f"--check={src}"], capture_output=True, text=True, cwd=tmp_path, timeout=300)
    assert "All checks completed, 0 errors" in after.stderr, after.stderr[-3000:]
    assert "file not found" not in after.stderr
    # a second library's commands merge in; the first one's stay
    other = write(tmp_path / "other.cpp", (EXAMPLES / "vector_add.cpp").read_text())
    assert subprocess.run([sys.executable, "-m", "kload", "ide", str(other)], env=env, timeout=600).returncode == 0
    files = sorted(c["file"] for c in json.loads((tmp_path / "compile_commands.json").read_text()))
    assert files == sorted([str(src), str(other)])


def test_a_killed_build_through_the_patched_loader_blocks_nobody(tmp_path):
    """torch's own loader leaves its lock file behind when a build is killed, and every
    later run waits on it for ever (pytorch#189245). Patched, the lock dies with its process."""
    import signal
    import subprocess
    import sys
    import textwrap
    import time

    from conftest import last_json, run_code, tiny

    cache = tmp_path / "cache"
    src = tiny(tmp_path, "killed_ext", factor=4)
    code = f"""
        import json, logging, torch, kload
        logging.basicConfig(level=logging.WARNING)
        from torch.utils.cpp_extension import load
        ops = load(name="killed_ext", sources=[{str(src)!r}])   # an op library: a handle
        print(json.dumps({{"out": ops.killed_ext(torch.ones(2)).tolist()}}))
    """
    env = dict(os.environ, KLOAD_CACHE_DIR=str(cache), KLOAD_PATCH_TORCH="1", **NO_PCH)
    victim = subprocess.Popen([sys.executable, "-c", textwrap.dedent(code)], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    deadline = time.time() + 120
    while not compiler_running(cache / "build"):  # ninja and the compiler are running
        assert victim.poll() is None, "the build finished before it could be killed"
        assert time.time() < deadline, "no compiler started"
        time.sleep(0.05)
    victim.send_signal(signal.SIGKILL)
    victim.wait()
    started = time.time()
    proc = run_code(code, {"KLOAD_CACHE_DIR": str(cache), "KLOAD_PATCH_TORCH": "1", **NO_PCH}, timeout=300)
    assert last_json(proc) == {"out": [4.0, 4.0]}
    assert "interrupted" in proc.stderr and time.time() - started < 300


@pytest.mark.slow
def test_kload_ide_line_magic_writes_the_database(tmp_path):
    """%kload ide, in an IPython shell of its own process (an IPython shell in the test
    process would turn on reload-on-save for every later test's handles)."""
    pytest.importorskip("IPython")
    src = tmp_path / "axpy.cpp"
    src.write_text((EXAMPLES / "vector_add.cpp").read_text())
    out = run_py(f"""
        import io, json, contextlib
        from IPython.core.interactiveshell import InteractiveShell
        from kload.doors.magic import CellError, KloadMagics
        shell = InteractiveShell.instance()
        shell.register_magics(KloadMagics)  # what %load_ext kload registers, without its background precompiles
        said = io.StringIO()
        with contextlib.redirect_stdout(said):
            shell.run_line_magic("kload", "ide {src}")
        try:
            shell.run_line_magic("kload", "ide")
            err = None
        except CellError as e:
            err = str(e)
        print(json.dumps({{"said": said.getvalue(), "err": err}}))
    """, env=NO_PCH)
    assert "1 compile command" in out["said"] and "%kload ide needs SOURCES" in out["err"]
    db = json.loads((tmp_path / "compile_commands.json").read_text())
    assert [c["file"] for c in db] == [str(src)]
    from kload.options import include_dir

    assert "-I" + str(include_dir()) in db[0]["arguments"]  # where <kload/kernel.h> is
