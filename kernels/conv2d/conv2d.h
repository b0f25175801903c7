// conv2d/conv2d.h — the input checks shared by conv2d.cpp's CPU, Meta and CUDA
// kernels: one message per mistake, whatever the device. Geometry is plain data:
// the CUDA launchers in conv2d.cu (no torch header) take the same struct.
#pragma once

#include <kload/stable.h>

#include <optional>
#include <sstream>
#include <string>
#include <vector>

#include "conv2d_geometry.h"

namespace kload_conv2d {

using kload::Tensor;

// "[1, 2]": an int[] argument, for messages
inline std::string list_str(const std::vector<int64_t>& v) {
  std::ostringstream s;
  s << '[';
  for (size_t i = 0; i < v.size(); ++i) s << (i ? ", " : "") << v[i];
  s << ']';
  return s.str();
}

inline Geometry check_conv2d(const Tensor& x, const Tensor& w, const std::optional<Tensor>& bias,
                             const std::vector<int64_t>& stride, const std::vector<int64_t>& padding) {
  using torch::headeronly::toString;
  STD_TORCH_CHECK(x.dim() == 4, "conv2d: x must be 4-D [N, C, H, W], got shape ", kload::shape_str(x));
  STD_TORCH_CHECK(w.dim() == 4, "conv2d: w must be 4-D [OC, C, kh, kw], got shape ", kload::shape_str(w));
  STD_TORCH_CHECK(x.device() == w.device(), "conv2d: x and w must be on the same device, got ", kload::device_str(x),
                  " and ", kload::device_str(w));
  STD_TORCH_CHECK(x.scalar_type() == w.scalar_type(), "conv2d: x and w must have the same dtype, got ",
                  toString(x.scalar_type()), " and ", toString(w.scalar_type()));
  STD_TORCH_CHECK(x.size(1) == w.size(1), "conv2d: x has ", x.size(1), " channels but w expects ", w.size(1), " (x ",
                  kload::shape_str(x), ", w ", kload::shape_str(w), "); groups are not supported");
  STD_TORCH_CHECK(stride.size() == 2 && padding.size() == 2, "conv2d: stride and padding must have 2 values");
  STD_TORCH_CHECK(stride[0] >= 1 && stride[1] >= 1, "conv2d: stride must be >= 1, got ", list_str(stride));
  STD_TORCH_CHECK(padding[0] >= 0 && padding[1] >= 0, "conv2d: padding must be >= 0, got ", list_str(padding));
  if (bias.has_value() && bias->defined()) {
    STD_TORCH_CHECK(bias->dim() == 1 && bias->size(0) == w.size(0), "conv2d: bias must have shape [", w.size(0),
                    "], got ", kload::shape_str(*bias));
    STD_TORCH_CHECK(bias->device() == x.device() && bias->scalar_type() == x.scalar_type(),
                    "conv2d: bias must match x's device and dtype, got ", kload::device_str(*bias), " ",
                    toString(bias->scalar_type()));
  }
  Geometry g{x.size(0), x.size(1), x.size(2), x.size(3), w.size(0), w.size(2), w.size(3),
             stride[0], stride[1], padding[0], padding[1], 0, 0};
  STD_TORCH_CHECK(g.KH <= g.H + 2 * g.PH && g.KW <= g.W + 2 * g.PW, "conv2d: kernel ", g.KH, "x", g.KW,
                  " is larger than the padded input ", g.H + 2 * g.PH, "x", g.W + 2 * g.PW);
  g.OH = (g.H + 2 * g.PH - g.KH) / g.SH + 1;
  g.OW = (g.W + 2 * g.PW - g.KW) / g.SW + 1;
  return g;
}

inline void check_conv2d_grad(const Tensor& grad, const Geometry& g) {
  STD_TORCH_CHECK(grad.dim() == 4 && grad.size(0) == g.N && grad.size(1) == g.OC && grad.size(2) == g.OH &&
                      grad.size(3) == g.OW,
                  "conv2d_backward: grad has shape ", kload::shape_str(grad), ", expected [", g.N, ", ", g.OC, ", ",
                  g.OH, ", ", g.OW, "]");
}

}  // namespace kload_conv2d
