"""Device code at edit speed: takes a ``.cu`` of ``__global__`` functions, gives kernels
to launch from Python (``kload.cuda_module``) or to bind into a C++ library's slots
(``device_code=``), recompiled by NVRTC in milliseconds when the file changes. No host
compiler runs; nothing on the CPU-only path imports this.

- ``nvrtc``: NVRTC through ctypes (source -> cubin or PTX);
- ``cubin``: the key, lookup and publish of a compiled image (a cache entry of kind ``cubin``);
- ``cudadrv``: the CUDA driver API through ctypes (load, get a kernel, launch);
- ``cuda_module``: CudaModule, the user's object, swapped in place after an edit;
- ``glue``: a C++ library's kernel slots bound to a CudaModule's kernels.
"""
