"""How a build registers, and what happens when torch refuses it.

- Before the compile, for a build trim.py trims: whether its registration and Tensor's
  operators can skip their heavy headers. Where every m.def is a schema literal over
  Tensor, int, float and bool, and every m.impl names one of those ops with a kernel,
  the generated header defines KLOAD_LIGHT_REGISTER and each schema's kinds ("TTd>T":
  Tensor, Tensor, float -> Tensor), and <kload/register.h> registers through torch's
  stable C shim instead of <torch/library.h> (~3 s of parsing here); each m.impl's
  kernel types are checked against its schema's kinds when it compiles (a consteval op
  name: a compile error at the user's line). Where no source includes <ATen/ATen.h>,
  <ATen/TensorOperators.h> or a torch/ header, <kload/operators.h> defines Tensor's
  operators without <ATen/ops/empty_like.h>'s preamble (~2 s where no at:: function is
  called). A compile these make fail ("redefinition of", KLOAD_WHOLE_API: a kernel type
  the shim path does not box) is one trim.py compiles again with the whole API.
- Before anything compiles: every schema literal read by torch's parser (check_schemas).
- After the compile, for a library that registers as it opens (TORCH_LIBRARY): opened in
  a forked child first (opens_safely), so that torch's abort ends the child.
- When a registration is refused (kernel.h's kload_register, the child, the stable
  TORCH_BOX check in library.py): the RegistrationError at the user's line (refusal).
"""
from __future__ import annotations

import os
import re
from pathlib import Path

from ..errors import KloadError

# what <kload/register.h> includes beyond Tensor (torch 2.9 and later)
HEADERS = ("torch/csrc/stable/c/shim.h", "torch/csrc/inductor/aoti_torch/c/shim.h", "torch/headeronly/version.h")

# comments only (string literals kept: the schemas are in them)
_ONLY_COMMENTS = re.compile(r"//[^\n]*|/\*.*?\*/|(\"(?:\\.|[^\"\\\n])*\")", re.S)
# what the registration of <kload/register.h> does not offer: torch::Library's own API, the dispatcher
_TORCH_API = re.compile(r"\bTORCH_LIBRARY|\bTORCH_FN\b|\btorch\s*::|\bc10\s*::\s*(?:Dispatcher|OperatorHandle|IValue|"
                        r"BoxedKernel|KernelFunction|impl\b)|\bDispatcher\b|\bIValue\b|\bKLOAD_LEAN\b")
_DEF_CALL, _IMPL_CALL = re.compile(r"\.\s*def\s*\("), re.compile(r"\.\s*impl\s*\(")
_DEF_LITERAL = re.compile(r'\.\s*def\s*\(\s*"((?:\\.|[^"\\\n])*)"\s*\)')
_IMPL_LITERAL = re.compile(r'\.\s*impl\s*\(\s*"([\w.]+)"\s*,')
_KINDS = {"Tensor": "T", "int": "i", "float": "d", "bool": "b"}
# headers that bring <ATen/TensorOperators.h> (whose operators <kload/operators.h> defines again)
_OPERATORS_INCLUDED = re.compile(r"(?m)^\s*#\s*include\s*[<\"](?:ATen/ATen\.h|ATen/TensorOperators\.h|ATen/native/|torch/)")


def _without_comments(text: str) -> str:
    return _ONLY_COMMENTS.sub(lambda m: m.group(1) or " ", text)


def kinds(texts: list[str]) -> dict[str, str] | None:
    """Each op's kinds ("TTd>T": Tensor, Tensor, float -> Tensor) where the sources'
    registration is m.def("schema") and m.impl("op", kernel) alone, over the types
    <kload/register.h> boxes; else None."""
    code = "\n".join(_without_comments(t) for t in texts)
    if _TORCH_API.search(code):
        return None  # torch's registration API
    defs, impls = _DEF_LITERAL.findall(code), _IMPL_LITERAL.findall(code)
    if not defs or len(defs) != len(_DEF_CALL.findall(code)) or len(impls) != len(_IMPL_CALL.findall(code)):
        return None  # a m.def or m.impl that is not a plain literal
    import torch

    kinds = {}
    for schema in defs:
        try:
            s = torch._C.parse_schema(schema.encode().decode("unicode_escape"))
        except RuntimeError:
            return None  # torch::Library gives the error
        args = [_KINDS.get(str(a.type)) for a in s.arguments]
        rets = [_KINDS.get(str(r.type)) for r in s.returns]
        if re.search(r"\bSymInt\b", schema):  # parsed as int; a traced call passes a symbol
            args.append(None)
        if None in args or any(r != "T" for r in rets):
            return None  # a type beyond Tensor, int, float and bool
        kinds[s.name + ("." + s.overload_name if s.overload_name else "")] = "".join(args) + ">" + "".join(rets)
    if not set(impls) <= set(kinds):
        return None  # a m.impl of an op defined elsewhere
    return kinds


def operators_apply(texts: list[str]) -> bool:
    """Whether <kload/operators.h> may stand for <ATen/TensorOperators.h>: no source
    includes a header that brings torch's."""
    return not any(_OPERATORS_INCLUDED.search(t) for t in texts)


# the schema literals of m.def("...") (also inside TORCH_SELECTIVE_SCHEMA), one string each
_SCHEMA_LITERAL = re.compile(r'\.\s*def\s*\(\s*(?:TORCH_SELECTIVE_SCHEMA\s*\(\s*)?"((?:\\.|[^"\\\n])*\((?:\\.|[^"\\\n])*)"'
                             r'\s*[,)]')


def check_schemas(name: str, paths: list[Path], log_path: Path) -> None:
    """Each schema the sources define, read by torch's own parser before anything compiles or
    opens (torch would throw while registering it: an abort, for a library that registers as
    it opens). A schema torch cannot read is a CompileError at its m.def line."""
    import torch

    from ..errors import CompileError, Diagnostic

    bad = []
    for path in paths:
        try:
            text = path.read_text(errors="replace")
        except OSError:
            continue
        if ".def" not in text:
            continue
        code = _ONLY_COMMENTS.sub(lambda m: m.group(1) or re.sub(r"[^\n]", " ", m.group(0)), text)  # offsets kept
        for m in _SCHEMA_LITERAL.finditer(code):
            try:
                torch._C.parse_schema(m[1].encode().decode("unicode_escape"))
            except RuntimeError as e:
                said = str(e).strip().splitlines()
                line = code.count("\n", 0, m.start(1)) + 1
                column = m.start(1) - code.rfind("\n", 0, m.start(1))
                d = Diagnostic(str(path), line, column, "torch cannot parse this schema: " + " ".join(
                    t.strip() for t in said[:1]) + (f" (at: {said[1].strip()})" if len(said) > 1 else ""))
                d.source_line = text.splitlines()[line - 1] if line <= len(text.splitlines()) else None
                bad.append(d)
    if bad:
        raw = "\n".join(f"{d.location()}: error: {d.message}" for d in bad)
        log_path.parent.mkdir(parents=True, exist_ok=True)
        log_path.write_text(raw + "\n")
        raise CompileError(name, bad, log_path, raw)


# -- a build's registration, refused or probed ----------------------------------------------

# torch's messages that name the op (its namespace is the build's: kload_<name>_<hex>, or the user's own)
_OP_IN_MESSAGE = (re.compile(r"operator:\s*(?:\w+::)?(\w+)"), re.compile(r"register an operator \((?:\w+::)?(\w+)"),
                  re.compile(r"\b\w+::(\w+)\b"))
_AS_IMPL = ("Inferred operator schema", "kernel", "impl")


def refusal(name: str, where: str, torch_says: str, sources: list[str], op: str | None = None,
            call: str | None = None) -> "RegistrationError":
    """What torch (or kload's check of TORCH_BOX) refused while a build registered, as the
    user's mistake: the op, the m.impl or m.def line in the user's sources that made it, and
    torch's own words. ``where`` is the "file:line" of the registration block (kernel.h's
    kload_register), if known; ``op`` and ``call`` where the caller knows them."""
    from ..errors import RegistrationError

    said = torch_says.strip()
    op = op or next((m[1] for p in _OP_IN_MESSAGE for m in [p.search(said)] if m), None)
    call = call or ("impl" if any(w in said for w in _AS_IMPL) and "multiple times" not in said else "def")
    block_file, _, number = where.rpartition(":")
    block = (block_file, int(number)) if number.isdigit() else None
    file, line = _locate(op, call, sources, "multiple times" in said, block) if op else (None, None)
    if file is None and block:
        file, line = block
    what = f'm.{call}("{op}")' if op else "a registration block"
    place = f"{file}:{line}" if line else (file or "?")
    reason = re.search(r"(?m)^\s*reason:\s*(.+)$", said)
    first = said.splitlines()[0] if said else "refused"
    if reason and "Inferred operator schema" in said:
        first = f"the kernel's C++ types do not match its schema ({reason[1].strip().rstrip('.')})"
    text = f"{name!r} did not register: {place}: {what}: {first}"
    if said and said != first:
        text += "\n  torch says: " + "\n    ".join(said.splitlines())
    return RegistrationError(name, op, file, line, text)


_LINE_DIRECTIVE = re.compile(r'(?m)^\s*#\s*line\s+(\d+)(?:\s+"((?:\\.|[^"\\])*)")?')


def _line_of(path: str, text: str, offset: int) -> tuple[str, int]:
    """The file and line of ``offset`` as the compiler names them: after a ``#line N "file"``
    (a notebook cell's generated source names the cell so), that file and line."""
    line = text.count("\n", 0, offset) + 1
    directive = None
    for d in _LINE_DIRECTIVE.finditer(text, 0, offset):
        directive = d
    if directive is None:
        return path, line
    at = text.count("\n", 0, directive.start()) + 1  # the directive's own line; the next is N
    return (directive[2] or path), int(directive[1]) + line - at - 1


def _locate(op: str, call: str, sources: list[str], last: bool, block: tuple[str, int] | None = None
            ) -> tuple[str | None, int | None]:
    """The file and line of ``m.impl("op"`` (or ``m.def("op``) in the sources: the first in the
    refused ``block`` (its file, from its line on) where it is known; the last one for a second def."""
    pattern = re.compile(r'\.\s*' + call + r'\s*\(\s*(?:TORCH_SELECTIVE_SCHEMA\s*\(\s*)?"(?:\w+::)?' + re.escape(op)
                         + r'\b')
    found = []
    for path in sources:
        try:
            text = Path(path).read_text(errors="replace")
        except OSError:
            continue
        found += [_line_of(path, text, m.start()) for m in pattern.finditer(text)]
    if not found:
        return None, None
    in_block = [f for f in found if block and f[0] == block[0] and f[1] >= block[1]]
    if in_block and not last:
        return in_block[0]
    return found[-1] if last else found[0]


# A library that registers as it opens (TORCH_LIBRARY, STABLE_TORCH_LIBRARY): opening it in a
# child first, so that torch's abort ends the child and not the user's process.
_ABORT = re.compile(r"terminate called after throwing an instance of '[^']*'\s*(?:what\(\):\s*)?(.*)", re.S)
PROBE_SECONDS = 60


def open_in_child(artifact: str) -> tuple[list[str] | None, str | None]:
    """Open ``artifact`` in a forked child of this process (same torch, same registrations).

    Returns ``(namespaces, None)``: the namespaces of the ops it registered; ``(None,
    message)``: opening it aborted, with torch's message; ``(None, None)``: the child could
    not tell (no fork here, or it died of something else), and the caller goes on."""
    import ctypes
    import json
    import selectors
    import signal
    import time

    import torch

    if not hasattr(os, "fork"):
        return None, None
    out_r, out_w = os.pipe()
    err_r, err_w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: open it, say what it registered, leave without running anything of the parent's
        try:
            os.close(out_r)
            os.close(err_r)
            os.dup2(err_w, 2)
            before = set(torch._C._dispatch_get_all_op_names())
            ctypes.CDLL(artifact)
            new = set(torch._C._dispatch_get_all_op_names()) - before
            os.write(out_w, json.dumps(sorted({n.split("::", 1)[0] for n in new if "::" in n})).encode())
        finally:
            os._exit(0)
    os.close(out_w)
    os.close(err_w)
    chunks = {out_r: b"", err_r: b""}
    deadline = time.monotonic() + PROBE_SECONDS
    with selectors.DefaultSelector() as sel:
        for fd in chunks:
            sel.register(fd, selectors.EVENT_READ)
        while sel.get_map() and time.monotonic() < deadline:
            for key, _ in sel.select(timeout=max(0.0, deadline - time.monotonic())):
                data = os.read(key.fd, 65536)
                if data:
                    chunks[key.fd] += data
                else:
                    sel.unregister(key.fd)
    if time.monotonic() >= deadline:
        os.kill(pid, signal.SIGKILL)
    _, status = os.waitpid(pid, 0)
    for fd in chunks:
        os.close(fd)
    if os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0 and chunks[out_r]:
        return json.loads(chunks[out_r]), None
    said = _ABORT.search(chunks[err_r].decode("utf-8", "replace"))
    if said:
        text = said[1].split("\nException raised from", 1)[0].split("\nframe #", 1)[0]
        return None, text.strip()
    return None, None


def namespace_taken(ns: str) -> str | None:
    """torch's refusal, when a TORCH_LIBRARY(ns, m) would be a second library of ``ns`` in this
    process (one that Python made with torch.library.Library(ns, "DEF"), say); else None.
    Asked by opening a library of ``ns`` and dropping it at once (microseconds)."""
    import torch

    try:
        probe = torch._C._dispatch_library("DEF", ns, "", "", 0)
    except RuntimeError as e:
        said = str(e).split("\nException raised from", 1)[0]
        at = re.search(r"Previous registration of TORCH_LIBRARY was registered at (.*?);", said)
        return f"its library was registered at {at[1]}" if at else said
    del probe  # its destructor gives the namespace back
    return None


_SECOND_LIBRARY = re.compile(r"Only a single TORCH_LIBRARY can be used to register the namespace (\w+)")


def opens_safely(name: str, artifact: str, namespaces: list[str], sources: list[str]) -> tuple[list[str], bool]:
    """A library that registers as it opens (TORCH_LIBRARY, STABLE_TORCH_LIBRARY), just built:
    open it in a child first. Returns the namespaces its ops are in and whether the child
    opened it; what torch refuses is a RegistrationError (the build is not published).

    Not asked where this process has one of its namespaces already: the child would be
    refused for a reason of this process, not of the library (the load refuses it here
    with the reason; a fresh process's first load opens it in a child first)."""
    import torch

    have = {n.split("::", 1)[0] for n in torch._C._dispatch_get_all_op_names()}
    mine = [ns for ns in namespaces if ns in have or namespace_taken(ns)]
    if mine:
        return namespaces, False
    found, said = open_in_child(artifact)
    if said:
        second = _SECOND_LIBRARY.search(said)
        if second and namespace_taken(second[1]):  # a namespace named through a macro, taken here
            return sorted(set(namespaces) | {second[1]}), False
        raise refusal(name, "", said, sources)
    if found is None:
        return namespaces, False
    return found or namespaces, True
