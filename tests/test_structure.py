"""The package's structure: loader/ and cache/ form no import circle, late
(function-level) imports included; loader/ is a folder per stage of a load, and
each module imports only from the shared modules and the stages before its own
(docs/design.md's table is the same order)."""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = {"kload": ROOT / "loader", "kload.cache": ROOT / "cache"}  # (cache/ is a folder of its own)

# The layers, leaves first, as the tree has them: what every stage shares (the top of
# loader/, and cache/), then one folder per stage of a load in the order a load runs
# them, then the names users import. A module may import only from modules listed
# before it: a stage from the shared modules and the stages before it, never a later
# one (a late import inside a function counts the same). docs/design.md's table is this.
LAYERS = [
    ("shared", ["kload.messages", "kload.errors",                        # the "kload: " prefix, the exceptions
                "kload.cache", "kload.cache.key", "kload.cache.store", "kload.cache.lock", "kload.cache.publish",
                "kload.cache.bundle", "kload.cache.remote",             # the cache (cache/)
                "kload.knobs", "kload.options", "kload.progress",       # settings, inputs and facts, the build line
                "kload.reloading"]),                                     # the reload policy, reload on save
    ("kload.plan", ["kload.plan.toolchain", "kload.plan.sources", "kload.plan.plan", "kload.plan.explain",
                    "kload.plan"]),
    ("kload.compile", ["kload.compile.foreground", "kload.compile.linking", "kload.compile.torchbuild",
                     "kload.compile.pch_build", "kload.compile.pch", "kload.compile.compilers", "kload.compile.registration",
                     "kload.compile.trim", "kload.compile.inputs",
                     "kload.compile.cuda_split.scan", "kload.compile.cuda_split.launches", "kload.compile.cuda_split.split",
                     "kload.compile.cuda_split.units", "kload.compile.cuda_split.build", "kload.compile.cuda_split",
                     "kload.compile.pipeline", "kload.compile"]),
    ("kload.resolve", ["kload.resolve.library", "kload.resolve.remote", "kload.resolve.obtain", "kload.resolve"]),
    ("kload.live", ["kload.live.nvrtc", "kload.live.cubin", "kload.live.cudadrv", "kload.live.cuda_module",
                    "kload.live.glue", "kload.live"]),
    ("kload.doors", ["kload.doors.handle", "kload.doors", "kload.doors.ide", "kload.doors.magic",
                     "kload.doors.cli_cache", "kload.doors.cli_remote", "kload.doors.cli"]),
    ("names users import", ["kload.cpp_extension", "kload.__main__", "kload"]),
]
ORDER = [m for _, mods in LAYERS for m in mods]


def modules() -> dict[str, Path]:
    found = {}
    for pkg, folder in PACKAGES.items():
        for path in sorted(folder.rglob("*.py")):
            parts = [pkg, *path.relative_to(folder).with_suffix("").parts]
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join(parts)] = path
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
    g["kload.options"] = g["kload.options"] | {"kload.doors.handle"}  # a late import back up the order
    assert any("kload.options" in c and "kload.doors.handle" in c for c in circles(g))


def test_every_module_is_placed_and_imports_only_earlier_steps():
    g = graph()
    assert sorted(g) == sorted(ORDER), "a new module needs its place in ORDER and in docs/design.md"
    rank = {m: i for i, m in enumerate(ORDER)}
    late = [f"{m} imports {d}" for m, deps in g.items() for d in deps if rank[d] >= rank[m]]
    assert late == []


def test_each_stage_is_a_folder_and_its_modules_are_in_it():
    """The layers are the tree: a stage's modules live in its folder (kload.plan.* in
    loader/plan/), and the shared layer is loader/'s top and cache/."""
    for stage, mods in LAYERS:
        if stage == "shared":
            assert all(m.count(".") == 1 or m.startswith("kload.cache") for m in mods), mods
        elif stage.startswith("kload."):
            assert all(m == stage or m.startswith(stage + ".") for m in mods), (stage, mods)


def test_no_module_grows_past_350_lines_without_saying_why():
    """A long module says at its top why it is one file ("Why this file is long: ...")."""
    long = [f"{name}: {path.read_text().count(chr(10))} lines" for name, path in modules().items()
            if path.read_text().count("\n") > 350 and "Why this file is long:" not in path.read_text()[:3000]]
    assert long == []
