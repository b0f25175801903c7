"""The identity of everything outside the
sources that shapes a binary.

Cheap on purpose: a cache hit must run no subprocess, so a compiler's version is
remembered in the cache directory, keyed by the compiler file's path, size and mtime.
"""
from __future__ import annotations

import os
import shutil
from functools import lru_cache
from pathlib import Path
from typing import NamedTuple

from ..errors import KloadError
from ..options import torch_identity, which
from kload.cache.store import read_json, write_json_atomic


def _toolkit(home: str | os.PathLike) -> bool:
    return Path(home, "bin", "nvcc").exists() and Path(home, "include", "cuda_runtime.h").exists()


@lru_cache(maxsize=None)
def _toolkit_behind(nvcc: str) -> str | None:
    """The toolkit an ``nvcc`` on PATH belongs to: its own folder's parent, or, for a
    wrapper script (``exec /usr/local/cuda-13.0/bin/nvcc "$@"``), the one it runs."""
    real = Path(nvcc).resolve()
    if _toolkit(real.parent.parent):
        return str(real.parent.parent)
    try:
        if real.stat().st_size < 65536:
            import re

            for found in re.findall(r"(/[^\s'\"]+)/bin/nvcc\b", real.read_text(errors="replace")):
                if _toolkit(found):
                    return found
    except OSError:
        pass
    return None


def find_cuda_home() -> str | None:
    """The CUDA toolkit: CUDA_HOME / CUDA_PATH, else the one behind the nvcc on PATH
    (through symlinks and wrapper scripts), else /usr/local/cuda. (torch guesses the
    parent of the nvcc on PATH, which for a wrapper in /usr/local/bin is /usr/local.)"""
    home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
    if home:
        return home
    nvcc = shutil.which("nvcc")
    if nvcc:
        found = _toolkit_behind(nvcc)
        if found:
            return found
    return "/usr/local/cuda" if Path("/usr/local/cuda/bin/nvcc").exists() else None


def pip_cuda_includes() -> list[str]:
    """The CUDA headers that came with a PyPI torch (nvidia/cu13/include, or
    nvidia/<lib>/include for CUDA 12): torch's CUDA headers include cusparse.h and
    cublas_v2.h, which a toolkit without those libraries lacks. Searched after the
    toolkit's own headers."""
    import torch

    root = Path(torch.__file__).resolve().parent.parent / "nvidia"
    return sorted(str(p) for p in root.glob("*/include") if p.is_dir()) if root.is_dir() else []


# With no GPU to ask and no TORCH_CUDA_ARCH_LIST, torch's loader fails with an
# IndexError. kload builds for A100 (8.0) and H100/H200 (9.0), plus PTX that newer
# GPUs compile at load; TORCH_CUDA_ARCH_LIST overrides it.
DEFAULT_CUDA_ARCHS = "8.0;9.0+PTX"


def cuda_unavailable_reason() -> str | None:
    """Why .cu sources cannot be built here, or None when they can."""
    ident = torch_identity()
    if ident["cuda"] is None:
        return f"the installed torch {ident['version']} is built without CUDA"
    home = find_cuda_home()
    if home is None or not Path(home, "bin", "nvcc").exists():
        return "nvcc was not found (set CUDA_HOME or put nvcc on PATH)"
    return None


class CudaArchs(NamedTuple):
    """The GPU architectures a CUDA build targets, and where that list came from."""

    archs: str    # TORCH_CUDA_ARCH_LIST's syntax: "8.0;9.0+PTX"
    origin: str   # "TORCH_CUDA_ARCH_LIST" (the caller's), "detected" (the GPUs here) or "default" (no GPU)

    def keyed(self) -> str:
        """As the cache key holds it: the caller's list as written, else ``origin:archs``."""
        return self.archs if self.origin == "TORCH_CUDA_ARCH_LIST" else f"{self.origin}:{self.archs}"


def cuda_archs() -> CudaArchs:
    """The GPU architectures a CUDA build targets (part of the key): TORCH_CUDA_ARCH_LIST,
    else those of the GPUs here, else DEFAULT_CUDA_ARCHS."""
    explicit = os.environ.get("TORCH_CUDA_ARCH_LIST")
    if explicit:
        return CudaArchs(explicit, "TORCH_CUDA_ARCH_LIST")
    import torch

    if torch.cuda.is_available():
        caps = sorted({torch.cuda.get_device_capability(i) for i in range(torch.cuda.device_count())})
        return CudaArchs(";".join(f"{a}.{b}" for a, b in caps), "detected")
    return CudaArchs(DEFAULT_CUDA_ARCHS, "default")


_memo: dict[str, dict] = {}


def memo(cache_root: Path) -> dict:
    """The cache's memo file (compiler versions, source scans), read once per process."""
    key = str(cache_root)
    if key not in _memo:
        _memo[key] = read_json(cache_root / "toolchain.json") or {}
    return _memo[key]


def save_memo(cache_root: Path) -> None:
    try:
        cache_root.mkdir(mode=0o700, parents=True, exist_ok=True)
        write_json_atomic(cache_root / "toolchain.json", memo(cache_root))
    except OSError:
        pass  # the memo only saves work next time


def is_gcc(identity: dict) -> bool:
    """Whether a compiler_identity() is GCC, as the compiler itself says (``__GNUC__``
    without ``__clang__``), through any wrapper (ccache, a site's ``cxx`` script)."""
    return identity.get("family") == "gcc"


def _ask_compiler(path: str) -> tuple[str, str, str | None]:
    """``(family, version, compiler proper)`` from the compiler's predefined macros, run
    by the name it was found under (a ccache symlink runs the compiler it stands for)."""
    import subprocess

    try:
        proc = subprocess.run([path, "-dM", "-E", "-x", "c++", os.devnull], capture_output=True, text=True,
                              timeout=60)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise KloadError(f"could not run {path} -dM -E: {e}") from e
    macros = dict(line.split(" ", 2)[1:] for line in proc.stdout.splitlines()
                  if line.startswith("#define ") and line.count(" ") >= 2)
    if "__clang__" in macros:
        return "clang", "clang " + macros.get("__clang_version__", "?").strip('"'), None
    # Intel's and NVIDIA's HPC compilers define __GNUC__ too; they are not GCC (nor its PCH format)
    if "__GNUC__" not in macros or any(m in macros for m in ("__INTEL_COMPILER", "__INTEL_LLVM_COMPILER",
                                                              "__NVCOMPILER", "__PGI")):
        return "other", "", None
    version = "gcc " + macros.get("__VERSION__", "?").strip('"')
    # the compiler proper (cc1plus) of the GCC that really compiles: its file is what an upgrade changes
    try:
        out = subprocess.run([path, "-print-prog-name=cc1plus"], capture_output=True, text=True, timeout=60)
        proper = os.path.realpath(out.stdout.strip()) if os.path.isabs(out.stdout.strip()) else None
    except (OSError, subprocess.TimeoutExpired):
        proper = None
    return "gcc", version, proper


def _stat_stamp(path: str) -> str | None:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return f"{path}|{st.st_ino}|{st.st_size}|{st.st_mtime_ns}"


def compiler_identity(command: str, cache_root: Path, ask: bool = True) -> dict:
    """``{"command", "version", "family", "proper" (GCC's cc1plus) or "real" (the resolved
    file)}`` of a compiler, from a stat-keyed memo when possible. ``ask``: identify a C/C++ compiler by its predefined macros (the
    compiler that really compiles, behind any wrapper); else (nvcc) by ``--version``."""
    path = which(command)
    if path is None:
        raise KloadError(f"compiler {command!r} not found on PATH (set CXX to a C++ compiler)")
    # the stamp follows links (a re-pointed link changes the inode); PATH: a wrapper such
    # as ccache's masquerade directory runs the next compiler of that name on PATH
    stamp = f"id3|{ask}|{_stat_stamp(path)}|{os.environ.get('PATH', '')}"
    known = memo(cache_root)
    found = known.get(stamp)
    # a wrapper (ccache) stays the same file when the GCC behind it is upgraded: its cc1plus does not
    if isinstance(found, list) and len(found) == 5 and (found[3] is None or _stat_stamp(found[3]) == found[4]):
        real, version, family, proper = found[:4]
    else:
        real = os.path.realpath(path)
        import subprocess

        try:
            proc = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=60)
        except (OSError, subprocess.TimeoutExpired) as e:
            raise KloadError(f"could not run {path} --version: {e}") from e
        lines = [t for t in (proc.stdout or proc.stderr).splitlines() if t.strip()]
        # gcc/clang name themselves on line 1; nvcc says "release X.Y" further down
        version = " | ".join(lines[:1] + [t for t in lines[1:] if "release" in t.lower()]) or "unknown"
        family, proper = "other", None
        if ask:
            family, said, proper = _ask_compiler(path)
            version = said or version
        known[stamp] = [real, version, family, proper, proper and _stat_stamp(proper)]
        save_memo(cache_root)
    # part of the key: what compiles, not how it is reached (ccache on PATH or not, /bin or
    # /usr/bin): for GCC its version and its compiler proper, for others the resolved file
    ident = {"command": command, "version": version, "family": family}
    if proper:
        ident["proper"] = proper
    else:
        ident["real"] = real
    return ident


def system_prefixes(with_cuda: bool) -> tuple[str, ...]:
    """Headers under these belong to torch, Python, the compiler or CUDA, which the
    key already covers by version; every other header is hashed by content."""
    import sysconfig

    import torch

    prefixes = [str(Path(torch.__file__).parent / "include"), "/usr/include/", "/usr/lib/"]
    for key in ("include", "platinclude"):
        p = sysconfig.get_paths().get(key)
        if p:
            prefixes.append(p)
    cuda_home = find_cuda_home()
    if with_cuda and cuda_home:
        prefixes.append(os.path.realpath(cuda_home))
        prefixes.append(cuda_home)
    return tuple(os.path.join(p, "") for p in prefixes)
