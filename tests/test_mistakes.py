"""No mistake in a kernel or a schema ends the process (issue 43).

Each mistake a user can type in an op library is made in ONE child process, one after the
other, as in a notebook: each must come back as a Python exception that names the op, the
file and the line, and the child must then still load and call a good op, and load the
fixed edit. Two children: the first-build path (no precompiled header: the trimmed build,
registration through torch's C shim) and the path with the precompiled <kload/kernel.h>
ready (torch::Library, what every edit after the first takes).

Why these builds cannot share: each mistake is its own library (a mistake stops its build or
its registration), and each path compiles differently. They share one child per path, so
one interpreter start and one precompiled header serve every case.
"""
from __future__ import annotations

import json
import textwrap

import pytest

from conftest import run_code, tiny

pytestmark = pytest.mark.slow

# The child: make every mistake in turn, record what came back, then show the process works.
CHILD = r'''
import json, os, sys, textwrap, time
from pathlib import Path
import torch, kload
from kload.compile import pch_build

phase, folder = sys.argv[1], Path(sys.argv[2])
out = {"cases": {}}

def src(name, text):
    path = folder / f"{name}.cpp"
    path.write_text(f"// {phase}\n" + textwrap.dedent(text))  # line 1: the phase, so each path has its own key
    return path

def attempt(case, text, call=None, **kw):
    path = src(f"{case}_{phase}", text)
    try:
        h = kload.load(str(path), name=f"{case}_{phase}", reload=False, **kw)
        h.load()
        got = call(h) if call else None
        out["cases"][case] = {"error": None, "got": got}
    except Exception as e:
        out["cases"][case] = {"error": type(e).__name__, "text": str(e), "op": getattr(e, "op", None),
                              "file": getattr(e, "file", None), "line": getattr(e, "line", None)}

GOOD = """\
    #include <kload/kernel.h>
    at::Tensor scale(const at::Tensor& x, double s) { return x * s; }
    KLOAD_LIBRARY(m) { m.def("scale(Tensor x, float s) -> Tensor"); }
    KLOAD_IMPL(CPU, m) { m.impl("scale", &scale); }
"""
if phase == "pch":  # a good build starts the precompiled header; every mistake below then uses it
    kload.load(str(src("warmup_pch", GOOD)), name="warmup_pch", reload=False).load()
    out["pch_ready"] = pch_build.wait(600)

attempt("param", GOOD.replace("double s", "int64_t s"))
attempt("ret", GOOD.replace("at::Tensor scale(const at::Tensor& x, double s) { return x * s; }",
                            "int64_t scale(const at::Tensor& x, double s) { return 1; }"))
attempt("optional", """\
    #include <kload/kernel.h>
    at::Tensor pick(const at::Tensor& x, const at::Tensor& y) { return x; }
    KLOAD_LIBRARY(m) { m.def("pick(Tensor x, Tensor? y) -> Tensor"); }
    KLOAD_IMPL(CPU, m) { m.impl("pick", &pick); }
""")
attempt("syntax", GOOD.replace('"scale(Tensor x, float s) -> Tensor"', '"scale(Tensor x, float s -> Tensor"'))
attempt("twice", """\
    #include <kload/kernel.h>
    at::Tensor twice(const at::Tensor& x) { return x * 2; }
    KLOAD_LIBRARY(m) { m.def("twice(Tensor x) -> Tensor");
                       m.def("twice(Tensor x) -> Tensor"); }
    KLOAD_IMPL(CPU, m) { m.impl("twice", &twice); }
""")
attempt("two_blocks", """\
    #include <kload/kernel.h>
    at::Tensor one(const at::Tensor& x) { return x + 1; }
    KLOAD_LIBRARY(m) { m.def("one(Tensor x) -> Tensor"); }
    KLOAD_LIBRARY(m) { m.def("two(Tensor x) -> Tensor"); }
    KLOAD_IMPL(CPU, m) { m.impl("one", &one); }
""")
if phase == "first":
    # a plain TORCH_LIBRARY: it registers as it opens, so kload opens it in a child first
    attempt("plain", """\
        #include <torch/library.h>
        #include <ATen/ATen.h>
        at::Tensor scale(const at::Tensor& x, int64_t s) { return x * s; }
        TORCH_LIBRARY(mistakes_plain, m) { m.def("scale(Tensor x, float s) -> Tensor"); }
        TORCH_LIBRARY_IMPL(mistakes_plain, CPU, m) { m.impl("scale", &scale); }
    """)
    # a namespace Python defined first: refused before anything compiles
    keep = torch.library.Library("mistakes_pyns", "DEF")
    attempt("pyns", """\
        #include <torch/library.h>
        TORCH_LIBRARY(mistakes_pyns, m) { m.def("noop(Tensor x) -> Tensor"); }
    """)
    # the stable ABI: TORCH_BOX's kernel types against the schema, before anything registers
    for case, decl in (("stable_int", "int64_t a"), ("stable_tensor", "const Tensor& a")):
        attempt(case, f"""\
            #include <kload/stable.h>
            using kload::Tensor;
            Tensor scale(const Tensor& x, {decl}) {{ return torch::stable::empty_like(x); }}
            KLOAD_LIBRARY(m) {{ m.def("scale(Tensor x, float a) -> Tensor"); }}
            KLOAD_IMPL(CPU, m) {{ m.impl("scale", TORCH_BOX(&scale)); }}
        """)
    # a reload of a mismatched edit keeps the last good build; the fix then loads (same process)
    path = src("reloaded", GOOD)
    h = kload.load(str(path), name="reloaded", reload=False)
    first = h.scale(torch.ones(2), 2.0).tolist()
    path.write_text(path.read_text().replace("double s", "int64_t s"))
    broken = h.reload()
    still = h.scale(torch.ones(2), 2.0).tolist()
    path.write_text(path.read_text().replace("int64_t s", "double s").replace("x * s", "x * s + 1"))
    fixed = h.reload()
    out["reload"] = {"first": first, "broken": broken, "still": still, "fixed": fixed,
                     "after": h.scale(torch.ones(2), 2.0).tolist()}
else:
    # the notebook: a %%kload cell of a mismatched edit fails, the name keeps the last good build
    from IPython.core.interactiveshell import InteractiveShell
    shell = InteractiveShell.instance()
    shell.run_line_magic("load_ext", "kload")
    shell.run_cell_magic("kload", "cellops", textwrap.dedent(GOOD))
    before = shell.user_ns["cellops"].scale(torch.ones(2), 3.0).tolist()
    try:
        shell.run_cell_magic("kload", "cellops", textwrap.dedent(GOOD).replace("double s", "int64_t s"))
        cell_error = None
    except Exception as e:
        cell_error = f"{type(e).__name__}: {e}"
    still = shell.user_ns["cellops"].scale(torch.ones(2), 3.0).tolist()
    shell.run_cell_magic("kload", "cellops", textwrap.dedent(GOOD).replace("x * s", "x * s - 1"))
    out["cell"] = {"before": before, "error": cell_error, "still": still,
                   "fixed": shell.user_ns["cellops"].scale(torch.ones(2), 3.0).tolist()}

# the fixed edit of a refused build loads in this process (a new build, not the refused one's handle)
out["param"] = out["cases"]["param"]
attempt("param", GOOD.replace("x * s", "x * s * 10"), call=lambda h: h.scale(torch.ones(2), 0.5).tolist())
out["fixed_param"] = out["cases"].pop("param")
good = kload.load(str(src("good_" + phase, GOOD)), name="good_" + phase, reload=False)
out["good"] = good.scale(torch.ones(3), 2.0).tolist()
out["good_pch"] = good.build().entry.manifest.get("pch")
print(json.dumps(out))
'''


def run_phase(tmp_path, phase: str, env: dict) -> dict:
    proc = run_code(CHILD.replace("sys.argv[1], Path(sys.argv[2])", f"{phase!r}, Path({str(tmp_path)!r})"),
                    env=env, timeout=1500)
    assert proc.returncode == 0, f"the child died (status {proc.returncode}):\n{proc.stderr[-3000:]}"
    return json.loads(proc.stdout.strip().splitlines()[-1])


def refused(case: dict, kind: str, line: int, *words: str) -> None:
    """``case`` came back as a ``kind`` exception naming its file and ``line`` and saying ``words``."""
    assert case["error"] == kind, case
    if kind == "CompileError":
        assert f".cpp:{line}:" in case["text"], case["text"]
    else:
        assert case["line"] == line and case["file"].endswith(".cpp"), case
    for w in words:
        assert w in case["text"], (w, case["text"])


def check_the_process_goes_on(out: dict) -> None:
    assert out["good"] == [2.0, 2.0, 2.0]
    assert out["fixed_param"] == {"error": None, "got": [5.0, 5.0]}  # 10 * 0.5: the fixed code, not a stale build


def test_first_builds_turn_every_mistake_into_an_exception(tmp_path, kload_cache):
    out = run_phase(tmp_path, "first", {"KLOAD_PCH": "0"})
    c = out["cases"]
    # the shim path checks the kernel's types at compile time: the user's m.impl line (line 1 is a comment)
    refused(out["param"], "CompileError", 5, "the_kernels_cpp_types_do_not_match")
    refused(c["ret"], "CompileError", 5, "the_kernels_cpp_types_do_not_match")
    refused(c["optional"], "RegistrationError", 5, 'm.impl("pick")', "Tensor? vs Tensor")
    refused(c["syntax"], "CompileError", 4, "torch cannot parse this schema", "expected )")
    refused(c["twice"], "RegistrationError", 5, 'm.def("twice")', "multiple times")
    refused(c["two_blocks"], "RegistrationError", 5, "Only a single TORCH_LIBRARY")
    refused(c["plain"], "RegistrationError", 6, 'm.impl("scale")', "float vs int")
    assert c["pyns"]["error"] == "KloadError" and "mistakes_pyns" in c["pyns"]["text"], c["pyns"]
    assert "registered at" in c["pyns"]["text"]  # where Python defined it
    refused(c["stable_int"], "RegistrationError", 6, "argument a is float in the schema", "is int")
    refused(c["stable_tensor"], "RegistrationError", 6, "argument a is float in the schema", "is Tensor")
    r = out["reload"]
    assert r == {"first": [2.0, 2.0], "broken": False, "still": [2.0, 2.0], "fixed": True, "after": [3.0, 3.0]}, r
    check_the_process_goes_on(out)


def test_with_the_precompiled_header_every_mistake_is_an_exception(tmp_path, kload_cache):
    """torch::Library's path: what used to abort while the library opened is caught where kload
    registers it (kernel.h's kload_register), and torch's own message names the mismatch."""
    out = run_phase(tmp_path, "pch", {})  # the session's cache: its precompiled header, if built already
    assert out["pch_ready"]
    assert any("used the precompiled" in note for note in out["good_pch"].values()), out["good_pch"]
    c = out["cases"]
    refused(out["param"], "RegistrationError", 5, 'm.impl("scale")', "float vs int")
    refused(c["ret"], "RegistrationError", 5, 'm.impl("scale")', "Tensor vs int")
    refused(c["optional"], "RegistrationError", 5, 'm.impl("pick")', "Tensor? vs Tensor")
    refused(c["syntax"], "CompileError", 4, "torch cannot parse this schema")
    refused(c["twice"], "RegistrationError", 5, 'm.def("twice")', "multiple times")
    refused(c["two_blocks"], "RegistrationError", 5, "Only a single TORCH_LIBRARY")
    cell = out["cell"]
    assert cell["before"] == [3.0, 3.0] and cell["still"] == [3.0, 3.0] and cell["fixed"] == [2.0, 2.0], cell
    assert cell["error"] and "cellops" in cell["error"] and "float vs int" in cell["error"], cell
    check_the_process_goes_on(out)


def test_a_pybind11_binding_mistake_is_shown_at_the_users_line(tmp_path):
    """pybind11's static_assert fires in pybind11.h; the error is shown at the m.def line that
    instantiated it, the header named in the message. (A compile error: nothing to share.)"""
    import kload

    src = tmp_path / "bind3.cpp"
    src.write_text(textwrap.dedent("""\
        #include <pybind11/pybind11.h>
        namespace py = pybind11;
        int add3(int a, int b, int c) { return a + b + c; }
        PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
          m.def("add3", &add3, py::arg("a"), py::arg("b"));
        }
    """))
    with pytest.raises(kload.CompileError) as e:
        kload.load(src, name="bind3", reload=False).build()
    [first, *_] = e.value.diagnostics
    assert (first.file, first.line) == (str(src), 5), first
    assert "argument annotations" in first.message and "(in pybind11.h:" in first.message
    assert 'py::arg("b")' in first.source_line


@pytest.mark.parametrize("below", [False, True])
def test_a_cache_directory_that_is_a_file_or_below_one_says_so(tmp_path, below):
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("")
    cache = blocker / "cache" if below else blocker
    src = tiny(tmp_path, "never_built")  # refused at the cache's first look, before any compile
    proc = run_code(f"""
        import kload
        try:
            kload.load({str(src)!r}).build()
        except kload.KloadError as e:
            print("KloadError:", e)
    """, env={"KLOAD_CACHE_DIR": str(cache)}, timeout=120)
    assert proc.returncode == 0, proc.stderr
    said = proc.stdout
    assert "KloadError:" in said and "not a directory" in said, said
    assert (f"is below {blocker}, which is a regular file" if below else f"{blocker} is a regular file") in said
    assert "File exists" not in said
