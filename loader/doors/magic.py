"""IPython/Jupyter magics: ``%load_ext kload``, then

    %%kload NAME [--cuda] [--stable] [--cflags="-O3 ..."] [-I DIR] [--debug]
    <C++ or CUDA, any binding style>

builds the cell (or finds it in the cache) and binds ``NAME`` to its handle; a
``--cuda`` cell of device code alone (``__global__`` functions, no bindings) is
compiled by NVRTC instead and ``NAME`` is its ``kload.cuda_module``, and

    %kload

shows the cache location and what this kernel session built or loaded, and

    %kload ide SOURCES...

writes compile_commands.json beside them (for clangd).

The cell is written beside a copy of the cell as the notebook shows it (line 1
is the ``%%kload`` line); a ``#line`` directive makes the compiler report cell
lines, so a compile error reads "line 5: error: ...", quoting line 5.
"""
from __future__ import annotations

import shlex
import time
from contextlib import contextmanager

from IPython.core.magic import Magics, cell_magic, line_magic, magics_class
from IPython.core.magic_arguments import argument, magic_arguments, parse_argstring

from .. import knobs
from . import cell_pch_source, default_header, inline_folder, load, write_files
from ..errors import CompileError, KloadError, diagnostic_lines
from .handle import HISTORY
from ..options import check_name
from ..messages import PREFIX

MAX_LINES = 40


class CellError(KloadError):
    """A ``%%kload`` cell did not build (a compile error, bad options, CUDA unavailable);
    shown as a short message, not a traceback."""

    def __init__(self, text: str):
        super().__init__(text)
        self.text = self.args[0]  # with the prefix

    def _render_traceback_(self):  # IPython shows these lines instead of a traceback
        return self.text.splitlines()


def cell_error_text(name: str, err: CompileError, cell_file: str) -> str:
    def where(d) -> str:
        if d.file != cell_file:
            return d.location()
        return f"line {d.line}" + (f", column {d.column}" if d.column is not None else "")

    lines = [f"cell {name!r} did not compile"] + diagnostic_lines(err.diagnostics, err.raw, where)
    lines.append(f"  full compiler output: {err.log_path}")
    if len(lines) > MAX_LINES:
        lines = lines[: MAX_LINES - 1] + [lines[-1]]
    return "\n".join(lines)


@contextmanager
def cell_errors(name: str | None = None, cell_file: str | None = None, catch=(KloadError, OSError),
                prefix: str = ""):
    """What goes wrong in a cell as a short CellError: a compile error in the cell's line
    numbers (with ``cell_file``), anything else of ``catch`` as its message."""
    try:
        yield
    except CompileError as e:
        if cell_file is None:
            raise CellError(str(e) if str(e).startswith(PREFIX) else prefix + str(e)) from None
        raise CellError(cell_error_text(name, e, cell_file)) from None
    except catch as e:
        raise CellError(str(e) if str(e).startswith(PREFIX) else prefix + str(e)) from None


def has_bindings(cell: str) -> bool:
    """Whether a cell registers ops or a module (else a ``--cuda`` cell is device code alone)."""
    from ..plan.sources import binding_style

    return bool(binding_style(cell))


def device_code_cell(name: str, source, nvrtc_flags: list[str], include: list[str], cell_file: str):
    """A ``--cuda`` cell of device code alone (``__global__`` functions, no bindings): NVRTC
    compiles it now, for the GPU here (sm_90 without one), and NAME is its CudaModule:
    ``NAME.k[grid, block](...)``. Re-running the edited cell gives NAME the new kernels;
    an op that launches ``NAME[...]`` in its body runs them at its next call."""
    from ..live.cuda_module import cuda_module

    with cell_errors(name, cell_file):  # also: no NVRTC here, a missing -I
        mod = cuda_module(source, options=nvrtc_flags, include_paths=include, reload=False)
        mod.compile()
    return mod


@magics_class
class KloadMagics(Magics):
    @magic_arguments()
    @argument("name", help="the handle's name in the notebook (a C identifier)")
    @argument("--cuda", action="store_true", help="the cell is CUDA (.cu)")
    @argument("--cflags", default="", help="extra compiler flags, one quoted string")
    @argument("--cuda-cflags", default="", help="extra nvcc flags, one quoted string")
    @argument("--ldflags", default="", help="extra linker flags, one quoted string")
    @argument("-I", dest="include", action="append", default=[], help="an include directory (repeatable)")
    @argument("--debug", action="store_true", help="build with -g -O0 (CUDA: -G) for gdb")
    @argument("--stable", action="store_true",
              help="the cell is written against the stable ABI (#include <kload/stable.h> is added; "
                   "found on its own where the cell uses TORCH_BOX or torch::stable::)")
    @cell_magic
    def kload(self, line, cell):
        """Compile the cell's C++/CUDA (or find it in the cache) and bind NAME to it."""
        args = parse_argstring(self.kload, line)
        with cell_errors(catch=ValueError, prefix=f"%%kload {line}: "):  # a bad name, an unbalanced quote
            name = check_name(args.name)
            flags = [shlex.split(f) for f in (args.cflags, args.cuda_cflags, args.ldflags)]
        suffix = ".cu" if args.cuda else ".cpp"
        device_only = args.cuda and not has_bindings(cell)
        cell_text = f"%%kload {line}\n{cell}"
        folder = inline_folder(name, {f"{name}.cell": cell_text, "suffix": suffix})
        cell_file = str(folder / f"{name}.cell")
        quoted = cell_file.replace("\\", "\\\\").replace('"', '\\"')
        header = "" if device_only else default_header(cell, stable=args.stable)  # NVRTC: no torch header
        source_text = header + f'#line 2 "{quoted}"\n' + cell
        source = write_files(folder, {f"{name}.cell": cell_text, f"{name}{suffix}": source_text})[name + suffix]
        if device_only:
            self.shell.user_ns[name] = device_code_cell(name, source, flags[1], args.include, cell_file)
            return
        # CUDA cannot be built here, a missing -I: the message
        with cell_errors(name, cell_file, catch=(KloadError, FileNotFoundError)):
            handle = load(source, name=name, extra_cflags=flags[0], extra_cuda_cflags=flags[1],
                          extra_ldflags=flags[2], extra_include_paths=args.include,
                          debug=True if args.debug else None, reload=False)
            handle.load()
        self.shell.user_ns[name] = handle

    @line_magic("kload")
    def kload_status(self, line):
        """``%kload``: the cache location and the builds and loads of this kernel session.
        ``%kload ide SOURCES...``: compile_commands.json beside the sources, for clangd."""
        words = shlex.split(line)
        if words[:1] == ["ide"]:
            from .ide import write_ide

            if len(words) < 2:
                raise CellError("%kload ide needs SOURCES (the .cpp/.cu files of one library)")
            with cell_errors():
                target, n = write_ide(load(*words[1:], reload=False))
            print(f"{target}: {n} compile command{'s' if n != 1 else ''}")
            return
        print(f"kload cache: {knobs.cache_dir()}")
        if not HISTORY:
            print("nothing built or loaded in this session yet")
            return
        print(f"{'name':<20} {'how':<6} {'time':>9}  {'when':<8}  key")
        for h in HISTORY:
            secs = h["seconds"]
            took = f"{secs:.1f} s" if secs >= 1 else f"{secs * 1e3:.1f} ms"
            print(f"{h['name']:<20} {h['how']:<6} {took:>9}  {time.strftime('%H:%M:%S', time.localtime(h['time']))}"
                  f"  {h['key'][:16]}")


def prebuild_cell_pch() -> list:
    """Start precompiling <kload/kernel.h> and <kload/stable.h> for cells with default
    flags, so that the first cell's edits find them ready; never an error (the cells
    compile anyway)."""
    import logging

    started = []
    for stable in (False, True):
        try:
            from kload.cache.store import Store

            from ..options import make_options
            from ..compile.pch import prebuild

            opts = make_options("kload_cell", [cell_pch_source(stable)], [], [], [], [], False, None, False)
            started += prebuild(opts, Store(knobs.cache_dir()))
        except Exception as e:  # noqa: BLE001 - a missing PCH only costs time (stable.h: torch < 2.10)
            logging.getLogger("kload").info("not precompiling %s for cells: %s",
                                            "<kload/stable.h>" if stable else "<kload/kernel.h>", e)
    return started


def load_ipython_extension(ipython) -> None:
    ipython.register_magics(KloadMagics)
    prebuild_cell_pch()
