// matmul — CUDA: 32x32 shared-memory tiles, one output element per thread,
// accumulation in fp32 for half/bfloat16. (cuBLAS is faster; this is the
// readable reference a user starts from.)
#define KLOAD_LEAN  // nvcc has no precompiled headers: Tensor and the registration API only
#include <kload/kernel.h>
#include "matmul.h"
#include <kload/cuda/common.cuh>
#include <ATen/ops/empty.h>

namespace {

constexpr int TILE = 32;

template <typename T>
__global__ void matmul_kernel(const T* __restrict__ a, const T* __restrict__ b, T* __restrict__ out, int64_t M,
                              int64_t K, int64_t N) {
  using A = kload::cuda::acc_t<T>;
  __shared__ A ta[TILE][TILE];
  __shared__ A tb[TILE][TILE];
  const int64_t row = blockIdx.y * int64_t(TILE) + threadIdx.y;
  const int64_t col = blockIdx.x * int64_t(TILE) + threadIdx.x;
  A sum = 0;
  for (int64_t k0 = 0; k0 < K; k0 += TILE) {
    const int64_t ka = k0 + threadIdx.x, kb = k0 + threadIdx.y;
    ta[threadIdx.y][threadIdx.x] = (row < M && ka < K) ? static_cast<A>(a[row * K + ka]) : A(0);
    tb[threadIdx.y][threadIdx.x] = (kb < K && col < N) ? static_cast<A>(b[kb * N + col]) : A(0);
    __syncthreads();
#pragma unroll
    for (int k = 0; k < TILE; ++k) sum += ta[threadIdx.y][k] * tb[k][threadIdx.x];
    __syncthreads();
  }
  if (row < M && col < N) out[row * N + col] = static_cast<T>(sum);
}

at::Tensor matmul_cuda(const at::Tensor& a_in, const at::Tensor& b_in) {
  CHECK_CUDA(a_in);
  CHECK_CUDA(b_in);
  kload_matmul::check_matmul(a_in, b_in);
  const c10::cuda::CUDAGuard guard(a_in.device());
  const at::Tensor a = a_in.contiguous(), b = b_in.contiguous();
  const int64_t M = a.size(0), K = a.size(1), N = b.size(1);
  at::Tensor out = at::empty({M, N}, a.options());
  if (M == 0 || N == 0) return out;
  const dim3 threads(TILE, TILE);
  const dim3 blocks(static_cast<unsigned>((N + TILE - 1) / TILE), static_cast<unsigned>((M + TILE - 1) / TILE));
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, a.scalar_type(), "matmul_cuda", [&] {
    matmul_kernel<scalar_t><<<blocks, threads, 0, stream>>>(a.const_data_ptr<scalar_t>(), b.const_data_ptr<scalar_t>(),
                                                            out.mutable_data_ptr<scalar_t>(), M, K, N);
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return out;
}

}  // namespace

KLOAD_IMPL(CUDA, m) { m.impl("matmul", &matmul_cuda); }
