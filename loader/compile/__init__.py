"""The compile: takes a Plan and an empty or stale build directory, gives a compiled
library there (and its full key: the plan's key plus every header it read). Imported
only when something must compile (kload.resolve.obtain calls ``pipeline.compile``).

- ``pipeline``: the compile as a list of stages: precompiled header, trim, split
  ``.cu``, torch's loader, link check;
- ``torchbuild``: torch.utils.cpp_extension.load on the build directory, stopped short
  of loading; ``compilers``: ccache, parallel jobs, the CUDA toolkit;
- ``linking``: the link flags a toolchain takes (gold where it works);
- ``pch``, ``pch_build``: precompiled headers, planned here and built in the background;
- ``foreground``: who has the cores (background precompiles pause while a build runs);
- ``trim``, ``registration``: a first build without ATen's whole API, and the checks
  of a library's registrations before it is loaded;
- ``cuda_split/``: a ``.cu`` compiled in two halves (host by g++, device by nvcc).
"""
