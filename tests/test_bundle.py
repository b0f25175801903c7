"""Portable bundles (``kload cache export`` / ``kload cache import``): a real build
carried from one cache to an empty one and loaded there by a fresh process with
zero compiles; every refusal leaves the target cache exactly as it was."""
from __future__ import annotations

import hashlib
import io
import json
import os
import tarfile
from pathlib import Path
from types import SimpleNamespace

import pytest

from kload.cache.bundle import BUNDLE_MANIFEST, import_bundle
from kload.cache.key import full_key
from kload.cache.store import Store
from kload.errors import KloadError

from conftest import compiles, kload_cli, run_py, write

# a stable-ABI op library: ~2 s to compile here without a precompiled header
BTWICE = """\
    #include <kload/stable.h>
    kload::Tensor btwice(const kload::Tensor& x) {
      KLOAD_CHECK_DTYPE(x, kload::ScalarType::Float);
      kload::Tensor out = kload::empty_like(x), xc = kload::as_contiguous(x);
      for (int64_t i = 0; i < x.numel(); ++i) out.mutable_data_ptr<float>()[i] = 2 * xc.const_data_ptr<float>()[i] + 1;
      return out;
    }
    KLOAD_LIBRARY(m) { m.def("btwice(Tensor x) -> Tensor"); }
    KLOAD_IMPL(CPU, m) { m.impl("btwice", TORCH_BOX(&btwice)); }
"""

LOAD = """
    import json, torch, kload
    import kload.plan.plan as p
    full = []  # the full lookup plans: count the plans made
    real = p.make_plan
    p.make_plan = lambda *a, **k: full.append(1) or real(*a, **k)
    ops = kload.load({src!r}, reload=False)
    out = ops.btwice(torch.ones(3)).tolist()
    print(json.dumps({{"out": out, "how": kload.HISTORY[-1]["how"], "path": ops.build(), "full": len(full)}}))
"""


@pytest.fixture(scope="module")
def built(tmp_path_factory, cxx_wrapper):
    """One real build in cache A (through the counting compiler), exported by the CLI."""
    d = tmp_path_factory.mktemp("bundle")
    cxx, log = cxx_wrapper
    src = write(d / "src" / "btwice.cpp", BTWICE)
    env = {"KLOAD_CACHE_DIR": str(d / "a"), "KLOAD_PCH": "0", "CXX": str(cxx)}
    first = run_py(LOAD.format(src=str(src)), env=env)
    assert first["how"] == "built" and first["out"] == [3.0, 3.0, 3.0]
    bundle = d / "good.tar"
    proc = kload_cli("cache", "export", "btwice", "-o", bundle, env=env)
    assert proc.returncode == 0, proc.stderr
    assert "exported btwice-" in proc.stdout and bundle.stat().st_mode & 0o022 == 0
    return SimpleNamespace(src=src, env=env, bundle=bundle, log=log, dir=d)


def snapshot(root: Path) -> dict:
    """Every path under ``root`` with its mode and content hash (None: absent)."""
    if not root.exists():
        return {}
    out = {}
    for dirpath, dirs, files in os.walk(root):
        for n in dirs + files:
            p = Path(dirpath, n)
            data = None if p.is_dir() else hashlib.sha256(p.read_bytes()).hexdigest()
            out[str(p.relative_to(root))] = (p.lstat().st_mode, data)
    return out


def members(bundle: Path) -> list:
    with tarfile.open(bundle) as tf:
        return [(m, tf.extractfile(m).read() if m.isfile() else None) for m in tf.getmembers()]


def relist(items: list) -> list:
    """The same members with kload-bundle.json's file list recomputed to match them."""
    top = next(data for m, data in items if m.name == BUNDLE_MANIFEST)
    bm = json.loads(top)
    bm["files"] = {m.name: {"sha256": hashlib.sha256(data).hexdigest(), "size": len(data)}
                   for m, data in items if m.isfile() and m.name != BUNDLE_MANIFEST}
    blob = json.dumps(bm).encode()
    return [(m, blob if m.name == BUNDLE_MANIFEST else data) for m, data in items]


def pack(path: Path, items: list) -> Path:
    with tarfile.open(path, "w") as tf:
        for m, data in items:
            if data is not None:
                m.size = len(data)
            tf.addfile(m, io.BytesIO(data) if data is not None else None)
    path.chmod(0o600)
    return path


def entry_dir(items) -> str:
    return next(m.name.split("/")[1] for m, _ in items if m.name.endswith("/manifest.json"))


def flip(data: bytes) -> bytes:
    i = len(data) // 2
    return data[:i] + bytes([data[i] ^ 0xFF]) + data[i + 1:]


def extra(name: str, kind=tarfile.REGTYPE, data: bytes | None = b"x", **attrs):
    m = tarfile.TarInfo(name)
    m.type, m.mode = kind, attrs.pop("mode", 0o600)
    for k, v in attrs.items():
        setattr(m, k, v)
    return m, data if kind == tarfile.REGTYPE else None


def _artifact(items, edit):
    return [(m, edit(m, data) if m.name.endswith(".so") else data) for m, data in items]


def _mode(items, mode):
    for m, _ in items:
        if m.name.endswith(".so"):
            m.mode = mode
    return items


CASES = {
    "tampered artifact byte": (lambda it, d: _artifact(it, lambda m, b: flip(b)), "does not match the bundle manifest"),
    "tampered artifact, relisted": (lambda it, d: relist(_artifact(it, lambda m, b: flip(b))),
                                    "does not match the artifact"),
    "symlink member": (lambda it, d: it + [extra(f"entries/{d}/evil", tarfile.SYMTYPE, linkname="/etc/passwd")],
                       "is a symbolic link"),
    "hard link member": (lambda it, d: it + [extra(f"entries/{d}/evil", tarfile.LNKTYPE, linkname=BUNDLE_MANIFEST)],
                         "is a hard link"),
    "fifo member": (lambda it, d: it + [extra(f"entries/{d}/pipe", tarfile.FIFOTYPE)], "is a FIFO"),
    "dotdot member": (lambda it, d: it + [extra("entries/../../evil.so")], "'..'"),
    "absolute member": (lambda it, d: it + [extra("/tmp/kload-evil.so")], "absolute path"),
    "unlisted member": (lambda it, d: it + [extra(f"entries/{d}/notes.txt")], "not listed in the bundle manifest"),
    "listed file missing": (lambda it, d: [(m, b) for m, b in it if not m.name.endswith("/manifest.json")],
                            "missing from the bundle"),
    "group-writable member": (lambda it, d: _mode(it, 0o775), "writable by group or others (mode 775)"),
    "setuid member": (lambda it, d: _mode(it, 0o4700), "setuid"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_bad_bundle_is_refused_whole_and_changes_nothing(built, tmp_path, case):
    edit, message = CASES[case]
    items = members(built.bundle)
    bad = pack(tmp_path / "bad.tar", edit(items, entry_dir(items)))
    store = Store(tmp_path / "b")
    store.prepare()
    before = snapshot(store.root)
    with pytest.raises(KloadError, match="refusing bundle") as e:
        import_bundle(store, bad)
    assert message in str(e.value) and "Nothing was imported" in str(e.value)
    assert snapshot(store.root) == before
    # a cache that did not exist yet is not created by a refused import
    with pytest.raises(KloadError, match="refusing bundle"):
        import_bundle(Store(tmp_path / "fresh"), bad)
    assert not (tmp_path / "fresh").exists()


@pytest.mark.parametrize("mode,owner,message", [(0o666, None, "writable by group or others"),
                                                (0o602, None, "writable by group or others"),
                                                (0o600, 12345, "owned by uid 12345")])
def test_a_bundle_file_others_could_have_written_is_refused(built, tmp_path, mode, owner, message):
    copy = tmp_path / "copy.tar"
    copy.write_bytes(built.bundle.read_bytes())
    copy.chmod(mode)
    if owner is not None:
        if os.geteuid() != 0:
            pytest.skip("needs root to give the file another owner")
        os.chown(copy, owner, owner)
    store = Store(tmp_path / "b")
    store.prepare()
    before = snapshot(store.root)
    with pytest.raises(KloadError, match=message):
        import_bundle(store, copy)
    assert snapshot(store.root) == before


def test_import_into_an_empty_cache_then_a_fresh_process_loads_with_zero_compiles(built, tmp_path):
    cache_b = tmp_path / "b"
    env = dict(built.env, KLOAD_CACHE_DIR=str(cache_b))
    proc = kload_cli("cache", "import", built.bundle, env=env)
    assert proc.returncode == 0, proc.stderr
    assert "imported btwice-" in proc.stdout and "warning" not in proc.stdout
    for p in [cache_b, *cache_b.rglob("*")]:  # ours, private, whatever the tar said
        st = p.lstat()
        assert st.st_uid == os.geteuid() and st.st_mode & 0o077 == 0, p
    before = compiles(built.log)
    first = run_py(LOAD.format(src=str(built.src)), env=env)
    assert first["how"] == "cache" and first["out"] == [3.0, 3.0, 3.0]
    assert first["path"].startswith(str(cache_b / "entries")) and first["full"] == 1  # the index found it
    assert compiles(built.log) == before
    # the next fresh process takes the hit record: the imported artifact's stamp is this machine's
    second = run_py(LOAD.format(src=str(built.src)), env=env)
    assert second["how"] == "cache" and second["full"] == 0 and second["path"] == first["path"]
    assert compiles(built.log) == before


def test_reimport_is_idempotent_and_says_so(built, tmp_path):
    env = dict(built.env, KLOAD_CACHE_DIR=str(tmp_path / "b"))
    assert kload_cli("cache", "import", built.bundle, env=env).returncode == 0
    after_first = {k: v for k, v in snapshot(tmp_path / "b").items() if "last_used" not in k}
    again = kload_cli("cache", "import", built.bundle, env=env)
    assert again.returncode == 0, again.stderr
    assert "already present" in again.stdout and "imported 0 entries, skipped 1" in again.stdout
    assert {k: v for k, v in snapshot(tmp_path / "b").items() if "last_used" not in k} == after_first


def test_cli_exit_status_and_messages(built, tmp_path):
    env = dict(built.env, KLOAD_CACHE_DIR=str(tmp_path / "b"))
    items = members(built.bundle)
    bad = pack(tmp_path / "bad.tar", items + [extra(f"entries/{entry_dir(items)}/x", tarfile.SYMTYPE, linkname="/")])
    proc = kload_cli("cache", "import", bad, env=env)
    assert proc.returncode == 1 and "kload: refusing bundle" in proc.stderr and "symbolic link" in proc.stderr
    proc = kload_cli("cache", "import", tmp_path / "nowhere.tar", env=env)
    assert proc.returncode == 1 and "cannot read bundle" in proc.stderr
    proc = kload_cli("cache", "export", "no_such_library", "-o", tmp_path / "x.tar", env=built.env)
    assert proc.returncode == 1 and "no entry" in proc.stderr and not (tmp_path / "x.tar").exists()


def test_compressed_bundle_of_everything_round_trips(built, tmp_path):
    gz = tmp_path / "all.tar.gz"
    proc = kload_cli("cache", "export", "--all", "-o", gz, env=built.env)
    assert proc.returncode == 0, proc.stderr
    assert gz.read_bytes()[:2] == b"\x1f\x8b"
    results = import_bundle(Store(tmp_path / "c"), gz)
    assert [r["status"] for r in results] == ["imported"] and results[0]["name"] == "btwice"


def test_a_header_missing_here_is_a_warning_not_a_refusal(built, tmp_path):
    """An entry keyed by a header this machine lacks imports, and the import says a
    load here will not find it (the key covers the header's path and bytes)."""
    items = members(built.bundle)
    old = entry_dir(items)
    m = json.loads(next(b for i, b in items if i.name.endswith("/manifest.json")))
    m["headers"]["/opt/elsewhere/include/only_there.h"] = "0" * 64
    m["key"] = full_key(m["source_key"], m["headers"])
    new = f"{m['name']}-{m['key'][:16]}"
    bm = json.loads(next(b for i, b in items if i.name == BUNDLE_MANIFEST))
    bm["entries"][0].update(key=m["key"], dir=new)
    moved = []
    for i, b in items:
        i.name = i.name.replace(old, new)
        b = json.dumps(m).encode() if i.name.endswith("/manifest.json") else json.dumps(bm).encode() \
            if i.name == BUNDLE_MANIFEST else b
        moved.append((i, b))
    bundle = pack(tmp_path / "elsewhere.tar", relist(moved))
    proc = kload_cli("cache", "import", bundle, env=dict(built.env, KLOAD_CACHE_DIR=str(tmp_path / "b")))
    assert proc.returncode == 0, proc.stderr
    assert f"imported {new}" in proc.stdout
    assert "warning: 1 of its headers do not exist on this machine (e.g. /opt/elsewhere/include/only_there.h)" \
        in proc.stdout


def test_an_entry_for_another_torch_imports_with_a_warning(built, tmp_path):
    items = members(built.bundle)
    m = json.loads(next(b for i, b in items if i.name.endswith("/manifest.json")))
    m["inputs"]["torch"] = {"version": "1.0.0", "git": "0" * 40}  # as a classic entry built elsewhere records it
    items = [(i, json.dumps(m).encode() if i.name.endswith("/manifest.json") else b) for i, b in items]
    bundle = pack(tmp_path / "old-torch.tar", relist(items))
    proc = kload_cli("cache", "import", bundle, env=dict(built.env, KLOAD_CACHE_DIR=str(tmp_path / "b")))
    assert proc.returncode == 0, proc.stderr
    assert "warning: built for torch 1.0.0, this is torch " in proc.stdout
