// bias_gelu — CUDA: y = gelu(x + bias) and its backward, one thread per element
// (grid-stride), fp32 math for half/bfloat16; grad_bias is a column reduction
// (torch's sum, in bias_gelu.cpp's glue). No torch header: the checks, the
// allocation, the device guard and the stream are bias_gelu.cpp's glue.
#include <kload/cuda/launch.cuh>

namespace {

constexpr int kThreads = 256;

template <typename T>
__global__ void bias_gelu_forward_kernel(const T* __restrict__ x, const T* __restrict__ bias, T* __restrict__ y,
                                         int64_t n, int64_t D) {
  using A = kload::cuda::acc_t<T>;
  using kload::cuda::to_acc;
  KLOAD_KERNEL_LOOP(i, n) {
    const A z = to_acc(x[i]) + to_acc(bias[i % D]);
    y[i] = kload::cuda::from_acc<T>(A(0.5) * z * (A(1) + erf(z * A(0.70710678118654752440))));
  }
}

template <typename T>
__global__ void bias_gelu_backward_kernel(const T* __restrict__ grad, const T* __restrict__ x,
                                          const T* __restrict__ bias, T* __restrict__ grad_x, int64_t n, int64_t D) {
  using A = kload::cuda::acc_t<T>;
  using kload::cuda::to_acc;
  KLOAD_KERNEL_LOOP(i, n) {
    const A z = to_acc(x[i]) + to_acc(bias[i % D]);
    const A cdf = A(0.5) * (A(1) + erf(z * A(0.70710678118654752440)));
    const A pdf = A(0.39894228040143267794) * exp(A(-0.5) * z * z);
    grad_x[i] = kload::cuda::from_acc<T>(to_acc(grad[i]) * (cdf + z * pdf));
  }
}

}  // namespace

KLOAD_LAUNCHER const char* kload_bias_gelu_cuda(int dtype, const void* x, const void* bias, void* y, int64_t n,
                                                int64_t D, void* stream) {
  if (n == 0) return nullptr;
  return kload::cuda::dispatch(dtype, [&](auto tag) {
    using T = decltype(tag);
    bias_gelu_forward_kernel<T><<<kload::cuda::blocks_for(n, kThreads), kThreads, 0, kload::cuda::stream(stream)>>>(
        static_cast<const T*>(x), static_cast<const T*>(bias), static_cast<T*>(y), n, D);
  });
}

KLOAD_LAUNCHER const char* kload_bias_gelu_backward_cuda(int dtype, const void* grad, const void* x, const void* bias,
                                                         void* grad_x, int64_t n, int64_t D, void* stream) {
  if (n == 0) return nullptr;
  return kload::cuda::dispatch(dtype, [&](auto tag) {
    using T = decltype(tag);
    bias_gelu_backward_kernel<T><<<kload::cuda::blocks_for(n, kThreads), kThreads, 0, kload::cuda::stream(stream)>>>(
        static_cast<const T*>(grad), static_cast<const T*>(x), static_cast<const T*>(bias), static_cast<T*>(grad_x), n,
        D);
  });
}
