"""The CUDA edit loop as users write CUDA: an ordinary .cu with ATen in it, edited and
rebuilt, in one run, sides alternating (issue 34):

    PYTHON benchmarks/tutorial_cuda.py [--repeat N] [--style tutorial|op_library]
    (a CUDA build of torch: make upgrade-check's venv; no GPU needed, it times the build)

Two styles of .cu:
- tutorial: section 4.1 (examples/tutorial_my_ops_cuda.cu: <torch/extension.h> +
  ATen/cuda/CUDAContext.h, a float kernel and its launcher; pybind11 in the .cpp);
- op_library: examples/vector_add_cuda.cu (<kload/kernel.h> + ATen/cuda/CUDAContext.h +
  CUDAGuard, a template kernel through AT_DISPATCH over four dtypes, KLOAD_IMPL(CUDA)).

Three sides:
- torch: torch.utils.cpp_extension.load, the same architectures (for the op library a
  one-line .cpp defines the namespace kload's build would give it);
- kload whole: KLOAD_SPLIT_CUDA=0, nvcc compiles the .cu whole (kload until issue 34);
- kload split: the .cu in two halves (docs/design.md, "a .cu in two halves").

Each side builds cold once (timed, not the target), then each repeat makes two edits,
each timed to a rebuilt library in a fresh process: a constant in the kernel's body,
then one in the host launcher. Nothing about the user's source changes otherwise.
kload runs as a user meets it: KLOAD_PCH on, its edits start at once after the cold
build and after each other, beside the background precompiles that its builds start
(the table says how many edits met one running); torch's edits start on a quiet machine.
"""
from __future__ import annotations

import argparse
import os
import re
import shlex
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import py, wait_quiet  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
EX = ROOT / "examples"
ARCHS = "8.0;9.0+PTX"  # kload's choice where no GPU is visible (torch's loader needs one given)
NS_SHIM = ('namespace kload { namespace detail {\n'
           '__attribute__((visibility("hidden"))) const char* ns() { return "torch_vector_add"; }\n}}\n')

# style -> (.cpp, .cu, (kernel-body edit: pattern, replacement), (launcher edit: ...))
STYLES = {
    "tutorial": (EX / "tutorial_my_ops_cuda.cpp", EX / "tutorial_my_ops_cuda.cu",
                 (r"out\[i\] = a\[i\] \+ b\[i\][^;]*;", "out[i] = a[i] + b[i] + {k} - {k};"),
                 (r"dim3 blocks\([^;]*\);", "dim3 blocks(256 + {k} - {k});")),
    "op_library": (EX / "vector_add.cpp", EX / "vector_add_cuda.cu",
                   (r"out\[i\] = a\[i\] \+ b\[i\][^;]*;", "out[i] = a[i] + b[i] + scalar_t({k}) - scalar_t({k});"),
                   (r"const int threads = [^;]*;", "const int threads = 256 + {k} - {k};")),
}
SIDES = ("torch", "kload whole", "kload split")

KLOAD = """
import json, time, kload
t = time.perf_counter()
h = kload.load(*{paths!r}, name="edit_loop").build()
print(json.dumps([time.perf_counter() - t, h.entry.manifest.get("cuda_split") or {{}}]))
"""
TORCH = """
import json, time
from torch.utils.cpp_extension import load
t = time.perf_counter()
load(name="edit_loop", sources={paths!r}, build_directory={ws!r}, is_python_module={pym!r},
     extra_cuda_cflags={flags!r}, extra_cflags={flags!r}, extra_include_paths={incs!r})
print(json.dumps([time.perf_counter() - t, {{}}]))
"""
# the tutorial uses CHECK_* without defining them (kload defines them); torch cannot build it without
# (quoted: torch's ninja file hands flags to a shell)
CHECKS = [shlex.quote(f) for f in ("-DCHECK_INPUT(x)=TORCH_CHECK(x.is_contiguous())",
                                   "-DCHECK_CUDA(x)=TORCH_CHECK(x.is_cuda())")]


def background_running(cache: Path) -> bool:
    """Whether a background precompile of this cache runs now."""
    for pid in (p for p in os.listdir("/proc") if p.isdigit()):
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        if b"kload.compile.pch_build" in cmd and str(cache).encode() in cmd:
            return True
    return False


def setup(style: str, side: str, work: Path) -> dict:
    from kload.plan.toolchain import find_cuda_home, pip_cuda_includes

    cpp, cu, *_ = STYLES[style]
    d = work / style / side.replace(" ", "_")
    (d / "ws").mkdir(parents=True)
    paths = [str(shutil.copy(cpp, d / cpp.name)), str(shutil.copy(cu, d / cu.name))]
    # torch's loader guesses CUDA_HOME from nvcc's folder (/usr/local for /usr/local/bin/nvcc): tell it;
    # TORCH_NO_COMPILER_WRAPPER: recent torch puts a ccache found on PATH in front of the compilers
    env = {"KLOAD_CACHE_DIR": str(d / "cache"), "TORCH_CUDA_ARCH_LIST": ARCHS, "MAX_JOBS": "2",
           "CUDA_HOME": find_cuda_home(), "TORCH_NO_COMPILER_WRAPPER": "1",
           "KLOAD_SPLIT_CUDA": "0" if side == "kload whole" else "1"}
    if side == "torch":
        incs, flags = [], list(CHECKS) if style == "tutorial" else []
        if style == "op_library":  # kload/kernel.h: its checks.h defines them
            (d / "ns.cpp").write_text(NS_SHIM)
            paths.append(str(d / "ns.cpp"))
            incs = [str(ROOT / "kernels" / "include")]
        # torch's CUDA headers include cusparse.h & co., which a PyPI torch keeps in nvidia/*/include
        flags += [f"-isystem {p}" for p in pip_cuda_includes()]
        code = TORCH.format(paths=paths, ws=str(d / "ws"), pym=style == "tutorial", flags=flags, incs=incs)
    else:
        code = KLOAD.format(paths=paths)
    return {"dir": d, "cu": Path(paths[1]), "env": env, "code": code, "cold": None,
            "kernel": [], "launcher": [], "met": 0, "edits": 0, "note": {}}


def run(side: str, s: dict) -> tuple[float, dict]:
    if side == "torch":
        wait_quiet()  # a torch user has no kload in the background
    elif background_running(s["dir"] / "cache"):
        s["met"] += 1
    seconds, note = py(s["code"], s["env"])
    return seconds, note


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--style", choices=sorted(STYLES), action="append")
    ap.add_argument("--baseline-repeat", type=int, default=None,
                    help="edits of each kind for torch and kload whole (default: --repeat)")
    args = ap.parse_args()
    import torch

    if torch.version.cuda is None or shutil.which("nvcc") is None:
        sys.exit("needs a CUDA build of torch and nvcc on PATH")
    work = Path(tempfile.mkdtemp(prefix="kload-editloop-"))
    styles = args.style or ["op_library", "tutorial"]
    print(f"torch {torch.__version__}; nvcc for {ARCHS}; {os.cpu_count()} cores; MAX_JOBS=2; "
          f"{args.repeat} x (kernel edit, launcher edit) a side, sides alternating", flush=True)
    for style in styles:
        sides = {side: setup(style, side, work) for side in SIDES}
        for side, s in sides.items():
            s["cold"] = run(side, s)[0]
            print(f"  {style}, {side}: cold build {s['cold']:.1f} s", flush=True)
        k = 0
        base_n = args.repeat if args.baseline_repeat is None else args.baseline_repeat
        for i in range(args.repeat):
            for edit in ("kernel", "launcher"):
                k += 1
                pattern, repl = STYLES[style][2 if edit == "kernel" else 3]
                for side, s in sides.items():
                    if side != "kload split" and i >= base_n:
                        continue
                    text = s["cu"].read_text()
                    new, n = re.subn(pattern, repl.format(k=k), text)
                    assert n == 1, (style, edit, pattern)
                    s["cu"].write_text(new)
                    seconds, s["note"] = run(side, s)
                    s[edit].append(seconds)
                    s["edits"] += side != "torch"
        report(style, sides)
    shutil.rmtree(work, ignore_errors=True)


def report(style: str, sides: dict) -> None:
    n = {side: len(s["kernel"]) for side, s in sides.items()}
    print(f"\n{style}: {STYLES[style][1].name}    (seconds to a rebuilt library; min / median; edits of each "
          f"kind: {', '.join(f'{k} {v}' for k, v in n.items())})")
    print(f"  {'':<12} {'cold':>6}   {'kernel edit':>15} {'vs torch':>8}   {'launcher edit':>15} {'vs torch':>8}"
          f"   edits beside a background precompile")
    base = {e: statistics.median(sides["torch"][e]) for e in ("kernel", "launcher")}
    for side, s in sides.items():
        cells = []
        for e in ("kernel", "launcher"):
            med = statistics.median(s[e])
            cells.append(f"{min(s[e]):6.2f} / {med:6.2f} {med / base[e]:7.3f}x")
        met = "-" if side == "torch" else f"{s['met']} of {s['edits']}"
        print(f"  {side:<12} {s['cold']:6.1f}   {cells[0]}   {cells[1]}   {met}")
    for f, note in sides["kload split"]["note"].items():
        print(f"  kload split, last edit: {Path(f).name} {note}")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
