"""Toolchains as GPU images ship them: a GCC whose libstdc++.so is unusable (so GNU
ld links libstdc++.a into every extension, and gold refuses to link), gold failing
where the default linker works, a GCC behind ccache, a namespace named through a
macro. Real compilers and linkers throughout; each broken toolchain is a CXX wrapper
script built here.

Why these compile on their own: each build is made by a different compiler command
(the broken or wrapped toolchain is the thing under test), so none can share the
session's builds. They are small stable-ABI, lean op-library and bare pybind11
sources (a few seconds each), with KLOAD_PCH=0 (a precompiled header per wrapper
would cost more than the builds).
"""
from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from conftest import run_code, run_py, write

STABLE = """\
    #include <kload/stable.h>
    kload::Tensor checked(const kload::Tensor& x) {
      STD_TORCH_CHECK(x.dim() == 1, "checked: x must be 1-D, got ", x.dim(), " dimensions");
      return x;
    }
    KLOAD_LIBRARY(m) { m.def("checked(Tensor x) -> Tensor"); }
    KLOAD_IMPL(CPU, m) { m.impl("checked", TORCH_BOX(&checked)); }
"""
OPLIB = """\
    #define KLOAD_LEAN
    #include <kload/kernel.h>
    at::Tensor same(const at::Tensor& x) { TORCH_CHECK(x.dim() == 1, "same: 1-D please"); return x; }
    KLOAD_LIBRARY(m) { m.def("same(Tensor x) -> Tensor"); }
    KLOAD_IMPL(CPU, m) { m.impl("same", &same); }
"""
PYBIND = """\
    #include <pybind11/pybind11.h>
    #include <stdexcept>
    int thrice(int x) { if (x < 0) throw std::invalid_argument("thrice: x must be >= 0"); return 3 * x; }
    PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def("thrice", &thrice); }
"""


def wrapper(d: Path, libdir: Path) -> Path:
    """A CXX that puts ``libdir`` first on the library path (as an image's GCC prefix
    does) and logs every call."""
    script = d / "cxx"
    script.write_text(f'#!/bin/sh\necho "$*" >> "{d / "calls.log"}"\nexec g++ -L{libdir} "$@"\n')
    script.chmod(0o755)
    return script


@pytest.fixture
def broken_gcc(tmp_path):
    """A GCC whose library path has a dangling libstdc++.so and a real libstdc++.a:
    gold fails ("cannot open .../libstdc++.so"), GNU ld silently links the archive."""
    lib = tmp_path / "lib"
    lib.mkdir()
    (lib / "libstdc++.so").symlink_to("/nonexistent/libstdc++.so")
    archive = subprocess.run(["g++", "-print-file-name=libstdc++.a"], capture_output=True, text=True).stdout.strip()
    if not os.path.isabs(archive):
        pytest.skip("this GCC has no libstdc++.a to link statically")
    shutil.copy(archive, lib / "libstdc++.a")
    return wrapper(tmp_path, lib)


def runtime_of(path: str) -> tuple[list[str], list[str]]:
    """(DT_NEEDED, the C++ runtime symbols it defines), read with binutils."""
    needed = [line.rsplit("[", 1)[1].rstrip("]") for line in
              subprocess.run(["readelf", "-d", path], capture_output=True, text=True).stdout.splitlines()
              if "(NEEDED)" in line]
    defined = subprocess.run(["nm", "-D", "--defined-only", path], capture_output=True, text=True).stdout
    return needed, [s for s in ("__cxa_throw", "__gxx_personality_v0") if s in defined]


def test_a_gcc_without_a_usable_libstdcxx_so_is_repaired_in_every_style(broken_gcc, tmp_path):
    # the same link without kload: the extension carries a private runtime (what crashed on the GPU image)
    obj = tmp_path / "probe.o"
    write(tmp_path / "probe.cpp", 'extern "C" void f(int x) { if (x) throw x; }\n')
    subprocess.run([str(broken_gcc), "-fPIC", "-c", str(tmp_path / "probe.cpp"), "-o", str(obj)], check=True)
    subprocess.run([str(broken_gcc), "-shared", str(obj), "-o", str(tmp_path / "raw.so")], check=True)
    assert runtime_of(str(tmp_path / "raw.so"))[1], "the broken toolchain did not reproduce the private runtime"
    has_gold = shutil.which("ld.gold") is not None  # binutils 2.44 and later ship none
    if has_gold:
        gold = subprocess.run([str(broken_gcc), "-shared", str(obj), "-fuse-ld=gold", "-o", str(tmp_path / "g.so")],
                              capture_output=True, text=True)
        assert gold.returncode != 0 and "libstdc++.so" in gold.stderr

    srcs = {n: write(tmp_path / f"{n}.cpp", t) for n, t in (("tc_stable", STABLE), ("tc_oplib", OPLIB),
                                                          ("tc_pybind", PYBIND))}
    code = f"""
        import json, torch, kload
        st = kload.load({str(srcs['tc_stable'])!r})
        op = kload.load({str(srcs['tc_oplib'])!r})
        py = kload.load({str(srcs['tc_pybind'])!r})
        out = {{"paths": [st.build(), op.build(), py.build()]}}
        assert torch.equal(st.checked(torch.ones(2)), torch.ones(2)) and py.thrice(2) == 6
        for key, call in (("stable", lambda: st.checked(torch.ones(2, 2))), ("oplib", lambda: op.same(torch.ones(2, 2))),
                          ("pybind", lambda: py.thrice(-1))):
            try:
                call()
                out[key] = "returned"
            except Exception as e:
                out[key] = type(e).__name__ + ": " + str(e).splitlines()[0]
        print(json.dumps(out))
    """
    env = {"CXX": str(broken_gcc), "KLOAD_PCH": "0"}
    proc = run_code(code, env)
    assert proc.returncode == 0, f"exit {proc.returncode} (a crash is negative):\n{proc.stdout}\n{proc.stderr}"
    import json

    out = json.loads(proc.stdout.strip().splitlines()[-1])
    for path in out["paths"]:
        needed, defined = runtime_of(path)
        assert "libstdc++.so.6" in needed and not defined, (path, needed, defined)
    assert out["stable"].startswith("RuntimeError:") and "checked: x must be 1-D, got 2" in out["stable"], out
    assert out["oplib"].startswith("RuntimeError: same: 1-D please"), out
    assert out["pybind"].startswith("ValueError: thrice: x must be >= 0"), out
    # said once, in one line, what was wrong and what was done; gold never on a build's link line
    said = [line for line in proc.stderr.splitlines() if "finds no usable shared libstdc++.so" in line]
    assert len(said) == 1 and "-l:libstdc++.so.6" in said[0], proc.stderr
    assert ("gold cannot link here" in said[0]) == has_gold, said[0]
    links = [line for line in (tmp_path / "calls.log").read_text().splitlines() if " -shared" in f" {line}"]
    assert len(links) >= 3 + 3  # the probe's links, then one per library
    assert not any("-fuse-ld=gold" in line for line in links[-3:]), links[-3:]

    # a second process: the toolchain's facts are remembered, no probe runs; the builds are hits
    before = len((tmp_path / "calls.log").read_text().splitlines())
    assert run_py(f"""
        import json, torch, kload
        h = kload.load({str(srcs['tc_stable'])!r})
        print(json.dumps(h.checked(torch.ones(3)).tolist()))
    """, env) == [1.0, 1.0, 1.0]
    assert len((tmp_path / "calls.log").read_text().splitlines()) == before


def test_a_toolchain_that_cannot_be_repaired_is_refused_and_nothing_is_cached(broken_gcc, tmp_path):
    # an unusable libstdc++.so.6 ahead of every other: the repair cannot find the shared runtime either
    (broken_gcc.parent / "lib" / "libstdc++.so.6").write_text("not a library\n")
    src = write(tmp_path / "tc_refused.cpp", STABLE)
    cache = tmp_path / "cache"
    proc = run_code(f"""
        import kload
        try:
            kload.load({str(src)!r}).build()
        except kload.KloadError as e:
            print("REFUSED", e)
    """, {"CXX": str(broken_gcc), "KLOAD_PCH": "0", "KLOAD_CACHE_DIR": str(cache)})
    assert proc.returncode == 0, proc.stderr
    assert "REFUSED" in proc.stdout and str(broken_gcc) in proc.stdout and "CXX=/usr/bin/g++" in proc.stdout, proc.stdout
    assert not list((cache / "entries").glob("tc_refused-*")) if (cache / "entries").exists() else True


def test_gold_failing_a_real_link_is_retried_without_it_and_not_tried_again(tmp_path):
    """gold links the probe but fails torch's link: a dangling libc10.so first on the library
    path, which gold refuses and GNU ld skips for torch's own."""
    if shutil.which("ld.gold") is None:
        pytest.skip("ld.gold is not installed")
    lib = tmp_path / "lib"
    lib.mkdir()
    (lib / "libc10.so").symlink_to("/nonexistent/libc10.so")
    cxx = wrapper(tmp_path, lib)
    src = write(tmp_path / "tc_gold.cpp", STABLE)
    src2 = write(tmp_path / "tc_gold2.cpp", STABLE.replace("checked", "checked2"))
    env = {"CXX": str(cxx), "KLOAD_PCH": "0"}
    proc = run_code(f"""
        import torch, kload
        h = kload.load({str(src)!r})
        assert torch.equal(h.checked(torch.ones(2)), torch.ones(2))
    """, env)
    assert proc.returncode == 0, proc.stderr
    assert "gold failed to link tc_gold" in proc.stderr and "without gold from now on" in proc.stderr, proc.stderr
    calls = (tmp_path / "calls.log").read_text().splitlines()
    gold_links = [c for c in calls if "-fuse-ld=gold" in c and "tc_gold" in c]
    assert len(gold_links) == 1  # the failed one; then the retry without it
    # the next build (another library, another process) does not try gold again
    proc = run_code(f"import torch, kload; kload.load({str(src2)!r}).build()", env)
    assert proc.returncode == 0, proc.stderr
    later = (tmp_path / "calls.log").read_text().splitlines()[len(calls):]
    assert any("tc_gold2" in c for c in later) and not any("-fuse-ld=gold" in c for c in later), later


def test_gcc_behind_ccache_is_gcc_and_keeps_the_precompiled_header(tmp_path, monkeypatch):
    """A ccache masquerade directory first on PATH: its c++ is ccache, and it is still GCC
    (asked through its predefined macros), with GCC's own version in the key."""
    if not Path("/usr/lib/ccache/c++").exists():
        pytest.skip("Debian's ccache is not installed (make test installs it as root)")
    from kload.plan import toolchain
    from kload.plan.plan import make_plan
    from kload.options import Options
    from kload.cache.store import Store
    from kload.compile import pch

    monkeypatch.setenv("PATH", "/usr/lib/ccache:" + os.environ["PATH"])
    monkeypatch.setenv("CCACHE_DIR", str(tmp_path / "ccache"))
    ident = toolchain.compiler_identity("c++", tmp_path / "memo")
    plain = toolchain.compiler_identity("g++", tmp_path / "memo")
    assert toolchain.which("c++") == "/usr/lib/ccache/c++" and os.path.realpath("/usr/lib/ccache/c++").endswith("ccache")
    assert ident["family"] == "gcc" and ident["version"] == plain["version"] and ident["version"].startswith("gcc ")
    assert ident["proper"] and ident["proper"].endswith("cc1plus") and ident["proper"] == plain["proper"]
    # what the key holds is what compiles, not how it is reached: the same with ccache in front or not
    assert {k: v for k, v in ident.items() if k != "command"} == {k: v for k, v in plain.items() if k != "command"}
    src = write(tmp_path / "tc_pch.cpp", OPLIB.replace("#define KLOAD_LEAN\n", ""))
    p = make_plan(Options("tc_pch", [src]), Store(tmp_path / "cache"))
    assert pch.not_applicable(p) is None and pch.plans_for(p, Store(tmp_path / "cache"))


MACRO_NS = """\
    #include <torch/csrc/stable/library.h>
    #include <torch/csrc/stable/tensor.h>
    #include <torch/csrc/stable/ops.h>
    using torch::stable::Tensor;
    Tensor saxpy(const Tensor& x, double a) { return torch::stable::empty_like(x); }
    #ifndef NSNAME
    #define NSNAME kload_macro_ns
    #endif
    STABLE_TORCH_LIBRARY(NSNAME, m) { m.def("saxpy(Tensor x, float a) -> Tensor"); }
    STABLE_TORCH_LIBRARY_IMPL(NSNAME, CPU, m) { m.impl("saxpy", TORCH_BOX(&saxpy)); }
"""


def test_a_namespace_named_through_a_macro_is_found_from_what_torch_registered(tmp_path):
    src = write(tmp_path / "tc_macro.cpp", MACRO_NS)
    code = f"""
        import json, torch, kload
        h = kload.load({str(src)!r}{{extra}})
        print(json.dumps([h.namespace, list(h.saxpy(torch.ones(3), 2.0).shape)]))
    """
    assert run_py(code.format(extra="")) == ["kload_macro_ns", [3]]  # builds
    assert run_py(code.format(extra="")) == ["kload_macro_ns", [3]]  # a hit in a fresh process
    assert run_py(code.format(extra=", extra_cflags=['-DNSNAME=kload_flag_ns']")) == ["kload_flag_ns", [3]]
