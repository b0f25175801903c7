"""Making and checking one precompiled header (a cache entry of kind ``pch``), in
the background after a build or in its foreground; pch.py says which a build uses.

g++ takes ~12 s to parse <kload/kernel.h> (the whole ATen API) and ~30 s for
<torch/extension.h>; loading the same header precompiled takes about a second.
kload precompiles each once per compiler and flag set (pch.py says which a build
uses), as an entry of the cache:

    <root>/entries/pch-kernel_h-<key16>/kload/kernel.h.gch   the precompiled header (clang's: kernel.h.pch)
                                        kload/kernel.h       stub: #include_next <kload/kernel.h>
                                        manifest.json        kind, key, size, SHA-256, header closure

Before every use the entry is checked like any artifact (size, SHA-256 behind a
stat stamp, ownership); a damaged one is quarantined and reported, never used. It
is built with exactly the flags torch gives the build's C++ sources (read from the
ninja file torch writes), published atomically (a directory renamed into place),
counted in KLOAD_CACHE_MAX_SIZE and evicted least-recently-used like any entry.

A background build runs as ``python -m kload.compile.pch_build SPEC`` at the lowest CPU
priority, in a session of its own (it outlives a notebook cell or a script), under
a lock per key: one build per key on the machine at a time.
"""
from __future__ import annotations

import json
import logging
import os
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

from kload.cache import MANIFEST, SCHEMA, Entry, stamp_of
from kload.cache.key import file_sha256, sha256_now
from kload.cache.publish import publish, stage
from kload.cache.store import Store, read_json, write_atomic, write_json_atomic

from . import foreground, torchbuild
from .. import knobs
from ..plan import toolchain
from ..errors import KloadError
from ..options import include_dir

log = logging.getLogger("kload")

_SLUG = {"kload/kernel.h": "kernel_h", "kload/stable.h": "stable_h", "torch/extension.h": "extension_h"}


# include guards of kload's headers (torch/extension.h has #pragma once, which GCC's
# PCH remembers)
_GUARD = {"kload/kernel.h": "KLOAD_KERNEL_H_", "kload/stable.h": "KLOAD_STABLE_H_"}


# clang: the templates the header's own code needs instantiated once, in the .pch, not again at the end of
# every compile that loads it (kernel.h: 2.0 s -> 0.4 s a compile); no timestamps of the headers in it (their
# sizes are checked, and their content where -fpch-validate-input-files-content sees another mtime: a cache
# shared between machines, a torch installed again)
CLANG_BUILD_FLAGS = ["-fpch-instantiate-templates", "-Xclang", "-fno-pch-timestamp"]


def entry_dir(store: Store, header: str, key: str) -> Path:
    """(a header kload generates, the host half of a split .cu's #include block: "cuprefix")"""
    return store.entries / f"pch-{_SLUG.get(header, 'cuprefix')}-{key[:16]}"


def _lock(store: Store, key: str):
    """The lock of one key's precompile: one at a time on the machine; dies with its holder."""
    from filelock import FileLock

    return FileLock(str(store.locks / f"pch-{key[:16]}.lock"), mode=0o600)


class PchPlan:
    """One precompiled header for one build configuration."""

    __slots__ = ("header", "key", "path", "spec")

    def __init__(self, header: str, key: str, path: Path, spec: dict):
        self.header, self.key, self.path, self.spec = header, key, path, spec

    @property
    def clang(self) -> bool:
        """Made by clang (a ``.pch`` its compiles name with ``-include-pch``), not GCC."""
        return bool(self.spec.get("clang"))

    @property
    def artifact(self) -> str:
        return self.header + (".pch" if self.clang else ".gch")

    @property
    def gch(self) -> Path:
        """The precompiled file: GCC's ``.gch`` beside the stub, or clang's ``.pch``."""
        return self.path / self.artifact

    @property
    def stub(self) -> Path:
        return self.path / self.header


def header_file(header: str) -> str:
    """The real header that ``header`` names."""
    if header.startswith("kload/"):
        return str(include_dir() / header)
    import torch

    return str(Path(torch.__file__).parent / "include" / header)


def check(pp: PchPlan, store: Store) -> Entry | None:
    """The published, verified entry of ``pp``, or None. A damaged one is moved to
    quarantine (so that GCC cannot find it) and reported."""
    if not pp.path.exists():
        return None
    m = read_json(pp.path / MANIFEST)
    if m is None:
        problem = "it has no readable manifest"
    elif m.get("schema") != SCHEMA or m.get("kind") != "pch" or m.get("key") != pp.key:
        problem = "its manifest does not match its key"
    else:
        entry = Entry(pp.path, m)
        problem = store.check_artifact(entry)  # size, SHA-256 (behind the stat stamp), ownership
        if problem is None and not pp.stub.is_file():
            problem = f"its stub {pp.header} is missing"
        if problem is None:
            return entry
    dest = store.quarantine(pp.path, f"precompiled <{pp.header}>: {problem}")
    if dest is None and pp.path.exists():
        raise KloadError(f"the precompiled header {pp.path} is unusable ({problem}) and cannot be moved "
                         "aside; remove it, or set KLOAD_PCH=0")
    log.warning("the precompiled <%s> was unusable (%s); compiling without it, and building a new one",
                pp.header, problem)
    return None


def compile_flags(spec: dict) -> list[str]:
    """The flags torch.utils.cpp_extension gives a C++ source of this build, read
    from the ninja file torch writes for it (so they match whatever torch adds),
    less the per-extension name, which kernel.h and extension.h never read."""
    found = torchbuild.torch_ninja_variables(name="kload_pch", sources=["x.cpp"], cflags=spec["cflags"], cuda_cflags=[],
                                  include_paths=spec["include_paths"], with_cuda=spec["with_cuda"])
    flags = shlex.split(found.get("cflags", "")) + shlex.split(found.get("post_cflags", ""))
    return [f for f in flags if not f.startswith("-DTORCH_EXTENSION_NAME=")]


def _depfile_headers(depfile: Path, system: tuple[str, ...], header: str) -> dict[str, str]:
    """Every non-system file the precompile read, with its SHA-256."""
    text = depfile.read_text().replace("\\\n", " ")
    files = shlex.split(text.partition(":")[2]) if ":" in text else []
    out = {}
    for f in files:
        p = os.path.normpath(f)
        if p.startswith(system):
            continue
        sha = file_sha256(p)
        if sha is None:
            raise KloadError(f"a header the precompile of <{header}> read is unreadable now: {p}")
        out[p] = sha
    return out


def build(spec: dict, *, wait: bool = False, background: bool = False) -> Entry | None:
    """Build and publish the precompiled header ``spec`` describes (the body of a
    background build, and of ``kload build --pch``). Returns the entry, or None
    when another process holds its lock and ``wait`` is False. ``background``: the
    compiler stops while a build runs (foreground.py)."""
    from filelock import Timeout

    store = Store(Path(spec["root"]))
    store.prepare()
    header, key = spec["header"], spec["key"]
    pp = PchPlan(header, key, entry_dir(store, header, key), spec)
    lock = _lock(store, key)
    try:
        lock.acquire(timeout=-1 if wait else 0)
    except Timeout:
        return None
    try:
        done = check(pp, store)
        if done is not None:
            return done
        ws = store.builds / f"pch-{key[:16]}"
        shutil.rmtree(ws, ignore_errors=True)  # what a killed build left
        ws.mkdir(mode=0o700)
        gch, depfile = ws / ("out.pch" if pp.clang else "out.gch"), ws / "out.d"
        source = header_file(header)
        if "text" in spec:  # a header kload writes (cuda_split/build.py), with the flags of its compiles
            source = str(ws / "prefix.h")
            write_atomic(Path(source), spec["text"])
        try:
            flags = spec["flags"] if "flags" in spec else compile_flags(spec)
            cmd = ([spec["cxx"]] + flags + (CLANG_BUILD_FLAGS if pp.clang else [])
                   + ["-x", "c++-header", source, "-o", str(gch), "-MD", "-MF", str(depfile)])
        except Exception as e:  # noqa: BLE001 - a torch whose ninja writer kload cannot read
            _failed(store, key).write_text(f"{e}\n")
            raise KloadError(f"cannot precompile <{header}>: {e}") from None
        started, paused = time.perf_counter(), 0.0
        if background:
            returncode, paused = foreground.run_yielding(cmd, ws, ws / "compiler.out")
            output = (ws / "compiler.out").read_text(errors="replace")
        else:
            proc = subprocess.run(cmd, cwd=ws, capture_output=True, text=True)
            returncode, output = proc.returncode, proc.stdout + proc.stderr
        seconds = time.perf_counter() - started - paused
        write_atomic(ws / "build.log", shlex.join(cmd) + "\n" + output)
        if returncode != 0:
            # the key holds all that decides the outcome: do not try this one again
            _failed(store, key).write_text((ws / "build.log").read_text())
            raise KloadError(f"precompiling <{header}> failed (exit {returncode}); "
                             f"see {_failed(store, key)}")
        headers = _depfile_headers(depfile, toolchain.system_prefixes(spec["with_cuda"]) + (str(ws) + os.sep,),
                                   header)
        entry = _publish(store, pp, gch, headers, {"build_seconds": round(seconds, 3), "command": cmd,
                                                   "paused_seconds": round(paused, 3)})
        log.info("precompiled <%s> in %.1f s (%.0f MB): %s", header, seconds,
                 entry.manifest["size"] / 1e6, entry.path)
        shutil.rmtree(ws, ignore_errors=True)
        store.evict_after_publish(entry.path.name, knobs.cache_max_size())
        return entry
    finally:
        lock.release()


def _publish(store: Store, pp: PchPlan, gch: Path, headers: dict, extra: dict) -> Entry:
    """The .gch and its stub into a staging directory, then published (cache/publish.py):
    a reader sees no entry or a whole one."""
    staged = stage(store, pp.path.name)
    try:
        (staged / pp.header).parent.mkdir(mode=0o700, parents=True)
        final = staged / pp.artifact
        os.replace(gch, final)
        os.chmod(final, 0o600)
        # guarded like the header itself: a second #include after the .gch was used opens
        # the stub but not the real header (pch.py tells "used" from "not used" by that)
        guard = _GUARD.get(pp.header)
        body = f"#include_next <{pp.header}>\n"
        if "text" in pp.spec:  # a generated header: the stub is its text, opened where GCC refuses the .gch
            write_atomic(staged / pp.header, pp.spec["text"])
        else:
            write_atomic(staged / pp.header, f"// kload: the stub of the precompiled <{pp.header}>\n"
                         + (f"#ifndef {guard}\n{body}#endif\n" if guard else body))
        st = os.stat(final)
        manifest = dict(extra, schema=SCHEMA, kind="pch", name=f"pch:{pp.header}", header=pp.header, key=pp.key,
                        source_key=pp.key, artifact=pp.artifact, size=st.st_size,
                        sha256=sha256_now(final), stat=stamp_of(st), created=time.time(), headers=headers,
                        inputs=pp.spec["inputs"])
    except BaseException:
        shutil.rmtree(staged, ignore_errors=True)
        raise
    # an entry at pp.path is a damaged one that could not be quarantined: replaced
    return publish(store, staged, pp.path.name, manifest)


# -- in the background ----------------------------------------------------------------

_started: dict[tuple[str, str], subprocess.Popen] = {}  # (cache root, key) -> a background build started here


def _failed(store: Store, key: str) -> Path:
    """Marks a key whose precompile failed (it would fail again): holds the log."""
    return store.builds / f"pch-{key[:16]}.failed"


_said_failed: set[str] = set()


def start(pp: PchPlan, store: Store) -> bool:
    """Build ``pp`` in the background unless this process already started it,
    another process holds its lock, or it failed before. True if a build was
    started. Never raises: without a precompiled header a build is only slower."""
    from filelock import Timeout

    running = _started.get((str(store.root), pp.key))
    if running is not None and running.poll() is None:
        return False
    if _failed(store, pp.key).exists():
        if pp.key not in _said_failed:
            _said_failed.add(pp.key)
            log.warning("precompiling <%s> failed before (%s); compiling without it", pp.header,
                        _failed(store, pp.key))
        return False
    try:
        store.prepare()
        lock = _lock(store, pp.key)
        try:
            lock.acquire(timeout=0)
        except Timeout:
            return False  # being built by another process
        lock.release()    # the worker takes it for real (and checks again)
        spec_path = store.builds / f"pch-{pp.key[:16]}.json"
        write_json_atomic(spec_path, pp.spec)
        with open(store.builds / f"pch-{pp.key[:16]}.log", "ab") as out:
            _started[(str(store.root), pp.key)] = subprocess.Popen(
                [sys.executable, "-m", "kload.compile.pch_build", str(spec_path)], stdin=subprocess.DEVNULL,
                stdout=out, stderr=subprocess.STDOUT, start_new_session=True, close_fds=True)
    except (OSError, KloadError) as e:  # a full or read-only cache: no precompile, the build goes on
        log.warning("cannot start precompiling <%s>: %s", pp.header, e)
        return False
    log.info("precompiling <%s> in the background (%s)", pp.header, pp.path.name)
    return True


def wait(timeout: float | None = None, root: str | os.PathLike | None = None) -> bool:
    """Wait for the background builds this process started (for the cache at ``root``
    only, when given); True if all ended."""
    deadline = None if timeout is None else time.monotonic() + timeout
    matched = False
    for (where, _), p in list(_started.items()):
        if root is not None and where != str(root):
            continue
        matched = True
        try:
            p.wait(None if deadline is None else max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            return False
    return matched or root is None  # a root this process started nothing for: a caller's mistake


def _main(argv: list[str]) -> int:
    try:
        os.nice(19)  # never take a core from a foreground compile
    except OSError:
        pass
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    spec = json.loads(Path(argv[0]).read_text())
    try:
        build(spec, background=True)
    except (KloadError, OSError) as e:
        log.error("%s", e)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
