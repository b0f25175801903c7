// vector_add — out = a + b, elementwise, same shape and dtype (no broadcasting).
//
// CPU: each OpenMP thread adds one contiguous chunk with a SIMD inner loop
// (tutorial sections 5.1 and 5.2). Non-contiguous inputs are made contiguous.
#include <kload/kernel.h>
#include "vector_add.h"
#include <kload/cpu/parallel.h>
#include <ATen/Dispatch.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/zeros_like.h>

namespace {

using namespace kload_vector_add;

// Pragmas cannot sit inside AT_DISPATCH's macro argument: the loops live here.
template <typename T>
void vector_add_kernel(const T* pa, const T* pb, T* po, int64_t n) {
  kload::cpu::parallel_chunks(n, 1 << 15, [&](int64_t begin, int64_t end) {
#pragma omp simd
    for (int64_t i = begin; i < end; ++i) po[i] = pa[i] + pb[i];
  });
}

at::Tensor vector_add_cpu(const at::Tensor& a_in, const at::Tensor& b_in) {
  check_vector_add(a_in, b_in);
  TORCH_CHECK(at::isFloatingType(a_in.scalar_type()) && a_in.element_size() >= 4,
              "vector_add (CPU): expected float32 or float64, got ", a_in.scalar_type());
  const at::Tensor a = a_in.contiguous(), b = b_in.contiguous();
  at::Tensor out = at::empty_like(a, at::MemoryFormat::Contiguous);
  const int64_t n = a.numel();
  AT_DISPATCH_FLOATING_TYPES(a.scalar_type(), "vector_add_cpu", [&] {
    vector_add_kernel(a.const_data_ptr<scalar_t>(), b.const_data_ptr<scalar_t>(), out.mutable_data_ptr<scalar_t>(),
                      n);
  });
  return out;
}

at::Tensor vector_add_meta(const at::Tensor& a, const at::Tensor& b) {
  check_vector_add(a, b);
  return at::empty_like(a, at::MemoryFormat::Contiguous);
}

}  // namespace

KLOAD_LIBRARY(m) { m.def("vector_add(Tensor a, Tensor b) -> Tensor"); }
KLOAD_IMPL(CPU, m) { m.impl("vector_add", &vector_add_cpu); }
KLOAD_IMPL(Meta, m) { m.impl("vector_add", &vector_add_meta); }
