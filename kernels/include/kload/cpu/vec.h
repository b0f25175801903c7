// kload/cpu/vec.h — the float vector of the build's target, for kernels that
// write their inner loops with GCC vector extensions.
//
// The width follows the instruction set the build targets (the shipped kernels
// build with -march=native, and kload keys such builds by the host CPU):
// 16 lanes with AVX-512, 8 with AVX/AVX2, 4 otherwise (SSE2, NEON). A vector
// wider than the machine's registers is legal but GCC splits and spills it: on
// an AVX2 machine the GEMM's 16-lane tile ran at 4 GFLOP/s, 20 with 8 lanes, and
// 149 once its vector type was also naturally aligned (below).
#pragma once

#include <cstdint>
#include <cstring>

#if defined(__AVX__)
#include <immintrin.h>
#endif

namespace kload {
namespace cpu {

#if defined(__AVX512F__)
constexpr int kLanes = 16;
#elif defined(__AVX__)
constexpr int kLanes = 8;
#else
constexpr int kLanes = 4;
#endif

// Register types, naturally aligned: memory goes through load()/store(), which
// need only float alignment. (An under-aligned vector type, aligned(4), made GCC
// keep a GEMM's whole accumulator tile in memory.)
typedef float vfloat __attribute__((vector_size(kLanes * sizeof(float))));
typedef int32_t vint __attribute__((vector_size(kLanes * sizeof(int32_t))));

inline vfloat load(const float* p) {
  vfloat v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
inline void store(float* p, vfloat v) { std::memcpy(p, &v, sizeof v); }

// 1 / x for finite, nonzero x, to ~2^-22 relative: the hardware estimate and one
// Newton step (three cheap instructions where a division holds the divider for
// several cycles). For x = 0 or +-inf the Newton step makes NaN.
inline float recip(float x) { return 1.f / x; }
inline vfloat recip(vfloat x) {
#if defined(__AVX512F__)
  const vfloat r = (vfloat)_mm512_rcp14_ps((__m512)x);
  return r * (2.f - x * r);
#elif defined(__AVX__)
  const vfloat r = (vfloat)_mm256_rcp_ps((__m256)x);
  return r * (2.f - x * r);
#else
  return 1.f / x;
#endif
}

}  // namespace cpu
}  // namespace kload
