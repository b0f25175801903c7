// bias_gelu — CUDA: y = gelu(x + bias) and its backward, one thread per element
// (grid-stride), fp32 math for half/bfloat16; grad_bias by a column reduction.
#define KLOAD_LEAN  // nvcc has no precompiled headers: Tensor and the registration API only
#include <kload/kernel.h>
#include "bias_gelu.h"
#include <kload/cuda/common.cuh>
#include <ATen/ops/empty_like.h>

namespace {

template <typename T>
__global__ void bias_gelu_forward_kernel(const T* __restrict__ x, const T* __restrict__ bias, T* __restrict__ y,
                                         int64_t n, int64_t D) {
  using A = kload::cuda::acc_t<T>;
  CUDA_KERNEL_LOOP_TYPE(i, n, int64_t) {
    const A z = static_cast<A>(x[i]) + static_cast<A>(bias[i % D]);
    y[i] = static_cast<T>(A(0.5) * z * (A(1) + erf(z * A(0.70710678118654752440))));
  }
}

template <typename T>
__global__ void bias_gelu_backward_kernel(const T* __restrict__ grad, const T* __restrict__ x,
                                          const T* __restrict__ bias, T* __restrict__ grad_x, int64_t n, int64_t D) {
  using A = kload::cuda::acc_t<T>;
  CUDA_KERNEL_LOOP_TYPE(i, n, int64_t) {
    const A z = static_cast<A>(x[i]) + static_cast<A>(bias[i % D]);
    const A cdf = A(0.5) * (A(1) + erf(z * A(0.70710678118654752440)));
    const A pdf = A(0.39894228040143267794) * exp(A(-0.5) * z * z);
    grad_x[i] = static_cast<T>(static_cast<A>(grad[i]) * (cdf + z * pdf));
  }
}

void check(const at::Tensor& x, const at::Tensor& bias) {
  CHECK_CUDA(x);
  CHECK_CUDA(bias);
  kload_bias_gelu::check_bias_gelu(x, bias);
}
void check_backward(const at::Tensor& grad, const at::Tensor& x, const at::Tensor& bias) {
  CHECK_CUDA(x);
  kload_bias_gelu::check_bias_gelu_backward(grad, x, bias);
}

at::Tensor bias_gelu_cuda(const at::Tensor& x_in, const at::Tensor& bias_in) {
  check(x_in, bias_in);
  const c10::cuda::CUDAGuard guard(x_in.device());
  const at::Tensor x = x_in.contiguous(), bias = bias_in.contiguous();
  at::Tensor y = at::empty_like(x, at::MemoryFormat::Contiguous);
  const int64_t n = x.numel(), D = x.size(-1);
  if (n == 0) return y;
  const int threads = 256;
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "bias_gelu_cuda", [&] {
    bias_gelu_forward_kernel<scalar_t><<<kload::cuda::blocks_for(n, threads), threads, 0, stream>>>(
        x.const_data_ptr<scalar_t>(), bias.const_data_ptr<scalar_t>(), y.mutable_data_ptr<scalar_t>(), n, D);
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return y;
}

std::tuple<at::Tensor, at::Tensor> bias_gelu_backward_cuda(const at::Tensor& grad_in, const at::Tensor& x_in,
                                                           const at::Tensor& bias_in) {
  check_backward(grad_in, x_in, bias_in);
  const c10::cuda::CUDAGuard guard(x_in.device());
  const at::Tensor x = x_in.contiguous(), bias = bias_in.contiguous(), grad = grad_in.contiguous();
  at::Tensor grad_x = at::empty_like(x, at::MemoryFormat::Contiguous);
  const int64_t n = x.numel(), D = x.size(-1);
  if (n > 0) {
    const int threads = 256;
    const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "bias_gelu_backward_cuda", [&] {
      bias_gelu_backward_kernel<scalar_t><<<kload::cuda::blocks_for(n, threads), threads, 0, stream>>>(
          grad.const_data_ptr<scalar_t>(), x.const_data_ptr<scalar_t>(), bias.const_data_ptr<scalar_t>(),
          grad_x.mutable_data_ptr<scalar_t>(), n, D);
    });
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
  at::Tensor grad_b = grad_x.reshape({-1, D}).sum(0);
  return {grad_x, grad_b};
}

}  // namespace

KLOAD_IMPL(CUDA, m) {
  m.impl("bias_gelu", &bias_gelu_cuda);
  m.impl("bias_gelu_backward", &bias_gelu_backward_cuda);
}
