// saxpy_op.cpp — C++ glue for examples/saxpy.cu: the op is registered once, in C++; the kernel
// is compiled by NVRTC and swapped in place on every edit of saxpy.cu.
//
//   ops = kload.load("examples/saxpy_op.cpp", device_code="examples/saxpy.cu")
//   out = ops.saxpy(x, y, 2.0)        # torch.ops.<ns>.saxpy: CUDA tensors of float, half or bfloat16
#include <kload/kernel.h>
#include <kload/live.h>

static kload::live::Kernel saxpy_f32("saxpy<float>");
static kload::live::Kernel saxpy_f16("saxpy<__half>");
static kload::live::Kernel saxpy_bf16("saxpy<__nv_bfloat16>");

at::Tensor saxpy(const at::Tensor& x, const at::Tensor& y, double a) {
  TORCH_CHECK(x.sizes() == y.sizes() && x.scalar_type() == y.scalar_type(), "saxpy: x and y differ in shape or dtype");
  auto xc = x.contiguous(), yc = y.contiguous();
  auto out = at::empty_like(yc);
  const int64_t n = yc.numel();
  if (n == 0) return out;
  const kload::live::Config config{std::min<int64_t>((n + 255) / 256, 65535), 256};
  switch (yc.scalar_type()) {  // at::Half and at::BFloat16 have the layout of __half and __nv_bfloat16
    case at::kFloat: saxpy_f32[config](out, xc, yc, float(a), n); break;
    case at::kHalf: saxpy_f16[config](out, xc, yc, float(a), n); break;
    case at::kBFloat16: saxpy_bf16[config](out, xc, yc, float(a), n); break;
    default: TORCH_CHECK(false, "saxpy: float32, float16 or bfloat16, got ", yc.scalar_type());
  }
  return out;
}

// for torch.compile and opcheck: the output's shape and dtype, no launch
at::Tensor saxpy_meta(const at::Tensor& x, const at::Tensor& y, double) { return at::empty_like(y); }

KLOAD_LIBRARY(m) { m.def("saxpy(Tensor x, Tensor y, float a) -> Tensor"); }
KLOAD_IMPL(CUDA, m) { m.impl("saxpy", &saxpy); }
KLOAD_IMPL(Meta, m) { m.impl("saxpy", &saxpy_meta); }
