"""Step 2 of a load, on the hit path: the fingerprint of the options.

The fingerprint is everything the hit record (kload/cache/__init__.py) must match
exactly before it may stand in for the full key: the options, the keyed
environment, the compiler command, torch's and Python's identity. It is a
``repr`` of plain values, computed without hashing a single file; the files
whose bytes go into the key are stamped in the record instead, and ``KEY_CODE``
lists kload's own key-making modules among them, so a record is void once the
code that makes keys changes.
"""
from __future__ import annotations

import os

import kload.cache as _cache
from kload.cache import SCHEMA

from . import knobs
from .options import _HERE, _KERNELS, CUDA_SUFFIXES, Options

# kload's own code that turns inputs into a key: a hit record is void once it changes
KEY_CODE = [os.path.join(_HERE, f) for f in ("options.py", "fingerprint.py", "plan.py", "sources.py",
                                             "toolchain.py", "knobs.py")] + [
    os.path.join(os.path.dirname(os.path.abspath(_cache.__file__)), "key.py")]
_FAST = 2  # the hit record's own format


def fingerprint(opts: Options) -> tuple[str, str] | None:
    """``(fingerprint, compiler path)`` for the hit record of these options, or None
    where the record cannot stand in for the full lookup: CUDA sources (the key
    depends on the GPUs found). ``-march=native`` builds add the CPU model and flags
    (one read of /proc/cpuinfo), as their key does."""
    if any(p.suffix in CUDA_SUFFIXES for p in opts.paths):
        return None
    native = knobs.host_cpu() if any("native" in f for f in opts.cflags + opts.ldflags) else None
    cxx_command = knobs.cxx_command()
    cxx = knobs.which(cxx_command)
    if cxx is None:
        return None  # the full lookup says what is wrong
    env = knobs.keyed_environment()
    env["PATH"] = os.environ.get("PATH", "")
    # repr() of str/bool/list/dict values is unambiguous and cheap (no hashing here)
    return repr((_FAST, SCHEMA, opts.name, [str(p) for p in opts.paths], opts.cflags, opts.cuda_cflags,
                 opts.ldflags, opts.include_paths, opts.debug, opts.with_cuda, opts.standalone, native,
                 knobs.fast_link(), sorted(env.items()),
                 cxx_command, sorted(knobs.torch_identity().items()), sorted(knobs.python_identity().items()),
                 _KERNELS)), cxx
