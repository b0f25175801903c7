// kload/split/host.h — the end of the host half's precompiled prefix (loader/cusplit.py):
// what g++ needs to compile a .cu's host code as nvcc would hand it over. Every kernel
// launch k<<<grid, block, shared, stream>>>(args) is written as nvcc writes it,
// (__cudaPushCallConfiguration(grid, block, shared, stream) ? (void)0 : k(args)): k is
// then nvcc's host stub of the kernel, defined by the device half's object, which pops
// the configuration and launches (cudaLaunchKernel) on the given stream.
#pragma once

#include <cuda.h>           // CUDA_VERSION, which torch's headers include for nvcc only
#include <cuda_runtime.h>

// attributes nvcc reads off a kernel's declaration; nothing to the host compiler
#ifndef __launch_bounds__
#define __launch_bounds__(...)
#endif
#ifndef __cluster_dims__
#define __cluster_dims__(...)
#endif
#ifndef __maxnreg__
#define __maxnreg__(...)
#endif

// torch declares RestrictPtrTraits for nvcc and hipcc only (__CUDACC__), yet a .cu's host code
// names it in packed_accessor32<T, N, RestrictPtrTraits>(): the same template, where nvcc's
// kernels have it (the device half's mangled names name it there)
#if __has_include(<torch/headeronly/core/TensorAccessor.h>)
namespace torch { namespace headeronly {
template <typename T> struct RestrictPtrTraits { typedef T* __restrict__ PtrType; };
}}  // namespace torch::headeronly
namespace at { using torch::headeronly::RestrictPtrTraits; }
#else
namespace at {
template <typename T> struct RestrictPtrTraits { typedef T* __restrict__ PtrType; };
}  // namespace at
#endif

extern "C" unsigned __cudaPushCallConfiguration(dim3 gridDim, dim3 blockDim = 1, size_t sharedMem = 0,
                                                struct CUstream_st* stream = 0);
