"""Compiling one split .cu (split.py's two halves) in
``<build dir>/split/``, with the commands torch's loader would have run on it.

    host half    g++ with the flags nvcc hands its host compiler (:func:`host_flags`) and
                 the .cu's #include block precompiled: a cache entry of kind pch
                 (pch_build.py), built here, in the foreground, at the block's first use
    device half  nvcc with the .cu's own command; its template kernels instantiated from
                 what the host half's object leaves undefined (nm), so it compiles after
                 the host half (without templates, beside it)
    check        every kernel stub and device variable the host object needs is defined
                 by the device object

Each object is reused while its command, its text and the user's headers it read are
unchanged (the record hashes them; torch's and CUDA's headers are keyed by their
identity): an edit of a kernel recompiles the device half only, an edit of the launcher
the host half. cuda_split/build.py decides which files are split and what a failure means.
"""
from __future__ import annotations

import hashlib
import os
import re
import shlex
import subprocess
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from kload.cache.key import digest, file_sha256
from kload.cache.store import Store, write_atomic

from . import split as cusplit
from ... import knobs
from .. import pch_build, torchbuild
from ...plan import toolchain
from ...options import which
from ...options import include_dir
from ...plan.plan import GCC_PARSE_FLAGS, Plan
from ...messages import msg

# nvcc flags that touch only device code (left out of the host half's command)
_DEVICE_FLAGS = re.compile(
    r"^-?-(?:gencode|generate-code|arch|gpu-architecture|code|gpu-code|expt-relaxed-constexpr|expt-extended-lambda|"
    r"extended-lambda|threads|t|use_fast_math|use-fast-math|lineinfo|generate-line-info|G|device-debug|Xptxas|"
    r"ptxas-options|maxrregcount|ftz|prec-div|prec-sqrt|fmad|diag-suppress|diag_suppress|Xcudafe|keep|"
    r"resource-usage|Wno-deprecated-gpu-targets|Wno-deprecated-declarations|display-error-number|"
    r"static-global-template-stub|Xnvlink|source-in-ptx|allow-unsupported-compiler|"
    r"device-entity-has-hidden-visibility)(?:=.*)?$")
_TAKES_VALUE = {"-gencode", "--generate-code", "-arch", "--gpu-architecture", "-code", "--gpu-code", "-t",
                "--threads", "-Xptxas", "--ptxas-options", "-maxrregcount", "--maxrregcount", "-Xcudafe",
                "-Xnvlink", "--diag-suppress", "-diag-suppress", "-ftz", "-prec-div", "-prec-sqrt", "-fmad"}
# host flags of nvcc's command line that mean the same to g++
_HOST_FLAGS = re.compile(r"^-(?:D|U|I|O|g|std=|f|W|m)")


class Failed(Exception):
    """One half did not compile (or the halves do not link): the output, and its log."""

    def __init__(self, half: str, output: str, log: Path):
        super().__init__(half)
        self.half, self.output, self.log = half, output, log


@dataclass
class Unit:
    """One .cu compiled in halves, and what compiling it found."""

    source: Path
    split: cusplit.Split
    stem: str
    notes: list[str] = field(default_factory=list)
    deps: dict[str, list[str]] = field(default_factory=dict)   # object -> the files its compile read
    objects: list[Path] = field(default_factory=list)
    pch: object | None = None                                   # the prefix's pch Entry, when one served


def host_flags(cuda_flags: list[str], cxx: str) -> list[str]:
    """nvcc's command line, as it reaches the host compiler: -D, -I, -O, -std and
    -Xcompiler's flags, without what concerns device code alone. A flag kload does not
    know makes the file compile whole (NotSplit), so that nothing changes its meaning."""
    out: list[str] = []
    it = iter(cuda_flags)
    for f in it:
        if f in ("-isystem", "-I", "-D", "-U", "-include"):
            out += [f, next(it, "")]
        elif f in ("-Xcompiler", "--compiler-options"):
            out += [x for x in next(it, "").split(",") if x]
        elif f.startswith(("-Xcompiler=", "--compiler-options=")):
            out += [x for x in f.split("=", 1)[1].split(",") if x]
        elif f in ("-ccbin", "--compiler-bindir") or f.startswith(("-ccbin=", "--compiler-bindir=")):
            host = next(it, "") if "=" not in f else f.split("=", 1)[1]
            if (which(host) or host) != (which(cxx) or cxx):
                raise cusplit.NotSplit(f"nvcc's host compiler {host} is not the C++ compiler {cxx}")
        elif f in _TAKES_VALUE:
            next(it, None)
        elif _DEVICE_FLAGS.match(f):
            continue
        elif _HOST_FLAGS.match(f):
            out.append(f)
        else:
            raise cusplit.NotSplit(f"kload does not know what nvcc's flag {f} does to host code")
    return out


class Tools:
    """The commands of one build's split units, and what they share: the job slots
    (MAX_JOBS), the record of the objects, the cache for the precompiled prefixes."""

    def __init__(self, plan: Plan, store: Store, folder: Path, sources: list[str]):
        cflags, cuda_cflags = torchbuild.extra_flags(plan, None)  # the plan's C++ flags are no .cu's
        found = torchbuild.torch_ninja_variables(name=plan.name, sources=sources, cflags=cflags,
                                                cuda_cflags=cuda_cflags, include_paths=list(plan.opts.include_paths),
                                                with_cuda=True)
        self.plan, self.store, self.dir = plan, store, folder
        self.cxx = shlex.split(found.get("cxx", "c++"))
        self.nvcc = shlex.split(found.get("nvcc", "nvcc"))
        self.cuda = shlex.split(found.get("cuda_cflags", "")) + shlex.split(found.get("cuda_post_cflags", ""))
        host = (shlex.split(found.get("cflags", "")) + shlex.split(found.get("post_cflags", ""))
                + GCC_PARSE_FLAGS + host_flags(self.cuda, self.cxx[-1]))
        self.forced = []  # -include FILE: the start of the precompiled prefix (GCC uses a PCH only first)
        while "-include" in host:
            i = host.index("-include")
            self.forced.append(host[i + 1])
            del host[i:i + 2]
        self.host = host
        self.jobs = threading.BoundedSemaphore(max(1, int(os.environ.get("MAX_JOBS") or "1")))
        self.lock = threading.Lock()
        self.record: dict = {}
        self.system = toolchain.system_prefixes(True) + (str(folder.parent) + os.sep,)

    def whole_command(self, source: Path) -> str:
        """nvcc's command for the whole file, as torch's loader would run it: what an
        editor's compilation database lists for a split .cu (clangd reads the .cu, not a half)."""
        return shlex.join(self.nvcc + self.cuda + ["-c", str(source), "-o", f"{source.stem}.cuda.o"])


def compile_unit(u: Unit, t: Tools) -> None:
    """Both halves of ``u`` (reused where the record allows), then the link check.
    Raises Failed."""
    sp = u.split
    prefix = "".join(f'#include "{f}"\n' for f in t.forced) + sp.prefix + "#include <kload/split/host.h>\n"
    inc = t.dir / "include"
    header = f"kload/split/prefix-{hashlib.sha256(prefix.encode()).hexdigest()[:16]}.h"
    if not (inc / header).is_file():  # named by its text: written once
        (inc / header).parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        write_atomic(inc / header, prefix)
    pch_dirs = _prefix_pch(header, prefix, u, t)
    host_src, host_obj = t.dir / f"{u.stem}.host.cpp", t.dir / f"{u.stem}.host.o"
    write_if_changed(host_src, f'#include "{header}"\n' + sp.host)
    cmd = (t.cxx + t.host + ["-Winvalid-pch"] + [f"-I{d}" for d in pch_dirs] + [f"-I{inc}"]
           + ["-MMD", "-MF", f"{host_obj}.d", "-c", str(host_src), "-o", str(host_obj)])
    device_src, device_obj = t.dir / f"{u.stem}.device.cu", t.dir / f"{u.stem}.device.o"
    stub = ["-static-global-template-stub=false"] if sp.templates and _nvcc_has_stub_flag(t.nvcc) else []
    dcmd = t.nvcc + ["-MD", "-MF", f"{device_obj}.d"] + t.cuda + ["-c", str(device_src), "-o", str(device_obj)] + stub

    def device() -> None:
        text = sp.device + (cusplit.instantiations(sp, nm(host_obj, undefined=True)) if sp.templates else "")
        write_if_changed(device_src, text)
        _object(u, t, "device", dcmd, device_src, device_obj)

    failed: list[Failed] = []

    def beside() -> None:
        try:
            device()
        except Failed as e:
            failed.append(e)

    # without templates the halves are independent: the device half compiles beside the host's
    side = None if sp.templates else threading.Thread(target=beside, daemon=True)
    if side:
        side.start()
    try:
        with _in_use(u.pch):  # eviction and `cache clear` wait while g++ reads it
            _object(u, t, "host", cmd, host_src, host_obj)
    finally:
        if side:
            side.join()
    if failed:
        raise failed[0]
    if sp.templates:
        device()
    _check_link(u, t, host_obj, device_obj)
    if pch_dirs and any(n.startswith("host half") for n in u.notes):
        used = not any(p.endswith(header) for p in u.deps.get(host_obj.name, []))
        u.notes.append(f"precompiled #include block {'used' if used else 'not used'}")
    u.objects = [host_obj, device_obj]


def _in_use(entry):
    from contextlib import nullcontext

    from kload.cache import entry_in_use

    return nullcontext() if entry is None else entry_in_use(entry.path)


def _prefix_pch(header: str, text: str, u: Unit, t: Tools) -> list[str]:
    """The entry directory of the host half's precompiled prefix (built now, in the
    foreground, when missing: never in the background, so no build waits for a paused
    one), or [] where no PCH applies (KLOAD_PCH=0)."""
    if not knobs.pch():
        return []
    plan = t.plan
    flags = [f for f in t.host if not f.startswith("-DTORCH_EXTENSION_NAME=")]  # no header reads it
    kload_headers = {n: file_sha256(str(include_dir() / "kload" / n)) for n in ("split/host.h", "checks.h")}
    inputs = {"text": text, "flags": flags, "cxx": plan.cxx, "torch": plan.torch, "python": plan.python,
              "env": plan.env, "kload_headers": kload_headers}
    if plan.host_cpu is not None:
        inputs["host_cpu"] = plan.host_cpu
    key = digest({"schema": 1, "kind": "pch", "inputs": inputs})
    spec = {"key": key, "header": header, "root": str(t.store.root), "inputs": inputs, "text": text,
            "cxx": which(t.cxx[-1]) or t.cxx[-1], "flags": flags, "with_cuda": True}
    pp = pch_build.PchPlan(header, key, pch_build.entry_dir(t.store, header, key), spec)
    entry = pch_build.check(pp, t.store)
    if entry is None:
        started = time.perf_counter()
        try:
            entry = pch_build.build(spec, wait=True)
        except Exception as e:  # noqa: BLE001 - without it the host half is only slower
            u.notes.append(f"no precompiled #include block ({e})")
            return []
        u.notes.append(f"precompiled its #include block in {time.perf_counter() - started:.1f} s")
    entry.touch()
    u.pch = entry
    return [str(pp.path)]


def _object(u: Unit, t: Tools, half: str, cmd: list[str], src: Path, obj: Path) -> None:
    """Compile ``src`` to ``obj`` unless the record says the same command, text and
    user headers made it."""
    with t.lock:
        rec = t.record.get(obj.name) or {}
    cmd_sha, src_sha = digest({"cmd": cmd}), file_sha256(str(src))
    if obj.is_file() and rec.get("cmd") == cmd_sha and rec.get("src") == src_sha \
            and all(file_sha256(p) == sha for p, sha in rec.get("deps", {}).items()):
        u.deps[obj.name] = rec.get("files", [])
        return
    log = t.dir / f"{obj.name}.log"
    with t.jobs:
        started = time.perf_counter()
        proc = subprocess.run(cmd, cwd=t.dir, capture_output=True, text=True)
        seconds = time.perf_counter() - started
    write_atomic(log, shlex.join(cmd) + "\n" + proc.stdout + proc.stderr)
    if proc.returncode != 0:
        with t.lock:
            t.record.pop(obj.name, None)
        raise Failed(f"{half} half", proc.stdout + proc.stderr, log)
    files = _depfile(Path(f"{obj}.d"))
    deps = {p: file_sha256(p) for p in files if not p.startswith(t.system) and p != str(src)}
    with t.lock:
        t.record[obj.name] = {"cmd": cmd_sha, "src": src_sha, "deps": deps, "files": files}
    u.deps[obj.name] = files
    u.notes.append(f"{half} half {seconds:.1f} s")


def _check_link(u: Unit, t: Tools, host_obj: Path, device_obj: Path) -> None:
    """Every kernel stub and device-variable reference the host object needs is in the
    device object: else the halves disagree about a type (the split is at fault)."""
    needed = [s for s in nm(host_obj, undefined=True)
              if s.startswith("kload_ref_") or s.startswith(tuple(f"void {k}{c}" for k in u.split.kernels
                                                                  for c in "(<"))]
    missing = sorted(set(needed) - set(nm(device_obj, undefined=False))) if needed else []
    if missing:
        raise Failed("link", LINK_MISMATCH + "; ".join(missing[:3]), t.dir / f"{host_obj.name}.log")


LINK_MISMATCH = msg("the device half does not define what the host half launches: ")

_stub_flag: dict[str, bool] = {}


def _nvcc_has_stub_flag(nvcc: list[str]) -> bool:
    """Whether this nvcc has -static-global-template-stub (the 12.x releases that made
    template kernels' host stubs static; older ones make them weak anyway)."""
    key = " ".join(nvcc)
    if key not in _stub_flag:
        try:
            out = subprocess.run(nvcc + ["--help"], capture_output=True, text=True, timeout=60).stdout
        except (OSError, subprocess.TimeoutExpired):
            out = ""
        _stub_flag[key] = "static-global-template-stub" in out
    return _stub_flag[key]


def _depfile(path: Path) -> list[str]:
    try:
        text = path.read_text().replace("\\\n", " ")
    except OSError:
        return []
    return [os.path.normpath(f) for f in shlex.split(text.partition(":")[2])] if ":" in text else []


def write_if_changed(path: Path, text: str) -> None:
    try:
        if path.read_text() == text:
            return
    except OSError:
        pass
    write_atomic(path, text)


def nm(obj: Path, *, undefined: bool) -> list[str]:
    """The demangled symbols an object leaves undefined, or defines."""
    proc = subprocess.run(["nm", "-C", "--undefined-only" if undefined else "--defined-only", str(obj)],
                          capture_output=True, text=True)
    return [parts[-1] for line in proc.stdout.splitlines()
            if (parts := line.split(None, 1 if undefined else 2))]
