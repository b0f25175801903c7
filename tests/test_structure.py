"""The package's structure: loader/ and cache/ form no import circle, late
(function-level) imports included, and each loader module imports only from the
steps of a load before it (docs/design.md draws the order)."""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = {"kload": ROOT / "loader", "kload.cache": ROOT / "cache"}

# The import layers, leaves first: a module may import only from modules listed before
# it. The comments give each module's step of a load, in the order a load runs them
# (docs/design.md); a step may call a later one (the front door calls the resolve),
# so layers and steps differ: the basics and the facts of step 3 sit low.
ORDER = [
    "kload.messages", "kload.errors",                              # basics: the "kload: " prefix, the exceptions
    "kload.cache", "kload.cache.key", "kload.cache.store", "kload.cache.lock",   # 2 hit record, 3 key, 4 lookup, lock
    "kload.cache.publish",                                         # 7 publish
    "kload.cache.bundle", "kload.cache.remote",                    # bundles; 5 the remote cache's server
    "kload.knobs", "kload.foreground",                             # 6 builds pause background precompiles
    "kload.options",                                               # 1 what the user passed
    "kload.progress",                                              # 6 the line the user sees (basics)
    "kload.fingerprint",                                           # 2 the hit record's fingerprint; the facts
    "kload.toolchain", "kload.linking", "kload.sources",           # 3 key inputs; 6 the link
    "kload.cuscan", "kload.culaunch", "kload.cusplit",             # 3 a .cu's structure, its launches, its two halves (text)
    "kload.plan", "kload.explain",                                 # 3 the plan, its key; 4 a refusal says why
    "kload.pch_build", "kload.pch",                                # 6 precompiled headers
    "kload.compilers", "kload.torchbuild",                         # 6 the compile
    "kload.registration", "kload.trim",                            # 6 a build without the PCH: its registration, ATen trimmed
    "kload.split_units", "kload.split_build",                      # 6 a .cu in halves
    "kload.build",
    "kload.remote",                                                # 5 the remote cache
    "kload.library",                                               # 8 load a library into the process
    "kload.obtain",                                                # 4-7 the miss: look, lock, fetch, compile, publish
    "kload.resolve",                                               # 2 hit record, else plan and the miss
    "kload.watch",                                                 # reload on save
    "kload.nvrtc", "kload.cubin", "kload.cudadrv", "kload.live_cuda",  # device code: NVRTC, cache, driver, swap
    "kload.live_glue",                                             # 8 device code bound to C++ glue's slots
    "kload.handle",                                                # 1 and 8 the user's Handle
    "kload.api", "kload.ide", "kload.cpp_extension", "kload.magic", "kload.cli_cache", "kload.cli_remote", "kload.__main__", "kload",  # 1 front doors
]


def modules() -> dict[str, Path]:
    found = {}
    for pkg, folder in PACKAGES.items():
        for path in sorted(folder.glob("*.py")):
            found[pkg if path.stem == "__init__" else f"{pkg}.{path.stem}"] = path
    return found


def imports_of(name: str, path: Path, known: set[str]) -> set[str]:
    """Every module of the package that ``name`` imports, at any depth of the file
    (a late import inside a function counts the same as one at the top)."""
    is_pkg = path.stem == "__init__"
    package = name if is_pkg else name.rpartition(".")[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                parts = parts[: len(parts) - (node.level - 1)]
                base = ".".join(parts + ([node.module] if node.module else []))
            # `from pkg import mod` imports the module pkg.mod; `from mod import f`, mod
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]
        else:
            continue
        for t in targets:
            while t and t not in known:  # `import kload.cache.store as s` -> kload.cache.store
                t = t.rpartition(".")[0]
            if t and t != name:
                out.add(t)
    return out


def graph() -> dict[str, set[str]]:
    mods = modules()
    known = set(mods)
    # a package's own __init__ runs before any of its modules: that parent import is
    # implicit in Python and not an edge; `kload` re-exporting its front doors is one
    return {m: imports_of(m, p, known) for m, p in mods.items()}


def circles(g: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in g.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(g):
        if v not in index:
            visit(v)
    return out


def test_no_import_circles():
    assert circles(graph()) == []


def test_the_checker_sees_a_late_import_circle():
    g = graph()
    g["kload.options"] = g["kload.options"] | {"kload.handle"}  # a late import back up the order
    assert any("kload.options" in c and "kload.handle" in c for c in circles(g))


def test_every_module_is_placed_and_imports_only_earlier_steps():
    g = graph()
    assert sorted(g) == sorted(ORDER), "a new module needs its place in ORDER and in docs/design.md"
    rank = {m: i for i, m in enumerate(ORDER)}
    late = [f"{m} imports {d}" for m, deps in g.items() for d in deps if rank[d] >= rank[m]]
    assert late == []


def test_no_module_grows_past_350_lines_without_saying_why():
    """A long module says at its top why it is one file ("Why this file is long: ...")."""
    long = [f"{name}: {path.read_text().count(chr(10))} lines" for name, path in modules().items()
            if path.read_text().count("\n") > 350 and "Why this file is long:" not in path.read_text()[:3000]]
    assert long == []
