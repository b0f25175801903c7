"""The compile itself: one run of torch.utils.cpp_extension.load
for a plan (kload's flags beside the plan's), with the linked library checked
where torch would load it (it is not loaded here), and torch's "Error building
extension" turned into a CompileError. Also what a built library tells about
itself: the stable ABI's imports.
"""
from __future__ import annotations

import errno
import os
import shlex
import shutil
import subprocess
import sys
import threading
from pathlib import Path

from kload.cache.store import writable_error

from . import linking
from ..plan import toolchain
from ..errors import CompileError, KloadError, parse_diagnostics
from ..options import include_dir
from ..plan.plan import Plan


def _ensure_ninja_on_path() -> None:
    if shutil.which("ninja") is None:
        here = Path(sys.executable).parent
        if (here / "ninja").exists():
            os.environ["PATH"] = f"{here}{os.pathsep}{os.environ.get('PATH', '')}"
        else:
            raise KloadError("ninja is not installed (pip install ninja)")


def ninja_deps(ws: Path) -> dict[str, list[str]]:
    """object file -> every file its compile read (ninja's record of the depfiles)."""
    proc = subprocess.run(["ninja", "-t", "deps"], cwd=ws, capture_output=True, text=True)
    if proc.returncode != 0:
        raise KloadError(f"could not read the header dependencies in {ws}: {proc.stderr.strip()}")
    deps: dict[str, list[str]] = {}
    current: list[str] | None = None
    for line in proc.stdout.splitlines():
        if not line.strip():
            continue
        if not line.startswith(" "):
            current = deps.setdefault(line.split(":", 1)[0], []) if "#deps" in line else None
        elif current is not None:
            current.append(os.path.normpath(os.path.join(ws, line.strip())))
    return deps


def forget_objects(ws: Path, paths: set[str]) -> None:
    """Delete every object in ``ws`` whose compile read one of ``paths``: the next
    ninja run compiles it again."""
    if not (ws / ".ninja_deps").exists():
        return
    for obj, files in ninja_deps(ws).items():
        if paths.intersection(files):
            try:
                os.unlink(ws / obj)
            except FileNotFoundError:
                pass


# Undefined symbols that tie a library to one torch build or one Python (demangled by nm -C)
_VERSIONED_SYMBOL = r"(?:^|[^\w:])(?:at|c10|torch|caffe2|pybind11)::|^_?Py"


def check_stable_imports(artifact: Path, name: str) -> None:
    """A stable-ABI entry is keyed without the torch build and Python: make sure the
    binary imports neither (only the C shims aoti_torch_* / torch_*, libc, libstdc++)."""
    import re

    proc = subprocess.run(["nm", "-D", "-C", "--undefined-only", str(artifact)], capture_output=True, text=True)
    if proc.returncode != 0:
        raise KloadError(f"cannot list the symbols {artifact} imports (nm): {proc.stderr.strip()}")
    bad = [line.split(None, 1)[-1] for line in proc.stdout.splitlines()
           if re.search(_VERSIONED_SYMBOL, line.split(None, 1)[-1])]
    if bad:
        shown = "\n  ".join(bad[:5]) + (f"\n  ... and {len(bad) - 5} more" if len(bad) > 5 else "")
        raise KloadError(
            f"{name!r} is built as a stable-ABI library (it includes kload/stable.h or torch/csrc/stable/), "
            f"but it imports symbols of torch's C++ API or of Python, which would tie it to this torch build:\n  "
            f"{shown}\nInclude only <kload/stable.h>, torch/csrc/stable/ and torch/headeronly/ headers (a header of "
            "ATen, c10, torch/library.h or pybind11 included by one of your own headers does this).")


class _CheckedLoad:
    """While torch's loader builds: check the linked library where torch would load it
    (linking.check_artifact: a private C++ runtime would crash this process on the
    first exception), and do not load it. The library opens once, from its cache entry,
    where registration can be checked first (library.py: kload's macros register when
    asked; a library that registers as it opens is opened in a child first, by compile/pipeline.py);
    and a build that is refused never holds its build directory's path in this process
    (glibc would hand that handle back to the fixed build at the same path). Torch's
    private load step is wrapped where it has one; else the check runs right after."""

    def __init__(self, cpp_extension, plan: Plan, artifact: Path):
        self.mod, self.plan, self.artifact = cpp_extension, plan, artifact
        self.original = getattr(cpp_extension, "_import_module_from_library", None)
        self.checked = False

    def check(self) -> None:
        if not self.checked and not self.plan.standalone:
            linking.check_artifact(self.artifact, self.plan.name, self.plan.cxx)
        self.checked = True

    def __enter__(self):
        if self.original is not None:
            def checked(module_name, path, is_python_module, *args, **kwargs):
                self.check()
                if is_python_module:  # (kload asks for none)
                    return self.original(module_name, path, is_python_module, *args, **kwargs)
                return str(self.artifact)
            self.mod._import_module_from_library = checked
        return self

    def __exit__(self, *exc):
        if self.original is not None:
            self.mod._import_module_from_library = self.original
        if exc[0] is None:
            self.check()
        return False


def run(plan: Plan, ws: Path, sources: list[str], pch_cflags: list[str], link: list[str], artifact: Path) -> None:
    """torch's loader on the plan, in this directory, without its load step (_CheckedLoad);
    ``link``: the toolchain's link flags (build.link_flags, not keyed). One at a time per
    process: the checked load swaps a function of torch's."""
    with _ONE_AT_A_TIME:
        _run(plan, ws, sources, pch_cflags, link, artifact)


_ONE_AT_A_TIME = threading.RLock()


def _run(plan: Plan, ws: Path, sources: list[str], pch_cflags: list[str], link: list[str], artifact: Path) -> None:
    _ensure_ninja_on_path()
    from torch.utils import cpp_extension

    # torch remembers per process which sources it built under a name and skips
    # the build when they look unchanged; it cannot see headers, so forget that.
    versioner = getattr(cpp_extension, "JIT_EXTENSION_VERSIONER", None)
    if versioner is not None and hasattr(versioner, "entries"):
        versioner.entries.pop(plan.name, None)
    log_path = ws / "build.log"
    # torch's own function, even when kload.patch() (or anything on top of it) replaced the attribute
    torch_load = getattr(cpp_extension, "_kload_torch_load", cpp_extension.load)
    try:
        with _CheckedLoad(cpp_extension, plan, artifact):
            _torch_load(torch_load, plan, ws, sources, pch_cflags, link)
    except RuntimeError as e:
        _raise_build_error(plan, ws, log_path, e)
    except OSError as e:
        cause = e.__cause__ or e
        hint = ""
        if plan.cuda_skipped and "undefined symbol" in str(cause):
            hint = f"\n(its CUDA sources were not built: {plan.cuda_skipped})"
        raise KloadError(f"{plan.name!r} compiled but cannot be loaded: {cause}{hint}") from None


def extra_flags(plan: Plan, pch_cflags: list[str] | None) -> tuple[list[str], list[str]]:
    """What kload hands torch's loader as extra_cflags and extra_cuda_cflags: the plan's,
    ``pch_cflags`` (None: the plan's C++ flags left out too, as a split .cu's host half
    takes none of them), kload's include directory (after the precompiled headers'
    directories, so that g++ finds those first; nvcc has none), the CUDA headers of a
    PyPI torch after the toolkit's own (not keyed: torch's identity covers them) and
    nvcc --threads. Fresh lists: torch appends its own flags to them."""
    kload_include = "-I" + shlex.quote(str(include_dir()))
    cuda_includes = [f"-isystem {shlex.quote(p)}" for p in toolchain.pip_cuda_includes()] if plan.with_cuda else []
    cflags = ([] if pch_cflags is None else list(plan.cflags) + pch_cflags) + [kload_include] + cuda_includes
    cuda = list(plan.cuda_cflags) + [kload_include] + cuda_includes + nvcc_threads(plan.cuda_cflags)
    return cflags, cuda


def _torch_load(torch_load, plan: Plan, ws: Path, sources: list[str], pch_cflags: list[str], link: list[str]) -> None:
    cflags, cuda_cflags = extra_flags(plan, pch_cflags)
    torch_load(
        name=plan.name,
        sources=sources,
        extra_cflags=cflags,
        extra_cuda_cflags=cuda_cflags,
        extra_ldflags=list(plan.ldflags) + link,
        extra_include_paths=list(plan.opts.include_paths),
        build_directory=str(ws),
        verbose=plan.opts.verbose,
        with_cuda=plan.with_cuda,
        is_python_module=False,
        is_standalone=plan.standalone,
    )


def nvcc_threads(flags: list[str]) -> list[str]:
    """nvcc compiles each architecture of TORCH_CUDA_ARCH_LIST in turn (cicc, then
    ptxas); ``--threads`` runs them side by side. Not part of the key (same output)."""
    archs = [a for a in os.environ.get("TORCH_CUDA_ARCH_LIST", "").replace(";", " ").split() if a]
    n = min(len(archs), len(os.sched_getaffinity(0)))
    mine = any(f.split("=")[0] in ("-t", "--threads") for f in flags)
    return [f"--threads={n}"] if n > 1 and not mine else []


LEAN_HINT = ("\n(kload compiled its .cu with a lean <torch/extension.h>, torch/types.h without the Python half and "
             "the torch:: frontend: if a torch:: name is missing, set KLOAD_LEAN_CUDA=0)")


def _raise_build_error(plan: Plan, ws: Path, log_path: Path, e: RuntimeError) -> None:
    """torch's "Error building extension" as a CompileError (first errors, full log)."""
    text = str(e)
    if not text.startswith("Error building extension"):
        raise e
    output = text.split(":", 1)[1] if ":" in text else text
    if "No space left on device" in output or "Disk quota exceeded" in output:
        raise writable_error(ws.parent.parent, OSError(errno.ENOSPC, "No space left on device", str(ws)))
    if not output.strip() and plan.opts.verbose:
        # verbose builds print straight to the terminal; capture the failure once more
        proc = subprocess.run(["ninja", "-v"], cwd=ws, capture_output=True, text=True)
        output = proc.stdout + proc.stderr
    log_path.write_text(output)
    err = CompileError(plan.name, parse_diagnostics(output), log_path, output)
    if any(f.endswith(os.path.join("kload", "lean")) for f in plan.cuda_cflags) and "torch::" in output:
        err.args = (err.args[0] + LEAN_HINT,)
    raise err from None


def torch_ninja_variables(*, name: str, sources: list[str], cflags: list[str], cuda_cflags: list[str],
                          include_paths: list[str], with_cuda: bool) -> dict[str, str]:
    """The variables of the ninja file torch.utils.cpp_extension writes for a build
    (``cflags``, ``cuda_cflags``, ``cuda_post_cflags``, ``cxx``, ``nvcc``, ...): the flags
    torch gives each kind of source, whatever this torch adds."""
    import inspect
    import tempfile

    from torch.utils import cpp_extension

    writer = getattr(cpp_extension, "_write_ninja_file_to_build_library", None)
    if writer is None:
        raise KloadError("this torch has no ninja writer that kload can read flags from")
    with tempfile.TemporaryDirectory(prefix="kload-flags-") as d:
        values = dict(path=os.path.join(d, "build.ninja"), name=name, sources=list(sources),
                      extra_cflags=list(cflags), extra_cuda_cflags=list(cuda_cflags), extra_sycl_cflags=[],
                      extra_ldflags=[], extra_include_paths=list(include_paths),
                      with_cuda=with_cuda, with_sycl=False, is_standalone=False)
        params = inspect.signature(writer).parameters
        missing = [p for p, v in params.items() if p not in values and v.default is inspect.Parameter.empty]
        if missing:
            raise KloadError(f"torch's ninja writer wants {missing}, which kload does not know")
        writer(**{k: v for k, v in values.items() if k in params})
        text = Path(values["path"]).read_text()
    found = {}
    for line in text.splitlines():
        key, sep, value = line.partition(" = ")
        if sep and not line.startswith(" "):
            found[key.strip()] = value
    return found
