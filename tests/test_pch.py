"""<kload/kernel.h> is ATen's whole C++ API, and precompiled headers make it fast:
each is a cache entry (kind pch), built in the background, checked before use,
rebuilt when damaged or refused, and the object code is the same with or without.
Every build and every precompile here runs g++ for real."""
from __future__ import annotations

import dataclasses
import json
import logging
import os
import shutil
import tempfile
from pathlib import Path

import nbformat
import pytest
import torch

import kload
from kload.compile import foreground, pch_build
from kload.cache import MANIFEST, stamp_of
from kload.cache.key import sha256_now

from conftest import kload_cli, write

pytestmark = pytest.mark.slow  # make test-quick leaves this file out (docs/testing.md)
from test_live import run_notebook, texts

# What a user writes first: operators, at:: factories, dispatch, parallel_for.
FULL_API = """\
    #include <kload/kernel.h>
    at::Tensor full(const at::Tensor& a, const at::Tensor& b) {
      auto out = at::empty_like(a);
      AT_DISPATCH_FLOATING_TYPES(a.scalar_type(), "full", [&] {
        const auto src = a.contiguous();
        const scalar_t* pa = src.data_ptr<scalar_t>();
        scalar_t* po = out.data_ptr<scalar_t>();
        at::parallel_for(0, src.numel(), 2048, [&](int64_t begin, int64_t end) {
          for (int64_t i = begin; i < end; ++i) po[i] = pa[i] * 2 + 1;
        });
      });
      TORCH_CHECK(at::allclose(out, a * 2 + 1), "full: the loop and ATen's a * 2 + 1 disagree");
      return out + (a + b) + at::zeros(a.sizes(), a.options()) + OFFSET;
    }
    KLOAD_LIBRARY(m) { m.def("full(Tensor a, Tensor b) -> Tensor"); }
    KLOAD_IMPL(CPU, m) { m.impl("full", &full); }
"""


def expected(a, b, offset=0.0):
    return (a * 2 + 1) + a + b + offset


def source(folder: Path, offset: int = 0) -> Path:
    return write(folder / "full.cpp", FULL_API.replace("OFFSET", str(offset)))


def test_ordinary_aten_code_compiles_and_runs(tmp_path):
    ops = kload.load(source(tmp_path), reload=False)
    for dtype in (torch.float32, torch.float64):
        a, b = torch.randn(5000, dtype=dtype), torch.randn(5000, dtype=dtype)
        torch.testing.assert_close(ops.full(a, b), expected(a, b))
    with pytest.raises(RuntimeError, match="full"):  # AT_DISPATCH_FLOATING_TYPES names the op
        ops.full(torch.ones(3, dtype=torch.int32), torch.ones(3, dtype=torch.int32))


def test_ordinary_aten_code_in_a_kload_cell(tmp_path):
    cell = "%%kload cellfull\n" + FULL_API.replace("#include <kload/kernel.h>\n", "").replace("OFFSET", "0")
    C = nbformat.v4.new_code_cell
    nb = nbformat.v4.new_notebook()
    nb.cells = [C("import torch, kload\n%load_ext kload"), C(cell),
                C("a = torch.arange(4.0); print('cell', cellfull.full(a, a).tolist())")]
    run_notebook(nb, tmp_path)
    assert "cell [1.0, 5.0, 9.0, 13.0]" in texts(nb.cells[2])


def pch_entries(cache: Path) -> list[dict]:
    listed = json.loads(kload_cli("cache", "list", "--json", env={"KLOAD_CACHE_DIR": str(cache)}).stdout)
    return [e for e in listed if e["kind"] == "pch"]


def objects(cache: Path, name: str) -> bytes:
    [obj] = (cache / "build").glob(f"{name}-*/full.o")
    return obj.read_bytes()


def test_precompiled_header_lifecycle(tmp_path, monkeypatch, caplog):
    """First build: none yet, one starts in the background. Then it is used (and the
    object code is byte for byte the same); a truncated one is moved aside and
    rebuilt; one GCC refuses (made for other flags) is said to be refused, moved
    aside and rebuilt; `cache clear` removes them."""
    cache = tmp_path / "cache"
    monkeypatch.setenv("KLOAD_CACHE_DIR", str(cache))
    caplog.set_level(logging.INFO, logger="kload")
    src = source(tmp_path / "a")
    a, b = torch.randn(100), torch.randn(100)

    def build(name, flags, offset=0, src=src):
        h = kload.load(src, name=name, extra_cflags=flags, reload=False)
        torch.testing.assert_close(h.full(a, b), expected(a, b, offset))
        [note] = h.build().entry.manifest["pch"].values()
        return note

    with monkeypatch.context() as m:  # ATen's whole API without the PCH (tests/test_trim.py: trimmed)
        m.setenv("KLOAD_TRIM", "0")
        assert build("cold", ["-O1"]).startswith("no precompiled <kload/kernel.h> yet")
    assert pch_build.wait(600, root=tmp_path / "cache")
    [entry] = pch_entries(cache)
    gch = Path(entry["path"]) / "kload" / "kernel.h.gch"
    assert gch.stat().st_size > 50_000_000

    # the same source and flags under another name: a new build, with the PCH, same object code
    assert build("warm", ["-O1"]).startswith("used the precompiled <kload/kernel.h>")
    assert objects(cache, "warm") == objects(cache, "cold")

    # an edit uses it too
    src2 = source(tmp_path / "a", offset=1)
    assert build("warm", ["-O1"], offset=1, src=src2).startswith("used the precompiled")

    # truncated: detected before use, moved aside, the build goes on without it, and a new one is made
    with open(gch, "r+b") as f:
        f.truncate(1_000_000)
    assert build("warm", ["-O1"], offset=2, src=source(tmp_path / "a", offset=2)).startswith("no precompiled")
    assert "the precompiled <kload/kernel.h> was unusable" in caplog.text
    assert any((cache / "quarantine").iterdir())
    assert pch_build.wait(600, root=tmp_path / "cache")
    assert build("warm", ["-O1"], offset=3, src=source(tmp_path / "a", offset=3)).startswith("used the precompiled")

    # a flag GCC checks (-g) makes a new key; plant the -O1 entry there, as if it were
    # stale or foreign: its manifest verifies, GCC refuses it and kload says so
    from kload.options import make_options
    from kload.compile.pch import plans_for
    from kload.plan.plan import make_plan
    from kload.cache.store import Store

    store = Store(cache)
    opts = make_options("debugged", [src], ["-O1", "-g"], [], [], [], False, False, False)
    [pp] = plans_for(make_plan(opts, store), store)
    shutil.copytree(entry["path"], pp.path)
    m = json.loads((pp.path / MANIFEST).read_text())
    st = (pp.path / "kload" / "kernel.h.gch").stat()
    m.update(key=pp.key, stat=stamp_of(st), sha256=sha256_now(pp.path / "kload" / "kernel.h.gch"))
    (pp.path / MANIFEST).write_text(json.dumps(m))
    note = build("debugged", ["-O1", "-g"], offset=3)  # full.cpp holds the last edit
    assert "was not used: GCC refused it" in note and "building a new one" in note
    assert pch_build.wait(600, root=tmp_path / "cache")
    assert build("debugged", ["-O1", "-g"], offset=4, src=source(tmp_path / "a", offset=4)).startswith(
        "used the precompiled")
    assert len(pch_entries(cache)) == 2  # one per flag set

    assert "cleared" in kload_cli("cache", "clear", env={"KLOAD_CACHE_DIR": str(cache)}).stdout
    assert pch_entries(cache) == []


def test_gcc_says_why_it_cannot_use_one(tmp_path, monkeypatch, capfd):
    """-Winvalid-pch: a #define before the include keeps the PCH from serving; the
    compile says why (a verbose build shows it), kload's note says so, and the
    answer is right."""
    monkeypatch.setenv("KLOAD_CACHE_DIR", str(tmp_path / "cache"))
    a = torch.ones(3)
    kload.load(source(tmp_path), name="first", reload=False).load()
    assert pch_build.wait(600, root=tmp_path / "cache")
    define_first = write(tmp_path / "define_first.cpp", "#define CHECK_INPUT(x) (void)0\n"
                         + FULL_API.replace("OFFSET", "0"))
    capfd.readouterr()
    h = kload.load(define_first, name="define_first", reload=False, verbose=True)
    torch.testing.assert_close(h.full(a, a), expected(a, a))
    out = capfd.readouterr()
    assert "not used because `CHECK_INPUT' is defined" in out.out + out.err
    assert "may come before" in h.build().entry.manifest["pch"]["define_first.cpp"]


def test_extension_h_is_precompiled_for_classic_sources(tmp_path, monkeypatch):
    monkeypatch.setenv("KLOAD_CACHE_DIR", str(tmp_path / "cache"))
    code = """\
        #include <torch/extension.h>
        torch::Tensor twice(torch::Tensor x) { CHECK_INPUT(x); return x * %d; }
        PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def("twice", &twice); }
    """
    src = write(tmp_path / "twice.cpp", code % 2)
    h = kload.load(src, reload=False)
    assert h.twice(torch.ones(2)).tolist() == [2.0, 2.0]
    assert h.build().entry.manifest["pch"]["twice.cpp"].startswith("no precompiled <torch/extension.h> yet")
    assert pch_build.wait(900, root=tmp_path / "cache")
    write(src, code % 3)
    h = kload.load(src, reload=False)
    assert h.twice(torch.ones(2)).tolist() == [3.0, 3.0]
    assert h.build().entry.manifest["pch"]["twice.cpp"].startswith("used the precompiled <torch/extension.h>")


def test_compilers_and_flags_where_no_pch_applies(tmp_path, monkeypatch):
    """Not GCC, KLOAD_PCH=0, or a flag after which GCC cannot use one: no PCH is
    planned, and the build goes on without (plan level: nothing compiles here)."""
    from kload.cache.store import Store
    from kload.options import make_options
    from kload.compile.pch import not_applicable, plans_for
    from kload.plan.plan import make_plan

    store = Store(tmp_path / "cache")
    src = source(tmp_path)
    p = make_plan(make_options("n", [src], [], [], [], [], False, False, False), store)
    assert not_applicable(p) is None and [pp.header for pp in plans_for(p, store)] == ["kload/kernel.h"]
    clang = dataclasses.replace(p, cxx={"command": "clang++-14", "real": "/usr/lib/llvm-14/bin/clang",
                                        "family": "clang", "version": "clang 14.0.6"})  # as compiler_identity says
    assert not_applicable(clang) is None  # its own .pch (tests/test_clang.py)
    [pp] = plans_for(clang, store)
    assert pp.clang and pp.gch.name == "kernel.h.pch" and pp.key != plans_for(p, store)[0].key
    p = dataclasses.replace(p, cxx={"command": "icpx", "real": "/opt/intel/bin/icpx", "family": "other",
                                    "version": "icpx"})
    assert "neither GCC nor clang" in not_applicable(p) and plans_for(p, store) == []
    for flags in (["-include", "x.h"], ["-E"], ["-fsyntax-only"], ["-x", "c++"]):
        p = make_plan(make_options("n", [src], flags, [], [], [], False, False, False), store)
        assert "rules it out" in not_applicable(p) and plans_for(p, store) == []
    monkeypatch.setenv("KLOAD_PCH", "0")
    p = make_plan(make_options("n", [src], [], [], [], [], False, False, False), store)
    assert not_applicable(p) == "KLOAD_PCH=0" and plans_for(p, store) == []


def test_check_macros_given_to_gcc_are_checks_h():
    """Classic sources get CHECK_* as -D flags (so a precompiled <torch/extension.h>
    can serve them); those must say what kload/checks.h says."""
    import re

    from kload.options import include_dir
    from kload.plan.plan import CHECK_MACROS

    text = (include_dir() / "kload" / "checks.h").read_text().replace("\\\n", " ")
    found = {m[0]: " ".join(m[1].split()) for m in re.findall(r"#define (CHECK_\w+)\(x\)\s+(.*)", text)}
    assert found == {k: " ".join(v.split()) for k, v in CHECK_MACROS.items()}


def test_a_killed_precompile_blocks_nothing(tmp_path, monkeypatch, tally):
    """SIGKILL to a background precompile (started as %load_ext kload starts the cells')
    mid-compile: nothing is published, the lock dies with it, and the next precompile of
    that key runs and publishes. Before the kill: while a build holds the foreground lock
    its compiler is stopped, and it runs again when the build lets go (foreground.py)."""
    import signal
    import time

    from kload.cache.store import Store
    from kload.options import make_options
    from kload.compile.pch import plans_for, prebuild
    from kload.plan.plan import make_plan

    cache = tmp_path / "cache"
    monkeypatch.setenv("KLOAD_CACHE_DIR", str(cache))
    # a foreground lock of its own (under TMPDIR, here and in the worker): the other
    # pytest worker's builds must not stop this precompile
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    store = Store(cache)
    store.prepare()
    opts = make_options("killed", [source(tmp_path)], ["-O2"], [], [], [], False, False, False)
    [pp] = prebuild(opts, store)  # what %load_ext kload calls for the cells: it starts the missing ones
    assert pp.key == plans_for(make_plan(opts, store), store)[0].key
    worker = pch_build._started[(str(store.root), pp.key)]
    deadline = time.monotonic() + 120
    while not _compiler_states(worker.pid):
        assert time.monotonic() < deadline and worker.poll() is None, "the compiler never started"
        time.sleep(0.2)
    with foreground.held():  # what every build holds while it compiles
        assert _settles(worker.pid, "T"), "the precompile went on beside a build"
    assert _settles(worker.pid, "RSD"), "the precompile stayed stopped after the build"
    os.killpg(worker.pid, signal.SIGKILL)
    worker.wait()
    tally("kills survived")
    assert pch_build.check(pp, store) is None and not pp.path.exists()
    entry = pch_build.build(pp.spec)  # takes the lock at once: the killed holder's lock died with it
    assert entry is not None and pch_build.check(pp, store) is not None


def _compiler_states(pgid: int) -> str:
    """The states (R, S, T, ...) of the cc1plus processes of process group ``pgid``."""
    states = ""
    for p in (p for p in os.listdir("/proc") if p.isdigit()):
        try:
            if os.getpgid(int(p)) == pgid and b"cc1plus" in Path(f"/proc/{p}/cmdline").read_bytes():
                states += Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            pass
    return states


def _settles(pgid: int, states: str, seconds: float = 10) -> bool:
    """Whether every cc1plus of ``pgid`` is in one of ``states`` within ``seconds``."""
    import time

    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        now = _compiler_states(pgid)
        if now and all(c in states for c in now):
            return True
        time.sleep(0.05)
    return False
