"""kload's exceptions, and the compiler-output digest a CompileError carries."""
from __future__ import annotations

import re
from pathlib import Path

from .messages import msg


class KloadError(RuntimeError):
    """Anything kload refuses to do, with a message that says why (``kload: `` is
    added to it here)."""

    def __init__(self, *args):
        if args and isinstance(args[0], str):
            args = (msg(args[0]),) + args[1:]
        super().__init__(*args)


class CompileError(KloadError):
    """A build failed. ``str(e)`` is the first compiler errors, ``e.log_path`` the full log."""

    def __init__(self, name: str, diagnostics: list[Diagnostic], log_path: Path, raw: str):
        self.name = name
        self.diagnostics = diagnostics
        self.log_path = log_path
        self.raw = raw
        # the compiler's digest, as it is: no prefix ("building 'name' failed" and the errors)
        RuntimeError.__init__(self, format_compile_error(name, diagnostics, log_path, raw))

    def _render_traceback_(self):
        """IPython/Jupyter show this short digest instead of a traceback through kload."""
        return [f"CompileError: {self.args[0].splitlines()[0]}"] + self.args[0].splitlines()[1:]


class RegistrationError(KloadError):
    """torch refused a build's registration (a kernel whose C++ types do not match its
    schema, a second def of one op, a namespace this process has). Nothing of the build
    was registered; the process and the builds it had loaded go on. ``e.op``, ``e.file``
    and ``e.line`` name the user's ``m.impl``/``m.def`` where kload found it."""

    def __init__(self, name: str, op: str | None, file: str | None, line: int | None, text: str):
        self.name, self.op, self.file, self.line = name, op, file, line
        super().__init__(text)


class Diagnostic:
    """One compiler error: where, what, and the offending source line."""

    __slots__ = ("file", "line", "column", "message", "source_line")

    def __init__(self, file: str, line: int | None, column: int | None, message: str, source_line=None):
        self.file, self.line, self.column, self.message = file, line, column, message
        self.source_line: str | None = source_line

    def __repr__(self) -> str:
        return f"Diagnostic({self.location()}: {self.message})"

    def location(self) -> str:
        where = self.file
        if self.line is not None:
            where += f":{self.line}"
            if self.column is not None:
                where += f":{self.column}"
        return where


# gcc/clang:  path:12:5: error: message      (also "fatal error:")
_GCC = r"^(?P<file>[^\s:][^:]*):(?P<line>\d+):(?:(?P<col>\d+):)?\s*(?:fatal\s+)?error:\s*(?P<msg>.*)$"
# nvcc/cudafe: path(12): error: message
_NVCC = r"^(?P<file>[^\s(][^(]*)\((?P<line>\d+)\):\s*(?:catastrophic\s+)?error:?\s*(?P<msg>.*)$"
# gcc's context before an error in a header: the user's line that led there
_CONTEXT = (r"^(?P<file>[^\s:][^:]*):(?P<line>\d+):(?:(?P<col>\d+):)?\s+"
            r"(?:in [‘'`]constexpr[’'`] expansion of|required from here)")
# kload's own headers: an error there (<kload/register.h>'s compile-time checks) is shown at that line
_KLOAD_HEADERS = "/kload/register.h"
# a library's headers (pybind11's static_asserts, torch's templates): an error there that the user's
# line led to ("required from here") is shown at the user's line, the header named in the message
_LIBRARY_HEADERS = re.compile(r"/(?:site|dist)-packages/|^/usr/(?:local/)?(?:include|lib)/|/cuda[^/]*/include/")
# the linker: anything that says "undefined reference" or "ld: ... error"
_LINK = r"(undefined reference to|ld(?:\.\w+)?: .*error|collect2: error)"

MAX_DIAGNOSTICS = 5


def parse_diagnostics(output: str, line_map=None) -> list[Diagnostic]:
    """The compiler's errors, first first, each with the offending source line.

    ``line_map(file, line) -> (file, line)`` lets a caller translate locations
    (the notebook magic maps generated files back to cell lines).
    """
    found: list[Diagnostic] = []
    seen = set()
    context = None
    for raw_line in output.splitlines():
        text = raw_line.rstrip()
        c = re.match(_CONTEXT, text)
        if c:
            if not (context is not None and _LIBRARY_HEADERS.search(c["file"])):
                context = c  # the user's line, not a library's own "required from here" below it
            continue
        m = re.match(_GCC, text) or re.match(_NVCC, text)
        if m:
            file, line = m["file"].strip(), int(m["line"])
            col = int(m["col"]) if m.groupdict().get("col") else None
            message = m["msg"].strip()
            if context is not None and (file.endswith(_KLOAD_HEADERS) or _LIBRARY_HEADERS.search(file)):
                if not file.endswith(_KLOAD_HEADERS):
                    message += f" (in {Path(file).name}:{line})"
                file, line = context["file"].strip(), int(context["line"])
                col = int(context["col"]) if context["col"] else None
            context = None  # it led to this error, not to a later one
            if line_map is not None:
                file, line = line_map(file, line)
            d = Diagnostic(file, line, col, message)
        elif re.search(_LINK, text):
            d = Diagnostic("linker", None, None, text.strip())
        else:
            continue
        ident = (d.file, d.line, d.message)
        if ident in seen:
            continue
        seen.add(ident)
        d.source_line = _read_line(d.file, d.line)
        found.append(d)
    return found


def _read_line(file: str, line: int | None) -> str | None:
    if line is None:
        return None
    try:
        with open(file, encoding="utf-8", errors="replace") as f:
            for i, text in enumerate(f, 1):
                if i == line:
                    return text.rstrip("\n")
    except OSError:
        return None
    return None


def hint_for(d: Diagnostic) -> str | None:
    missing = re.search(r"[‘'`\"](\w+)[’'`\"] is not a member of [‘'`\"]at[’'`\"]", d.message) or re.search(
        r"namespace [‘'`\"]at[’'`\"] has no member [‘'`\"](\w+)[’'`\"]", d.message)
    if missing and d.file.endswith(".cu"):  # <kload/kernel.h> under KLOAD_LEAN, as nvcc sources use it
        return f"with KLOAD_LEAN defined, <kload/kernel.h> has no at:: functions; add #include <ATen/ops/{missing[1]}.h>"
    return None


def diagnostic_lines(diagnostics: list[Diagnostic], raw: str, where=None) -> list[str]:
    """The first errors, each with its offending line and a hint; ``where(d)`` names
    the location (default ``file:line:col``; the notebook magic says "line 5")."""
    where = where or Diagnostic.location
    lines = []
    shown = diagnostics[:MAX_DIAGNOSTICS]
    for d in shown:
        lines.append(f"  {where(d)}: error: {d.message}")
        if d.source_line is not None:
            lines.append(f"    {d.line:>5} | {d.source_line.rstrip()}")
        hint = hint_for(d)
        if hint:
            lines.append(f"    hint: {hint}")
    if len(diagnostics) > len(shown):
        lines.append(f"  ... and {len(diagnostics) - len(shown)} more")
    if not diagnostics:
        # No recognisable diagnostic: the tail of the output is the best clue.
        lines += ["  " + t for t in [t for t in raw.strip().splitlines() if t.strip()][-15:]]
    return lines


def format_compile_error(name: str, diagnostics: list[Diagnostic], log_path: Path, raw: str) -> str:
    lines = [f"building {name!r} failed"] + diagnostic_lines(diagnostics, raw)
    lines.append(f"full log: {log_path}")
    return "\n".join(lines)
