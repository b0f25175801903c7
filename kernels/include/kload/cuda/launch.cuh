// kload/cuda/launch.cuh — what the shipped CUDA kernels share, with no torch header:
// a <op>.cu that includes only this (and the CUDA runtime's headers) compiles with
// nvcc in about a second, where torch's headers cost it 7-9 s (nvcc has no
// precompiled headers). The glue that checks the inputs, allocates and picks the
// stream lives in <op>.cpp (see kload/cuda/launcher.h for the contract).
//
//   template <typename T>
//   __global__ void twice(const T* x, T* y, int64_t n) {
//     KLOAD_KERNEL_LOOP(i, n) y[i] = kload::cuda::from_acc<T>(2 * kload::cuda::to_acc(x[i]));
//   }
//   KLOAD_LAUNCHER const char* kload_twice_cuda(int dtype, const void* x, void* y, int64_t n, void* stream) {
//     return kload::cuda::dispatch(dtype, [&](auto tag) {
//       using T = decltype(tag);
//       twice<T><<<kload::cuda::blocks_for(n, 256), 256, 0, kload::cuda::stream(stream)>>>(
//           static_cast<const T*>(x), static_cast<T*>(y), n);
//     });
//   }
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>
#include <cstdint>

#include "launcher.h"

// Grid-stride loop over [0, n) with an int64_t index (torch's CUDA_KERNEL_LOOP_TYPE(i, n, int64_t)).
#define KLOAD_KERNEL_LOOP(i, n)                                                                       \
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x, i##_step = int64_t(blockDim.x) * gridDim.x; \
       i < (n); i += i##_step)

// nullptr, or the string of the last CUDA error (and clears it): what a launcher
// returns after its launches (torch's C10_CUDA_KERNEL_LAUNCH_CHECK, as a value).
// (Hidden, like the launchers: nothing outside the library needs these.)
__attribute__((visibility("hidden"))) inline const char* kload_cuda_result() {
  const cudaError_t err = cudaGetLastError();
  return err == cudaSuccess ? nullptr : cudaGetErrorString(err);
}

namespace kload {
namespace cuda {

// Blocks for n elements at `threads` per block: at least 1, at most 65535 * 32
// (the grid-stride loop covers the rest).
__attribute__((visibility("hidden"))) inline int blocks_for(int64_t n, int threads) {
  return static_cast<int>(std::max<int64_t>(1, std::min<int64_t>((n + threads - 1) / threads, 65535LL * 32)));
}

// The current device's multiprocessor count and compute capability (major * 10 +
// minor), asked once per device and cached (cudaDeviceGetAttribute is cheap, but
// not free on every launch). 0 when the runtime cannot say (the launch that
// follows reports the error).
struct DeviceInfo {
  int sms;
  int cc;
};
__attribute__((visibility("hidden"))) inline DeviceInfo device_info() {
  constexpr int kMaxDevices = 64;
  static std::atomic<int> sms[kMaxDevices], ccs[kMaxDevices];  // 0: not asked yet
  int dev = 0;
  if (cudaGetDevice(&dev) != cudaSuccess || dev < 0) return {0, 0};
  if (dev < kMaxDevices) {
    const int known = sms[dev].load(std::memory_order_acquire);
    if (known > 0) return {known, ccs[dev].load(std::memory_order_relaxed)};
  }
  int count = 0, major = 0, minor = 0;
  if (cudaDeviceGetAttribute(&count, cudaDevAttrMultiProcessorCount, dev) != cudaSuccess ||
      cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev) != cudaSuccess ||
      cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, dev) != cudaSuccess)
    return {0, 0};
  if (dev < kMaxDevices) {  // benign race: every thread stores the same values
    ccs[dev].store(major * 10 + minor, std::memory_order_relaxed);
    sms[dev].store(count, std::memory_order_release);
  }
  return {count, major * 10 + minor};
}

// Blocks for a grid-stride loop over `work` items at `threads` per block: enough
// to fill every SM `per_sm` times over (full occupancy for a 256-thread kernel
// on every GPU since Volta: 2048 threads per SM), never more than the work needs.
__attribute__((visibility("hidden"))) inline int blocks_for_sms(int64_t work, int threads, int per_sm = 8) {
  const int sms = device_info().sms;
  const int64_t needed = std::max<int64_t>(1, (work + threads - 1) / threads);
  const int64_t most = sms > 0 ? int64_t(sms) * per_sm : 65535;
  return static_cast<int>(std::min<int64_t>(needed, most));
}

// a launcher's `void* stream` argument (kload::cuda_stream(x) in the glue)
__attribute__((visibility("hidden"))) inline cudaStream_t stream(void* s) { return static_cast<cudaStream_t>(s); }

// Accumulation type: float for half and bfloat16 (fp32 math), the type itself otherwise.
template <typename T> struct acc { using type = T; };
template <> struct acc<__half> { using type = float; };
template <> struct acc<__nv_bfloat16> { using type = float; };
template <typename T> using acc_t = typename acc<T>::type;

// Conversions to and from acc_t, by intrinsics: torch builds CUDA code with
// __CUDA_NO_HALF_CONVERSIONS__ and __CUDA_NO_BFLOAT16_CONVERSIONS__, which remove
// the implicit ones. Both round to nearest even, as c10::Half and c10::BFloat16 do.
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

// Calls f(T{}) for the dtype code (kload/cuda/launcher.h) with T one of float,
// double, __half, __nv_bfloat16; then returns kload_cuda_result(). An unknown code
// launches nothing and says so (the glue checks dtypes first: kload::cuda::dtype_code).
template <typename F>
__attribute__((visibility("hidden"))) inline const char* dispatch(int dtype, const F& f) {
  switch (dtype) {
    case KLOAD_FLOAT32: f(float{}); break;
    case KLOAD_FLOAT64: f(double{}); break;
    case KLOAD_FLOAT16: f(__half{}); break;
    case KLOAD_BFLOAT16: f(__nv_bfloat16{}); break;
    default: return "unsupported dtype code (expected float32, float64, float16 or bfloat16)";
  }
  return kload_cuda_result();
}

}  // namespace cuda
}  // namespace kload
