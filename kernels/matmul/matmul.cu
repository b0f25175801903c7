// matmul — CUDA: 32x32 shared-memory tiles, one output element per thread,
// accumulation in fp32 for half/bfloat16. (cuBLAS is faster; this is the
// readable reference a user starts from.) No torch header: the checks, the
// allocation, the device guard and the stream are matmul.cpp's glue.
#include <kload/cuda/launch.cuh>

namespace {

constexpr int TILE = 32;

template <typename T>
__global__ void matmul_kernel(const T* __restrict__ a, const T* __restrict__ b, T* __restrict__ out, int64_t M,
                              int64_t K, int64_t N) {
  using A = kload::cuda::acc_t<T>;
  using kload::cuda::to_acc;
  __shared__ A ta[TILE][TILE];
  __shared__ A tb[TILE][TILE];
  const int64_t row = blockIdx.y * int64_t(TILE) + threadIdx.y;
  const int64_t col = blockIdx.x * int64_t(TILE) + threadIdx.x;
  A sum = 0;
  for (int64_t k0 = 0; k0 < K; k0 += TILE) {
    const int64_t ka = k0 + threadIdx.x, kb = k0 + threadIdx.y;
    ta[threadIdx.y][threadIdx.x] = (row < M && ka < K) ? to_acc(a[row * K + ka]) : A(0);
    tb[threadIdx.y][threadIdx.x] = (kb < K && col < N) ? to_acc(b[kb * N + col]) : A(0);
    __syncthreads();
#pragma unroll
    for (int k = 0; k < TILE; ++k) sum += ta[threadIdx.y][k] * tb[k][threadIdx.x];
    __syncthreads();
  }
  if (row < M && col < N) out[row * N + col] = kload::cuda::from_acc<T>(sum);
}

}  // namespace

KLOAD_LAUNCHER const char* kload_matmul_cuda(int dtype, const void* a, const void* b, void* out, int64_t M,
                                             int64_t K, int64_t N, void* stream) {
  if (M == 0 || N == 0) return nullptr;
  const dim3 threads(TILE, TILE);
  const dim3 blocks(static_cast<unsigned>((N + TILE - 1) / TILE), static_cast<unsigned>((M + TILE - 1) / TILE));
  return kload::cuda::dispatch(dtype, [&](auto tag) {
    using T = decltype(tag);
    matmul_kernel<T><<<blocks, threads, 0, kload::cuda::stream(stream)>>>(
        static_cast<const T*>(a), static_cast<const T*>(b), static_cast<T*>(out), M, K, N);
  });
}
