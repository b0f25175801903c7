"""Live editing: reload on save, the %%kload magic in a real Jupyter kernel,
progress output, incremental rebuilds, debug builds. Every build compiles for real.
"""
from __future__ import annotations

from pathlib import Path

import nbformat
import pytest
import torch
from nbclient import NotebookClient

import kload

from conftest import EXAMPLES, compiles, last_json, run_code, run_py, tiny, write

OP = """\
    #include <kload/kernel.h>
    #include "factor.h"
    at::Tensor scale(const at::Tensor& x) {{ return x.mul(FACTOR); }}
    KLOAD_LIBRARY(m) {{ m.def("scale(Tensor x) -> Tensor"); }}
    KLOAD_IMPL(CPU, m) {{ m.impl("scale", &scale); }}
"""


def run_notebook(nb, cwd: Path):
    NotebookClient(nb, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(cwd)}}).execute()
    return nb


def texts(cell) -> str:
    out = []
    for o in cell.get("outputs", []):
        out.append(o.get("text") or o.get("data", {}).get("text/plain", "") or "\n".join(o.get("traceback", [])))
    return "\n".join(out)


# -- reload on save -------------------------------------------------------------------

RELOAD_SCRIPT = """
    import json, time, torch, kload
    from pathlib import Path
    d = Path({d!r})
    ops = kload.load(d / "scale.cpp", reload=True)

    def wait_stale(h, timeout=60):  # the watcher thread handled the save (an inotify event), not a fixed sleep:
        deadline = time.monotonic() + timeout  # it raised the flag, then dropped the ops (CI run 17 read one
        while not (h.__dict__["_reload"].stale and "scale" not in h.__dict__):  # between the two and got the old op)
            assert time.monotonic() < deadline, "the watcher never saw the edit"
            time.sleep(0.01)

    x = torch.ones(2)
    seen = [ops.scale(x).tolist()]
    fn_before = ops.scale
    same_op = ops.scale is getattr(torch.ops, ops.namespace).scale   # no wrapper on the call path
    (d / "factor.h").write_text("#define FACTOR 3.0\\n")              # a header edit
    wait_stale(ops)
    seen.append(ops.scale(x).tolist())
    (d / "factor.h").write_text("#define FACTOR oops(\\n")            # a broken edit
    wait_stale(ops)
    seen.append(ops.scale(x).tolist())                                # the last good build serves
    seen.append(ops.scale(x).tolist())
    (d / "factor.h").write_text("#define FACTOR 5.0\\n")              # fixed
    wait_stale(ops)
    seen.append(ops.scale(x).tolist())
    (d / "scale.cpp").write_text((d / "scale.cpp").read_text().replace("x.mul(FACTOR)", "x.mul(FACTOR).add(1)"))
    wait_stale(ops)
    seen.append(ops.scale(x).tolist())
    # an include of a header not written yet: the failed build cannot name it, and its later
    # creation must still reload (the directory is watched whole while the build fails)
    (d / "scale.cpp").write_text('#include "extra.h"\\n' + (d / "scale.cpp").read_text().replace("add(1)", "add(EXTRA)"))
    wait_stale(ops)
    seen.append(ops.scale(x).tolist())
    quiet = time.monotonic()
    while time.monotonic() - quiet < 1.0:  # that save's later events (close after write) handled first
        if ops.__dict__["_reload"].stale:
            ops.scale  # fails again, said once
            quiet = time.monotonic()
        time.sleep(0.05)
    (d / "extra.h").write_text("#define EXTRA 2\\n")
    wait_stale(ops)
    seen.append(ops.scale(x).tolist())
    print(json.dumps({{"seen": seen, "same_op": same_op, "old_fn_still_works": fn_before(x).tolist()}}))
"""


@pytest.mark.slow
def test_edit_reloads_and_a_failed_rebuild_keeps_the_last_good_build(tmp_path):
    write(tmp_path / "factor.h", "#define FACTOR 2.0\n")
    write(tmp_path / "scale.cpp", OP.format())
    proc = run_code(RELOAD_SCRIPT.format(d=str(tmp_path)))
    out = last_json(proc)
    assert out["seen"] == [[2.0, 2.0], [3.0, 3.0], [3.0, 3.0], [3.0, 3.0], [5.0, 5.0], [6.0, 6.0], [6.0, 6.0],
                           [7.0, 7.0]]
    assert out["same_op"] is True
    assert out["old_fn_still_works"] == [2.0, 2.0]  # an op fetched earlier keeps its build
    # each failure is reported once, with the compiler's location, not twice
    assert proc.stderr.count("rebuilding scale failed") == 2, proc.stderr
    assert "factor.h:1" in proc.stderr and "extra.h: No such file" in proc.stderr


PYBIND = """\
    #include <pybind11/pybind11.h>
    int answer() {{ return {value}; }}
    PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {{ m.def("answer", &answer); }}
"""


def test_a_directory_deleted_and_created_again_is_watched_again(tmp_path):
    # its own directory to delete (four stable-ABI builds, ~1.5 s each): a git checkout that
    # removes the kernel's folder and writes it back ended its watch, and later saves went unseen
    d = tmp_path / "kernel"
    tiny(d, "grow", factor=2)
    out = run_py(f"""
        import json, shutil, time, torch, kload
        from pathlib import Path
        d = Path({str(d)!r})
        ops = kload.load(d / "grow.cpp", reload=True)

        def after(save):
            save()
            deadline = time.monotonic() + 60
            while not (ops.__dict__["_reload"].stale and "grow" not in ops.__dict__):
                assert time.monotonic() < deadline, "the watcher never saw the save"
                time.sleep(0.01)
            return ops.grow(torch.ones(1)).tolist()

        text = (d / "grow.cpp").read_text()
        seen = [ops.grow(torch.ones(1)).tolist()]

        def checkout():
            shutil.rmtree(d)
            d.mkdir()
            (d / "grow.cpp").write_text(text.replace("2 *", "3 *"))

        seen.append(after(checkout))
        time.sleep(0.5)  # the deletion's own events all handled (each marks the handle again)
        ops.grow
        seen.append(after(lambda: (d / "grow.cpp").write_text(text.replace("2 *", "4 *"))))
        # deleted and used while gone (the last good build serves), written back later: its parent
        # folder, watched meanwhile, says when
        seen.append(after(lambda: shutil.rmtree(d)))
        time.sleep(0.5)
        ops.grow

        def back():
            d.mkdir()
            (d / "grow.cpp").write_text(text.replace("2 *", "5 *"))

        seen.append(after(back))
        print(json.dumps(seen))
    """)
    assert out == [[2.0], [3.0], [4.0], [4.0], [5.0]]


def test_a_broken_edit_undone_and_made_again_is_reported_again(tmp_path):
    # its own library (one stable-ABI build; the broken ones fail at once): undoing a broken edit
    # finds the loaded build again, which must end the failed state (the error said once per spell)
    tiny(tmp_path, "undo", factor=2)
    proc = run_code(f"""
        import json, time, torch, kload
        from pathlib import Path
        src = Path({str(tmp_path / "undo.cpp")!r})
        ops = kload.load(src, reload=True)
        good = src.read_text()

        def after(text):
            src.write_text(text)
            deadline = time.monotonic() + 60
            while not (ops.__dict__["_reload"].stale and "undo" not in ops.__dict__):
                assert time.monotonic() < deadline, "the watcher never saw the save"
                time.sleep(0.01)
            out = ops.undo(torch.ones(1)).tolist()
            time.sleep(0.5)  # the save's later events (close after write) handled
            ops.undo
            return out

        seen = [ops.undo(torch.ones(1)).tolist()]
        for text in (good.replace("return out;", "return out"), good, good.replace("return out;", "return out")):
            seen.append(after(text))
        print(json.dumps(seen))
    """)
    assert last_json(proc) == [[2.0]] * 4
    assert proc.stderr.count("rebuilding undo failed") == 2, proc.stderr


def test_only_sources_and_headers_count_as_saves_in_a_folder_watched_whole():
    # from a build's start until one succeeds, the sources' folders are watched whole: an editor's
    # swap file or a notebook's autosave there must not start a compile
    from kload.reloading import source_like

    assert all(map(source_like, ["k.cu", "k.cuh", "a.h", "b.hpp", "vector", "x.inl", "y.cpp", "z.cc", "t.tcc"]))
    assert not any(map(source_like, [".k.cu.swp", "k.cu~", "#k.cu#", "notes.ipynb", "build.log", ".nfs0001",
                                     "k.cu.orig", "data.json"]))


def test_reload_of_a_pybind11_module_and_explicit_reload(tmp_path):
    src = write(tmp_path / "answer.cpp", PYBIND.format(value=41))
    h = kload.load(src, reload=False)
    assert h.answer() == 41
    assert h.reload() is False  # nothing changed: the check is a cache hit
    write(src, PYBIND.format(value=42))
    assert h.reload() is True
    assert h.answer() == 42


# -- incremental ----------------------------------------------------------------------

@pytest.mark.slow
def test_editing_one_translation_unit_recompiles_only_it(tmp_path, cxx_wrapper):
    cxx, log = cxx_wrapper
    write(tmp_path / "ops_main.cpp", """\
        #include <kload/kernel.h>
        at::Tensor twice_impl(const at::Tensor& x);
        at::Tensor twice(const at::Tensor& x) { return twice_impl(x); }
        KLOAD_LIBRARY(m) { m.def("twice(Tensor x) -> Tensor"); }
        KLOAD_IMPL(CPU, m) { m.impl("twice", &twice); }
    """)
    helper = write(tmp_path / "ops_helper.cpp", """\
        #include <ATen/core/Tensor.h>
        at::Tensor twice_impl(const at::Tensor& x) { return x.mul(2); }
    """)
    code = f"""
        import json, torch, kload
        ops = kload.load({str(tmp_path / "ops_main.cpp")!r}, {str(helper)!r}, name="incr")
        print(json.dumps({{"out": ops.twice(torch.ones(2)).tolist()}}))
    """
    env = {"CXX": str(cxx)}
    main_before, helper_before = compiles(log, "ops_main.cpp"), compiles(log, "ops_helper.cpp")
    assert run_py(code, env)["out"] == [2.0, 2.0]
    assert compiles(log, "ops_main.cpp") - main_before == 1
    assert compiles(log, "ops_helper.cpp") - helper_before == 1
    helper.write_text(helper.read_text().replace("x.mul(2)", "x.mul(2).add(1)"))
    assert run_py(code, env)["out"] == [3.0, 3.0]
    assert compiles(log, "ops_helper.cpp") - helper_before == 2, "the edited unit recompiles"
    assert compiles(log, "ops_main.cpp") - main_before == 1, "the unchanged unit reuses its object"


# -- progress -------------------------------------------------------------------------

def test_progress_line_with_verbose_and_silence_without(tmp_path):
    write(tmp_path / "factor.h", "#define FACTOR 7.0\n")
    src = write(tmp_path / "scale.cpp", OP.format())
    code = f"""
        import json, torch, kload
        ops = kload.load({str(src)!r})
        print(json.dumps({{"out": ops.scale(torch.ones(1)).tolist()}}))
    """
    proc = run_code(code, {"KLOAD_VERBOSE": "1"})
    assert proc.returncode == 0, proc.stderr
    assert "kload: building scale" in proc.stderr and "compiling scale.cpp" in proc.stderr, proc.stderr
    assert "kload: built scale in" in proc.stderr
    # the same build again, not a terminal and no KLOAD_VERBOSE: nothing on stderr
    proc = run_code(code)
    assert proc.returncode == 0 and "kload" not in proc.stderr, proc.stderr


# -- debug builds ---------------------------------------------------------------------

@pytest.mark.slow
def test_debug_build_is_an_entry_of_its_own_with_debug_info(vadd_dir):
    plain = kload.load(vadd_dir / "vadd.cpp", name="vadd_dbg_cmp")
    debug = kload.load(vadd_dir / "vadd.cpp", name="vadd_dbg_cmp", debug=True)
    p, d = Path(plain.build()), Path(debug.build())
    assert p.parent != d.parent
    assert b".debug_line" in d.read_bytes() and b".debug_line" not in p.read_bytes()
    torch.testing.assert_close(debug.vector_add(torch.ones(3), torch.ones(3)), torch.full((3,), 2.0))


# -- notebooks, in a real Jupyter kernel ----------------------------------------------

@pytest.mark.slow
def test_example_notebook_runs(tmp_path):
    nb = run_notebook(nbformat.read(EXAMPLES / "notebook.ipynb", as_version=4), tmp_path)
    assert not any(o.get("output_type") == "error" for c in nb.cells for o in c.get("outputs", []))
    every = "\n".join(texts(c) for c in nb.cells)
    assert "tensor([1., 3., 5., 7.])" in every and "tensor([2., 4., 6., 8.])" in every  # before/after the edit
    assert "tensor([3., 3., 3.])" in every  # the file-based handle after the rewrite
    assert "kload cache:" in every


@pytest.mark.slow
def test_magic_edit_rerun_error_lines(tmp_path):
    C = nbformat.v4.new_code_cell
    v1 = ('%%kload cellop\n'
          'at::Tensor f(const at::Tensor& x) { return x.mul(2); }\n'
          'KLOAD_LIBRARY(m) { m.def("f(Tensor x) -> Tensor"); }\n'
          'KLOAD_IMPL(CPU, m) { m.impl("f", &f); }')
    v2 = v1.replace("x.mul(2)", "x.mul(10)")
    bad = ('%%kload broken --cflags="-O1"\n'
           '// line 2\n'
           'at::Tensor f(const at::Tensor& x) {\n'
           '  return x.mul(undeclared_thing);\n'
           '}\n'
           'KLOAD_LIBRARY(m) { m.def("f(Tensor x) -> Tensor"); }\n')
    nb = nbformat.v4.new_notebook()
    nb.cells = [
        C("import torch, kload\n%load_ext kload"),
        C(v1), C("print('v1', cellop.f(torch.ones(2)).tolist())"),
        C(v2), C("print('v2', cellop.f(torch.ones(2)).tolist())"),
        C(v2), C("print('rerun', kload.HISTORY[-1]['how'], cellop.f(torch.ones(2)).tolist())"),
        C(bad, metadata={"tags": ["raises-exception"]}),
        C("%kload"),
    ]
    run_notebook(nb, tmp_path)
    assert "v1 [2.0, 2.0]" in texts(nb.cells[2])
    assert "v2 [10.0, 10.0]" in texts(nb.cells[4])
    assert "rerun cache [10.0, 10.0]" in texts(nb.cells[6])  # an unchanged cell is a cache hit
    err = [o for o in nb.cells[7].outputs if o.output_type == "error"]
    assert len(err) == 1
    shown = "\n".join(err[0].traceback)
    assert len(err[0].traceback) <= 40
    assert "line 4, column" in shown and "undeclared_thing" in shown  # the notebook's numbering
    assert "return x.mul(undeclared_thing);" in shown                  # the offending line, quoted
    assert "Traceback" not in shown and "handle.py" not in shown       # no trip through kload's internals
    assert "cellop" in texts(nb.cells[8]) and "kload cache:" in texts(nb.cells[8])
