"""The command line (``python -m kload``, the ``kload`` script): manage the cache, prebuild, explain.

    kload cache list                     entries: name, key, size, last use, torch, compiler
    kload cache info KEY                 every key input of one entry (KEY: a key prefix or entry name)
    kload cache verify                   re-hash every artifact; quarantine bad ones (exit 1 if any)
    kload cache prune --max-size 5G      least recently used first; --older-than DAYS
    kload cache clear                    entries, index, build directories (never one in use)
    kload cache export NAME... -o B.tar  entries into one file (NAME: a library name, all its builds, or with
                                         --latest the newest; a key prefix; or --all); .tar.gz/.tar.xz compress
    kload cache import B.tar             verify a bundle whole (hashes, members, modes, owner), then add its entries
    kload build SOURCES... [--name N] [--cflags "..."] [-I DIR] [--debug] [--pch]
    kload build --pch [--cflags "..."]    precompile <kload/kernel.h> for these flags (for images)
    kload explain SOURCES... [same flags]     hit, or which key input differs from the nearest entry
    kload ide SOURCES... [same flags] [-o DIR]  compile_commands.json beside the sources, for clangd
"""
from __future__ import annotations

import argparse
import os
import shlex
import sys
import time
from pathlib import Path

from .. import knobs
from .cli_cache import cmd_clear, cmd_info, cmd_list, cmd_prune, cmd_verify, human_size
from .cli_cache import cmd_export, cmd_import
from ..errors import KloadError
from ..messages import msg


# -- build / explain ---------------------------------------------------------------------

def _options(args, sources=None):
    """The options of ``kload.load`` for these command-line arguments (validated as it does)."""
    from ..options import make_options, source_paths

    return make_options(args.name, source_paths(list(sources or args.sources)),
                        sum((shlex.split(f) for f in args.cflags), []),
                        sum((shlex.split(f) for f in args.cuda_cflags), []),
                        sum((shlex.split(f) for f in args.ldflags), []),
                        args.include, verbose=False, debug=True if args.debug else None, reload=False)


def _handle(args):
    from .handle import Handle

    return Handle(_options(args))


def cmd_build(args) -> int:
    if args.pch:
        _precompile(args)
        if not args.sources:
            return 0
    elif not args.sources:
        raise KloadError("build needs SOURCES (or --pch alone, to precompile <kload/kernel.h>)")
    built = _handle(args).build()
    name = args.name or Path(args.sources[0]).stem
    changed = built.entry.changed_during_build
    if changed:  # a prebuild no later load can find: say so, as a failure (a script runs it again)
        print(msg(f"{name}: {', '.join(changed)} changed while it compiled; nothing usable was cached, "
              "run the build again"), file=sys.stderr)
        return 1
    how = f"built in {built.seconds:.1f} s" if built.how == "built" else "already in the cache"
    print(f"{name}: {how}: {built}")
    return 0


def _precompile(args) -> None:
    """Build the precompiled headers SOURCES (default: a cell with these flags) would
    use, in the foreground, and say where they are."""
    from kload.cache.store import Store

    from . import cell_pch_source
    from ..compile.pch import not_applicable, plans_for
    from ..plan.plan import make_plan
    from ..compile.pch_build import build as build_pch

    store = Store(knobs.cache_dir())
    store.prepare()
    p = make_plan(_options(args, args.sources or [cell_pch_source()]), store)
    plans = plans_for(p, store)
    if not plans:
        why = not_applicable(p) or "no source starts with #include <kload/kernel.h> or <torch/extension.h>"
        print(f"no precompiled header applies: {why}")
    for pp in plans:
        t = time.perf_counter()
        entry = build_pch(pp.spec, wait=True)
        print(f"precompiled <{pp.header}> ({human_size(entry.manifest['size'])}) in {time.perf_counter() - t:.1f} s: "
              f"{entry.path}")


def cmd_explain(args) -> int:
    from kload.cache.store import Store

    if not args.sources:
        raise KloadError("explain needs SOURCES")
    from ..plan.explain import explain_plan
    from ..plan.plan import make_plan

    opts = _options(args)
    store = Store(knobs.cache_dir())
    store.check_root()
    print(explain_plan(make_plan(opts, store), store).text())
    return 0


def cmd_ide(args) -> int:
    from .ide import write_ide

    if not args.sources:
        raise KloadError("ide needs SOURCES")
    target, n = write_ide(_handle(args), args.out)
    print(f"{target}: {n} compile command{'s' if n != 1 else ''} for {args.name or Path(args.sources[0]).stem} "
          "(clangd and editors read it from there)")
    return 0


def _remote_cmd(name: str):
    """A remote-cache command; redis is imported only when one runs."""
    def run(args) -> int:
        from . import cli_remote

        return getattr(cli_remote, name)(args)
    return run


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kload", description=msg("JIT-compiled kernels for PyTorch; "
                                f"cache at $KLOAD_CACHE_DIR (now {knobs.cache_dir()})"))
    sub = p.add_subparsers(dest="command", required=True)

    cache = sub.add_parser("cache", help="inspect and manage the cache")
    csub = cache.add_subparsers(dest="cache_command", required=True)
    c = csub.add_parser("list", help="every entry: name, key, size, last use, torch, compiler")
    c.add_argument("--json", action="store_true", help="machine-readable output")
    c.add_argument("--remote", action="store_true", help="the entries of the remote cache (KLOAD_REMOTE_CACHE)")
    c.set_defaults(func=lambda a: _remote_cmd("cmd_list_remote")(a) if a.remote else cmd_list(a))
    c = csub.add_parser("info", help="every key input of one entry")
    c.add_argument("key", help="a key prefix (>= 4 characters) or an entry name")
    c.set_defaults(func=cmd_info)
    c = csub.add_parser("verify", help="re-hash every artifact; quarantine bad ones (exit status 1 if any)")
    c.set_defaults(func=cmd_verify)
    c = csub.add_parser("prune", help="remove least recently used entries")
    c.add_argument("--max-size", metavar="SIZE", help="keep at most this much, e.g. 5G, 500M")
    c.add_argument("--older-than", metavar="DAYS", type=float, help="remove entries unused for this long")
    c.set_defaults(func=cmd_prune)
    c = csub.add_parser("clear", help="remove every entry, the index and the build directories")
    c.set_defaults(func=cmd_clear)
    c = csub.add_parser("export", help="write entries and their manifests into one bundle file")
    c.add_argument("names", nargs="*", metavar="NAME",
                   help="a library name (all its entries) or a key prefix / entry name (one entry)")
    c.add_argument("-o", "--output", required=True, metavar="BUNDLE",
                   help="the bundle to write: .tar, or .tar.gz/.tgz, .tar.xz to compress")
    c.add_argument("--all", action="store_true", help="every library entry in the cache")
    c.add_argument("--latest", action="store_true", help="for a library name, only its newest build")
    c.set_defaults(func=cmd_export)
    c = csub.add_parser("import", help="verify a bundle whole, then add its entries (exit status 1 if refused)")
    c.add_argument("bundle", help="a bundle written by `kload cache export`")
    c.set_defaults(func=cmd_import)
    c = csub.add_parser("push", help="upload entries to the remote cache (KLOAD_REMOTE_CACHE), signed if a key is set")
    c.add_argument("names", nargs="*", metavar="NAME|KEY", help="library names or key prefixes (none: every entry)")
    c.set_defaults(func=_remote_cmd("cmd_push"))
    c = csub.add_parser("pull", help="download and verify entries of the remote cache (exit status 1 if any refused)")
    c.add_argument("names", nargs="*", metavar="NAME|KEY", help="library names or key prefixes (none: every entry)")
    c.set_defaults(func=_remote_cmd("cmd_pull"))

    flags = argparse.ArgumentParser(add_help=False)
    flags.add_argument("sources", nargs="*", help=".cpp/.cu files")
    flags.add_argument("--name", help="the library's name (default: the first source's stem)")
    flags.add_argument("--cflags", action="append", default=[], help='extra compiler flags, e.g. "-O2 -DX=1"')
    flags.add_argument("--cuda-cflags", action="append", default=[], help="extra nvcc flags")
    flags.add_argument("--ldflags", action="append", default=[], help="extra linker flags")
    flags.add_argument("-I", dest="include", action="append", default=[], help="an include directory")
    flags.add_argument("--debug", action="store_true", help="-g -O0 (CUDA: -G)")
    b = sub.add_parser("build", parents=[flags], help="compile into the cache now (for images and clusters)")
    b.add_argument("--pch", action="store_true",
                   help="also precompile the headers the sources start with (alone: <kload/kernel.h> for cells)")
    b.set_defaults(func=cmd_build)
    e = sub.add_parser("explain", parents=[flags], help="hit, or what differs from the nearest entry")
    e.set_defaults(func=cmd_explain)
    i = sub.add_parser("ide", parents=[flags], help="write compile_commands.json beside the sources (for clangd)")
    i.add_argument("-o", "--out", metavar="DIR", help="where to write it (default: the first source's folder)")
    i.set_defaults(func=cmd_ide)
    return p


def main(argv=None) -> int:
    args = parser().parse_args(argv)
    try:
        return args.func(args)
    except BrokenPipeError:  # `kload cache list | head`: the reader left; not an error
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except (KloadError, ValueError, OSError, TypeError) as e:
        print(msg(str(e)), file=sys.stderr)
        return 1

