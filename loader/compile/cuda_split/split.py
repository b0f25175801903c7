"""For a .cu that includes torch's headers: the split of its text
into what the host compiler can take and what nvcc must see (cuda_split/build.py
compiles the halves).

nvcc parses a .cu three times (host preprocessing, cudafe++, cicc per architecture)
and can use no precompiled header, so a kernel next to ``#include <torch/extension.h>``
costs 20-40 s to rebuild. The halves:

- the **host half** is the file as the host compiler sees it, with every
  ``__global__`` function reduced to its declaration (nvcc's host stub, defined by the
  device half, has that very name and signature), device functions and variables left
  out, and each ``k<<<grid, block, shared, stream>>>(args)`` written as nvcc writes it
  for the host compiler: ``(__cudaPushCallConfiguration(grid, block, shared, stream) ?
  (void)0 : k(args))``. Its leading ``#include`` block is a header g++ can precompile.
- the **device half** is the file's kernels, device functions and variables,
  ``__host__ __device__`` functions, and the types, constants and macros they use,
  with torch's host-API headers replaced by the few device-side pieces of torch
  the kernels name (``c10::Half``, ``PackedTensorAccessor32``, ``C10_*`` macros).
  Template kernels get their instantiations from the host half's compiled object
  (cuda_split/build.py: what its object leaves undefined).

Both halves start each piece with ``#line``, so a compiler error names the user's
file and line. What the text says cannot be split safely is refused with the
reason (the file is then compiled whole, as before): ``<<<`` in a macro or in device
code, device code (a ``__device__`` lambda, ``__shared__``, ``threadIdx``) inside host
functions, ``__CUDACC__`` or torch's macros in conditions, thrust/cub in host code,
unbalanced braces. This module reads text only; nothing here runs a compiler.
"""
from __future__ import annotations

import hashlib
import os
import re
from bisect import bisect_right
from dataclasses import dataclass

from .launches import rewrite_launches
from .scan import IDENT, NotSplit, match, read

__all__ = ["NotSplit", "Split", "split", "instantiations", "rewrite_launches", "classify_include"]

# torch's headers that only host code needs; the device half gets kload/split/device.h instead
_TORCH_PREFIXES = ("torch/", "ATen/", "c10/", "caffe2/", "pybind11/", "kload/")
# torch headers that device code may use (kept in the device half as written)
_DEVICE_TORCH = re.compile(r"^(?:c10/macros/|c10/util/(?:Half|BFloat16|complex|Float8\w*|TypeSafeSignMath|"
                           r"math_compat)\.h$|ATen/core/TensorAccessor\.h$|c10/cuda/CUDAMathCompat\.h$|"
                           r"ATen/cuda/detail/KernelUtils\.h$|torch/headeronly/)|\.cuh$")
# CUDA toolkit headers only device code can include (dropped from the host half)
_DEVICE_ONLY = re.compile(r"^(?:cub/|thrust/|cuda/|cooperative_groups|mma\.h|cuda_pipeline|cuda_awbarrier|"
                          r"curand_kernel|crt/|sm_\d+)|\.cuh$")
# names a kernel may use from torch, and the device-side header that has each
_DEVICE_EXTRAS = {
    "Half": "c10/util/Half.h", "BFloat16": "c10/util/BFloat16.h", "complex": "c10/util/complex.h",
    "TensorAccessor": "ATen/core/TensorAccessor.h", "PackedTensorAccessor32": "ATen/core/TensorAccessor.h",
    "PackedTensorAccessor64": "ATen/core/TensorAccessor.h", "GenericPackedTensorAccessor": "ATen/core/TensorAccessor.h",
    "RestrictPtrTraits": "ATen/core/TensorAccessor.h", "DefaultPtrTraits": "ATen/core/TensorAccessor.h",
    "CUDA_KERNEL_LOOP": "ATen/cuda/detail/KernelUtils.h", "CUDA_KERNEL_LOOP_TYPE": "ATen/cuda/detail/KernelUtils.h",
}
# device code where host code must have none, and what its presence means
_DEVICE_IN_HOST = re.compile(r"\b(__device__|__shared__|__syncthreads|threadIdx|blockIdx)\b")
_NOT_IN_HOST = re.compile(r"\b(thrust|cub)\s*::")
_CONDITION = re.compile(r"^\s*#\s*(?:if|ifdef|ifndef|elif)\b(.*)", re.S)
_BAD_CONDITION = re.compile(r"\b(__CUDACC\w*|__NVCC__|__HIP\w*|USE_ROCM|TORCH_\w+|C10_\w+|AT_\w+)\b")


@dataclass(frozen=True)
class Split:
    """One .cu's two halves. ``prefix``: the host half's leading #include block (a
    header g++ can precompile); ``host``: the rest of the host half; ``device``: the
    device half, less the instantiations of ``templates`` (qualified names of the
    template kernels) that cuda_split/build.py appends; ``kernels``: every kernel's
    qualified name; ``host_dropped``: includes the host half leaves out."""

    prefix: str
    host: str
    device: str
    templates: tuple[str, ...]
    kernels: tuple[str, ...]
    host_dropped: tuple[str, ...]


# -- the two halves --------------------------------------------------------------------

def classify_include(name: str, angle: bool, here: str, include_dirs: list[str]) -> str:
    """Which half an #include belongs to: "host" (torch's host API), "device" (device-only
    headers, user headers with device code), or "both"."""
    if angle and name.startswith(_TORCH_PREFIXES):
        return "both" if _DEVICE_TORCH.search(name) else "host"
    if _DEVICE_ONLY.search(name):
        return "device"
    if not angle or not re.match(r"^[\w./+-]+$", name) or "/" in name:
        for d in ([here] if not angle else []) + include_dirs:
            p = os.path.join(d, name)
            if os.path.isfile(p):
                try:
                    with open(p, encoding="utf-8", errors="replace") as f:
                        text = f.read()
                except OSError:
                    break
                return "device" if re.search(r"\b(__global__|__device__|__shared__|__constant__)\b|<<<", text) \
                    else "both"
    return "both"


def split(text: str, path: str, include_dirs: list[str] = ()) -> Split:
    """The two halves of the .cu ``text`` at ``path``; raises NotSplit with the reason."""
    anon = "kload_anon_" + hashlib.sha256(path.encode()).hexdigest()[:8]
    code, items = read(text, anon)
    lines = [0] + [m.end() for m in re.finditer("\n", text)]
    here = os.path.dirname(path)
    sides = _include_sides(text, items, here, include_dirs)
    _check_code(code, items, lines)
    halves = _Halves(text, code, path, here, anon, lines, *_device_closure(code, items))
    for n, it in enumerate(items):
        halves.add(n, it, sides)
    return halves.result(items)


def _include_sides(text: str, items, here: str, include_dirs) -> dict[int, str]:
    """Each #include's side ("host", "device", "both"), by its item's index; raises NotSplit
    for a directive the two compilers would read differently, or no host header at all."""
    sides: dict[int, str] = {}
    for n, it in enumerate(items):
        if it.kind != "directive":
            continue
        d = text[it.start:it.end]
        inc = re.match(r'\s*#\s*include\s*([<"])([^>"]+)[>"]', d)
        if inc:
            sides[n] = classify_include(inc[2], inc[1] == "<", here, list(include_dirs))
        elif "<<<" in d:
            raise NotSplit("a macro holds a kernel launch (<<<)")
        else:
            cond = _CONDITION.match(d)
            bad = cond and _BAD_CONDITION.search(cond[1])
            if bad:
                raise NotSplit(f"a preprocessor condition reads {bad[1]}, which the host compiler "
                               "and nvcc would see differently")
    if not any(s == "host" for s in sides.values()):
        raise NotSplit("it includes none of torch's host headers (nvcc is fast on it as it is)")
    return sides


def _check_code(code: str, items, lines: list[int]) -> None:
    """NotSplit for code only nvcc's whole-file compile handles."""
    for it in items:
        seg = code[it.start:it.end]
        if it.kind in ("kernel", "device") and "<<<" in seg:
            raise NotSplit("device code launches a kernel (dynamic parallelism needs nvcc's whole-file compile)")
        if it.kind == "host":
            bad = _DEVICE_IN_HOST.search(seg) or _NOT_IN_HOST.search(seg)
            if bad:
                raise NotSplit(f"host code uses {bad[0].rstrip(': ')} (line {bisect_right(lines, it.start)}), "
                               "which only nvcc compiles")


def _device_closure(code: str, items) -> tuple[set[int], set[str], set[str]]:
    """What the device half takes along: the items the device code needs (the decls it
    names, transitively), the words it uses, and the words host code uses."""
    by_name: dict[str, list[int]] = {}
    for n, it in enumerate(items):
        for name in it.names if it.kind in ("decl", "device_decl") else ():
            by_name.setdefault(name, []).append(n)
    needed = {n for n, it in enumerate(items) if it.kind in ("kernel", "device", "hd", "device_decl")
              or it.names == {"*"}}
    work, seen = list(needed), set()
    while work:
        it = items[work.pop()]
        for w in set(IDENT.findall(code[it.start:it.end])) - seen:
            seen.add(w)
            for n in by_name.get(w, ()):
                if n not in needed:
                    needed.add(n)
                    work.append(n)
    host_words = set()
    for it in items:
        if it.kind in ("host", "hd", "decl"):
            host_words |= set(IDENT.findall(code[it.start:it.end]))
    return needed, seen, host_words


class _Halves:
    """The halves' texts, written item by item (each after a #line of the user's file)."""

    def __init__(self, text, code, path, here, anon, lines, needed, used_by_device, host_words):
        self.text, self.code, self.path, self.here, self.anon, self.lines = text, code, path, here, anon, lines
        self.needed, self.host_words = needed, host_words
        self.prefix, self.host, self.device, self.host_dropped, self.refs = [], [], [], [], []
        extras = sorted({h for w, h in _DEVICE_EXTRAS.items() if w in used_by_device})
        self.prelude = "".join(f"#include <{h}>\n" for h in ["kload/split/device.h"] + extras)
        self.in_prefix = True

    def where(self, it) -> str:
        return f'#line {bisect_right(self.lines, it.start)} "{self.path}"\n'

    def add(self, n: int, it, sides: dict[int, str]) -> None:
        piece = self.text[it.start:it.end]
        if it.kind == "directive":
            self.directive(n, it, _beside(piece, self.here), sides)
            return
        self.in_prefix = self.in_prefix and it.kind == "empty"
        code, host, device, where = self.code[it.start:it.end], self.host, self.device, self.where
        if it.kind in ("open", "close"):
            if it.kind == "open" and it.names == {""}:  # unnamed: one name both halves share
                piece = f"namespace {self.anon} {{}} using namespace {self.anon}; namespace {self.anon} {{"
            host.append(piece + "\n")
            device.append(piece + "\n")
        elif it.kind == "kernel":
            head = self.text[it.start:it.body[0]] if it.body else piece.rstrip(";")
            head = re.sub(r"\bstatic\b", "      ", head)
            if not (it.template and re.match(r"\s*template\s*[^<\s]", code)):
                host += [where(it), head.rstrip(), ";\n"]   # explicit instantiations are the device half's
            device += [where(it), re.sub(r"\bstatic\b", "      ", piece[:len(head)]), piece[len(head):], "\n"]
        elif it.kind == "device":
            device += [where(it), piece, "\n"]
            if it.body is None and it.names & self.host_words and "__shared__" not in code:
                symbol = f"{self.anon.replace('anon', 'ref')}_{it.qualname.replace('::', '__')}"
                host += [where(it), _host_reference(piece, sorted(it.names)[0], symbol), "\n"]
                self.refs.append(f'__attribute__((used)) decltype({it.qualname})& {symbol} __asm__("{symbol}") = '
                                 f"{it.qualname};\n")
        elif it.kind in ("hd", "decl") or (it.kind == "device_decl" and it.names & self.host_words):
            if it.kind == "device_decl":
                piece = _strip_device_bodies(piece, code)
            host += [where(it), rewrite_launches(piece, code), "\n"]
            if n in self.needed:
                device += [where(it), self.text[it.start:it.end], "\n"]
        elif it.kind == "device_decl":
            device += [where(it), piece, "\n"]
        elif it.kind == "host":
            host += [where(it), rewrite_launches(piece, code), "\n"]

    def directive(self, n: int, it, piece: str, sides: dict[int, str]) -> None:
        """The leading #includes and #defines of torch's host headers form the host half's
        prefix (precompiled); a host header is dropped from the device half, which gets
        kload's device prelude in its place."""
        side = sides.get(n, "both")
        if self.in_prefix and (side == "host" or (side == "both" and n in sides and _system(piece))
                               or (n not in sides and re.match(r"\s*#\s*(define|undef|pragma\s+once)\b", piece))):
            self.prefix.append(piece + "\n")
        elif side != "device":
            self.in_prefix = False
            self.host += [self.where(it), piece, "\n"]
        else:
            self.host_dropped.append(piece.strip())
        if side == "host":
            if self.prelude:
                self.device += [self.prelude, self.where(it)]
                self.prelude = ""
        else:
            self.device += [self.where(it), piece, "\n"]

    def result(self, items) -> Split:
        kernels = tuple(it.qualname for it in items if it.kind == "kernel" and it.body)
        templates = tuple(sorted({it.qualname for it in items if it.kind == "kernel" and it.template}))
        if self.refs:  # nvcc's host shadows of device variables are static: host code reaches them through these
            self.device.append("\n// kload: the device variables the host half names\n" + "".join(self.refs))
        return Split("".join(self.prefix), "".join(self.host), "".join(self.device), templates, kernels,
                     tuple(self.host_dropped))


def _beside(directive: str, here: str) -> str:
    """A quoted #include of a header next to the .cu, named by its full path: the halves
    are written elsewhere, and the compiler looks beside the including file first."""
    inc = re.match(r'(\s*#\s*include\s*)"([^"]+)"', directive)
    if inc and not os.path.isabs(inc[2]) and os.path.isfile(os.path.join(here, inc[2])):
        return f'{inc[1]}"{os.path.normpath(os.path.join(here, inc[2]))}"' + directive[inc.end():]
    return directive


def _system(directive: str) -> bool:
    """An #include of a header that is not the user's own (angle brackets, no quotes)."""
    return bool(re.match(r"\s*#\s*include\s*<", directive))


def _host_reference(decl: str, name: str, symbol: str) -> str:
    """The host half's view of a device variable that host code names (cudaMemcpyToSymbol):
    nvcc's host shadow of it is static, so the device half exports a reference to it
    under ``symbol``, and the host half declares one of the variable's type."""
    d = re.sub(r"\b(__device__|__constant__|static|extern)\b", "", decl)
    d = re.split(r"=|\{", d, maxsplit=1)[0].rstrip().rstrip(";")
    if "," in d or "__managed__" in decl:
        raise NotSplit(f"host code names the device variable {name}, which kload cannot declare for it")
    shape = re.sub(rf"\b{name}\b", f"kload_decl_{name}", d, count=1).strip()
    return f'extern {shape}; extern decltype(kload_decl_{name})& {name} __asm__("{symbol}");'


def _strip_device_bodies(piece: str, code: str) -> str:
    """A class for the host half: its __device__-only member functions reduced to declarations."""
    out = piece
    b = code.find("{")
    if b < 0:
        return piece
    j, member_start = b + 1, b + 1
    while j < len(code):
        ch = code[j]
        if ch in ";}":
            member_start = j + 1
        elif ch == "{":
            k = match(code, j, "{", "}")
            head = code[member_start:j]
            if re.search(r"\b__device__\b", head) and not re.search(r"\b__host__\b", head):
                if re.search(r"\)\s*:[^:]", head):
                    raise NotSplit("a class's __device__ constructor has an initializer list")
                out = out[:j] + ";" + "".join(c if c == "\n" else " " for c in out[j + 1:k + 1]) + out[k + 1:]
            j, member_start = k + 1, k + 1
            continue
        j += 1
    return out


def instantiations(sp: Split, undefined: list[str]) -> str:
    """What the device half adds for the template kernels its host half launches:
    ``undefined`` is what the host half's object leaves undefined, demangled (``nm -C``);
    each instantiation of a template kernel becomes an address taken (nvcc then
    instantiates the kernel and its host stub, weak with -static-global-template-stub=false),
    after the device-side headers of torch its template arguments name."""
    wanted = []
    for sym in undefined:
        sym = sym.strip()
        for q in sp.templates:
            if sym.startswith(f"void {q}<"):
                start = len("void ") + len(q)
                depth, end = 0, start
                for end in range(start, len(sym)):
                    depth += sym[end] == "<"
                    depth -= sym[end] == ">"
                    if depth == 0:
                        break
                wanted.append((q, sym[len("void "):end + 1], sym[end + 1:]))
    if not wanted:
        return ""
    overloaded = {q for q in sp.templates if sp.kernels.count(q) > 1}
    words = set(IDENT.findall(" ".join(w[1] for w in wanted)))
    out = ["\n// kload: the instantiations the host half launches\n"]
    out += [f"#include <{h}>\n" for h in sorted({h for w, h in _DEVICE_EXTRAS.items() if w in words})]
    for n, (q, tid, params) in enumerate(sorted(set(wanted))):
        target = f"static_cast<void (*){params}>(&{tid})" if q in overloaded else f"&{tid}"
        out.append(f"__attribute__((used)) static auto* const kload_instance_{n} = {target};\n")
    return "".join(out)
