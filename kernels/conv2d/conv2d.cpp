// conv2d — NCHW convolution with the semantics of F.conv2d(x, w, bias, stride, padding)
// (groups=1, dilation=1), forward and backward.
//
// Method: im2col + GEMM. Each image's receptive fields are unfolded into a
// [C*kh*kw, OH*OW] matrix and multiplied by the weights viewed as [OC, C*kh*kw]
// with kload/cpu/gemm.h, so the convolution runs at the GEMM's speed and shares
// its tested micro-kernel. The forward unfolds a band of output rows at a time
// (about 256 columns: 576 x 256 floats = 590 KB for the benchmark shape), so the
// unfolded band is still in L2 when the GEMM reads it, instead of a 7 MB buffer
// per image that streams through memory twice. OpenMP threads take whole images.
// Backward: grad_w = sum_n grad_n @ col_n^T, grad_x = col2im(w^T @ grad_n).
// CUDA: the kernels are in conv2d.cu (no torch header); the glue is at the end.
#include <kload/stable.h>
#include "conv2d.h"
#include <kload/cpu/gemm.h>
#include <kload/cpu/parallel.h>

#include <algorithm>
#include <optional>
#include <tuple>
#include <vector>

namespace {

using namespace kload_conv2d;
using kload::ScalarType;

// row-major, densely packed operands
template <typename T>
void gemm_any(int64_t M, int64_t N, int64_t K, const T* A, const T* B, T* C, bool acc) {
  kload::cpu::gemm_any<T>(M, N, K, A, K, B, N, C, N, acc);
}

// col[(c, i, j), (oh, ow)] = x[c, oh*SH - PH + i, ow*SW - PW + j] (0 outside)
template <typename T>
void im2col(const Geometry& g, const T* x, T* col) {
  for (int64_t c = 0; c < g.C; ++c)
    for (int64_t i = 0; i < g.KH; ++i)
      for (int64_t j = 0; j < g.KW; ++j) {
        T* row = col + ((c * g.KH + i) * g.KW + j) * g.ohw();
        for (int64_t oh = 0; oh < g.OH; ++oh) {
          const int64_t h = oh * g.SH - g.PH + i;
          T* out = row + oh * g.OW;
          if (h < 0 || h >= g.H) {
            for (int64_t ow = 0; ow < g.OW; ++ow) out[ow] = T(0);
            continue;
          }
          const T* in = x + (c * g.H + h) * g.W;
          for (int64_t ow = 0; ow < g.OW; ++ow) {
            const int64_t wi = ow * g.SW - g.PW + j;
            out[ow] = (wi >= 0 && wi < g.W) ? in[wi] : T(0);
          }
        }
      }
}

// The same for output rows [oh0, oh1): col has (oh1 - oh0) * OW columns. Each
// row splits into zero padding on the left, a contiguous (stride 1) or strided
// run of valid inputs, and zero padding on the right: no branch per element.
template <typename T>
void im2col_rows(const Geometry& g, const T* x, T* col, int64_t oh0, int64_t oh1) {
  const int64_t ncols = (oh1 - oh0) * g.OW;
  for (int64_t c = 0; c < g.C; ++c)
    for (int64_t i = 0; i < g.KH; ++i)
      for (int64_t j = 0; j < g.KW; ++j) {
        T* row = col + ((c * g.KH + i) * g.KW + j) * ncols;
        // valid ow: 0 <= ow*SW - PW + j < W
        const int64_t lo = std::min(g.OW, std::max<int64_t>(0, (g.PW - j + g.SW - 1) / g.SW));
        const int64_t hi = std::max(lo, std::min(g.OW, (g.W + g.PW - j + g.SW - 1) / g.SW));
        for (int64_t oh = oh0; oh < oh1; ++oh) {
          const int64_t h = oh * g.SH - g.PH + i;
          T* out = row + (oh - oh0) * g.OW;
          if (h < 0 || h >= g.H) {
            std::fill(out, out + g.OW, T(0));
            continue;
          }
          const T* in = x + (c * g.H + h) * g.W + (lo * g.SW - g.PW + j);
          std::fill(out, out + lo, T(0));
          if (g.SW == 1)
            std::copy(in, in + (hi - lo), out + lo);
          else
            for (int64_t ow = lo; ow < hi; ++ow) out[ow] = in[(ow - lo) * g.SW];
          std::fill(out + hi, out + g.OW, T(0));
        }
      }
}

// the adjoint of im2col: x[c, h, w] += col[...]
template <typename T>
void col2im(const Geometry& g, const T* col, T* x) {
  for (int64_t c = 0; c < g.C; ++c)
    for (int64_t i = 0; i < g.KH; ++i)
      for (int64_t j = 0; j < g.KW; ++j) {
        const T* row = col + ((c * g.KH + i) * g.KW + j) * g.ohw();
        for (int64_t oh = 0; oh < g.OH; ++oh) {
          const int64_t h = oh * g.SH - g.PH + i;
          if (h < 0 || h >= g.H) continue;
          T* out = x + (c * g.H + h) * g.W;
          for (int64_t ow = 0; ow < g.OW; ++ow) {
            const int64_t wi = ow * g.SW - g.PW + j;
            if (wi >= 0 && wi < g.W) out[wi] += row[oh * g.OW + ow];
          }
        }
      }
}

template <typename T>
void transpose(const T* a, int64_t rows, int64_t cols, T* out) {  // out[cols, rows] = a[rows, cols]^T
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < cols; ++c) out[c * rows + r] = a[r * cols + c];
}

void check_cpu_dtype(const Tensor& x) {
  const ScalarType t = x.scalar_type();
  STD_TORCH_CHECK(t == ScalarType::Float || t == ScalarType::Double, "conv2d (CPU): expected float32 or float64, got ",
                  torch::headeronly::toString(t));
}

Tensor conv2d_cpu(const Tensor& x_in, const Tensor& w_in, const std::optional<Tensor>& bias,
                  const std::vector<int64_t>& stride, const std::vector<int64_t>& padding) {
  const Geometry g = check_conv2d(x_in, w_in, bias, stride, padding);
  check_cpu_dtype(x_in);
  const Tensor x = kload::as_contiguous(x_in), w = kload::as_contiguous(w_in);
  Tensor out = kload::empty(x, {g.N, g.OC, g.OH, g.OW});
  const bool has_bias = bias.has_value() && bias->defined();
  const Tensor b = has_bias ? kload::as_contiguous(*bias) : Tensor();
  KLOAD_DISPATCH_FLOATING(x.scalar_type(), "conv2d_cpu", [&] {
    const scalar_t* px = x.const_data_ptr<scalar_t>();
    const scalar_t* pw = w.const_data_ptr<scalar_t>();
    const scalar_t* pb = has_bias ? b.const_data_ptr<scalar_t>() : nullptr;
    scalar_t* po = out.mutable_data_ptr<scalar_t>();
    // output rows per band: ~256 unfolded columns (at least one row)
    const int64_t band = std::max<int64_t>(1, 256 / std::max<int64_t>(1, g.OW));
    kload::cpu::parallel_chunks(g.N, 1, [&](int64_t n0, int64_t n1) {
      std::vector<scalar_t> col(g.ckk() * std::min(band, g.OH) * g.OW);
      for (int64_t n = n0; n < n1; ++n) {
        const scalar_t* xn = px + n * g.C * g.H * g.W;
        scalar_t* o = po + n * g.OC * g.ohw();
        for (int64_t oh0 = 0; oh0 < g.OH; oh0 += band) {
          const int64_t oh1 = std::min(g.OH, oh0 + band), ncols = (oh1 - oh0) * g.OW;
          im2col_rows(g, xn, col.data(), oh0, oh1);
          kload::cpu::gemm_any<scalar_t>(g.OC, ncols, g.ckk(), pw, g.ckk(), col.data(), ncols,
                                         o + oh0 * g.OW, g.ohw(), false);
        }
        if (pb)
          for (int64_t oc = 0; oc < g.OC; ++oc)
            for (int64_t p = 0; p < g.ohw(); ++p) o[oc * g.ohw() + p] += pb[oc];
      }
    });
  });
  return out;
}

template <typename scalar_t>
void conv2d_backward_kernel(const Geometry& g, const Tensor& x, const Tensor& w, const Tensor& grad, Tensor& grad_x,
                            Tensor& grad_w) {
  const scalar_t* px = x.const_data_ptr<scalar_t>();
  const scalar_t* pg = grad.const_data_ptr<scalar_t>();
  std::vector<scalar_t> wt(g.ckk() * g.OC);  // w^T: [C*kh*kw, OC]
  transpose(w.const_data_ptr<scalar_t>(), g.OC, g.ckk(), wt.data());
  scalar_t* pgx = grad_x.mutable_data_ptr<scalar_t>();
  scalar_t* pgw = grad_w.mutable_data_ptr<scalar_t>();
  const int threads = std::max(1, std::min<int>(kload::cpu::num_threads(), static_cast<int>(g.N)));
  std::vector<std::vector<scalar_t>> partial(threads, std::vector<scalar_t>(g.OC * g.ckk(), scalar_t(0)));
  kload::cpu::parallel_threads(threads, [&](int64_t t, int64_t nt) {
    std::vector<scalar_t> col(g.ckk() * g.ohw()), colt(g.ohw() * g.ckk());
    for (int64_t n = g.N * t / nt; n < g.N * (t + 1) / nt; ++n) {
      const scalar_t* gn = pg + n * g.OC * g.ohw();
      im2col(g, px + n * g.C * g.H * g.W, col.data());
      transpose(col.data(), g.ckk(), g.ohw(), colt.data());
      gemm_any<scalar_t>(g.OC, g.ckk(), g.ohw(), gn, colt.data(), partial[t].data(), true);
      gemm_any<scalar_t>(g.ckk(), g.ohw(), g.OC, wt.data(), gn, col.data(), false);
      col2im(g, col.data(), pgx + n * g.C * g.H * g.W);
    }
  });
  for (const auto& p : partial)
    for (int64_t i = 0; i < g.OC * g.ckk(); ++i) pgw[i] += p[i];
}

std::tuple<Tensor, Tensor> conv2d_backward_cpu(const Tensor& grad_in, const Tensor& x_in, const Tensor& w_in,
                                               const std::vector<int64_t>& stride,
                                               const std::vector<int64_t>& padding) {
  const Geometry g = check_conv2d(x_in, w_in, std::nullopt, stride, padding);
  check_cpu_dtype(x_in);
  check_conv2d_grad(grad_in, g);
  const Tensor x = kload::as_contiguous(x_in), w = kload::as_contiguous(w_in), grad = kload::as_contiguous(grad_in);
  Tensor grad_x = torch::stable::new_zeros(x, x.sizes()), grad_w = torch::stable::new_zeros(w, w.sizes());
  KLOAD_DISPATCH_FLOATING(x.scalar_type(), "conv2d_backward_cpu",
                          [&] { conv2d_backward_kernel<scalar_t>(g, x, w, grad, grad_x, grad_w); });
  return {grad_x, grad_w};
}

Tensor conv2d_meta(const Tensor& x, const Tensor& w, const std::optional<Tensor>& bias,
                   const std::vector<int64_t>& stride, const std::vector<int64_t>& padding) {
  const Geometry g = check_conv2d(x, w, bias, stride, padding);
  return torch::stable::new_empty(x, {g.N, g.OC, g.OH, g.OW});
}

std::tuple<Tensor, Tensor> conv2d_backward_meta(const Tensor& grad, const Tensor& x, const Tensor& w,
                                                const std::vector<int64_t>& stride,
                                                const std::vector<int64_t>& padding) {
  const Geometry g = check_conv2d(x, w, std::nullopt, stride, padding);
  check_conv2d_grad(grad, g);  // the fake kernel rejects what the real one does
  return {torch::stable::new_empty(x, x.sizes()), torch::stable::new_empty(w, w.sizes())};
}

}  // namespace

KLOAD_LIBRARY(m) {
  m.def("conv2d(Tensor x, Tensor w, Tensor? bias=None, int[2] stride=1, int[2] padding=0) -> Tensor");
  m.def("conv2d_backward(Tensor grad, Tensor x, Tensor w, int[2] stride, int[2] padding) -> (Tensor, Tensor)");
}
KLOAD_IMPL(CPU, m) {
  m.impl("conv2d", TORCH_BOX(&conv2d_cpu));
  m.impl("conv2d_backward", TORCH_BOX(&conv2d_backward_cpu));
}
KLOAD_IMPL(Meta, m) {
  m.impl("conv2d", TORCH_BOX(&conv2d_meta));
  m.impl("conv2d_backward", TORCH_BOX(&conv2d_backward_meta));
}

#ifdef KLOAD_WITH_CUDA
#include <kload/cuda/launcher.h>

KLOAD_LAUNCHER const char* kload_conv2d_workspace(int dtype, kload_conv2d::Geometry g, int64_t* bytes);
KLOAD_LAUNCHER const char* kload_conv2d_cuda(int dtype, const void* x, const void* w, const void* bias, void* out,
                                             void* workspace, kload_conv2d::Geometry g, void* stream);
KLOAD_LAUNCHER const char* kload_conv2d_backward_cuda(int dtype, const void* grad, const void* x, const void* w,
                                                      void* grad_x, void* grad_w, kload_conv2d::Geometry g,
                                                      void* stream);

namespace {

Tensor conv2d_cuda(const Tensor& x_in, const Tensor& w_in, const std::optional<Tensor>& bias_in,
                   const std::vector<int64_t>& stride, const std::vector<int64_t>& padding) {
  KLOAD_CHECK_CUDA(x_in);
  KLOAD_CHECK_CUDA(w_in);
  const Geometry g = check_conv2d(x_in, w_in, bias_in, stride, padding);
  const int dtype = kload::cuda::dtype_code(x_in, "conv2d");
  kload::DeviceGuard guard(x_in.get_device_index());
  const Tensor x = kload::as_contiguous(x_in), w = kload::as_contiguous(w_in);
  const bool has_bias = bias_in.has_value() && bias_in->defined();
  const Tensor bias = has_bias ? kload::as_contiguous(*bias_in) : Tensor();
  Tensor out = kload::empty(x, {g.N, g.OC, g.OH, g.OW});
  if (out.numel() == 0) return out;
  // the implicit GEMM (half/bfloat16) reads an NHWC copy of x and reordered weights
  int64_t bytes = 0;
  KLOAD_CHECK_LAUNCH(kload_conv2d_workspace(dtype, g, &bytes));
  const int64_t elem = static_cast<int64_t>(x.element_size());
  const Tensor workspace = bytes > 0 ? kload::empty(x, {(bytes + elem - 1) / elem}) : Tensor();
  KLOAD_CHECK_LAUNCH(kload_conv2d_cuda(dtype, x.const_data_ptr(), w.const_data_ptr(),
                                       has_bias ? bias.const_data_ptr() : nullptr, out.mutable_data_ptr(),
                                       bytes > 0 ? workspace.mutable_data_ptr() : nullptr, g, kload::cuda_stream(x)));
  return out;
}

std::tuple<Tensor, Tensor> conv2d_backward_cuda(const Tensor& grad_in, const Tensor& x_in, const Tensor& w_in,
                                                const std::vector<int64_t>& stride,
                                                const std::vector<int64_t>& padding) {
  KLOAD_CHECK_CUDA(x_in);
  KLOAD_CHECK_CUDA(w_in);
  const Geometry g = check_conv2d(x_in, w_in, std::nullopt, stride, padding);
  KLOAD_CHECK_CUDA(grad_in);
  check_conv2d_grad(grad_in, g);
  const int dtype = kload::cuda::dtype_code(x_in, "conv2d_backward");
  kload::DeviceGuard guard(x_in.get_device_index());
  const Tensor x = kload::as_contiguous(x_in), w = kload::as_contiguous(w_in), grad = kload::as_contiguous(grad_in);
  Tensor gx = kload::empty_like(x), gw = kload::empty_like(w);
  KLOAD_CHECK_LAUNCH(kload_conv2d_backward_cuda(dtype, grad.const_data_ptr(), x.const_data_ptr(), w.const_data_ptr(),
                                                gx.numel() ? gx.mutable_data_ptr() : nullptr,
                                                gw.numel() ? gw.mutable_data_ptr() : nullptr, g,
                                                kload::cuda_stream(x)));
  return {gx, gw};
}

}  // namespace

KLOAD_IMPL(CUDA, m) {
  m.impl("conv2d", TORCH_BOX(&conv2d_cuda));
  m.impl("conv2d_backward", TORCH_BOX(&conv2d_backward_cuda));
}
#endif  // KLOAD_WITH_CUDA
