"""Bring a published artifact into this process.

Op libraries and plain ``TORCH_LIBRARY`` code load with ``torch.ops.load_library``;
pybind11 modules through an ``ExtensionFileLoader`` on the entry's own path. Also
here: listing a namespace's ops, the once-per-process rule of fixed
``TORCH_LIBRARY`` namespaces, and stand-in CUDA kernels for a library built
without its CUDA sources. On the hit path: torch is imported only when a
library is actually loaded.
"""
from __future__ import annotations

import logging
import threading

from kload.cache import Entry

log = logging.getLogger("kload")

_fixed_owner: dict[str, str] = {}          # TORCH_LIBRARY namespace -> key of the build that owns it


def _error(text: str):
    from ..errors import KloadError  # only when something is refused: errors.py is not on the hit path

    return KloadError(text)


def ops_in_namespace(ns: str) -> set[str]:
    import torch

    prefix = ns + "::"
    try:
        all_names = torch._C._dispatch_get_all_op_names()
    except AttributeError:  # older torch
        all_names = [s.name for s in torch._C._jit_get_all_schemas()]
    return {n[len(prefix):].split(".", 1)[0] for n in all_names if n.startswith(prefix)}


def _has_any_op(ns: str, ops: list[str]) -> bool:
    """Whether this process has one of ``ns::op``: a schema lookup per name (1.7 µs in
    benchmarks/clients.py) where listing the process's ~3,600 ops takes 2.7 ms; without
    names, that listing."""
    if not ops:
        return bool(ops_in_namespace(ns))
    import torch

    return any(torch._C._jit_get_schemas_for_operator(f"{ns}::{op}") for op in ops)


def check_fixed_namespaces(name: str, namespaces: list[str], key: str | None, ops: list[str] = (),
                           defined: list[str] | None = None) -> None:
    """Refuse to load a TORCH_LIBRARY namespace that this process already has.

    PyTorch aborts the whole process when a second library registers a
    namespace; this turns that into an exception before anything is loaded.
    ``ops`` are the names the library defines (sources.py found them): the check
    looks those up, not every op of the process. ``defined``: the namespaces its
    TORCH_LIBRARY blocks define, each also asked of torch (a library that Python
    made with ``torch.library.Library(ns, "DEF")`` has no op to look up).
    """
    for ns in namespaces:
        owner = _fixed_owner.get(ns)
        if owner is not None and owner == key:
            continue
        taken = None
        if owner is None and not _has_any_op(ns, list(ops)):
            if ns in (defined or ()):
                from ..compile.registration import namespace_taken  # (a TORCH_LIBRARY library's first load only)

                taken = namespace_taken(ns)
            if taken is None:
                continue
        raise _error(
            f"{name!r} registers TORCH_LIBRARY({ns}, ...), and this process already has "
            + (f"a library of namespace {ns!r} (torch: {taken})" if taken else f"operators in namespace {ns!r}")
            + (" from an earlier build of it" if owner else "")
            + ". PyTorch registers a namespace once per process, so this build cannot be loaded "
            "here: restart the process (the new build is then a cache hit), or register with "
            "KLOAD_LIBRARY(m) so that kload gives every build its own namespace."
        )


def _register(path: str, m: dict) -> None:
    """Register a kload op library's blocks (kernel.h's kload_register) now that torch has
    opened it: what torch refuses is a RegistrationError, and the process goes on."""
    import ctypes

    try:
        run = ctypes.CDLL(path).kload_register
    except AttributeError:  # built before registration was deferred: it registered as it opened
        return
    run.restype = ctypes.c_char_p
    said = run()
    if said:
        from ..compile.registration import refusal  # only when something is refused

        where, _, text = said.decode("utf-8", "replace").partition("\t")
        raise refusal(m["name"], where, text, list(m.get("source_paths") or ()))


def _open_in_child_first(path: str, m: dict) -> None:
    """A library that registers as it opens, not yet opened anywhere: open it in a child
    first, so that torch's abort on a mistake ends the child, not this process."""
    from ..compile.registration import open_in_child, refusal

    _, said = open_in_child(path)
    if said:
        raise refusal(m["name"], "", said, list(m.get("source_paths") or ()))


def claim_fixed_namespaces(namespaces: list[str], key: str) -> None:
    for ns in namespaces:
        _fixed_owner[ns] = key


def register_cuda_stubs(loaded: Loaded, name: str, reason: str):
    """Give each op without a CUDA kernel one that says why it has none."""
    import torch

    libs = []
    for ns in loaded.namespaces:
        lib = None
        for op in sorted(ops_in_namespace(ns)):
            qual = f"{ns}::{op}"
            if any(torch._C._dispatch_has_kernel_for_dispatch_key(qual, k)
                   for k in ("CUDA", "CompositeImplicitAutograd", "CompositeExplicitAutograd")):
                continue
            if lib is None:
                lib = torch.library.Library(ns, "IMPL")
                libs.append(lib)

            def _no_cuda(*args, _op=op, **kwargs):
                raise _error(
                    f"{name}.{_op} was called with CUDA tensors, but {name!r} was built without "
                    f"its CUDA sources: {reason}"
                )

            lib.impl(op, _no_cuda, "CUDA")
    return libs


# library identity -> (namespace, schemas, kernels) of its last stable-ABI load in this process
_stable_last: dict[str, tuple[str, tuple, frozenset]] = {}


def library_identity(m: dict) -> str:
    """What stays the same across edits of one library: its name and its source files
    (a cell's or load_inline's files are named by their content, so there the name)."""
    import os

    from .. import knobs

    inline = os.path.join(str(knobs.cache_dir()), "inline", "")
    return m["name"] + "|" + ",".join(sorted("<inline>" if p.startswith(inline) else p for p in m["source_paths"]))


def load_stable(entry: Entry, path: str) -> tuple[list[str], str | None]:
    """Open a stable-ABI library and register its ops (see kload/stable.h).

    A kload op library registers when asked, under a namespace chosen here:
    ``kload_<name>_<key10>`` the first time; a later build of the same library
    whose schemas are unchanged (and which drops no kernel) registers only its
    kernels, under the namespace the process already has, so ``torch.ops.<ns>.<op>``
    runs the new code. Plain STABLE_TORCH_LIBRARY code registers as it opens."""
    import ctypes

    import torch

    from ..options import torch_release

    m = entry.manifest
    name = m["name"]
    target = m["stable_target"]
    have = torch_release()
    if have < tuple(int(x) for x in target.split(".")):
        raise _error(f"{name!r} is a stable-ABI build for torch {target} and later, and this torch is "
                     f"{torch.__version__}: upgrade torch, or rebuild with KLOAD_STABLE_TARGET={have[0]}.{have[1]}")
    try:
        lib = ctypes.CDLL(path)
    except OSError as e:
        raise _error(f"cannot load {path}: {e}") from None
    if not hasattr(lib, "kload_stable_register"):  # STABLE_TORCH_LIBRARY(ns, m): registered on opening
        return [], None
    lib.kload_stable_describe.restype = ctypes.c_char_p
    lib.kload_stable_register.restype = ctypes.c_char_p
    lib.kload_stable_register.argtypes = [ctypes.c_char_p, ctypes.c_int]
    schemas_t, kernels_f = _stable_blocks(name, lib.kload_stable_describe().decode("utf-8", "replace"), m)
    ident = library_identity(m)
    last = _stable_last.get(ident)
    note = None
    if last is not None and last[1] == schemas_t and kernels_f >= last[2]:
        ns, impl_only = last[0], 1
        note = f"{name}: schemas unchanged; the new kernels run under the same names (torch.ops.{ns})"
    else:
        ns, impl_only = f"kload_{name}_{entry.key[:10]}", 0
        if ops_in_namespace(ns):  # cannot happen for one artifact; never register a namespace twice
            ns = f"{ns}_{len(_stable_last)}"
        if last is not None:
            why = "its schemas changed" if last[1] != schemas_t else "it no longer has a kernel the last build had"
            note = f"{name}: {why}, so its ops are now in torch.ops.{ns} (torch.ops.{last[0]} keeps the last build)"
    err = lib.kload_stable_register(ns.encode(), impl_only)
    if err:
        raise _error(f"registering the ops of {name!r} failed: {err.decode('utf-8', 'replace')}")
    _stable_last[ident] = (ns, schemas_t, kernels_f)
    return [ns], note


def _stable_blocks(name: str, described: str, m: dict) -> tuple[tuple, frozenset]:
    """What a stable library's KLOAD_LIBRARY/KLOAD_IMPL blocks define and implement (its
    ``kload_stable_describe``): the schemas, sorted, and the (dispatch key, op) kernels.
    Each schema is read by torch's parser, and each kernel's C++ types (TORCH_BOX's)
    are compared with its schema, before anything registers."""
    import torch

    schemas, kernels, parsed = [], set(), {}
    for line in described.splitlines():
        kind, _, rest = line.partition("\t")
        if kind == "error":
            raise _error(f"{name!r}: a KLOAD_LIBRARY/KLOAD_IMPL block failed: {rest}")
        if kind == "def":
            try:
                s = torch._C.parse_schema(rest)
            except RuntimeError as e:
                raise _error(f"{name!r} defines an invalid schema {rest!r}: {e}") from None
            parsed[s.name + ("." + s.overload_name if s.overload_name else "")] = s
            schemas.append(rest)
        elif kind == "impl":
            key, op, types = (rest.split("\t") + ["", ""])[:3]
            kernels.add((key, op))
            wrong = _boxing_mismatch(parsed.get(op), types)
            if wrong:  # TORCH_BOX would read the arguments' bits as the wrong types: refused before registering
                from ..compile.registration import refusal

                raise refusal(name, "", wrong, list(m.get("source_paths") or ()), op=op, call="impl")
    return tuple(sorted(schemas)), frozenset(kernels)


def _boxing_mismatch(schema, types: str) -> str | None:
    """What differs between a schema and the C++ types TORCH_BOX saw its kernel take
    ("Tensor,float>Tensor"; an empty name is a type kload does not compare), or None."""
    if schema is None or not types:
        return None
    args, _, rets = types.partition(">")
    for what, want, have in (("argument", [(a.name, str(a.type)) for a in schema.arguments], args),
                             ("return", [(f"#{i + 1}", str(r.type)) for i, r in enumerate(schema.returns)], rets)):
        have = have.split(",") if have else []
        if len(have) != len(want):
            return (f"the kernel's C++ types do not match its schema: the schema has {len(want)} {what}s, "
                    f"the kernel {len(have)}")
        for (arg, expected), got in zip(want, have):
            if got and got != expected:
                return (f"the kernel's C++ types do not match its schema: {what} {arg} is {expected} in the "
                        f"schema, the kernel's is {got} (TORCH_BOX would read its bits as {got})")
    return None


_load_lock = threading.RLock()
_loaded: dict[str, "Loaded"] = {}          # artifact path -> what it registered


class Loaded:
    """What one artifact brought into this process."""

    __slots__ = ("entry", "module", "namespaces", "note", "_keepalive")

    def __init__(self, entry: Entry, module, namespaces: list[str], note: str | None = None):
        self.entry, self.module, self.namespaces = entry, module, namespaces
        self.note = note  # how a stable library was registered, when that is news (in place / new namespace)
        self._keepalive: list = []  # torch.library.Library objects that must outlive the handle

    def op_names(self) -> list[str]:
        names: set[str] = set()
        for ns in self.namespaces:
            names.update(ops_in_namespace(ns))
        return sorted(names)

    def names(self) -> list[str]:
        names = set(self.op_names())
        if self.module is not None:
            names.update(n for n in vars(self.module) if not n.startswith("_"))
        return sorted(names)

    def attribute(self, attr: str):
        if self.module is not None and not attr.startswith("_") and hasattr(self.module, attr):
            return getattr(self.module, attr)
        import torch

        for ns in self.namespaces:
            try:  # one schema lookup, not a listing of every op in the process
                return getattr(getattr(torch.ops, ns), attr)
            except (AttributeError, RuntimeError):
                continue
        return None


def load_entry(entry: Entry) -> Loaded:
    """Load an entry's artifact into this process (once per artifact).

    Op libraries and TORCH_LIBRARY code load with ``torch.ops.load_library``;
    pybind11 modules through an ``ExtensionFileLoader`` on the entry's own path
    (never put in ``sys.modules``), so a newer build of the same module name
    loads beside the old."""
    path = str(entry.artifact)
    with _load_lock:
        done = _loaded.get(path)
        if done is not None:
            return done
        m = entry.manifest
        fixed = list(m.get("fixed_namespaces") or [])
        if fixed:  # refused where this process has one of its namespaces (an earlier load claimed it)
            check_fixed_namespaces(m["name"], fixed, entry.key, m.get("fixed_ops") or (), m.get("def_namespaces"))
            # its build could not open it in a child: here, first (an entry from before the field was
            # opened by its builder's own load: known to open, not asked again on every hit)
            if m.get("opens_checked") is False:
                _open_in_child_first(path, m)
        import torch

        module, note = None, None
        if "stable" in (m.get("style") or ""):
            own, note = load_stable(entry, path)
        else:
            own = [m["namespace"]] if m.get("namespace") else []
            try:
                if m.get("python_module"):
                    from importlib.machinery import ExtensionFileLoader
                    from importlib.util import module_from_spec, spec_from_file_location

                    # A dotted name unique to this build: Python still calls PyInit_<name>
                    # (the last component), and pybind11, which caches modules by their
                    # full name, initializes each build's module on its own.
                    qual = f"_kload_{entry.key[:16]}.{m['name']}"
                    spec = spec_from_file_location(qual, path, loader=ExtensionFileLoader(qual, path))
                    module = module_from_spec(spec)
                    spec.loader.exec_module(module)
                else:
                    torch.ops.load_library(path)
            except (OSError, ImportError) as e:
                cause = e.__cause__ or e
                hint = f" (its CUDA sources were not built: {m['cuda_skipped']})" if m.get("cuda_skipped") else ""
                raise _error(f"cannot load {path}: {cause}{hint}") from None
            if m.get("namespace"):  # kload's macros register now, not while the library opened (kernel.h)
                _register(path, m)
        if fixed:
            claim_fixed_namespaces(fixed, entry.key)
        loaded = Loaded(entry, module, own + fixed, note)
        if m.get("cuda_skipped"):
            loaded._keepalive.append(register_cuda_stubs(loaded, m["name"], m["cuda_skipped"]))
        _loaded[path] = loaded
        return loaded
