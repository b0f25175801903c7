// kload/cuda/launcher.h — the contract between a shipped op's torch-free <op>.cu
// and the glue in its <op>.cpp: how a launcher is declared, and the dtype codes of
// its `int dtype` argument. Neither torch nor CUDA is included here: nvcc reads it
// through kload/cuda/launch.cuh, g++ after <kload/stable.h>.
//
//   <op>.cu  (nvcc):  KLOAD_LAUNCHER const char* kload_op_cuda(int dtype, const void* x, ..., void* stream) {...}
//   <op>.cpp (g++):   KLOAD_LAUNCHER const char* kload_op_cuda(int dtype, const void* x, ..., void* stream);
//                     KLOAD_CHECK_LAUNCH(kload_op_cuda(kload::cuda::dtype_code(x, "op"), ..., kload::cuda_stream(x)));
//
// A launcher returns nullptr, or the CUDA error of its launch (the string of
// cudaGetErrorString): no exception and no torch type crosses between the two.
#pragma once

#include <cstdlib>
#include <cstring>

// extern "C", and hidden: the .cu and the .cpp are linked into one library, and
// nothing outside it calls the launchers (nor can one library's launchers bind
// another's of the same name).
#define KLOAD_LAUNCHER extern "C" __attribute__((visibility("hidden")))

// The dtypes the shipped CUDA kernels take. The values are torch's ScalarType
// numbers (checked below when g++ compiles the glue), so the glue passes
// static_cast<int>(x.scalar_type()).
enum kload_dtype : int { KLOAD_FLOAT16 = 5, KLOAD_FLOAT32 = 6, KLOAD_FLOAT64 = 7, KLOAD_BFLOAT16 = 15 };

// KLOAD_KERNELS_IMPL picks the shipped CUDA kernels at each call: unset, empty or
// "fast" for the tuned ones (vectorized, tensor cores), "simple" for the first,
// one-thread-per-element ones, kept as readable references and for comparison
// (benchmarks/gpu.py runs both). Read at every call (getenv: ~100 ns, a launch
// costs microseconds), so a process can switch between calls.
namespace kload {
namespace cuda {

enum class Impl : int { fast = 0, simple = 1, invalid = 2 };

__attribute__((visibility("hidden"))) inline Impl kernels_impl() {
  const char* v = std::getenv("KLOAD_KERNELS_IMPL");
  if (v == nullptr || *v == '\0' || std::strcmp(v, "fast") == 0) return Impl::fast;
  if (std::strcmp(v, "simple") == 0) return Impl::simple;
  return Impl::invalid;
}

}  // namespace cuda
}  // namespace kload

// what a launcher returns for Impl::invalid
#define KLOAD_KERNELS_IMPL_ERROR "KLOAD_KERNELS_IMPL must be unset, \"fast\" or \"simple\""

#if defined(KLOAD_STABLE_H_) && !defined(__CUDACC__)  // the .cpp glue
static_assert(KLOAD_FLOAT16 == static_cast<int>(torch::headeronly::ScalarType::Half) &&
                  KLOAD_FLOAT32 == static_cast<int>(torch::headeronly::ScalarType::Float) &&
                  KLOAD_FLOAT64 == static_cast<int>(torch::headeronly::ScalarType::Double) &&
                  KLOAD_BFLOAT16 == static_cast<int>(torch::headeronly::ScalarType::BFloat16),
              "kload/cuda/launcher.h: the dtype codes must be torch's ScalarType numbers");

namespace kload {
namespace cuda {

// x's dtype code for a launcher: float32, float64, float16 or bfloat16, or an
// error naming the op ("vector_add (CUDA): expected ..., got Int").
inline int dtype_code(const Tensor& x, const char* op) {
  const ScalarType t = x.scalar_type();
  STD_TORCH_CHECK(t == ScalarType::Float || t == ScalarType::Double || t == ScalarType::Half ||
                      t == ScalarType::BFloat16,
                  op, " (CUDA): expected float32, float64, float16 or bfloat16, got ",
                  torch::headeronly::toString(t));
  return static_cast<int>(t);
}

}  // namespace cuda
}  // namespace kload
#endif
