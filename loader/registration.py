"""Step 6 of a load, before the compile, for a build trim.py trims: whether its
registration and Tensor's operators can skip their heavy headers.

- Registration: where every m.def is a schema literal over Tensor, int, float and
  bool, and every m.impl names one of those ops with a kernel, the generated header
  defines KLOAD_LIGHT_REGISTER and each schema's kinds ("TTd>T": Tensor, Tensor,
  float -> Tensor), and <kload/register.h> registers through torch's stable C shim
  instead of <torch/library.h> (~3 s of parsing here). Each m.impl's kernel types
  are checked against its schema's kinds when it compiles (a consteval op name: a
  compile error at the user's line). What the shim refuses while registering (a
  second def of one op) is recorded in the library (kload_light_errors, in the
  namespace unit build.py writes), and ``check_registered`` raises it once torch has
  loaded the build, with torch's message (torch::Library would throw it while the
  library opens, which aborts the process).
- Operators: where no source includes <ATen/ATen.h>, <ATen/TensorOperators.h> or a
  torch/ header, <kload/operators.h> defines Tensor's operators without
  <ATen/ops/empty_like.h>'s preamble (~2 s where no at:: function is called).
A compile these make fail ("redefinition of", KLOAD_WHOLE_API: a kernel type the
shim path does not box) is one trim.py compiles again with the whole API.
"""
from __future__ import annotations

import re
from pathlib import Path

from .errors import KloadError

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


def check_registered(artifact: Path, name: str) -> None:
    """After torch loaded the build: a registration the shim refused (a second def of one
    op, ...) is an error of the build."""
    import ctypes

    try:
        errors = ctypes.CDLL(str(artifact)).kload_light_errors
    except (OSError, AttributeError):
        return
    errors.restype = ctypes.c_char_p
    text = (errors() or b"").decode("utf-8", "replace").strip()
    if text:
        raise KloadError(f"{name} did not register: " + "; ".join(text.splitlines()))
