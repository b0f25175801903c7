// conv2d/conv2d.h — the input checks shared by conv2d.cpp (CPU, Meta) and conv2d.cu (CUDA):
// one message per mistake, whatever the device.
#pragma once

#include <kload/kernel.h>

namespace kload_conv2d {

struct Geometry {
  int64_t N, C, H, W, OC, KH, KW, SH, SW, PH, PW, OH, OW;
  int64_t ckk() const { return C * KH * KW; }
  int64_t ohw() const { return OH * OW; }
};

inline Geometry check_conv2d(const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& bias,
                      at::IntArrayRef stride, at::IntArrayRef padding) {
  TORCH_CHECK(x.dim() == 4, "conv2d: x must be 4-D [N, C, H, W], got shape ", x.sizes());
  TORCH_CHECK(w.dim() == 4, "conv2d: w must be 4-D [OC, C, kh, kw], got shape ", w.sizes());
  TORCH_CHECK(x.device() == w.device(), "conv2d: x and w must be on the same device, got ", x.device(), " and ",
              w.device());
  TORCH_CHECK(x.scalar_type() == w.scalar_type(), "conv2d: x and w must have the same dtype, got ",
              x.scalar_type(), " and ", w.scalar_type());
  TORCH_CHECK(x.size(1) == w.size(1), "conv2d: x has ", x.size(1), " channels but w expects ", w.size(1),
              " (x ", x.sizes(), ", w ", w.sizes(), "); groups are not supported");
  TORCH_CHECK(stride.size() == 2 && padding.size() == 2, "conv2d: stride and padding must have 2 values");
  TORCH_CHECK(stride[0] >= 1 && stride[1] >= 1, "conv2d: stride must be >= 1, got ", stride);
  TORCH_CHECK(padding[0] >= 0 && padding[1] >= 0, "conv2d: padding must be >= 0, got ", padding);
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == w.size(0), "conv2d: bias must have shape [", w.size(0),
                "], got ", bias->sizes());
    TORCH_CHECK(bias->device() == x.device() && bias->scalar_type() == x.scalar_type(),
                "conv2d: bias must match x's device and dtype, got ", bias->device(), " ", bias->scalar_type());
  }
  Geometry g{x.size(0), x.size(1), x.size(2), x.size(3), w.size(0), w.size(2), w.size(3),
             stride[0], stride[1], padding[0], padding[1], 0, 0};
  TORCH_CHECK(g.KH <= g.H + 2 * g.PH && g.KW <= g.W + 2 * g.PW, "conv2d: kernel ", g.KH, "x", g.KW,
              " is larger than the padded input ", g.H + 2 * g.PH, "x", g.W + 2 * g.PW);
  g.OH = (g.H + 2 * g.PH - g.KH) / g.SH + 1;
  g.OW = (g.W + 2 * g.PW - g.KW) / g.SW + 1;
  return g;
}

inline void check_conv2d_grad(const at::Tensor& grad, const Geometry& g) {
  TORCH_CHECK(grad.dim() == 4 && grad.size(0) == g.N && grad.size(1) == g.OC && grad.size(2) == g.OH &&
                  grad.size(3) == g.OW,
              "conv2d_backward: grad has shape ", grad.sizes(), ", expected [", g.N, ", ", g.OC, ", ", g.OH, ", ",
              g.OW, "]");
}

}  // namespace kload_conv2d
