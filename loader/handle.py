"""``kload.load`` and the handle it returns: lazy, memoized attribute access to ops.

The first access of an op builds (or finds in the cache) and loads the library;
the op is then stored on the instance, so later calls cost a plain attribute
lookup: ``handle.vector_add`` *is* ``torch.ops.<ns>.vector_add``.

This module is the whole cache-hit path of a fresh process, with ``knobs`` and
``kload.cache``: a hit record matches (see kload/cache/__init__.py), the entry is
checked and its library loaded, and nothing else of kload is imported. The full
lookup (plan.py: hashing sources, compiler identity, index) and the build
machinery load on a miss only.
"""
from __future__ import annotations

import logging
import os
import threading
import time
from pathlib import Path

import kload.cache as _cache
from kload.cache import SCHEMA, Entry, entry_in_use, fast_lookup

from . import knobs

log = logging.getLogger("kload")

HISTORY: list[dict] = []  # what this process built or loaded, for `%kload` and `python -m kload`

CPP_SUFFIXES = (".cpp", ".cc", ".cxx", ".c++", ".c")
CUDA_SUFFIXES = (".cu",)

_HERE = os.path.dirname(os.path.abspath(__file__))
# kload/kernels in an installed package; kernels/ beside loader/ in a checkout
_KERNELS = os.path.join(_HERE, "kernels")
if not os.path.isdir(_KERNELS):
    _KERNELS = os.path.join(os.path.dirname(_HERE), "kernels")
# kload's own code that turns inputs into a key: a hit record is void once it changes
KEY_CODE = [os.path.join(_HERE, f) for f in ("plan.py", "sources.py", "toolchain.py", "knobs.py")] + [
    os.path.join(os.path.dirname(os.path.abspath(_cache.__file__)), "key.py")]
_FAST = 2  # the hit record's own format


def include_dir() -> Path:
    """Where <kload/kernel.h> lives."""
    return Path(_KERNELS, "include")


# -- what the caller asked for ------------------------------------------------------

def _error(text: str):
    from .errors import KloadError

    return KloadError(text)


def _is_c_identifier(name: str) -> bool:
    return name.isidentifier() and name.isascii()  # no regex on the hit path


def check_name(name: str) -> str:
    if not isinstance(name, str) or not _is_c_identifier(name):
        raise ValueError(
            f"kload: name must be a C identifier (letters, digits, underscores; not starting with a digit), got {name!r}"
        )
    return name


def default_name(path: Path) -> str:
    stem = "".join(c if c.isascii() and (c.isalnum() or c == "_") else "_" for c in path.stem)
    return stem if _is_c_identifier(stem) else f"_{stem}"


def resolve_paths(sources) -> list[Path]:
    """Absolute paths of the given sources; a clear error for a missing or odd one.
    (os.path on strings, Path objects at the end: this runs on every load().)"""
    if isinstance(sources, (str, Path)):
        sources = [sources]
    texts: list[str] = []
    for s in sources:
        if not isinstance(s, (str, Path)):
            raise TypeError(f"kload: a source must be a path, got {type(s).__name__}: {s!r}")
        text = os.fspath(s)
        if text.startswith("~"):
            text = os.path.expanduser(text)
        text = os.path.normpath(text if os.path.isabs(text) else os.path.join(os.getcwd(), text))
        suffix = os.path.splitext(text)[1]
        if suffix.lower() not in CPP_SUFFIXES + CUDA_SUFFIXES:
            raise _error(
                f"kload: unsupported source type {suffix or '(no suffix)'!r} for {text}; "
                f"expected one of {', '.join(CPP_SUFFIXES + CUDA_SUFFIXES)} (headers are found through #include)"
            )
        if not os.path.isfile(text):
            raise FileNotFoundError(f"kload: source file not found: {text}")
        if text in texts:
            raise _error(f"kload: source listed twice: {text}")
        texts.append(text)
    if not texts:
        raise _error("kload: load() needs at least one source file")
    stems = [os.path.splitext(os.path.basename(t))[0] for t in texts if not t.endswith(CUDA_SUFFIXES)]
    dup = {s for s in stems if stems.count(s) > 1}
    if dup:
        # torch names object files after the stem: two a.cpp would overwrite each other's a.o
        raise _error(f"kload: two C++ sources share the file name {sorted(dup)[0]!r}; rename one")
    return [Path(t) for t in texts]


class Options:
    """What the caller asked for, validated."""

    __slots__ = ("name", "paths", "cflags", "cuda_cflags", "ldflags", "include_paths", "verbose", "debug",
                 "reload")

    def __init__(self, name, paths, cflags=(), cuda_cflags=(), ldflags=(), include_paths=(), verbose=False,
                 debug=False, reload=False):
        self.name, self.paths = name, list(paths)
        self.cflags, self.cuda_cflags, self.ldflags = list(cflags), list(cuda_cflags), list(ldflags)
        self.include_paths, self.verbose, self.debug = list(include_paths), verbose, debug
        self.reload = reload  # watch the files and rebuild on save (not part of the key)


def _flag_list(value, what: str, kinds=(str,)) -> list:
    if value is None:
        return []
    if isinstance(value, (str, os.PathLike)):
        raise TypeError(f"kload: {what} must be a list of strings, got {value!r} (wrap it in a list)")
    out = list(value)
    for v in out:
        if not isinstance(v, kinds):
            raise TypeError(f"kload: {what} must contain strings, got {type(v).__name__}: {v!r}")
    return out


def make_options(name, paths, extra_cflags, extra_cuda_cflags, extra_ldflags, extra_include_paths,
                 verbose, debug, reload=None) -> Options:
    incs = [os.path.abspath(os.path.expanduser(os.fspath(p)))
            for p in _flag_list(extra_include_paths, "extra_include_paths", (str, os.PathLike))]
    for inc in incs:
        if not os.path.isdir(inc):
            raise FileNotFoundError(f"kload: include directory not found: {inc}")
    return Options(
        name=check_name(name if name is not None else default_name(paths[0])),
        paths=paths,
        cflags=_flag_list(extra_cflags, "extra_cflags"),
        cuda_cflags=_flag_list(extra_cuda_cflags, "extra_cuda_cflags"),
        ldflags=_flag_list(extra_ldflags, "extra_ldflags"),
        include_paths=incs,
        verbose=bool(verbose),
        debug=knobs.debug() if debug is None else bool(debug),
        reload=knobs.reload() if reload is None else bool(reload),
    )


def load(*sources, name=None, extra_cflags=(), extra_cuda_cflags=(), extra_ldflags=(),
         extra_include_paths=(), verbose=False, debug=None, reload=None) -> "Handle":
    """A handle to the ops in ``sources`` (.cpp/.cu); nothing compiles until first use.

    ``debug=True`` builds with ``-g -O0`` (CUDA: ``-G``) into an entry of its own
    (default: ``KLOAD_DEBUG``). ``reload=True`` watches the sources and the headers
    they include, and the next access after a save runs the new code (default:
    ``KLOAD_RELOAD``, else on in IPython/Jupyter and interactive sessions).
    Missing files, unsupported suffixes and malformed options raise here, at once.
    """
    if len(sources) == 1 and isinstance(sources[0], (list, tuple)):
        sources = tuple(sources[0])
    paths = resolve_paths(list(sources))
    opts = make_options(name, paths, extra_cflags, extra_cuda_cflags, extra_ldflags,
                        extra_include_paths, verbose, debug, reload)
    return Handle(opts)


# -- finding the entry ----------------------------------------------------------------

def fingerprint(opts: Options) -> tuple[str, str] | None:
    """``(fingerprint, compiler path)`` for the hit record of these options, or None
    where the record cannot stand in for the full lookup: CUDA sources (the key
    depends on the GPUs found) and ``-march=native`` (on the CPU model)."""
    if any(p.suffix in CUDA_SUFFIXES for p in opts.paths):
        return None
    flags = opts.cflags + opts.ldflags
    if any("native" in f for f in flags):
        return None
    cxx_command = knobs.cxx_command()
    cxx = knobs.which(cxx_command)
    if cxx is None:
        return None  # the full lookup says what is wrong
    env = knobs.keyed_environment()
    env["PATH"] = os.environ.get("PATH", "")
    # repr() of str/bool/list/dict values is unambiguous and cheap (no hashing here)
    return repr((_FAST, SCHEMA, opts.name, [str(p) for p in opts.paths], opts.cflags, opts.cuda_cflags,
                 opts.ldflags, opts.include_paths, opts.debug, knobs.fast_link(), sorted(env.items()),
                 cxx_command, sorted(knobs.torch_identity().items()), sorted(knobs.python_identity().items()),
                 _KERNELS)), cxx


def resolve_entry(opts: Options) -> tuple[Entry, str, float]:
    """``(entry, "cache" | "built", seconds)``: the hit record, else the full lookup,
    else lock and compile."""
    started = time.perf_counter()
    root = knobs.cache_root()
    fast = fingerprint(opts)
    if fast is not None:
        entry = fast_lookup(root, opts.name, *fast)
        if entry is not None:
            entry.touch()
            return entry, "cache", time.perf_counter() - started
    from .plan import resolve_full

    entry, how = resolve_full(opts, Path(root), fast)
    return entry, how, time.perf_counter() - started


# -- loading --------------------------------------------------------------------------

_load_lock = threading.RLock()
_loaded: dict[str, "Loaded"] = {}          # artifact path -> what it registered


class Loaded:
    """What one artifact brought into this process."""

    __slots__ = ("entry", "module", "namespaces", "_keepalive")

    def __init__(self, entry: Entry, module, namespaces: list[str]):
        self.entry, self.module, self.namespaces = entry, module, namespaces
        self._keepalive: list = []  # torch.library.Library objects that must outlive the handle

    def op_names(self) -> list[str]:
        from .runtime import ops_in_namespace

        names: set[str] = set()
        for ns in self.namespaces:
            names.update(ops_in_namespace(ns))
        return sorted(names)

    def names(self) -> list[str]:
        names = set(self.op_names())
        if self.module is not None:
            names.update(n for n in vars(self.module) if not n.startswith("_"))
        return sorted(names)

    def resolve(self, attr: str):
        if self.module is not None and not attr.startswith("_") and hasattr(self.module, attr):
            return getattr(self.module, attr)
        import torch

        for ns in self.namespaces:
            try:  # one schema lookup, not a listing of every op in the process
                return getattr(getattr(torch.ops, ns), attr)
            except (AttributeError, RuntimeError):
                continue
        return None


def load_entry(entry: Entry, *, just_built: bool = False) -> Loaded:
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
        if fixed:
            from .runtime import check_fixed_namespaces

            if not just_built:
                check_fixed_namespaces(m["name"], fixed, entry.key)
        import torch

        module = None
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
            raise _error(f"kload: cannot load {path}: {cause}{hint}") from None
        if fixed:
            from .runtime import claim_fixed_namespaces

            claim_fixed_namespaces(fixed, entry.key)
        namespaces = ([m["namespace"]] if m.get("namespace") else []) + fixed
        loaded = Loaded(entry, module, namespaces)
        if m.get("cuda_skipped"):
            from .runtime import register_cuda_stubs

            loaded._keepalive.append(register_cuda_stubs(loaded, m["name"], m["cuda_skipped"]))
        _loaded[path] = loaded
        return loaded


# -- the handle -----------------------------------------------------------------------

class Handle:
    """Ops and functions of one kernel library, compiled at first use."""

    def __init__(self, opts: Options):
        d = self.__dict__
        d["_opts"] = opts
        d["_mutex"] = threading.RLock()
        d["_loaded"] = None
        d["_entry"] = None
        d["_stale"] = False       # a watched file changed: rebuild at the next access
        d["_files"] = set()       # what the watcher looks at (sources + local headers), if watched
        d["_last_error"] = None   # the rebuild error reported last (each is reported once)

    # -- public API (few names, so they rarely shadow an op; ops stay reachable via .ops) --
    def build(self) -> str:
        """Compile now (or find in the cache) without loading; returns the artifact's path."""
        with self._mutex:
            if self._entry is None:
                entry, how, seconds = resolve_entry(self._opts)
                self._record(entry, how, seconds)
            return str(self._entry.artifact)

    def load(self) -> "Handle":
        """Build if needed and load into this process; returns the handle."""
        self._ensure()
        return self

    def reload(self) -> bool:
        """Check the sources and headers now; rebuild and switch to the new code if
        they changed. True when new code was loaded. A failed rebuild is reported
        and the last good build keeps serving."""
        self.__dict__["_stale"] = True
        return self._refresh()

    @property
    def ops(self):
        """``torch.ops.<namespace>`` of this build (op libraries)."""
        import torch

        loaded = self._ensure()
        if not loaded.namespaces:
            raise AttributeError(f"kload: {self._opts.name!r} registers no operators (it is a pybind11 module)")
        return getattr(torch.ops, loaded.namespaces[0])

    @property
    def module(self):
        """The pybind11 module of a classic extension, else None."""
        return self._ensure().module

    @property
    def namespace(self) -> str | None:
        """The operator namespace of this build, as in ``torch.ops.<namespace>``."""
        ns = self._ensure().namespaces
        return ns[0] if ns else None

    def names(self) -> list[str]:
        """Every op and function this library exposes."""
        return self._ensure().names()

    # -- machinery --------------------------------------------------------------
    def _record(self, entry: Entry, how: str, seconds: float) -> None:
        self.__dict__["_entry"] = entry
        HISTORY.append({"name": self._opts.name, "how": how, "seconds": seconds, "key": entry.key,
                        "path": str(entry.artifact), "time": time.time()})
        if how != "built":  # a build's summary replaced its progress line already
            ms = seconds * 1e3
            text = (f"kload: loaded {self._opts.name} from cache in {ms:.1f} ms" if ms < 10 else
                    f"kload: loaded {self._opts.name} from cache in {ms:.0f} ms")
            if knobs.output_mode() is None:
                log.info("%s", text)  # what say() would do, without importing the progress display
            else:
                from .progress import say

                say(text)

    def _ensure(self) -> Loaded:
        loaded = self._loaded
        if loaded is not None:
            return loaded
        with self._mutex:
            if self._loaded is None:
                if self._entry is None:
                    entry, how, seconds = resolve_entry(self._opts)
                    self._record(entry, how, seconds)
                else:
                    how = "cache"
                with entry_in_use(self._entry.path):
                    self.__dict__["_loaded"] = load_entry(self._entry, just_built=(how == "built"))
                self._watch()
            return self._loaded

    def _watch(self) -> None:
        if self._opts.reload:  # reload() checks through the key and needs no file list
            from .watch import watch

            watch(self, [str(p) for p in self._opts.paths] + list(self._entry.manifest.get("headers", {})))

    def _drop_ops(self) -> None:
        for attr in [a for a in list(self.__dict__) if not a.startswith("_")]:  # list(): atomic copy
            self.__dict__.pop(attr, None)

    def _mark_stale(self) -> None:
        """Called by the watcher thread: the next access of an op rebuilds."""
        self.__dict__["_stale"] = True
        self._drop_ops()

    def _refresh(self) -> bool:
        from .errors import KloadError

        with self._mutex:
            if not self._stale:
                return False
            self.__dict__["_stale"] = False
            if self._loaded is None:  # never loaded: the first access builds anyway
                self.__dict__["_entry"] = None
                return False
            try:
                entry, how, seconds = resolve_entry(self._opts)
                if entry.key == self._entry.key:
                    return False
                with entry_in_use(entry.path):
                    loaded = load_entry(entry, just_built=(how == "built"))
            except (KloadError, OSError) as e:
                text = str(e)
                if text != self._last_error:
                    from .progress import say

                    self.__dict__["_last_error"] = text
                    say(f"kload: rebuilding {self._opts.name} failed; still running the last good build.\n{text}",
                        error=True)
                return False
            self.__dict__["_last_error"] = None
            self._record(entry, how, seconds)
            self.__dict__["_loaded"] = loaded
            self._drop_ops()
            self._watch()
            return True

    def __getattr__(self, attr: str):
        if attr.startswith("_"):
            raise AttributeError(attr)
        if self._stale:
            self._refresh()
        loaded = self._ensure()
        value = loaded.resolve(attr)
        if value is None:
            names = loaded.names()
            raise AttributeError(
                f"kload: {self._opts.name!r} has no op or function {attr!r}; it has: "
                + (", ".join(names) if names else "(nothing)")
            )
        self.__dict__[attr] = value
        return value

    def __setattr__(self, attr, value):
        raise AttributeError(f"kload: a handle's attributes are its ops; cannot set {attr!r}")

    def __dir__(self):
        base = ["build", "load", "reload", "ops", "module", "namespace", "names"]
        return base + (self._loaded.names() if self._loaded is not None else [])

    def __repr__(self) -> str:
        state = "not built yet" if self._entry is None else f"entry {self._entry.path.name}"
        if self._loaded is not None:
            state += ", loaded: " + ", ".join(self._loaded.names())
        return f"<kload.Handle {self._opts.name!r} ({state})>"
