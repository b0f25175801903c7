"""What the link of an extension can rely on.

Two facts of a toolchain, found once by linking a tiny shared C++ library with it,
and remembered in the cache's memo (``toolchain.json``) under the compiler's
identity, ``PATH``, ``LIBRARY_PATH`` and the caller's link flags:

- whether the fast linker (gold) links at all here (gold refuses a dangling
  ``libstdc++.so`` that GNU ld silently skips);
- whether ``-lstdc++`` finds the *shared* C++ runtime. Where it does not (a GCC
  in its own prefix without a usable ``libstdc++.so``: conda toolchains, RHEL
  gcc-toolset, vendor GPU images), GNU ld links ``libstdc++.a`` into the
  extension without a word. The library then carries a private C++ runtime: an
  exception thrown inside it (``STD_TORCH_CHECK``) is unwound by torch's runtime,
  and the process dies with SIGSEGV. kload repairs that by naming the shared
  runtime (``-l:libstdc++.so.6``), verifies the repair on the probe, and refuses
  a toolchain it cannot repair.

And one check of every linked artifact before torch loads it (compile/pipeline.py):
a C++ library needs ``libstdc++.so.6`` and defines no C++ runtime symbol.
"""
from __future__ import annotations

import logging
import os
import subprocess
import tempfile
from pathlib import Path
from typing import NamedTuple

from ..errors import KloadError
from ..plan.toolchain import memo, save_memo, which

log = logging.getLogger("kload")

# Symbols only a C++ runtime defines: a library that defines one carries its own
RUNTIME_SYMBOLS = frozenset({"__cxa_throw", "__gxx_personality_v0", "__cxa_begin_catch", "_ZSt9terminatev"})
FAST_LINKER = "-fuse-ld=gold"
RUNTIME_FIX = "-l:libstdc++.so.6"  # the shared runtime by its file name: no static fallback
_PROBE = 'extern "C" void kload_link_probe(int x) { if (x) throw x; }\n'
_VERSION = 1  # of the memo's records


class LinkFacts(NamedTuple):
    fast_linker: bool          # gold links a shared C++ library with this toolchain
    runtime_flags: list[str]   # what the link needs to use the shared C++ runtime ([] where it does already)


class Artifact(NamedTuple):
    needed: list[str]          # DT_NEEDED
    defines_runtime: list[str]  # C++ runtime symbols it defines (a private runtime)
    uses_runtime: bool         # it imports C++ runtime symbols


def inspect(path: str | os.PathLike) -> Artifact:
    """What a shared library needs and defines, from ``readelf`` (binutils, beside every
    GNU toolchain)."""
    try:
        proc = subprocess.run(["readelf", "-W", "--dynamic", "--dyn-syms", str(path)], capture_output=True,
                              text=True, timeout=120)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise KloadError(f"cannot inspect {path} with readelf: {e}") from None
    if proc.returncode != 0:
        raise KloadError(f"cannot inspect {path} with readelf: {proc.stderr.strip()}")
    needed, defines, uses = [], [], False
    for line in proc.stdout.splitlines():
        if "(NEEDED)" in line and "[" in line:
            needed.append(line.rsplit("[", 1)[1].rstrip("]"))
            continue
        parts = line.split()
        # Num: Value Size Type Bind Vis Ndx Name
        if len(parts) >= 8 and parts[0].endswith(":") and parts[0][:-1].isdigit():
            sym = parts[7].split("@", 1)[0]
            if parts[6] == "UND":
                uses |= sym.startswith(("__cxa_", "__gxx_", "_ZSt", "_ZNSt", "_ZTVN10__cxxabiv"))
            elif sym in RUNTIME_SYMBOLS:
                defines.append(sym)
    return Artifact(needed, sorted(set(defines)), uses)


def private_runtime(art: Artifact) -> str | None:
    """Why a library carries a C++ runtime of its own, or None when it uses the shared one."""
    if art.defines_runtime:
        return f"it defines {', '.join(art.defines_runtime)}, so libstdc++.a was linked into it"
    if art.uses_runtime and not any(n.startswith("libstdc++.so") for n in art.needed):
        return "it uses the C++ runtime but does not need libstdc++.so.6"
    return None


def check_artifact(path: str | os.PathLike, name: str, cxx: dict) -> None:
    """Refuse a linked library that carries a private C++ runtime (before it is loaded)."""
    why = private_runtime(inspect(path))
    if why:
        raise KloadError(
            f"refusing to load {name!r}: {why}. An exception thrown in it would crash this process. "
            f"The compiler {cxx['command']} ({cxx['version']}) finds no usable shared libstdc++.so; "
            f"set CXX to a compiler that does (e.g. CXX=/usr/bin/g++). Nothing was cached.")


def _probe(cxx: str, obj: Path, flags: list[str], out: Path) -> tuple[Artifact | None, str]:
    """Link ``obj`` into a shared library with ``flags``: (what it is, or None, and the output)."""
    try:
        proc = subprocess.run([cxx, "-shared", str(obj), *flags, "-o", str(out)], capture_output=True,
                              text=True, timeout=120)
    except subprocess.TimeoutExpired:  # not a fact of the toolchain: nothing is remembered
        raise KloadError(f"the link probe of {cxx} did not finish in 120 s") from None
    except OSError as e:
        return None, str(e)
    if proc.returncode != 0:
        return None, (proc.stderr or proc.stdout).strip()
    return inspect(out), ""


def _find(cxx: str, ldflags: list[str], want_fast: bool) -> tuple[bool, list[str], str | None]:
    """Link the probe: (gold works, runtime flags, a note for the user or None).
    Raises KloadError for a toolchain whose runtime cannot be repaired."""
    user = [f for f in ldflags if not f.startswith("-fuse-ld")]
    try:
        tmp_dir = tempfile.TemporaryDirectory(prefix="kload-link-")
    except OSError as e:
        raise KloadError(f"no temporary directory for the link probe ({e}); set TMPDIR") from None
    with tmp_dir as tmp:
        src, obj = Path(tmp, "probe.cpp"), Path(tmp, "probe.o")
        src.write_text(_PROBE)
        try:
            proc = subprocess.run([cxx, "-fPIC", "-c", str(src), "-o", str(obj)], capture_output=True, text=True,
                                  timeout=120)
        except (OSError, subprocess.TimeoutExpired) as e:
            raise KloadError(f"the compiler {cxx} could not compile a one-line C++ file: {e}") from None
        if proc.returncode != 0:
            raise KloadError(f"the compiler {cxx} cannot compile a one-line C++ file:\n"
                             f"{(proc.stderr or proc.stdout).strip()}")
        out = Path(tmp, "probe.so")
        fast, notes = False, []
        if want_fast:
            art, err = _probe(cxx, obj, user + [FAST_LINKER], out)
            fast = art is not None and private_runtime(art) is None
            if art is None:
                notes.append(f"gold cannot link here ({err.splitlines()[-1] if err else 'failed'}); "
                             "linking with the compiler's default linker")
        art, err = _probe(cxx, obj, user, out)
        if art is None:
            raise KloadError(f"the compiler {cxx} cannot link a shared C++ library:\n{err}")
        why = private_runtime(art)
        if why is None:
            return fast, [], "; ".join(notes) or None
        fixed, err = _probe(cxx, obj, user + [RUNTIME_FIX], out)
        if fixed is None or private_runtime(fixed) is not None:
            raise KloadError(
                f"the compiler {cxx} links libstdc++.a into shared libraries (its libstdc++.so is "
                f"missing or unusable: {why}), and linking {RUNTIME_FIX} did not repair it"
                + (f" ({err.splitlines()[-1]})" if err else "")
                + ". Such a library crashes the process on its first C++ exception, so kload builds nothing with "
                "this compiler: set CXX to one with a working libstdc++.so (e.g. CXX=/usr/bin/g++).")
        if fast:  # gold with the repair, too
            art, _ = _probe(cxx, obj, user + [RUNTIME_FIX, FAST_LINKER], out)
            fast = art is not None and private_runtime(art) is None
        notes.append(f"{cxx} finds no usable shared libstdc++.so (a library linked with it would carry a private "
                     f"C++ runtime); kload links {RUNTIME_FIX} instead, checked on every build")
        return fast, [RUNTIME_FIX], "; ".join(notes)


def _key(cxx: dict, ldflags: list[str], want_fast: bool) -> str:
    return "|".join(["link", str(_VERSION), cxx["command"], cxx.get("proper") or cxx.get("real", ""), cxx["version"],
                     os.environ.get("PATH", ""),
                     os.environ.get("LIBRARY_PATH", ""), repr(list(ldflags)), str(want_fast)])


def link_facts(cxx: dict, ldflags: list[str], cache_root: Path, want_fast: bool) -> LinkFacts:
    """The toolchain's link facts, from the memo when known (one probe per toolchain)."""
    if want_fast and which("ld.gold") is None:
        want_fast = False
    key = _key(cxx, ldflags, want_fast)
    known = memo(cache_root)
    found = known.get(key)
    if isinstance(found, list) and len(found) == 2:
        return LinkFacts(bool(found[0]), list(found[1]))
    fast, flags, note = _find(cxx["command"], ldflags, want_fast)
    if note:
        from ..progress import say

        say(f"{note}", warning=True)
    known[key] = [fast, flags]
    save_memo(cache_root)
    return LinkFacts(fast, flags)


def forget_fast_linker(cxx: dict, ldflags: list[str], cache_root: Path) -> None:
    """A real link failed with gold where the probe passed: never try gold with this
    toolchain again (``ldflags``: the caller's, as link_facts had them)."""
    known = memo(cache_root)
    known[_key(cxx, ldflags, True)] = [False, list((known.get(_key(cxx, ldflags, True)) or [0, []])[1])]
    save_memo(cache_root)
