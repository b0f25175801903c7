"""The plan: takes a load's Options, gives a Plan: everything known before anything
compiles, and the source key it hashes to (kload/cache/key.py). It runs on a miss of
the hit record (kload.resolve); on a hit nothing here is imported.

- ``plan``: the Plan itself: the flags, the key inputs, the key;
- ``sources``: what the sources are: their binding style, the namespaces they
  register, the headers their text names;
- ``toolchain``: the compilers' identities and the CUDA architectures, memoized;
- ``explain``: why a plan's key misses (``kload explain``, a refused lookup).
"""
