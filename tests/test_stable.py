"""Stable-ABI op libraries (kload/stable.h, STABLE_TORCH_LIBRARY): built for real,
loaded, reloaded in place, refused where torch would crash."""
from __future__ import annotations

import json
import subprocess
import textwrap
import time

import pytest
import torch

import kload
from kload.errors import CompileError, KloadError

from conftest import kload_cli, raises_in_child, run_py, write

SADD = """\
    #include <kload/stable.h>
    using kload::Tensor;

    Tensor sadd(const Tensor& a, const Tensor& b) {
      KLOAD_CHECK_CPU(a);
      kload::check_same(a, b, "sadd");
      Tensor ac = torch::stable::contiguous(a), bc = torch::stable::contiguous(b);
      Tensor out = torch::stable::empty_like(ac);
      const int64_t n = ac.numel();
      KLOAD_DISPATCH_FLOATING(ac.scalar_type(), "sadd", [&] {
        const scalar_t* pa = ac.const_data_ptr<scalar_t>();
        const scalar_t* pb = bc.const_data_ptr<scalar_t>();
        scalar_t* po = out.mutable_data_ptr<scalar_t>();
        torch::stable::parallel_for(0, n, 1 << 14, [&](int64_t b0, int64_t e0) {
          for (int64_t i = b0; i < e0; ++i) po[i] = pa[i] + pb[i] + OFFSET;
        });
      });
      return out;
    }

    KLOAD_LIBRARY(m) { m.def("sadd(Tensor a, Tensor b) -> Tensor"); }
    KLOAD_IMPL(CPU, m) { m.impl("sadd", TORCH_BOX(&sadd)); }
    """


def sadd_source(folder, offset=0, schema=None):
    text = SADD.replace("OFFSET", str(offset))
    if schema:
        text = text.replace('"sadd(Tensor a, Tensor b) -> Tensor"', f'"{schema}"')
    return write(folder / "sadd.cpp", text)


@pytest.fixture(scope="module")
def sadd(tmp_path_factory):
    src = sadd_source(tmp_path_factory.mktemp("stable"))
    h = kload.load(src, reload=False)
    h.load()
    return h, src


def test_builds_loads_and_runs_with_a_stable_key(sadd):
    h, _ = sadd
    a, b = torch.randn(1000), torch.randn(1000)
    torch.testing.assert_close(h.sadd(a, b), a + b)
    torch.testing.assert_close(h.sadd(a.double(), b.double()), (a + b).double())
    m = h._loaded.entry.manifest
    assert "stable" in m["style"] and m["stable_target"] == "2.10"
    assert m["namespace"] is None and h.namespace.startswith("kload_sadd_")
    inputs = m["inputs"]
    # keyed by the stable ABI version it targets, not by this torch build or this Python
    assert inputs["torch"]["stable_abi"] == "2.10" and "version" not in inputs["torch"]
    assert inputs["python"] is None
    assert "-DTORCH_TARGET_VERSION=0x020a000000000000" in inputs["cflags"]
    # what makes it version-independent, checked on the binary itself
    undefined = subprocess.run(["nm", "-D", "-C", "--undefined-only", str(h._loaded.entry.artifact)],
                               capture_output=True, text=True, check=True).stdout
    assert "aoti_torch_" in undefined
    assert not any(s in undefined for s in ("at::", "c10::", "torch::", "pybind11::", " Py"))
    needed = subprocess.run(["readelf", "-d", str(h._loaded.entry.artifact)], capture_output=True, text=True).stdout
    assert "libtorch_python" not in needed


def test_bad_inputs_raise_the_kernels_message(sadd):
    h, _ = sadd
    a = torch.randn(8)
    h.load()  # each check runs in a fork of this process (a crash fails the check, not the run)
    raises_in_child(lambda: h.sadd(a, torch.randn(3)), RuntimeError,
                    r"inputs must have the same shape, got \[8\] and \[3\]")
    raises_in_child(lambda: h.sadd(a, a.double()), RuntimeError, "inputs must have the same dtype, got Float and Double")
    raises_in_child(lambda: h.sadd(a.int(), a.int()), RuntimeError, r"\"sadd\" not implemented for 'Int'")
    # a device with no kernel: torch's own message, not a crash
    raises_in_child(lambda: h.sadd(a.to("meta"), a), RuntimeError, "no fake impl or Meta kernel registered")


def test_edit_reloads_in_place_and_a_schema_change_takes_a_new_namespace(tmp_path):
    src = sadd_source(tmp_path, offset=0)
    h = kload.load(src, name="sadd_live", reload=False)
    a, b = torch.randn(64), torch.randn(64)
    torch.testing.assert_close(h.sadd(a, b), a + b)
    ns = h.namespace
    op = getattr(getattr(torch.ops, ns), "sadd")  # what user code and compiled graphs hold

    sadd_source(tmp_path, offset=5)
    assert h.reload()
    assert h.namespace == ns                            # the same op name...
    torch.testing.assert_close(op(a, b), a + b + 5)    # ...runs the new kernel
    torch.testing.assert_close(h.sadd(a, b), a + b + 5)

    sadd_source(tmp_path, offset=7, schema="sadd(Tensor a, Tensor b, int k=0) -> Tensor")
    # the C++ signature must follow the schema: a compile-time mistake here would be a box error at call time
    text = (tmp_path / "sadd.cpp").read_text().replace("const Tensor& b)", "const Tensor& b, int64_t k)")
    (tmp_path / "sadd.cpp").write_text(text)
    assert h.reload()
    assert h.namespace != ns
    torch.testing.assert_close(h.sadd(a, b, 1), a + b + 7)
    torch.testing.assert_close(op(a, b), a + b + 5)    # the old name keeps the last build of that schema


def test_compile_error_names_file_and_line(tmp_path):
    src = write(tmp_path / "broken.cpp", SADD.replace("OFFSET", "undefined_thing"))
    with pytest.raises(CompileError) as e:
        kload.load(src, reload=False).load()
    assert any(d.file.endswith("broken.cpp") and d.line == 15 for d in e.value.diagnostics), e.value.diagnostics


def test_invalid_schema_is_a_clear_error(tmp_path):
    src = sadd_source(tmp_path, schema="sadd(Tensor a, Tensor b -> Tensor")
    # read by torch's parser before anything compiles: a CompileError at the m.def line
    with pytest.raises(kload.CompileError, match=r"sadd\.cpp:\d+:\d+: error: torch cannot parse this schema"):
        kload.load(src, name="sadd_bad_schema", reload=False).load()


def test_a_library_that_imports_torch_cpp_symbols_is_refused(tmp_path):
    write(tmp_path / "helper.h", """\
        #pragma once
        // torch's own headers refuse to be included beside TORCH_TARGET_VERSION; a
        // hand-written declaration still reaches into libtorch's C++ API
        namespace at { int get_num_threads(); }
        inline void helper(bool ok) { if (!ok) at::get_num_threads(); }
        """)
    src = write(tmp_path / "impure.cpp", '#include <kload/stable.h>\n#include "helper.h"\n'
                + textwrap.dedent(SADD).split("\n", 1)[1].replace("OFFSET", "0").replace(
                    "KLOAD_CHECK_CPU(a);", "KLOAD_CHECK_CPU(a); helper(true);"))
    with pytest.raises(KloadError, match="imports symbols of torch's C\\+\\+ API"):
        kload.load(src, reload=False).load()


def test_a_target_newer_than_this_torch_is_refused(tmp_path, monkeypatch):
    monkeypatch.setenv("KLOAD_STABLE_TARGET", "2.99")
    with pytest.raises(KloadError, match="built for torch 2.99 and later"):
        kload.load(sadd_source(tmp_path), name="sadd_future", reload=False).load()


FIXED = """\
    #include <torch/csrc/stable/library.h>
    #include <torch/csrc/stable/ops.h>
    using torch::stable::Tensor;
    Tensor twice(const Tensor& x) { Tensor out = torch::stable::empty_like(x); torch::stable::copy_(out, x); return out; }
    STABLE_TORCH_LIBRARY(NS, m) { m.def("twice(Tensor x) -> Tensor"); }
    STABLE_TORCH_LIBRARY_IMPL(NS, CPU, m) { m.impl("twice", TORCH_BOX(&twice)); }
    """


def test_plain_stable_torch_library_and_a_second_namespace_owner_is_refused_not_a_crash(tmp_path):
    # in a fresh process: torch 2.13/2.14 segfault when a second library defines the namespace
    write(tmp_path / "one.cpp", FIXED.replace("NS", "kload_fixed_st"))
    write(tmp_path / "two.cpp", FIXED.replace("NS", "kload_fixed_st").replace("twice(Tensor x)", "twice(Tensor y)"))
    out = run_py(f"""
        import json, torch, kload
        one = kload.load({str(tmp_path / 'one.cpp')!r}, reload=False).load()
        x = torch.arange(4.)
        ok = torch.equal(torch.ops.kload_fixed_st.twice(x), x)
        style = one._loaded.entry.manifest["style"]
        try:
            kload.load({str(tmp_path / 'two.cpp')!r}, reload=False).load()
            err = None
        except kload.KloadError as e:
            err = str(e)
        print(json.dumps({{"ok": ok, "style": style, "err": err}}))
        """)
    assert out["ok"] and out["style"] == "torch_library+stable"
    assert "already has operators in namespace 'kload_fixed_st'" in out["err"]


def test_cpu_only_key_differs_with_and_without_cuda_sources(tmp_path):
    if torch.version.cuda is not None:
        pytest.skip("a CUDA torch builds the .cu")
    from kload.cache.store import Store
    from kload.options import make_options, source_paths
    from kload.plan.plan import make_plan

    cpp = sadd_source(tmp_path)
    cu = write(tmp_path / "sadd_cuda.cu", "// no kernel yet\n")
    from kload import knobs

    store = Store(knobs.cache_dir())
    keys = {}
    for sources in ([cpp], [cpp, cu]):
        opts = make_options("sadd", source_paths(sources), None, None, None, None, False, False, False)
        keys[len(sources)] = make_plan(opts, store).skey
    assert keys[1] != keys[2]


def test_cache_info_shows_the_stable_target(sadd):
    h, _ = sadd
    proc = kload_cli("cache", "info", h._loaded.entry.key[:16])
    assert json.loads(proc.stdout)["stable_target"] == "2.10"


def test_stable_cells_in_a_notebook(tmp_path):
    import nbformat
    from test_live import run_notebook, texts

    C = nbformat.v4.new_code_cell
    body = ('kload::Tensor f(const kload::Tensor& x) {\n'
            '  kload::Tensor out = torch::stable::empty_like(x);\n'
            '  for (int64_t i = 0; i < x.numel(); ++i) out.mutable_data_ptr<float>()[i] = x.const_data_ptr<float>()[i] * FACTOR;\n'
            '  return out;\n'
            '}\n'
            'KLOAD_LIBRARY(m) { m.def("f(Tensor x) -> Tensor"); }\n'
            'KLOAD_IMPL(CPU, m) { m.impl("f", TORCH_BOX(&f)); }')
    nb = nbformat.v4.new_notebook()
    nb.cells = [
        C("import torch, kload\n%load_ext kload"),
        C("%%kload sc --stable\n" + body.replace("FACTOR", "2")),
        C("ns1 = sc.namespace\nprint('v1', sc.f(torch.ones(2)).tolist(), sc._loaded.entry.manifest['style'])"),
        C("%%kload sc\n" + body.replace("FACTOR", "10")),  # found to be stable from the code itself
        C("print('v2', sc.f(torch.ones(2)).tolist(), sc.namespace == ns1)"),
    ]
    run_notebook(nb, tmp_path)
    assert "v1 [2.0, 2.0] op_library+stable" in texts(nb.cells[2])
    assert "v2 [10.0, 10.0] True" in texts(nb.cells[4])  # in place: the same op names run the new code


def test_two_libraries_of_one_name_never_replace_each_others_kernels(tmp_path):
    # same name, same schema, different files: not an edit of one library
    one = kload.load(sadd_source(tmp_path / "one", offset=1), name="sadd_twin", reload=False)
    two = kload.load(sadd_source(tmp_path / "two", offset=2), name="sadd_twin", reload=False)
    a = torch.zeros(4)
    torch.testing.assert_close(one.sadd(a, a), a + 1)
    torch.testing.assert_close(two.sadd(a, a), a + 2)
    torch.testing.assert_close(one.sadd(a, a), a + 1)
    assert one.namespace != two.namespace


def test_a_fresh_process_loads_it_from_the_hit_record(sadd):
    h, src = sadd
    code = f"""
        import json, torch, kload
        from kload.doors.handle import HISTORY
        h = kload.load({str(src)!r}, reload=False)
        a = torch.ones(3)
        print(json.dumps({{"ok": torch.equal(h.sadd(a, a), a * 2), "how": HISTORY[-1]["how"],
                          "ns": h.namespace, "full": "kload.plan" in sys.modules}}))
        """.replace("import json,", "import json, sys,")
    time.sleep(2.2)  # past the hit record's racy window (RACY_NS) for the source as built
    out = run_py(code)  # the full lookup (a hit) writes the record, unless an earlier test did
    out = run_py(code)
    # the hit record served: the full lookup's modules (plan.py and what it imports) never loaded
    assert out["ok"] and out["how"] == "cache" and out["ns"] == h.namespace and not out["full"], out


def test_a_compiled_graph_holding_the_op_runs_the_new_kernel(tmp_path):
    src = sadd_source(tmp_path, offset=0)
    h = kload.load(src, name="sadd_graph", reload=False)
    op = getattr(torch.ops, h.namespace).sadd
    torch.library.register_fake(f"{h.namespace}::sadd", lambda a, b: torch.empty_like(a))  # for tracing
    fn = torch.compile(lambda a, b: op(a, b) * 1, backend="aot_eager", fullgraph=True)
    a = torch.ones(8)
    torch.testing.assert_close(fn(a, a), a * 2)
    sadd_source(tmp_path, offset=3)
    assert h.reload()
    torch.testing.assert_close(fn(a, a), a * 2 + 3)  # the same graph, no recompile: the new kernel
