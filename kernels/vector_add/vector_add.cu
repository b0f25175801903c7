// vector_add — CUDA: one thread per element, grid-stride loop; float, double,
// half and bfloat16. Launched on the current stream under a device guard.
#define KLOAD_LEAN  // nvcc has no precompiled headers: Tensor and the registration API only
#include <kload/kernel.h>
#include "vector_add.h"
#include <kload/cuda/common.cuh>
#include <ATen/ops/empty_like.h>

namespace {

template <typename T>
__global__ void vector_add_kernel(const T* __restrict__ a, const T* __restrict__ b, T* __restrict__ out, int64_t n) {
  CUDA_KERNEL_LOOP_TYPE(i, n, int64_t)
    out[i] = static_cast<T>(static_cast<float>(a[i]) + static_cast<float>(b[i]));
}

template <>
__global__ void vector_add_kernel<double>(const double* __restrict__ a, const double* __restrict__ b,
                                          double* __restrict__ out, int64_t n) {
  CUDA_KERNEL_LOOP_TYPE(i, n, int64_t)
    out[i] = a[i] + b[i];
}

at::Tensor vector_add_cuda(const at::Tensor& a_in, const at::Tensor& b_in) {
  CHECK_CUDA(a_in);
  CHECK_CUDA(b_in);
  kload_vector_add::check_vector_add(a_in, b_in);
  const c10::cuda::CUDAGuard guard(a_in.device());
  const at::Tensor a = a_in.contiguous(), b = b_in.contiguous();
  at::Tensor out = at::empty_like(a, at::MemoryFormat::Contiguous);
  const int64_t n = a.numel();
  if (n == 0) return out;
  // the tutorial's section 4.1 passes these the other way round: blocks first, then threads per block
  const int threads = 256;
  const int blocks = kload::cuda::blocks_for(n, threads);
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, a.scalar_type(), "vector_add_cuda", [&] {
    vector_add_kernel<scalar_t><<<blocks, threads, 0, stream>>>(
        a.const_data_ptr<scalar_t>(), b.const_data_ptr<scalar_t>(), out.mutable_data_ptr<scalar_t>(), n);
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return out;
}

}  // namespace

KLOAD_IMPL(CUDA, m) { m.impl("vector_add", &vector_add_cuda); }
