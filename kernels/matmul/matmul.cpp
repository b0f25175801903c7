// matmul — out[M, N] = a[M, K] @ b[K, N].
//
// CPU float32: kload/cpu/gemm.h's packed, register-tiled GEMM; OpenMP threads take
// contiguous bands of rows of `out` (each packs B itself: no sharing, no locks).
// float64 uses the generic blocked loop. Non-contiguous inputs are made contiguous.
#include <kload/kernel.h>
#include "matmul.h"
#include <kload/cpu/gemm.h>
#include <kload/cpu/parallel.h>
#include <ATen/Dispatch.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/zeros_like.h>

namespace {

using namespace kload_matmul;

at::Tensor matmul_cpu(const at::Tensor& a_in, const at::Tensor& b_in) {
  check_matmul(a_in, b_in);
  TORCH_CHECK(a_in.scalar_type() == at::kFloat || a_in.scalar_type() == at::kDouble,
              "matmul (CPU): expected float32 or float64, got ", a_in.scalar_type());
  const at::Tensor a = a_in.contiguous(), b = b_in.contiguous();
  const int64_t M = a.size(0), K = a.size(1), N = b.size(1);
  at::Tensor out = at::empty({M, N}, a.options());
  AT_DISPATCH_FLOATING_TYPES(a.scalar_type(), "matmul_cpu", [&] {
    const scalar_t* pa = a.const_data_ptr<scalar_t>();
    const scalar_t* pb = b.const_data_ptr<scalar_t>();
    scalar_t* po = out.mutable_data_ptr<scalar_t>();
    const int64_t bands = (M + kload::cpu::MR - 1) / kload::cpu::MR;  // thread work in whole MR-row bands
    const int64_t grain = std::max<int64_t>(1, (1 << 18) / std::max<int64_t>(1, K * N));
    kload::cpu::parallel_chunks(bands, grain, [&](int64_t begin, int64_t end) {
      const int64_t r0 = begin * kload::cpu::MR, r1 = std::min(M, end * kload::cpu::MR);
      kload::cpu::gemm_any<scalar_t>(r1 - r0, N, K, pa + r0 * K, K, pb, N, po + r0 * N, N);
    });
  });
  return out;
}

at::Tensor matmul_meta(const at::Tensor& a, const at::Tensor& b) {
  check_matmul(a, b);
  return at::empty({a.size(0), b.size(1)}, a.options());
}

}  // namespace

KLOAD_LIBRARY(m) { m.def("matmul(Tensor a, Tensor b) -> Tensor"); }
KLOAD_IMPL(CPU, m) { m.impl("matmul", &matmul_cpu); }
KLOAD_IMPL(Meta, m) { m.impl("matmul", &matmul_meta); }
