"""A ``.cu`` in two halves: takes a CUDA source of a build, gives two objects (the
host half compiled by g++ with the precompiled ``#include`` block, the device half by
nvcc) that torch's loader links with the other sources, or says why it compiles the
file whole instead.

- ``scan``: the text of a ``.cu``: tokens, functions, what is host and what is device;
- ``launches``: each ``kernel<<<...>>>`` rewritten into a call of a device-half stub;
- ``split``: the two halves' texts;
- ``units``: compiling one half (its precompiled block, its flags);
- ``build``: which sources are split, and what a failure means.
"""
