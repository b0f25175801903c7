// matmul — out[M, N] = a[M, K] @ b[K, N].
//
// CPU float32: kload/cpu/gemm.h's packed, register-tiled GEMM; OpenMP threads take
// contiguous bands of rows of `out` (each packs B itself: no sharing, no locks).
// float64 uses the generic blocked loop. Non-contiguous inputs are made contiguous.
// CUDA: the kernels are in matmul.cu (no torch header); the glue is at the end.
// allow_tf32 lets float32 run on TF32 tensor cores on a GPU (the CPU ignores it):
// torch.backends.cuda.matmul.allow_tf32 is a flag of torch's C++ context, which
// the stable ABI cannot read, so the caller passes it; kernels.matmul (Python)
// passes torch's setting.
#include <kload/stable.h>
#include "matmul.h"
#include <kload/cpu/gemm.h>
#include <kload/cpu/parallel.h>

namespace {

using namespace kload_matmul;
using kload::ScalarType;

Tensor matmul_cpu(const Tensor& a_in, const Tensor& b_in, bool /*allow_tf32*/) {
  check_matmul(a_in, b_in);
  const ScalarType t = a_in.scalar_type();
  STD_TORCH_CHECK(t == ScalarType::Float || t == ScalarType::Double,
                  "matmul (CPU): expected float32 or float64, got ", torch::headeronly::toString(t));
  const Tensor a = kload::as_contiguous(a_in), b = kload::as_contiguous(b_in);
  const int64_t M = a.size(0), K = a.size(1), N = b.size(1);
  Tensor out = kload::empty(a, {M, N});
  KLOAD_DISPATCH_FLOATING(t, "matmul_cpu", [&] {
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

Tensor matmul_meta(const Tensor& a, const Tensor& b, bool /*allow_tf32*/) {
  check_matmul(a, b);
  return torch::stable::new_empty(a, {a.size(0), b.size(1)});
}

}  // namespace

KLOAD_LIBRARY(m) { m.def("matmul(Tensor a, Tensor b, bool allow_tf32=False) -> Tensor"); }
KLOAD_IMPL(CPU, m) { m.impl("matmul", TORCH_BOX(&matmul_cpu)); }
KLOAD_IMPL(Meta, m) { m.impl("matmul", TORCH_BOX(&matmul_meta)); }

#ifdef KLOAD_WITH_CUDA
#include <kload/cuda/launcher.h>

KLOAD_LAUNCHER const char* kload_matmul_cuda(int dtype, const void* a, const void* b, void* out, int64_t M,
                                             int64_t K, int64_t N, int allow_tf32, void* stream);

namespace {

Tensor matmul_cuda(const Tensor& a_in, const Tensor& b_in, bool allow_tf32) {
  KLOAD_CHECK_CUDA(a_in);
  KLOAD_CHECK_CUDA(b_in);
  kload_matmul::check_matmul(a_in, b_in);
  const int dtype = kload::cuda::dtype_code(a_in, "matmul");
  kload::DeviceGuard guard(a_in.get_device_index());
  const Tensor a = kload::as_contiguous(a_in), b = kload::as_contiguous(b_in);
  const int64_t M = a.size(0), K = a.size(1), N = b.size(1);
  Tensor out = kload::empty(a, {M, N});
  if (M == 0 || N == 0) return out;
  KLOAD_CHECK_LAUNCH(kload_matmul_cuda(dtype, a.const_data_ptr(), b.const_data_ptr(), out.mutable_data_ptr(), M, K, N,
                                       allow_tf32 ? 1 : 0, kload::cuda_stream(a)));
  return out;
}

}  // namespace

KLOAD_IMPL(CUDA, m) { m.impl("matmul", TORCH_BOX(&matmul_cuda)); }
#endif  // KLOAD_WITH_CUDA
