// kload/cpu/gemm.h — a cache-blocked, register-tiled single-precision GEMM.
//
//   C[M,N] (+)= A[M,K] * B[K,N]     row-major, leading dimensions lda/ldb/ldc
//
// Free of framework includes (the STYLE's kernel/glue split): matmul.cpp and
// conv2d.cpp call it. BLIS-style loop nest: B is packed into KC x NR panels, A
// into MR x KC panels, and an MR x NR micro-kernel keeps its accumulators in
// registers: MR rows of two target vectors each (kload/cpu/vec.h), 6x32 with
// AVX-512, 6x16 with AVX2 (BLIS's haswell shape): 12 accumulators, two B vectors
// and a broadcast fit the register file either way. Parallelism is the caller's:
// gemm() runs on the calling thread.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "vec.h"

namespace kload {
namespace cpu {

constexpr int64_t MR = 6, NR = 2 * kLanes, KC = 256, MC = 96, NC = 2048;

// B[k0:k0+kc, n0:n0+nc] -> panels of NR columns, zero-padded, k-major.
inline void pack_b(const float* B, int64_t ldb, int64_t kc, int64_t nc, float* out) {
  for (int64_t j = 0; j < nc; j += NR) {
    const int64_t w = std::min(NR, nc - j);
    for (int64_t k = 0; k < kc; ++k) {
      const float* src = B + k * ldb + j;
      float* dst = out + (j / NR) * NR * kc + k * NR;
      if (w == NR) {
        std::memcpy(dst, src, NR * sizeof(float));
      } else {
        std::memcpy(dst, src, w * sizeof(float));
        std::memset(dst + w, 0, (NR - w) * sizeof(float));
      }
    }
  }
}

// A[m0:m0+mc, k0:k0+kc] -> panels of MR rows, zero-padded, k-major.
inline void pack_a(const float* A, int64_t lda, int64_t mc, int64_t kc, float* out) {
  for (int64_t i = 0; i < mc; i += MR) {
    const int64_t h = std::min(MR, mc - i);
    float* dst = out + (i / MR) * MR * kc;
    for (int64_t k = 0; k < kc; ++k)
      for (int64_t r = 0; r < MR; ++r) dst[k * MR + r] = r < h ? A[(i + r) * lda + k] : 0.f;
  }
}

// acc[MR x NR] = sum_k a[k, 0:MR] (x) b[k, 0:NR]; then C (+)= acc for the valid h x w part.
inline void micro_kernel(int64_t kc, const float* a, const float* b, float* C, int64_t ldc, int64_t h,
                         int64_t w, bool accumulate) {
  vfloat acc[MR][2] = {};
  for (int64_t k = 0; k < kc; ++k) {
    const vfloat b0 = load(b + k * NR), b1 = load(b + k * NR + kLanes);
#pragma GCC unroll 6
    for (int64_t r = 0; r < MR; ++r) {
      const float s = a[k * MR + r];
      acc[r][0] += s * b0;
      acc[r][1] += s * b1;
    }
  }
  // Only constant indices into acc (the unrolled loop): one runtime index, as in
  // `acc[r]` for r < h, makes GCC keep the whole tile in memory and store it
  // on every k.
  float tile[MR * NR];
#pragma GCC unroll 6
  for (int64_t r = 0; r < MR; ++r) {
    store(tile + r * NR, acc[r][0]);
    store(tile + r * NR + kLanes, acc[r][1]);
  }
  for (int64_t r = 0; r < h; ++r) {
    const float* t = tile + r * NR;
    float* c = C + r * ldc;
    if (accumulate)
      for (int64_t j = 0; j < w; ++j) c[j] += t[j];
    else
      for (int64_t j = 0; j < w; ++j) c[j] = t[j];
  }
}

// C = A*B (accumulate=false) or C += A*B, on the calling thread.
inline void gemm(int64_t M, int64_t N, int64_t K, const float* A, int64_t lda, const float* B, int64_t ldb,
                 float* C, int64_t ldc, bool accumulate = false) {
  if (M == 0 || N == 0) return;
  if (K == 0) {
    if (!accumulate)
      for (int64_t i = 0; i < M; ++i) std::memset(C + i * ldc, 0, N * sizeof(float));
    return;
  }
  thread_local std::vector<float> bpack, apack;
  bpack.resize(KC * ((std::min(NC, N) + NR - 1) / NR) * NR);
  apack.resize(KC * ((std::min(MC, M) + MR - 1) / MR) * MR);
  for (int64_t n0 = 0; n0 < N; n0 += NC) {
    const int64_t nc = std::min(NC, N - n0);
    for (int64_t k0 = 0; k0 < K; k0 += KC) {
      const int64_t kc = std::min(KC, K - k0);
      const bool acc = accumulate || k0 > 0;
      pack_b(B + k0 * ldb + n0, ldb, kc, nc, bpack.data());
      for (int64_t m0 = 0; m0 < M; m0 += MC) {
        const int64_t mc = std::min(MC, M - m0);
        pack_a(A + m0 * lda + k0, lda, mc, kc, apack.data());
        for (int64_t j = 0; j < nc; j += NR)
          for (int64_t i = 0; i < mc; i += MR)
            micro_kernel(kc, apack.data() + (i / MR) * MR * kc, bpack.data() + (j / NR) * NR * kc,
                         C + (m0 + i) * ldc + n0 + j, ldc, std::min(MR, mc - i), std::min(NR, nc - j), acc);
      }
    }
  }
}

// Generic (double, ...) fallback: blocked i-k-j loops the compiler vectorizes.
template <typename T>
inline void gemm_generic(int64_t M, int64_t N, int64_t K, const T* A, int64_t lda, const T* B, int64_t ldb,
                         T* C, int64_t ldc, bool accumulate = false) {
  for (int64_t i = 0; i < M; ++i) {
    T* c = C + i * ldc;
    if (!accumulate)
      for (int64_t j = 0; j < N; ++j) c[j] = T(0);
    for (int64_t k = 0; k < K; ++k) {
      const T a = A[i * lda + k];
      const T* b = B + k * ldb;
#pragma omp simd
      for (int64_t j = 0; j < N; ++j) c[j] += a * b[j];
    }
  }
}

// The fast path for float, the generic loop for every other type.
template <typename T>
inline void gemm_any(int64_t M, int64_t N, int64_t K, const T* A, int64_t lda, const T* B, int64_t ldb, T* C,
                     int64_t ldc, bool accumulate = false) {
  if constexpr (std::is_same_v<T, float>)
    gemm(M, N, K, A, lda, B, ldb, C, ldc, accumulate);
  else
    gemm_generic<T>(M, N, K, A, lda, B, ldb, C, ldc, accumulate);
}

}  // namespace cpu
}  // namespace kload
