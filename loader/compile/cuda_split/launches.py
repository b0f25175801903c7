"""For a .cu split in two (split.py): a kernel launch written as
nvcc writes it for the host compiler.

``callee<<<grid, block, shared, stream>>>(args)`` in host code becomes
``(__cudaPushCallConfiguration(grid, block, shared, stream) ? (void)0 : callee(args))``:
the push of the launch configuration, then a call of the host stub that nvcc's device
half defines under the kernel's own name. A launch the text does not let kload read
(no argument list after ``>>>``) is refused with its line, and the file is compiled
whole. Text only; nothing here runs a compiler.
"""
from __future__ import annotations

import re

from .scan import NotSplit, match

__all__ = ["rewrite_launches"]

_PUSH = "(__cudaPushCallConfiguration({cfg}) ? (void)0 : {callee}({args}))"


def rewrite_launches(text: str, code: str) -> str:
    """Every ``callee<<<cfg>>>(args)`` of host code as nvcc gives it to the host compiler."""
    spans = []
    for m in re.finditer(r"<<<", code):
        a = m.start()
        depth, b = 0, a + 3
        while b < len(code) and not (depth == 0 and code.startswith(">>>", b)):
            depth += code[b] in "(["
            depth -= code[b] in ")]"
            b += 1
        p = b + 3
        while p < len(code) and code[p].isspace():
            p += 1
        if b >= len(code) or p >= len(code) or code[p] != "(":
            raise NotSplit(f"a kernel launch kload cannot read (line {code.count(chr(10), 0, a) + 1})")
        q = match(code, p, "(", ")")
        s = _callee_start(code, a)
        spans.append((s, q + 1, text[s:a].strip(), text[a + 3:b], text[p + 1:q]))
    for s, e, callee, cfg, args in reversed(spans):
        new = _PUSH.format(cfg=cfg, callee=callee, args=args)
        text = text[:s] + new + text[e:]
    return text


def _callee_start(code: str, i: int) -> int:
    """Where the expression naming the kernel before ``<<<`` at ``i`` begins."""
    j = i
    while True:
        start = j
        while j > 0 and code[j - 1].isspace():
            j -= 1
        if j and code[j - 1] in ">)]":
            close = code[j - 1]
            open_ = {">": "<", ")": "(", "]": "["}[close]
            depth = 0
            while j > 0:
                j -= 1
                depth += code[j] == close
                depth -= code[j] == open_
                if depth == 0:
                    break
            continue
        k = j
        while k > 0 and (code[k - 1].isalnum() or code[k - 1] == "_"):
            k -= 1
        if k == j:  # no name before: the expression began where the spaces did
            return start
        j = k
        back = j
        while back > 0 and code[back - 1].isspace():
            back -= 1
        if code[max(0, back - 2):back] in ("::", "->") or code[back - 1:back] == ".":
            j = back - (1 if code[back - 1] == "." else 2)
            continue
        return j
