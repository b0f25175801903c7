"""kload's shipped kernels (see issue 3): each compiles on first use from kernels/<op>/."""
