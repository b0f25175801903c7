// vector_add — out = a + b, elementwise, same shape and dtype (no broadcasting).
//
// CPU: each OpenMP thread adds one contiguous chunk with a SIMD inner loop
// (tutorial sections 5.1 and 5.2). Non-contiguous inputs are made contiguous.
// CUDA: the kernel is in vector_add.cu (no torch header); the glue is at the end.
#include <kload/stable.h>
#include "vector_add.h"
#include <kload/cpu/parallel.h>

namespace {

using namespace kload_vector_add;
using kload::ScalarType;

// Pragmas cannot sit inside the dispatch macro's argument: the loops live here.
template <typename T>
void vector_add_kernel(const T* pa, const T* pb, T* po, int64_t n) {
  kload::cpu::parallel_chunks(n, 1 << 15, [&](int64_t begin, int64_t end) {
#pragma omp simd
    for (int64_t i = begin; i < end; ++i) po[i] = pa[i] + pb[i];
  });
}

Tensor vector_add_cpu(const Tensor& a_in, const Tensor& b_in) {
  check_vector_add(a_in, b_in);
  const ScalarType t = a_in.scalar_type();
  STD_TORCH_CHECK(t == ScalarType::Float || t == ScalarType::Double,
                  "vector_add (CPU): expected float32 or float64, got ", torch::headeronly::toString(t));
  const Tensor a = kload::as_contiguous(a_in), b = kload::as_contiguous(b_in);
  Tensor out = kload::empty_like(a);
  const int64_t n = a.numel();
  KLOAD_DISPATCH_FLOATING(t, "vector_add_cpu", [&] {
    vector_add_kernel(a.const_data_ptr<scalar_t>(), b.const_data_ptr<scalar_t>(), out.mutable_data_ptr<scalar_t>(),
                      n);
  });
  return out;
}

Tensor vector_add_meta(const Tensor& a, const Tensor& b) {
  check_vector_add(a, b);
  return torch::stable::new_empty(a, a.sizes());
}

}  // namespace

KLOAD_LIBRARY(m) { m.def("vector_add(Tensor a, Tensor b) -> Tensor"); }
KLOAD_IMPL(CPU, m) { m.impl("vector_add", TORCH_BOX(&vector_add_cpu)); }
KLOAD_IMPL(Meta, m) { m.impl("vector_add", TORCH_BOX(&vector_add_meta)); }

#ifdef KLOAD_WITH_CUDA
#include <kload/cuda/launcher.h>

KLOAD_LAUNCHER const char* kload_vector_add_cuda(int dtype, const void* a, const void* b, void* out, int64_t n,
                                                 void* stream);

namespace {

Tensor vector_add_cuda(const Tensor& a_in, const Tensor& b_in) {
  KLOAD_CHECK_CUDA(a_in);
  KLOAD_CHECK_CUDA(b_in);
  kload_vector_add::check_vector_add(a_in, b_in);
  const int dtype = kload::cuda::dtype_code(a_in, "vector_add");
  kload::DeviceGuard guard(a_in.get_device_index());
  const Tensor a = kload::as_contiguous(a_in), b = kload::as_contiguous(b_in);
  Tensor out = kload::empty_like(a);
  const int64_t n = a.numel();
  if (n == 0) return out;
  KLOAD_CHECK_LAUNCH(kload_vector_add_cuda(dtype, a.const_data_ptr(), b.const_data_ptr(), out.mutable_data_ptr(), n,
                                           kload::cuda_stream(a)));
  return out;
}

}  // namespace

KLOAD_IMPL(CUDA, m) { m.impl("vector_add", TORCH_BOX(&vector_add_cuda)); }
#endif  // KLOAD_WITH_CUDA
