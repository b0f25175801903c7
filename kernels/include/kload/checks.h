// kload/checks.h — the input checks that the classic extension tutorials use
// without defining. Only macros: TORCH_CHECK is resolved where they are used,
// so this header includes nothing and costs nothing to compile.
//
// kload force-includes it (-include) into classic PYBIND11_MODULE sources that
// use CHECK_* without defining them; <kload/kernel.h> includes it for op libraries.
#pragma once

#ifndef CHECK_CUDA
#define CHECK_CUDA(x) \
  TORCH_CHECK((x).is_cuda(), #x " must be a CUDA tensor, got a tensor on ", (x).device())
#endif

#ifndef CHECK_CONTIGUOUS
#define CHECK_CONTIGUOUS(x) \
  TORCH_CHECK((x).is_contiguous(), #x " must be contiguous, got strides ", (x).strides())
#endif

// Defined and contiguous. No device requirement: the same check serves CPU and
// CUDA code (add CHECK_CUDA where a kernel needs the GPU).
#ifndef CHECK_INPUT
#define CHECK_INPUT(x)                                              \
  do {                                                              \
    TORCH_CHECK((x).defined(), #x " must be a defined tensor");     \
    CHECK_CONTIGUOUS(x);                                            \
  } while (0)
#endif
