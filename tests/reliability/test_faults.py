"""Faults: a build killed mid-way, corrupt artifacts, a full or read-only cache."""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from conftest import compiler_running, kload_cli, last_json, run_code, tiny, tiny_call


def entry_dirs(cache: Path) -> list[Path]:
    d = cache / "entries"
    return [p for p in d.iterdir() if not p.name.startswith(".")] if d.exists() else []


def count_lost(cache: Path, before: list[Path], tally) -> None:
    """Every entry that existed before the fault is still there. The figure is how many
    entries were checked so (a lost one fails the test, so it is never counted)."""
    lost = [p for p in before if not (p / "manifest.json").exists()]
    assert not lost, f"entries lost: {lost}"
    tally("entries checked after a fault (each would fail its test if lost)", len(before))


def no_half_entries(cache: Path) -> None:
    for e in entry_dirs(cache):
        assert (e / "manifest.json").exists(), f"half entry left: {e}"


@pytest.mark.parametrize("when", ["first build", "rebuild after an edit"])
def test_sigkill_mid_build_blocks_nobody(tmp_path, tally, when):
    cache = tmp_path / "cache"
    env = {"KLOAD_CACHE_DIR": str(cache)}
    src = tiny(tmp_path, "killed", factor=2)
    if when == "rebuild after an edit":
        assert last_json(run_code(tiny_call(src, "killed"), env))["out"] == [2.0, 2.0]
        src = tiny(tmp_path, "killed", factor=5)
    before = entry_dirs(cache)
    victim = subprocess.Popen([sys.executable, "-c", textwrap.dedent(tiny_call(src, "killed"))],
                              env=dict(os.environ, **env), stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    deadline = time.time() + 120
    while not compiler_running(cache / "build"):
        assert victim.poll() is None, "the build finished before it could be killed"
        assert time.time() < deadline, "no compiler started"
        time.sleep(0.05)
    victim.send_signal(signal.SIGKILL)  # ninja and the compiler live on as orphans
    victim.wait()
    started = time.time()
    proc = run_code(tiny_call(src, "killed"), env, timeout=300)
    out = last_json(proc)
    assert out["out"] == ([2.0, 2.0] if when == "first build" else [5.0, 5.0])
    assert "interrupted" in proc.stderr  # it noticed, and started from a clean directory
    assert time.time() - started < 300
    no_half_entries(cache)
    count_lost(cache, before, tally)
    tally("kills survived")


CORRUPTIONS = {
    "truncated": lambda so: so.write_bytes(so.read_bytes()[: so.stat().st_size // 2]),
    "zeroed": lambda so: so.write_bytes(b"\0" * so.stat().st_size),
    "foreign": lambda so: shutil.copyfile("/bin/true", so),
    "same size, one byte flipped": lambda so: so.write_bytes(
        (lambda b: b[:4096] + bytes([b[4096] ^ 0xFF]) + b[4097:])(so.read_bytes())),
}


@pytest.mark.parametrize("how", list(CORRUPTIONS))
def test_corrupt_artifact_is_quarantined_and_rebuilt(tmp_path, tally, how):
    cache = tmp_path / "cache"
    env = {"KLOAD_CACHE_DIR": str(cache)}
    src = tiny(tmp_path, "corrupt", factor=4)
    so = Path(last_json(run_code(tiny_call(src, "corrupt"), env))["path"])
    st = so.stat()
    CORRUPTIONS[how](so)
    if how != "truncated":  # the worst case: size and mtime as recorded
        os.utime(so, ns=(st.st_atime_ns, st.st_mtime_ns))
    proc = run_code(tiny_call(src, "corrupt"), env)
    assert last_json(proc)["out"] == [4.0, 4.0]
    assert "quarantine" in proc.stderr
    q = list((cache / "quarantine").iterdir())
    assert len(q) == 1 and (q[0] / "QUARANTINED").exists()
    no_half_entries(cache)
    tally("corruptions detected")


def test_cache_verify_finds_and_quarantines(tmp_path, tally):
    cache = tmp_path / "cache"
    env = {"KLOAD_CACHE_DIR": str(cache)}
    good = Path(last_json(run_code(tiny_call(tiny(tmp_path, "vgood"), "vgood"), env))["path"])
    bad = Path(last_json(run_code(tiny_call(tiny(tmp_path, "vbad"), "vbad"), env))["path"])
    st = bad.stat()
    CORRUPTIONS["same size, one byte flipped"](bad)
    os.utime(bad, ns=(st.st_atime_ns, st.st_mtime_ns))
    proc = kload_cli("cache", "verify", env=env)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "BAD  vbad-" in proc.stdout and "ok   vgood-" in proc.stdout
    assert "1 ok, 1 quarantined" in proc.stdout
    assert good.exists() and not bad.exists()
    count_lost(cache, [good.parent], tally)
    assert kload_cli("cache", "verify", env=env).returncode == 0
    tally("corruptions detected")


def test_corrupt_manifest_and_index_are_misses_not_crashes(tmp_path, tally):
    cache = tmp_path / "cache"
    env = {"KLOAD_CACHE_DIR": str(cache)}
    src = tiny(tmp_path, "badjson", factor=6)
    so = Path(last_json(run_code(tiny_call(src, "badjson"), env))["path"])
    (so.parent / "manifest.json").write_text("{ not json")
    for idx in (cache / "index").iterdir():
        idx.write_bytes(b"\0\0\0")
    assert last_json(run_code(tiny_call(src, "badjson"), env))["out"] == [6.0, 6.0]
    tally("corruptions detected", 2)


# -- full and read-only cache directories (a real tmpfs mount: root only) ---------------

@pytest.fixture
def small_fs(tmp_path):
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    if os.geteuid() != 0 or subprocess.run(["mount", "-t", "tmpfs", "-o", "size=24m", "tmpfs", str(mnt)],
                                           capture_output=True).returncode != 0:
        pytest.skip("needs root to mount a small tmpfs (CI runs as root)")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], capture_output=True)


def seeded(fs: Path, tmp_path: Path, name: str, factor: int):
    """A cache on ``fs`` holding one built entry: (cache, env, its source, entries now)."""
    cache = fs / "cache"
    env = {"KLOAD_CACHE_DIR": str(cache)}
    src = tiny(tmp_path, name, factor=factor)
    assert last_json(run_code(tiny_call(src, name), env))["out"] == [float(factor)] * 2
    return cache, env, src, entry_dirs(cache)


def test_full_disk_is_a_clear_error_and_loses_no_entry(small_fs, tmp_path, tally):
    cache, env, kept, before = seeded(small_fs, tmp_path, "kept", 2)
    filler = small_fs / "filler"
    with open(filler, "wb") as f:  # fill the file system to the last block
        try:
            while True:
                f.write(b"\0" * (1 << 16))
                f.flush()
        except OSError:
            pass
    proc = run_code(tiny_call(tiny(tmp_path, "nospace"), "nospace"), env)
    assert proc.returncode != 0
    assert "kload: cannot write the cache" in proc.stderr and "full" in proc.stderr, proc.stderr[-2000:]
    # what was there still loads, and nothing half-written is left behind
    assert last_json(run_code(tiny_call(kept, "kept"), env))["out"] == [2.0, 2.0]
    no_half_entries(cache)
    count_lost(cache, before, tally)
    filler.unlink()
    assert last_json(run_code(tiny_call(tiny(tmp_path, "nospace"), "nospace"), env))["out"] == [2.0, 2.0]
    tally("full-disk builds refused cleanly")


def test_read_only_cache_serves_hits_and_refuses_builds_clearly(small_fs, tmp_path, tally):
    cache, env, kept, before = seeded(small_fs, tmp_path, "rokept", 3)
    subprocess.run(["mount", "-o", "remount,ro", str(small_fs)], check=True)
    try:
        assert last_json(run_code(tiny_call(kept, "rokept"), env))["out"] == [3.0, 3.0]
        proc = run_code(tiny_call(tiny(tmp_path, "romiss"), "romiss"), env)
        assert proc.returncode != 0 and "read-only file system" in proc.stderr, proc.stderr[-2000:]
    finally:
        subprocess.run(["mount", "-o", "remount,rw", str(small_fs)], check=True)
    no_half_entries(cache)
    count_lost(cache, before, tally)
    tally("read-only builds refused cleanly")
