// kload/cuda/gemm.cuh — a tensor-core GEMM tile, C[M, N] = A[M, K] B[K, N] with fp32
// accumulation, shared by matmul.cu and conv2d.cu (an implicit GEMM). No torch header.
//
// The design is the usual one for Ampere and Hopper's mma.sync (CUTLASS's sm80
// "multistage" GEMM, without its abstractions):
//
//   - a block of 128 threads (4 warps) computes a 128 x 128 tile of C; each warp a
//     64 x 64 piece of it (the warps as 2 x 2), as 4 x 8 mma tiles of 16 x 8, in
//     128 fp32 registers per thread (CUTLASS's 128x128_32x4 tile for sm80: a 64 x 64
//     warp tile reads 8 fragments from shared memory per 32 mma, where 64 x 32 reads
//     6 per 16, so shared memory's bandwidth keeps up with the tensor cores);
//   - K advances BK at a time (32 for half/bfloat16, 16 for fp32 as TF32): 16 KB
//     of A and B per step, copied global -> shared with cp.async, 16 bytes per
//     instruction, kStages = 4 steps in flight (the copies of steps k+1 .. k+3
//     overlap the math of step k; "double buffering" with two more buffers);
//   - half/bfloat16 fragments come out of shared memory with ldmatrix (4 8x8
//     matrices per instruction; .trans for B, which is stored k-major), and go to
//     mma.sync.m16n8k16; fp32 is rounded to TF32 (cvt.rna, as cuBLAS does) and goes
//     to mma.sync.m16n8k8;
//   - shared rows are padded by 16 bytes (32 for fp32 B), so the 8 rows an
//     ldmatrix or a fragment load reads fall in different banks: no conflicts,
//     and no swizzle to decode;
//   - blocks are numbered in groups of 8 block rows (Triton's "grouped ordering"),
//     so the blocks running together share their A and B tiles in L2.
//
// Each tile's operands come through a Problem, which says where 16 bytes of A (or B)
// start, or that they are zero (past an edge, or in a convolution's padding):
//   struct Problem {
//     using T = ...;                          // __half, __nv_bfloat16 or float
//     static constexpr bool kBKContiguous;    // B stored [N][K] (true) or [K][N] (false)
//     int64_t M, N, K;
//     const T* any();                         // some readable address (K >= 1)
//     Row a_row(int64_t m);                   // what a thread keeps about row m of A (once per block)
//     const T* a_chunk(const Row&, int64_t k);  // A[m, k .. k+kVec), or nullptr for zeros
//     const T* b_chunk(int64_t row, int64_t col);  // the same for B, (row, col) in its stored layout
//     T a_at(const Row&, int64_t k);          // one element (the unaligned path)
//     T b_at(int64_t k, int64_t n);
//     void store(int64_t m, int64_t n, float v);  // C[m, n] = v (skips m >= M, n >= N)
//   };
// With kAligned (every chunk lies whole inside or whole outside the matrix, on a
// 16-byte boundary: K and N multiples of kVec, aligned base pointers), the copies
// are asynchronous cp.async; otherwise each thread loads its chunks element by
// element (bounds-checked) and stores them: the same tiles and math, slower loads.
//
// Needs sm_80 or later (cp.async, ldmatrix, bf16 and tf32 mma): on older targets the
// kernel compiles empty, and launchers must not pick it (kload::cuda::device_info().cc).
#pragma once

#include "launch.cuh"
#include "ptx.cuh"

namespace kload {
namespace cuda {
namespace gemm {

// The block tile's shape: 2 x KLOAD_GEMM_WARPS_N warps (2: 64 x 64 each, the default; 4: 64 x 32,
// this kernel's first version) and KLOAD_GEMM_STAGES stages (4; 3 or more). Compile-time knobs for
// measuring other shapes (benchmarks/gemm_shapes.py builds the matmul with -D for each), not for users.
#ifndef KLOAD_GEMM_WARPS_N
#define KLOAD_GEMM_WARPS_N 2
#endif
#ifndef KLOAD_GEMM_STAGES
#define KLOAD_GEMM_STAGES 4
#endif
constexpr int BM = 128, BN = 128, kStages = KLOAD_GEMM_STAGES;
constexpr int kWarpsM = 2, kWarpsN = KLOAD_GEMM_WARPS_N, kThreads = 32 * kWarpsM * kWarpsN;
constexpr int WM = BM / kWarpsM, WN = BN / kWarpsN;                  // 64 x 64 (or 64 x 32) per warp
static_assert((kWarpsN == 2 || kWarpsN == 4) && kStages >= 3, "KLOAD_GEMM_WARPS_N: 2 or 4; KLOAD_GEMM_STAGES: >= 3");
constexpr int kFragsM = WM / 16, kFragsN = WN / 8;                   // 4 x 8 mma tiles per warp

// Per element type: the K step of one block iteration and of one mma, and the
// shared-memory row padding.
template <typename T>
struct Traits {  // __half, __nv_bfloat16
  static constexpr int kVec = 8;           // elements per 16-byte chunk
  static constexpr int BK = 32;            // K per stage: 64-byte rows of A
  static constexpr int kMmaK = 16;         // m16n8k16
  static constexpr int kPadA = 8, kPadB = 8;  // 16 bytes
};
template <>
struct Traits<float> {  // TF32
  static constexpr int kVec = 4;
  static constexpr int BK = 16;
  static constexpr int kMmaK = 8;          // m16n8k8
  static constexpr int kPadA = 4, kPadB = 8;  // B's fragment loads walk k: 8 words of padding
};

// Shared memory of one stage: A as [BM][BK + pad] (k contiguous); B as [BK][BN + pad]
// (n contiguous, matmul) or [BN][BK + pad] (k contiguous, convolution).
template <typename T, bool kBKContiguous>
struct Stage {
  using Tr = Traits<T>;
  static constexpr int kARow = Tr::BK + Tr::kPadA;
  static constexpr int kBRow = kBKContiguous ? Tr::BK + Tr::kPadA : BN + Tr::kPadB;
  static constexpr int kBRows = kBKContiguous ? BN : Tr::BK;
  T a[BM * kARow];
  T b[kBRows * kBRow];
};

template <typename T, bool kBKContiguous>
constexpr int smem_bytes() {
  return kStages * static_cast<int>(sizeof(Stage<T, kBKContiguous>));
}

// -- fragments: one warp's A and B operands of one mma K step ----------------------
// The mma layouts (PTX ISA, "Matrix fragments for mma.m16n8k16 / m16n8k8"), with
// g = lane / 4 and t = lane % 4: A's thread holds rows g and g + 8, B's thread
// column g, C's thread rows g and g + 8, columns 2t and 2t + 1.

// A rows [m0, m0 + 16) x [kk, kk + kMmaK) of a stage
template <typename T>
__device__ __forceinline__ void load_a(uint32_t (&a)[4], const T* sa, int row_len, int m0, int kk, int lane) {
  // matrices: rows 0-7 / 8-15 (lanes 0-15) x k 0-7 / 8-15 (lanes 16-31)
  ptx::ldmatrix_x4(a, sa + (m0 + (lane & 15)) * row_len + kk + (lane >> 4) * 8);
}
__device__ __forceinline__ void load_a(uint32_t (&a)[4], const float* sa, int row_len, int m0, int kk, int lane) {
  const int g = lane >> 2, t = lane & 3;
  const float* p = sa + (m0 + g) * row_len + kk + t;
  a[0] = ptx::to_tf32(p[0]);
  a[1] = ptx::to_tf32(p[8 * row_len]);
  a[2] = ptx::to_tf32(p[4]);
  a[3] = ptx::to_tf32(p[8 * row_len + 4]);
}

// B columns [n0, n0 + 16) (two mma tiles: b[0] and b[1]) x [kk, kk + kMmaK) of a stage
template <bool kBKContiguous, typename T>
__device__ __forceinline__ void load_b(uint32_t (&b0)[2], uint32_t (&b1)[2], const T* sb, int row_len, int n0, int kk,
                                       int lane) {
  uint32_t r[4];
  if (kBKContiguous) {  // [n][k]: like A; matrices n 0-7 k 0-7, n 0-7 k 8-15, n 8-15 k 0-7, n 8-15 k 8-15
    ptx::ldmatrix_x4(r, sb + (n0 + (lane & 7) + (lane >> 4) * 8) * row_len + kk + ((lane >> 3) & 1) * 8);
  } else {  // [k][n], transposed: k 0-7 n 0-7, k 8-15 n 0-7, k 0-7 n 8-15, k 8-15 n 8-15
    ptx::ldmatrix_x4_trans(r, sb + (kk + (lane & 15)) * row_len + n0 + (lane >> 4) * 8);
  }
  b0[0] = r[0], b0[1] = r[1], b1[0] = r[2], b1[1] = r[3];
}
template <bool kBKContiguous>
__device__ __forceinline__ void load_b(uint32_t (&b0)[2], uint32_t (&b1)[2], const float* sb, int row_len, int n0,
                                       int kk, int lane) {
  const int g = lane >> 2, t = lane & 3;
  uint32_t* b[2] = {b0, b1};
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int n = n0 + h * 8 + g;
    if (kBKContiguous) {
      b[h][0] = ptx::to_tf32(sb[n * row_len + kk + t]);
      b[h][1] = ptx::to_tf32(sb[n * row_len + kk + t + 4]);
    } else {
      b[h][0] = ptx::to_tf32(sb[(kk + t) * row_len + n]);
      b[h][1] = ptx::to_tf32(sb[(kk + t + 4) * row_len + n]);
    }
  }
}

// -- the kernel ---------------------------------------------------------------------

// One 16-byte chunk into shared memory: asynchronously, or element by element.
template <bool kAligned, typename T, typename Load>
__device__ __forceinline__ void load_chunk(T* dst, const T* src, const T* any_valid, const Load& element) {
  constexpr int kVec = Traits<T>::kVec;
  if (kAligned) {
    ptx::cp_async16(dst, src ? src : any_valid, src != nullptr);
  } else {
    struct alignas(16) Chunk {
      T v[kVec];
    } c;
#pragma unroll
    for (int e = 0; e < kVec; ++e) c.v[e] = element(e);
    *reinterpret_cast<Chunk*>(dst) = c;
  }
}

// Which row of a tile whose rows are 4 chunks of 16 bytes (A, and the convolution's B:
// 80-byte rows with the padding) copy slot s fills. One 16-byte store per thread goes to
// shared memory a quarter-warp (8 threads, 128 bytes) per pass, in one pass only if the 8
// addresses differ in bits 4-6, (5 row + chunk) mod 8 here: two rows 4 apart cover all 8
// (rows 1 apart would meet: 5 + 3 = 0 mod 8), so slots 2j and 2j + 1 take rows j and j + 4.
__device__ __forceinline__ int spread_row(int s) { return (s & ~7) | (s & 1) << 2 | (s & 7) >> 1; }

// Block (bm, bn) of the grouped ordering, from a 1-D grid.
__device__ __forceinline__ void block_tile(int64_t grid_m, int64_t grid_n, int64_t& bm, int64_t& bn) {
  constexpr int64_t kGroup = 8;
  const int64_t pid = blockIdx.x, per_group = kGroup * grid_n;
  const int64_t first_m = (pid / per_group) * kGroup;
  const int64_t rows = min(grid_m - first_m, kGroup);
  bm = first_m + (pid % per_group) % rows;
  bn = (pid % per_group) / rows;
}

template <typename Problem, bool kAligned>
__global__ void __launch_bounds__(kThreads) gemm_kernel(const Problem p) {
#if KLOAD_CUDA_SM80
  using T = typename Problem::T;
  using Tr = Traits<T>;
  constexpr bool kBK = Problem::kBKContiguous;
  using S = Stage<T, kBK>;
  constexpr int BK = Tr::BK, kVec = Tr::kVec;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  S* stages = reinterpret_cast<S*>(smem_raw);

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int wm = warp / kWarpsN, wn = warp % kWarpsN;
  int64_t bm, bn;
  block_tile((p.M + BM - 1) / BM, (p.N + BN - 1) / BN, bm, bn);
  const int64_t m_base = bm * BM, n_base = bn * BN;
  const T* any_valid = p.any();  // a readable address for the zero-filling copies (which read nothing)

  // Each thread copies kPassesA chunks of A and kPassesB of B per stage (512 of each: 4
  // and 4 with 128 threads): of A, rows spread_row(tid / 4) + i * kThreads / 4 of the tile
  // at k offset (tid % 4) * kVec, the same rows every stage (their Row, worked out once);
  // of B, chunks tid + i * kThreads (rows spread the same way where they are 4 chunks).
  constexpr int kChunksPerRowA = BK / kVec;                                  // 4
  constexpr int kChunksPerRowB = kBK ? BK / kVec : BN / kVec;                // 4, or 16 / 32
  constexpr int kRowsPerPassA = kThreads / kChunksPerRowA, kPassesA = BM / kRowsPerPassA;
  constexpr int kPassesB = (kBK ? BN : BK) * kChunksPerRowB / kThreads;
  static_assert(kChunksPerRowA == 4 && kRowsPerPassA % 8 == 0 && BM % kRowsPerPassA == 0,
                "A's chunks: whole rows per pass, in groups of 8 (spread_row)");
  static_assert(kPassesB * kThreads == (kBK ? BN : BK) * kChunksPerRowB, "B's chunks: whole passes");
  typename Problem::Row a_rows[kPassesA];
#pragma unroll
  for (int i = 0; i < kPassesA; ++i)
    a_rows[i] = p.a_row(m_base + spread_row(tid / kChunksPerRowA) + i * kRowsPerPassA);
  auto load_stage = [&](int stage, int64_t k0) {
    S& s = stages[stage];
#pragma unroll
    for (int i = 0; i < kPassesA; ++i) {
      const int r = spread_row(tid / kChunksPerRowA) + i * kRowsPerPassA, kc = (tid % kChunksPerRowA) * kVec;
      const int64_t k = k0 + kc;
      const typename Problem::Row& row = a_rows[i];
      load_chunk<kAligned>(&s.a[r * S::kARow + kc], kAligned ? p.a_chunk(row, k) : nullptr, any_valid,
                           [&](int e) { return p.a_at(row, k + e); });
    }
#pragma unroll
    for (int i = 0; i < kPassesB; ++i) {
      const int c = tid + i * kThreads;
      const int r = kChunksPerRowB == 4 ? spread_row(c / 4) : c / kChunksPerRowB;
      const int cc = (c % kChunksPerRowB) * kVec;
      if (kBK) {  // row r is n, chunk cc is k
        const int64_t n = n_base + r, k = k0 + cc;
        load_chunk<kAligned>(&s.b[r * S::kBRow + cc], kAligned ? p.b_chunk(n, k) : nullptr, any_valid,
                             [&](int e) { return p.b_at(k + e, n); });
      } else {  // row r is k, chunk cc is n
        const int64_t k = k0 + r, n = n_base + cc;
        load_chunk<kAligned>(&s.b[r * S::kBRow + cc], kAligned ? p.b_chunk(k, n) : nullptr, any_valid,
                             [&](int e) { return p.b_at(k, n + e); });
      }
    }
  };

  float acc[kFragsM][kFragsN][4];
#pragma unroll
  for (int i = 0; i < kFragsM; ++i)
#pragma unroll
    for (int j = 0; j < kFragsN; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) acc[i][j][e] = 0.f;

  const int64_t ktiles = (p.K + BK - 1) / BK;
#pragma unroll
  for (int s = 0; s < kStages - 1; ++s) {  // the pipeline's first kStages - 1 steps
    if (s < ktiles) load_stage(s, int64_t(s) * BK);
    ptx::cp_async_commit();
  }

  for (int64_t kt = 0; kt < ktiles; ++kt) {
    ptx::cp_async_wait<kStages - 2>();  // step kt has landed (this thread's copies) ...
    __syncthreads();               // ... and everyone's; and step kt - 1's buffer is free
    const int64_t next = kt + kStages - 1;
    if (next < ktiles) load_stage(static_cast<int>(next % kStages), next * BK);
    ptx::cp_async_commit();  // (an empty group past the end keeps the count)

    const S& s = stages[kt % kStages];
#pragma unroll
    for (int kk = 0; kk < BK; kk += Tr::kMmaK) {
      uint32_t af[kFragsM][4], bf[kFragsN][2];
#pragma unroll
      for (int i = 0; i < kFragsM; ++i) load_a(af[i], s.a, S::kARow, wm * WM + i * 16, kk, lane);
#pragma unroll
      for (int j = 0; j < kFragsN; j += 2)
        load_b<kBK>(bf[j], bf[j + 1], s.b, S::kBRow, wn * WN + j * 8, kk, lane);
#pragma unroll
      for (int i = 0; i < kFragsM; ++i)
#pragma unroll
        for (int j = 0; j < kFragsN; ++j) ptx::mma<T>(acc[i][j], af[i], bf[j]);
    }
  }
  ptx::cp_async_wait<0>();

  // C: thread (g, t) of each 16 x 8 tile holds rows g, g + 8 and columns 2t, 2t + 1
  const int g = lane >> 2, t = lane & 3;
#pragma unroll
  for (int i = 0; i < kFragsM; ++i)
#pragma unroll
    for (int j = 0; j < kFragsN; ++j) {
      const int64_t m = m_base + wm * WM + i * 16 + g, n = n_base + wn * WN + j * 8 + 2 * t;
      p.store(m, n, acc[i][j][0]);
      p.store(m, n + 1, acc[i][j][1]);
      p.store(m + 8, n, acc[i][j][2]);
      p.store(m + 8, n + 1, acc[i][j][3]);
    }
#endif  // KLOAD_CUDA_SM80
}

// Launches `kernel` (gemm_kernel<Problem, kAligned>) for p on `stream`. nullptr, or what went wrong.
template <typename Problem>
inline const char* launch_kernel(void (*kernel)(Problem), const Problem& p, cudaStream_t stream) {
  using T = typename Problem::T;
  constexpr int bytes = smem_bytes<T, Problem::kBKContiguous>();
  static_assert(bytes <= 99 * 1024, "the GEMM's stages must fit every sm_80+ GPU (sm_86/89: 99 KB per block)");
  const int64_t blocks = ((p.M + BM - 1) / BM) * ((p.N + BN - 1) / BN);
  if (blocks > 0x7fffffff) return "kload gemm: the output has too many 128 x 128 tiles for one grid";
  // more than 48 KB of dynamic shared memory is opt-in, per kernel
  const cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes);
  if (err != cudaSuccess) return cudaGetErrorString(err);
  kernel<<<static_cast<unsigned>(blocks), kThreads, bytes, stream>>>(p);
  return nullptr;
}

// Every chunk 16 aligned bytes (cp.async), or element loads where not.
template <typename Problem>
inline const char* launch(const Problem& p, bool aligned, cudaStream_t stream) {
  return launch_kernel(aligned ? gemm_kernel<Problem, true> : gemm_kernel<Problem, false>, p, stream);
}

// Only the cp.async kernel, for callers that guarantee alignment (half the compile time).
template <typename Problem>
inline const char* launch_aligned(const Problem& p, cudaStream_t stream) {
  return launch_kernel(gemm_kernel<Problem, true>, p, stream);
}

}  // namespace gemm
}  // namespace cuda
}  // namespace kload
