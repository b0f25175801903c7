// kload/cuda/live.cuh — what a kernel file for kload.cuda_module (NVRTC) may include:
// the fixed-width integers, a grid-stride loop and fp32 math for half/bfloat16. NVRTC
// has no C++ standard library headers; nvcc reads this file too (then <cstdint>).
//
//   #include <kload/cuda/live.cuh>
//   extern "C" __global__ void saxpy(float* out, const float* x, const float* y, float a, int64_t n) {
//     KLOAD_KERNEL_LOOP(i, n) out[i] = a * x[i] + y[i];
//   }
#pragma once

#ifdef __CUDACC_RTC__
typedef signed char int8_t;
typedef short int16_t;
typedef int int32_t;
typedef long long int64_t;
typedef unsigned char uint8_t;
typedef unsigned short uint16_t;
typedef unsigned int uint32_t;
typedef unsigned long long uint64_t;
#else
#include <cstdint>
#endif

#include <cuda_bf16.h>
#include <cuda_fp16.h>

// Grid-stride loop over [0, n) with an int64_t index (as kload/cuda/launch.cuh).
#ifndef KLOAD_KERNEL_LOOP
#define KLOAD_KERNEL_LOOP(i, n)                                                                       \
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x, i##_step = int64_t(blockDim.x) * gridDim.x; \
       i < (n); i += i##_step)
#endif

namespace kload {
namespace live {

// fp32 math for the half types: to_acc(x) widens, from_acc<T>(v) rounds to nearest even.
template <typename T> struct acc { using type = T; };
template <> struct acc<__half> { using type = float; };
template <> struct acc<__nv_bfloat16> { using type = float; };
template <typename T> using acc_t = typename acc<T>::type;

template <typename T>
__device__ __forceinline__ T to_acc(T v) { return v; }
__device__ __forceinline__ float to_acc(__half v) { return __half2float(v); }
__device__ __forceinline__ float to_acc(__nv_bfloat16 v) { return __bfloat162float(v); }

template <typename T>
__device__ __forceinline__ T from_acc(acc_t<T> v) { return static_cast<T>(v); }
template <>
__device__ __forceinline__ __half from_acc<__half>(float v) { return __float2half_rn(v); }
template <>
__device__ __forceinline__ __nv_bfloat16 from_acc<__nv_bfloat16>(float v) { return __float2bfloat16_rn(v); }

}  // namespace live
}  // namespace kload
