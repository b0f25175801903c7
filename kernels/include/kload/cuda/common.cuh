// kload/cuda/common.cuh — what every shipped CUDA op needs: device guard, the
// current stream, a checked launch, and float accumulation for half types.
// Kernels loop with torch's grid-stride CUDA_KERNEL_LOOP_TYPE(i, n, int64_t).
#pragma once

#include <ATen/Dispatch.h>
#include <ATen/cuda/detail/KernelUtils.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

namespace kload {
namespace cuda {

// float for half and bfloat16 (accumulate in fp32), the type itself otherwise
template <typename T> struct acc { using type = T; };
template <> struct acc<c10::Half> { using type = float; };
template <> struct acc<c10::BFloat16> { using type = float; };
template <typename T> using acc_t = typename acc<T>::type;

inline int blocks_for(int64_t n, int threads) {
  return static_cast<int>(std::max<int64_t>(1, std::min<int64_t>((n + threads - 1) / threads, 65535LL * 32)));
}

}  // namespace cuda
}  // namespace kload
