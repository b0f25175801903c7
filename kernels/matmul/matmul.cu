// matmul — CUDA: out[M, N] = a[M, K] @ b[K, N], row-major and contiguous (the glue
// makes them so). No torch header: the checks, the allocation, the device guard and
// the stream are matmul.cpp's glue.
//
// Which kernel (KLOAD_KERNELS_IMPL unset or "fast"):
//   - half / bfloat16 on sm_80+: tensor cores, kload/cuda/gemm.cuh (128 x 128 x 32
//     tiles, 4 warps of 64 x 64, mma.sync m16n8k16 fed by ldmatrix, a 4-stage cp.async
//     pipeline), fp32 accumulation, rounded to T once at the end;
//   - float32 with allow_tf32 (torch.backends.cuda.matmul.allow_tf32, which
//     kernels.matmul passes) on sm_80+: the same tiles in TF32 (m16n8k8, 128 x 128 x 16);
//   - float32 otherwise: sgemm_kernel below, on the CUDA cores: 128 x 128 x 8
//     block tiles, 8 x 8 outputs per thread in registers, A and B staged in shared
//     memory twice (the next step's loads fly while this one computes);
//   - float64, and half / bfloat16 before sm_80: the simple kernel.
// The tensor-core and sgemm kernels take any M, N, K: with K and N multiples of 8
// (4 for fp32) and 16-byte aligned pointers, tiles are copied 16 bytes at a time
// (cp.async / float4), else element by element with bounds checks.
// KLOAD_KERNELS_IMPL=simple: the first version for every dtype: 32 x 32 shared
// tiles, one output per thread.
#include <kload/cuda/gemm.cuh>
#include <kload/cuda/launch.cuh>

#include <type_traits>

namespace {

using kload::cuda::from_acc;
using kload::cuda::to_acc;

// -- the tensor-core GEMM's view of a row-major matmul ---------------------------
template <typename Elem>
struct MatmulProblem {
  using T = Elem;
  static constexpr bool kBKContiguous = false;  // b is [K][N]: n contiguous
  const T* a;
  const T* b;
  T* c;
  int64_t M, N, K;

  struct Row {
    const T* p;  // row m of a, or nullptr past M
  };
  __device__ const T* any() const { return a; }
  __device__ Row a_row(int64_t m) const { return {m < M ? a + m * K : nullptr}; }
  __device__ const T* a_chunk(const Row& r, int64_t k) const { return r.p && k < K ? r.p + k : nullptr; }
  __device__ const T* b_chunk(int64_t k, int64_t n) const { return k < K && n < N ? b + k * N + n : nullptr; }
  __device__ T a_at(const Row& r, int64_t k) const { return r.p && k < K ? r.p[k] : from_acc<T>(0.f); }
  __device__ T b_at(int64_t k, int64_t n) const { return k < K && n < N ? b[k * N + n] : from_acc<T>(0.f); }
  __device__ void store(int64_t m, int64_t n, float v) const {
    if (m < M && n < N) c[m * N + n] = from_acc<T>(v);
  }
};

// -- fp32 on the CUDA cores --------------------------------------------------------
// 256 threads as 16 x 16; thread (tx, ty) owns rows ty*4 + {0..3} and 64 + ty*4 + {0..3},
// columns tx*4 + {0..3} and 64 + tx*4 + {0..3} of the block's 128 x 128 tile (two
// 4-wide halves each way: a warp's float4 reads of a shared row are then 16
// consecutive float4s, or 2 broadcast ones, never a bank conflict). A is stored
// transposed in shared memory ([k][m]), so both operands of the k loop are float4 reads.
namespace sgemm {

constexpr int BM = 128, BN = 128, BK = 8, kThreads = 256;

template <bool kAligned>
__global__ void __launch_bounds__(kThreads) sgemm_kernel(const float* __restrict__ a, const float* __restrict__ b,
                                                        float* __restrict__ c, int64_t M, int64_t K, int64_t N) {
  __shared__ __align__(16) float As[2][BK][BM + 4];  // + 4: the transposed stores hit 32 different banks
  __shared__ __align__(16) float Bs[2][BK][BN];
  const int tid = threadIdx.x, tx = tid % 16, ty = tid / 16;
  int64_t bm, bn;
  kload::cuda::gemm::block_tile((M + BM - 1) / BM, (N + BN - 1) / BN, bm, bn);
  const int64_t m_base = bm * BM, n_base = bn * BN;

  // this thread's share of a step: A[m_base + a_row][k0 + a_k .. + 4), B[k0 + b_k][n_base + b_n .. + 4),
  // through pointers that advance by BK columns of A and BK rows of B per step
  const int a_row = tid / 2, a_k = (tid % 2) * 4, b_k = tid / 32, b_n = (tid % 32) * 4;
  const bool a_in = m_base + a_row < M;
  const int64_t b_left = N - (n_base + b_n);
  const int b_cols = b_left < 4 ? static_cast<int>(b_left) : 4;  // B columns of this thread inside N (<= 0: none)
  const float* pa = a + (a_in ? (m_base + a_row) * K : 0) + a_k;
  const float* pb = b + int64_t(b_k) * N + n_base + b_n;
  float ra[4], rb[4];
  auto fetch = [&](int64_t k0) {  // the step at k0; pa and pb point at it
    const int64_t ka = k0 + a_k, kb = k0 + b_k;
    if (kAligned && a_in && ka < K) {  // K % 4 == 0: the 4 are all in
      const float4 v = *reinterpret_cast<const float4*>(pa);
      ra[0] = v.x, ra[1] = v.y, ra[2] = v.z, ra[3] = v.w;
    } else {
#pragma unroll
      for (int e = 0; e < 4; ++e) ra[e] = a_in && ka + e < K ? pa[e] : 0.f;
    }
    if (kAligned && kb < K && b_cols == 4) {  // N % 4 == 0
      const float4 v = *reinterpret_cast<const float4*>(pb);
      rb[0] = v.x, rb[1] = v.y, rb[2] = v.z, rb[3] = v.w;
    } else {
#pragma unroll
      for (int e = 0; e < 4; ++e) rb[e] = kb < K && e < b_cols ? pb[e] : 0.f;
    }
    pa += BK;
    pb += BK * N;
  };
  auto stash = [&](int buf) {
#pragma unroll
    for (int e = 0; e < 4; ++e) As[buf][a_k + e][a_row] = ra[e];
    *reinterpret_cast<float4*>(&Bs[buf][b_k][b_n]) = make_float4(rb[0], rb[1], rb[2], rb[3]);
  };

  float acc[8][8] = {};
  fetch(0);
  stash(0);
  __syncthreads();
  int buf = 0;
  for (int64_t k0 = 0; k0 < K; k0 += BK) {
    const bool more = k0 + BK < K;
    if (more) fetch(k0 + BK);  // global loads in flight during the math below
#pragma unroll
    for (int kk = 0; kk < BK; ++kk) {
      float av[8], bv[8];
      *reinterpret_cast<float4*>(&av[0]) = *reinterpret_cast<const float4*>(&As[buf][kk][ty * 4]);
      *reinterpret_cast<float4*>(&av[4]) = *reinterpret_cast<const float4*>(&As[buf][kk][64 + ty * 4]);
      *reinterpret_cast<float4*>(&bv[0]) = *reinterpret_cast<const float4*>(&Bs[buf][kk][tx * 4]);
      *reinterpret_cast<float4*>(&bv[4]) = *reinterpret_cast<const float4*>(&Bs[buf][kk][64 + tx * 4]);
#pragma unroll
      for (int i = 0; i < 8; ++i)
#pragma unroll
        for (int j = 0; j < 8; ++j) acc[i][j] += av[i] * bv[j];
    }
    if (more) stash(buf ^ 1);  // the other buffer: its last readers passed the barrier below
    __syncthreads();
    buf ^= 1;
  }

  const bool vec_out = kAligned && reinterpret_cast<uintptr_t>(c) % 16 == 0;
  const int64_t n0 = n_base + tx * 4;
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    const int64_t m = m_base + (i < 4 ? ty * 4 + i : 64 + ty * 4 + i - 4);
    if (m >= M) continue;
    float* row = c + m * N + n0;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int64_t left = N - (n0 + h * 64);  // columns of N from this half's first one
      const float* v = &acc[i][h * 4];
      if (vec_out && left >= 4) {
        *reinterpret_cast<float4*>(row + h * 64) = make_float4(v[0], v[1], v[2], v[3]);
      } else {
#pragma unroll
        for (int e = 0; e < 4; ++e)
          if (e < left) row[h * 64 + e] = v[e];
      }
    }
  }
}

}  // namespace sgemm

// -- the first version (KLOAD_KERNELS_IMPL=simple; float64) ------------------------
constexpr int TILE = 32;

template <typename T>
__global__ void matmul_simple_kernel(const T* __restrict__ a, const T* __restrict__ b, T* __restrict__ out,
                                     int64_t M, int64_t K, int64_t N) {
  using A = kload::cuda::acc_t<T>;
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
  if (row < M && col < N) out[row * N + col] = from_acc<T>(sum);
}

bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

}  // namespace

// allow_tf32: fp32 may run on TF32 tensor cores (torch.backends.cuda.matmul.allow_tf32)
KLOAD_LAUNCHER const char* kload_matmul_cuda(int dtype, const void* a, const void* b, void* out, int64_t M,
                                             int64_t K, int64_t N, int allow_tf32, void* stream) {
  if (M == 0 || N == 0) return nullptr;
  const kload::cuda::Impl impl = kload::cuda::kernels_impl();
  if (impl == kload::cuda::Impl::invalid) return KLOAD_KERNELS_IMPL_ERROR;
  const cudaStream_t s = kload::cuda::stream(stream);
  const bool sm80 = kload::cuda::device_info().cc >= 80;
  const char* error = nullptr;
  const char* launch_error = kload::cuda::dispatch(dtype, [&](auto tag) {
    using T = decltype(tag);
    const T* pa = static_cast<const T*>(a);
    const T* pb = static_cast<const T*>(b);
    T* po = static_cast<T*>(out);
    constexpr bool kHalf = sizeof(T) == 2;
    constexpr bool kFloat = std::is_same<T, float>::value;
    const bool fast = impl == kload::cuda::Impl::fast;
    if (fast && ((kHalf && sm80) || (kFloat && allow_tf32 && sm80))) {
      using Elem = typename std::conditional<kHalf || kFloat, T, float>::type;  // (double never gets here)
      constexpr int kVec = kload::cuda::gemm::Traits<Elem>::kVec;
      const MatmulProblem<Elem> p{reinterpret_cast<const Elem*>(pa), reinterpret_cast<const Elem*>(pb),
                                  reinterpret_cast<Elem*>(po), M, N, K};
      const bool aligned = K % kVec == 0 && N % kVec == 0 && aligned16(a) && aligned16(b);
      error = kload::cuda::gemm::launch(p, aligned, s);
      return;
    }
    if (fast && kFloat) {
      const auto* fa = reinterpret_cast<const float*>(pa);
      const auto* fb = reinterpret_cast<const float*>(pb);
      auto* fo = reinterpret_cast<float*>(po);
      const int64_t blocks = ((M + sgemm::BM - 1) / sgemm::BM) * ((N + sgemm::BN - 1) / sgemm::BN);
      if (blocks > 0x7fffffff) {
        error = "matmul: the output has too many 128 x 128 tiles for one grid";
        return;
      }
      const bool aligned = K % 4 == 0 && N % 4 == 0 && aligned16(a) && aligned16(b);
      if (aligned)
        sgemm::sgemm_kernel<true><<<static_cast<unsigned>(blocks), sgemm::kThreads, 0, s>>>(fa, fb, fo, M, K, N);
      else
        sgemm::sgemm_kernel<false><<<static_cast<unsigned>(blocks), sgemm::kThreads, 0, s>>>(fa, fb, fo, M, K, N);
      return;
    }
    const dim3 threads(TILE, TILE);
    const dim3 blocks(static_cast<unsigned>((N + TILE - 1) / TILE), static_cast<unsigned>((M + TILE - 1) / TILE));
    matmul_simple_kernel<T><<<blocks, threads, 0, s>>>(pa, pb, po, M, K, N);
  });
  return error ? error : launch_error;
}
