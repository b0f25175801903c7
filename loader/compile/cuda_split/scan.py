"""For a .cu that includes torch's headers (split.py): reading its
structure from its text. A .cu is read as a sequence of top-level items, each a
preprocessor directive, a namespace's opening or closing brace, or one declaration or
definition, classified by CUDA's execution-space keywords (and the macros that stand
for them: C10_HOST_DEVICE, a file's own ``#define HD __host__ __device__``):

    kernel       a __global__ function (its qualified name; template or not)
    device       a __device__ function or variable, __constant__, __shared__
    hd           a __host__ __device__ function
    host         a host function, a registration block (TORCH_LIBRARY, KLOAD_IMPL, ...),
                 a variable, a prototype, a using-directive of torch's namespaces
    decl         a type, alias, constexpr function or constant either half may need
                 (with the names it declares)
    device_decl  a type with __device__-only member functions

Comments, string and character literals (raw ones, digit separators) and directives are
blanked first (:func:`mask`), so no brace or keyword inside them counts. Text this
reader cannot make sense of (an unbalanced brace) raises NotSplit. No compiler runs.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field

IDENT = re.compile(r"[A-Za-z_]\w*")
HOST_NAMESPACES = {"at", "c10", "torch", "pybind11", "py", "caffe2"}

_KEYWORDS = frozenset("""alignas alignof auto bool break case catch char class const constexpr consteval constinit
    const_cast continue decltype default delete do double dynamic_cast else enum explicit export extern false float
    for friend goto if inline int long mutable namespace new noexcept nullptr operator private protected public
    register reinterpret_cast requires return short signed sizeof static static_assert static_cast struct switch
    template this throw true try typedef typeid typename union unsigned using virtual void volatile wchar_t while
    __global__ __device__ __host__ __shared__ __constant__ __managed__ __forceinline__ __noinline__ __restrict__
    __launch_bounds__ __align__ __attribute__ __inline__ __grid_constant__""".split())


class NotSplit(Exception):
    """The text cannot be split safely; ``str(e)`` says why (the build line shows it)."""


@dataclass
class Item:
    kind: str           # directive, open, close, kernel, device, hd, host, decl, device_decl, empty
    start: int
    end: int
    body: tuple[int, int] | None = None   # the outermost { } of a definition, or None
    template: bool = False
    qualname: str = ""                     # kernels: the qualified name
    names: set[str] = field(default_factory=set)  # what a decl declares


def mask(text: str) -> tuple[str, list[tuple[int, int]]]:
    """``text`` with comments, literals' contents and preprocessor directives blanked
    (same length, newlines kept), and the directives' spans."""
    out = list(text)
    n, i, bol, directives = len(text), 0, True, []

    def blank(a: int, b: int) -> None:
        for k in range(a, b):
            if out[k] != "\n":
                out[k] = " "

    while i < n:
        c = text[i]
        if c == "\n":
            bol, i = True, i + 1
        elif c in " \t\r\f\v":
            i += 1
        elif bol and c == "#":
            j = i
            while j < n and not (text[j] == "\n" and text[j - 1] != "\\"):
                if text.startswith("/*", j):
                    k = text.find("*/", j + 2)
                    j = n if k < 0 else k + 2
                    continue
                j += 1
            directives.append((i, j))
            blank(i, j)
            i = j
        elif text.startswith("//", i):
            j = text.find("\n", i)
            j = n if j < 0 else j
            blank(i, j)
            i = j
        elif text.startswith("/*", i):
            j = text.find("*/", i + 2)
            j = n if j < 0 else j + 2
            blank(i, j)
            i = j
        elif c == '"' or (c == "'" and not _digit_separator(text, i)):
            raw = re.match(r'R"([^()\\\s]{0,16})\(', text[i - 1:i + 19]) if i and text[i - 1] == "R" else None
            if raw:
                j = text.find(")" + raw[1] + '"', i)
                j = n if j < 0 else j + len(raw[1]) + 1
            else:
                j = i + 1
                while j < n and text[j] != c and text[j] != "\n":
                    j += 2 if text[j] == "\\" else 1
            blank(i + 1, min(j, n))
            bol, i = False, j + 1
        else:
            bol, i = False, i + 1
    return "".join(out), directives


def _digit_separator(text: str, i: int) -> bool:
    """Whether the ' at ``i`` separates digits (1'000'000, 0xFF'FF), not a character literal."""
    j = i
    while j > 0 and (text[j - 1].isalnum() or text[j - 1] in "'."):
        j -= 1
    return j < i and text[j].isdigit() and i + 1 < len(text) and text[i + 1].isalnum()


def match(code: str, i: int, open_: str, close: str) -> int:
    """The index of the bracket closing the one at ``i``."""
    depth = 0
    for j in range(i, len(code)):
        if code[j] == open_:
            depth += 1
        elif code[j] == close:
            depth -= 1
            if depth == 0:
                return j
    raise NotSplit(f"an unbalanced {open_!r} (line {code.count(chr(10), 0, i) + 1})")


def _strip_template(head: str) -> str:
    """``head`` without its leading ``template <...>`` clauses."""
    head = head.strip()
    while head.startswith("template"):
        rest = head[8:].lstrip()
        if not rest.startswith("<"):
            return rest  # an explicit instantiation: template void f<int>(int);
        depth = 0
        for j, ch in enumerate(rest):
            depth += ch == "<"
            depth -= ch == ">"
            if depth == 0:
                head = rest[j + 1:].strip()
                break
        else:
            return rest
    return head


def _needs_semicolon(head: str) -> bool:
    """Whether a brace block after ``head`` is followed by more of the declaration
    (a class body, an initializer), not the end of a function."""
    h = _strip_template(head)
    if re.match(r"(?:typedef\s+)?(?:struct|class|union|enum)\b", h):
        return True
    depth = 0
    for j, ch in enumerate(h):
        depth += ch in "(["
        depth -= ch in ")]"
        if ch == "=" and depth == 0 and h[j - 1:j] not in ("=", "!", "<", ">") and h[j + 1:j + 2] != "=" \
                and not re.search(r"\boperator\s*\S*$", h[:j]):
            return True
    return False


def segment(code: str, directives: dict[int, int], start: int, end: int, scope: list[str],
             aliases: dict[str, set[str]]) -> list[Item]:
    items: list[Item] = []
    i = start
    while i < end:
        if i in directives:
            items.append(Item("directive", i, directives[i]))
            i = directives[i]
            continue
        if code[i].isspace():
            i += 1
            continue
        if code[i] == "}":
            raise NotSplit(f"an unbalanced '}}' (line {code.count(chr(10), 0, i) + 1})")
        depth, j, body = 0, i, None
        while j < end:
            ch = code[j]
            if ch in "([":
                depth += 1
            elif ch in ")]":
                depth -= 1
            elif ch == ";" and depth == 0:
                j += 1
                break
            elif ch == "{" and depth == 0:
                head = code[i:j]
                ns = re.fullmatch(r"\s*(?:inline\s+)?namespace\s*([\w:]*)\s*", head)
                if ns or re.fullmatch(r'\s*extern\s+"\s*"\s*', head):
                    close = match(code, j, "{", "}")
                    items.append(Item("open", i, j + 1, names={ns[1] if ns else '"C"'}))
                    items += segment(code, directives, j + 1, close, scope + ([ns[1] or "<anon>"] if ns else []),
                                      aliases)
                    items.append(Item("close", close, close + 1))
                    j = -1
                    break
                k = match(code, j, "{", "}")
                if body is None:
                    body = (j, k + 1)
                if _needs_semicolon(head) or body != (j, k + 1):
                    j = k + 1
                    continue
                j = k + 1
                break
            j += 1
        if j == -1:  # a namespace block, appended whole
            i = items[-1].end
            continue
        items.append(_classify(code, i, j, body, scope, aliases))
        i = j
    return items


# attribute-like macros before a function's name (not the name)
_ATTRIBUTE = re.compile(r"__\w+__|C10_LAUNCH_BOUNDS\w*|alignas|decltype")


def _classify(code: str, start: int, end: int, body, scope: list[str], aliases: dict[str, set[str]]) -> Item:
    head = code[start:body[0] if body else end]
    words = set(IDENT.findall(head))
    for w in words & aliases.keys():
        words |= aliases[w]
    template = head.lstrip().startswith("template")
    if not head.strip(" \n\t;"):
        return Item("empty", start, end)
    if "__global__" in words:
        name = next((m[1] for m in re.finditer(r"(\w+)\s*\(", _strip_template(head))
                     if not _ATTRIBUTE.fullmatch(m[1])), "")
        return Item("kernel", start, end, body, template, "::".join(scope + [name]))
    device = words & {"__device__", "__constant__", "__managed__", "__shared__"}
    if device and "__host__" not in words:
        names = _declared(head, body is not None)
        return Item("device", start, end, body, template, "::".join(scope + sorted(names)[:1]), names=names)
    if device:
        return Item("hd", start, end, body, template, names=_declared(head, True))
    h = _strip_template(head)
    if body is not None and not _needs_semicolon(head):
        kind = "decl" if re.search(r"\bconstexpr\b", h) else "host"
        return Item(kind, start, end, body, template, names=_declared(head, True))
    whole = code[start:end]
    is_type = re.match(r"(?:typedef|using|enum|struct|class|union)\b", h) or re.search(r"\bconst(?:expr)?\b", h)
    if is_type and not re.match(r"using\s+namespace\b", h):
        kind = "device_decl" if re.search(r"\b__device__\b", whole) and not re.search(r"\b__host__\b", whole) \
            else "decl"
        return Item(kind, start, end, body, template, names=_declared(head, False) | _enumerators(code, h, body))
    if re.match(r"using\s+namespace\b", h):
        target = re.match(r"using\s+namespace\s+:*(\w+)", h)
        return Item("decl" if target and target[1] not in HOST_NAMESPACES else "host", start, end, body, names={"*"})
    return Item("host", start, end, body, template)


def _declared(head: str, function: bool) -> set[str]:
    """The name a declaration introduces (approximately: its use only decides what the
    device half takes along, and a wrong guess costs a fallback, never a wrong build)."""
    h = _strip_template(head)
    m = re.match(r"(?:typedef\s+)?(?:struct|class|union|enum(?:\s+class|\s+struct)?)\s+"
                 r"(?:(?:__align__|alignas|__attribute__)\s*\(+[^)]*\)+\s*)*(\w+)", h)
    if m:
        return {m[1]}
    m = re.match(r"using\s+(\w+)\s*=", h)
    if m:
        return {m[1]}
    if h.startswith("typedef"):
        m = re.search(r"\(\s*\*\s*(\w+)\s*\)", h) or re.search(r"(\w+)\s*(?:\[[^\]]*\]\s*)*;?\s*$", h)
        return {m[1]} if m else set()
    depth, last = 0, None
    for tok in re.finditer(r"[A-Za-z_]\w*|[=({\[;,)\]]", h):
        t = tok[0]
        if t in "([" and depth == 0 and (function or t == "["):
            break
        if t in "=;,{" and depth == 0:
            break
        depth += t in "(["
        depth -= t in ")]"
        if depth == 0 and IDENT.fullmatch(t) and t not in _KEYWORDS:
            last = t
    return {last} if last else set()


def _enumerators(code: str, head: str, body) -> set[str]:
    if body is None or not re.match(r"enum\b", head):
        return set()
    return {m[1] for m in re.finditer(r"(?:^|,)\s*([A-Za-z_]\w*)", code[body[0] + 1:body[1] - 1])}


# torch's macros for CUDA's execution-space keywords
_C10_ALIASES = {"C10_HOST_DEVICE": {"__host__", "__device__"}, "C10_DEVICE": {"__device__"},
                "C10_HOST": {"__host__"}}


def aliases(text: str, directives: list[tuple[int, int]]) -> dict[str, set[str]]:
    """Macros that stand for __global__ / __device__ / __host__: torch's, and the file's own
    (``#define HD __host__ __device__``)."""
    out = {k: set(v) for k, v in _C10_ALIASES.items()}
    for a, b in directives:
        m = re.match(r"\s*#\s*define\s+(\w+)\s+(.*)", text[a:b], re.S)
        if m:
            found = set(re.findall(r"\b(__global__|__device__|__host__)\b", m[2]))
            for w in set(IDENT.findall(m[2])) & out.keys():
                found |= out[w]
            if found:
                out[m[1]] = found
    return out




def read(text: str, anon: str) -> tuple[str, list[Item]]:
    """The masked text and the top-level items of ``text``; an unnamed namespace is
    called ``anon`` in the items' qualified names (cuda_split/split.py names it so in both halves)."""
    code, directives = mask(text)
    items = segment(code, dict(directives), 0, len(code), [], aliases(text, directives))
    for it in items:
        it.qualname = it.qualname.replace("<anon>", anon)
    return code, items
