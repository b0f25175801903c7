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
#include <cmath>
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
typedef uint32_t vuint __attribute__((vector_size(kLanes * sizeof(uint32_t))));  // for shifts that may overflow

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

// max(a, b) as x86's max instruction defines it: a > b ? a : b, so b when either
// is NaN (max_of(lo, x) clamps x from below and keeps a NaN x). One instruction where
// the ternary on vectors compiles to a compare and a blend.
inline float max_of(float a, float b) { return a > b ? a : b; }
inline vfloat max_of(vfloat a, vfloat b) {
#if defined(__AVX512F__)
  return (vfloat)_mm512_max_ps((__m512)a, (__m512)b);
#elif defined(__AVX__)
  return (vfloat)_mm256_max_ps((__m256)a, (__m256)b);
#else
  return a > b ? a : b;
#endif
}

// min(a, b) likewise: a < b ? a : b, b when either is NaN.
inline float min_of(float a, float b) { return a < b ? a : b; }
inline vfloat min_of(vfloat a, vfloat b) {
#if defined(__AVX512F__)
  return (vfloat)_mm512_min_ps((__m512)a, (__m512)b);
#elif defined(__AVX__)
  return (vfloat)_mm256_min_ps((__m256)a, (__m256)b);
#else
  return a < b ? a : b;
#endif
}

// |x|: the sign bit cleared.
inline float abs_of(float x) { return std::fabs(x); }
inline vfloat abs_of(vfloat x) { return (vfloat)((vint)x & 0x7fffffff); }

// Per lane, `negative` where s's sign bit is set (-0 and negative NaNs included),
// else `other`. AVX's blend reads the sign bit itself: no comparison.
inline float select_by_sign(float s, float negative, float other) { return std::signbit(s) ? negative : other; }
inline vfloat select_by_sign(vfloat s, vfloat negative, vfloat other) {
#if defined(__AVX__) && !defined(__AVX512F__)
  return (vfloat)_mm256_blendv_ps((__m256)other, (__m256)negative, (__m256)s);
#else
  return (vint)s < 0 ? negative : other;
#endif
}

}  // namespace cpu
}  // namespace kload
