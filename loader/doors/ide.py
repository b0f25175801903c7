"""``kload ide SOURCES...`` (and ``%kload ide``): a ``compile_commands.json`` beside
the sources, so that clangd and editors built on it resolve <kload/kernel.h>,
torch's headers and the library's own, with the flags of the real build.

Every build leaves ninja's compilation database in its build directory
(compile/pipeline.py). This builds the sources if they are not in the cache, takes that
database, keeps the commands of the user's own files, drops what only GCC
understands (its precompiled-header directories, ``--param``), and merges the
result into the file beside the sources: commands for other files stay.
"""
from __future__ import annotations

import json
import os
import shlex
from pathlib import Path

from kload.cache.store import write_atomic

from ..compile.inputs import COMPDB
from ..errors import KloadError
from .handle import Handle


def _for_clangd(args: list[str]) -> list[str]:
    """The compile command without what only GCC reads: the precompiled-header
    directories kload puts on the include path, -Winvalid-pch, --param."""
    out: list[str] = []
    skip = False
    for a in args:
        if skip:
            skip = False
            continue
        if a == "-Winvalid-pch" or a.startswith("--param"):
            skip = a == "--param"
            continue
        if a.startswith("-I") and f"{os.sep}entries{os.sep}pch-" in a:
            continue
        out.append(a)
    return out


def build_commands(handle: Handle) -> list[dict]:
    """The compile commands of the handle's build (built first if need be), for its
    own source files."""
    built = handle.build()
    ws = built.build_dir
    try:
        commands = json.loads((ws / COMPDB).read_text())
    except (OSError, ValueError, TypeError):  # TypeError: an entry without key inputs has no directory
        raise KloadError(f"{built.entry.manifest.get('name')!r} is in the cache, but its build directory has "
                         f"no {COMPDB} ({ws}): the entry was imported or built by an older kload. `kload cache "
                         "clear` and build it again to make one.") from None
    own = set(built.sources)  # the user's files (not kload's generated namespace source)
    out = []
    for c in commands:
        if c.get("file") not in own:
            continue
        args = c["arguments"] if "arguments" in c else shlex.split(c["command"])
        out.append({"directory": c["directory"], "file": c["file"], "arguments": _for_clangd(args),
                    "output": c.get("output")})
    return out


def write_ide(handle: Handle, out_dir: str | os.PathLike | None = None) -> tuple[Path, int]:
    """Merge the handle's compile commands into ``out_dir/compile_commands.json``
    (default: the folder of its first source). Returns the file and how many
    commands it now has for this library."""
    commands = build_commands(handle)
    folder = Path(out_dir) if out_dir is not None else Path(handle.build().sources[0]).parent
    target = folder / COMPDB
    existing: list = []
    if target.exists():
        try:
            existing = json.loads(target.read_text())
        except (OSError, ValueError):
            existing = None
        if not isinstance(existing, list):
            raise KloadError(f"{target} exists and is not a compilation database; move it away")
    mine = {c["file"] for c in commands}
    merged = [c for c in existing if not (isinstance(c, dict) and c.get("file") in mine)] + commands
    write_atomic(target, json.dumps(merged, indent=2) + "\n", mode=0o644)
    return target, len(commands)
