"""The cache you manage: the CLI, the size limit, JIT disabled, permissions, ccache."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
from pathlib import Path

import pytest

from conftest import compiles, kload_cli, last_json, run_code, tiny, tiny_call, write


def names(cache: Path) -> set[str]:
    d = cache / "entries"
    return {p.name.rsplit("-", 1)[0] for p in d.iterdir() if not p.name.startswith(".")} if d.exists() else set()


def age(cache: Path, name: str, seconds: float) -> None:
    """Move an entry's last-use stamp back in time (the stamp LRU reads)."""
    for p in (cache / "entries").iterdir():
        if p.name.startswith(name + "-"):
            t = time.time() - seconds
            os.utime(p / "last_used", (t, t))


@pytest.mark.slow
def test_list_info_explain_build(tmp_path, cxx_wrapper):
    cxx, log = cxx_wrapper
    cache = tmp_path / "cache"
    env = {"KLOAD_CACHE_DIR": str(cache), "CXX": str(cxx)}
    write(tmp_path / "detail" / "scale.h", "#define SCALE 2\n")
    src = write(tmp_path / "cli_op.cpp", """\
        #include <kload/kernel.h>
        #include "detail/scale.h"
        at::Tensor cli_op(const at::Tensor& x) { return x.mul(SCALE); }
        KLOAD_LIBRARY(m) { m.def("cli_op(Tensor x) -> Tensor"); }
        KLOAD_IMPL(CPU, m) { m.impl("cli_op", &cli_op); }
    """)
    miss = kload_cli("explain", src, env=env)
    assert miss.returncode == 0 and miss.stdout.startswith("miss") and "no entries yet" in miss.stdout
    before = compiles(log, "cli_op.cpp")  # the wrapper's log is the session's: count from here
    built = kload_cli("build", src, env=env)
    assert built.returncode == 0 and "built in" in built.stdout, built.stderr
    assert compiles(log, "cli_op.cpp") == before + 1
    assert "already in the cache" in kload_cli("build", src, env=env).stdout
    # a prebuilt entry serves a process that may not compile
    out = last_json(run_code(tiny_call(src, "cli_op"), {**env, "KLOAD_DISABLE_JIT": "1"}))
    assert out["out"] == [2.0, 2.0] and compiles(log, "cli_op.cpp") == before + 1

    listing = kload_cli("cache", "list", env=env)
    assert listing.returncode == 0
    import torch

    assert "cli_op" in listing.stdout and torch.__version__ in listing.stdout
    rows = json.loads(kload_cli("cache", "list", "--json", env=env).stdout)
    assert len(rows) == 1 and rows[0]["name"] == "cli_op" and rows[0]["size"] > 0
    info = json.loads(kload_cli("cache", "info", rows[0]["key"][:10], env=env).stdout)
    assert info["inputs"]["torch"]["version"] and info["inputs"]["cxx"]["version"]
    assert any(h.endswith("detail/scale.h") for h in info["headers"])

    assert kload_cli("explain", src, env=env).stdout.startswith("hit:")
    flags = kload_cli("explain", src, "--cflags=-O2", env=env).stdout
    assert "miss" in flags and "cflags: -O2 added" in flags
    write(tmp_path / "detail" / "scale.h", "#define SCALE 3\n")
    header = kload_cli("explain", src, env=env).stdout
    assert "header detail/scale.h changed" in header, header
    env_change = kload_cli("explain", src, env={**env, "TORCH_CUDA_ARCH_LIST": "9.0"}).stdout
    assert "env TORCH_CUDA_ARCH_LIST: unset → 9.0" in env_change, env_change


def test_disable_jit_refuses_a_miss_and_compiles_nothing(tmp_path, cxx_wrapper):
    cxx, log = cxx_wrapper
    cache = tmp_path / "cache"
    env = {"KLOAD_CACHE_DIR": str(cache), "CXX": str(cxx)}
    src = tiny(tmp_path, "nojit", factor=2)
    last_json(run_code(tiny_call(src, "nojit"), env))
    before = compiles(log, "nojit.cpp")
    proc = run_code(tiny_call(src, "nojit", extra=", extra_cflags=['-DCHANGED=1']"),
                    {**env, "KLOAD_DISABLE_JIT": "1"})
    assert proc.returncode != 0
    assert "KLOAD_DISABLE_JIT=1" in proc.stderr and "cflags: -DCHANGED=1 added" in proc.stderr, proc.stderr
    assert "python -m kload build" in proc.stderr
    assert compiles(log, "nojit.cpp") == before and names(cache) == {"nojit"}


@pytest.mark.slow
def test_size_limit_evicts_least_recently_used_never_one_in_use(tmp_path):
    from kload.cache.store import Store, dir_size, entry_in_use

    cache = tmp_path / "cache"
    env = {"KLOAD_CACHE_DIR": str(cache), "KLOAD_CACHE_MAX_SIZE": "0"}
    for n in ("lru_a", "lru_b", "lru_c"):
        last_json(run_code(tiny_call(tiny(tmp_path, n), n), env))
    age(cache, "lru_a", 3 * 3600)   # oldest use
    age(cache, "lru_b", 2 * 3600)
    age(cache, "lru_c", 1 * 3600)
    store = Store(cache)
    one = max(dir_size(e.path) for e in store.all_entries())
    # room for two and a half entries: building a fourth evicts the two least recently used
    limit = str(int(2.5 * one))
    last_json(run_code(tiny_call(tiny(tmp_path, "lru_d"), "lru_d"), {**env, "KLOAD_CACHE_MAX_SIZE": limit}))
    assert names(cache) == {"lru_c", "lru_d"}
    # ...but never an entry a process is loading, however old
    age(cache, "lru_c", 9 * 3600)
    age(cache, "lru_d", 8 * 3600)
    c = next(e for e in store.all_entries() if e.manifest["name"] == "lru_c")
    with entry_in_use(c.path):
        removed = store.evict_to(0)
    assert {e.manifest["name"] for e in removed} == {"lru_d"} and names(cache) == {"lru_c"}
    # prune from the CLI: by size (recently used entries stay), then by age
    last_json(run_code(tiny_call(tiny(tmp_path, "lru_e"), "lru_e"), env))
    proc = kload_cli("cache", "prune", "--max-size", "1", env=env)
    assert proc.returncode == 0 and "removed 1 entries" in proc.stdout and names(cache) == {"lru_e"}, proc.stdout
    assert "last used 9 h ago" in proc.stdout
    age(cache, "lru_e", 40 * 86400)
    proc = kload_cli("cache", "prune", "--older-than", "30", env=env)
    assert proc.returncode == 0 and "removed 1 entries" in proc.stdout and names(cache) == set()
    cleared = kload_cli("cache", "clear", env=env)
    assert cleared.returncode == 0 and names(cache) == set()


def test_private_cache_refuses_shared_or_foreign(tmp_path):
    cache = tmp_path / "cache"
    env = {"KLOAD_CACHE_DIR": str(cache)}
    src = tiny(tmp_path, "mine", factor=2)
    last_json(run_code(tiny_call(src, "mine"), env))
    assert cache.stat().st_mode & 0o777 == 0o700
    entry = next(p for p in (cache / "entries").iterdir())
    assert entry.stat().st_mode & 0o777 == 0o700 and (entry / "manifest.json").stat().st_mode & 0o777 == 0o600
    os.chmod(cache, 0o777)
    proc = run_code(tiny_call(src, "mine"), env)
    assert proc.returncode != 0 and "writable by group or others" in proc.stderr
    cli = kload_cli("cache", "list", env=env)
    assert cli.returncode == 1 and "writable by group or others" in cli.stderr and "Traceback" not in cli.stderr
    os.chmod(cache, 0o700)
    if os.geteuid() == 0:  # root can hand an entry to another user
        os.chown(entry, 65534, 65534)
        proc = run_code(tiny_call(src, "mine"), env)
        assert proc.returncode != 0 and "owned by uid 65534" in proc.stderr
        os.chown(entry, 0, 0)
    os.chmod(entry / "mine.so", 0o777)
    proc = run_code(tiny_call(src, "mine"), env)
    assert proc.returncode != 0 and "writable by group or others" in proc.stderr
    os.chmod(entry / "mine.so", 0o700)
    assert last_json(run_code(tiny_call(src, "mine"), env))["out"] == [2.0, 2.0]


BAD_INPUTS = [
    [], ["bogus"], ["cache"], ["cache", "bogus"], ["cache", "info"], ["cache", "info", "ab"],
    ["cache", "info", "ffffffffffff"], ["cache", "prune"], ["cache", "prune", "--max-size", "10X"],
    ["cache", "prune", "--max-size", "-5G"], ["cache", "prune", "--older-than", "abc"],
    ["cache", "prune", "--older-than", "-1"], ["build"], ["build", "/nonexistent/x.cpp"],
    ["build", "{txt}"], ["build", "{src}", "--name", "1bad"], ["build", "{src}", "-I", "/nonexistent"],
    ["explain", "/nonexistent/x.cpp"], ["build", "{src}", "--cflags", "'unbalanced"],
]


def test_cli_bad_inputs_are_one_clear_line(tmp_path, tally):
    env = {"KLOAD_CACHE_DIR": str(tmp_path / "cache")}
    src = tiny(tmp_path, "cli_bad")
    txt = write(tmp_path / "notes.txt", "hello\n")
    for argv in BAD_INPUTS:
        argv = [a.format(src=src, txt=txt) for a in argv]
        proc = kload_cli(*argv, env=env)
        assert proc.returncode in (1, 2), (argv, proc.returncode, proc.stdout, proc.stderr)
        assert "Traceback" not in proc.stderr, (argv, proc.stderr)
        assert proc.stderr.strip(), argv
        tally("bad CLI inputs tried")
    assert not (tmp_path / "cache" / "entries").exists() or not any((tmp_path / "cache" / "entries").iterdir())


@pytest.mark.skipif(shutil.which("ccache") is None, reason="ccache is not installed (make test installs it as root)")
def test_ccache_launcher_serves_a_cold_build_after_clear(tmp_path):
    cache = tmp_path / "cache"
    env = {"KLOAD_CACHE_DIR": str(cache), "KLOAD_CXX_LAUNCHER": "ccache", "CCACHE_DIR": str(tmp_path / "ccache")}
    src = tiny(tmp_path, "ccached", factor=7)

    def stats() -> dict:
        out = subprocess.run(["ccache", "--print-stats"], capture_output=True, text=True,
                             env={**os.environ, **env}).stdout
        return {k: int(v) for k, v in (line.split("\t") for line in out.splitlines() if "\t" in line)
                if v.isdigit()}

    assert last_json(run_code(tiny_call(src, "ccached"), env))["out"] == [7.0, 7.0]
    first = stats()
    assert first.get("cache_miss", 0) >= 1
    assert kload_cli("cache", "clear", env=env).returncode == 0
    assert last_json(run_code(tiny_call(src, "ccached"), env))["out"] == [7.0, 7.0]
    second = stats()
    hits = second.get("direct_cache_hit", 0) + second.get("preprocessed_cache_hit", 0)
    assert hits >= 1, second  # the op's translation unit came from ccache
    assert "ccache" in (cache / "launchers").iterdir().__next__().joinpath("c++").read_text()
