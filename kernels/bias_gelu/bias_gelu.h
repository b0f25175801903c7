// bias_gelu/bias_gelu.h — the input checks shared by bias_gelu.cpp's CPU, Meta and
// CUDA kernels: one message per mistake, whatever the device.
#pragma once

#include <kload/stable.h>

namespace kload_bias_gelu {

using kload::Tensor;

inline void check_bias_gelu(const Tensor& x, const Tensor& bias) {
  using torch::headeronly::toString;
  STD_TORCH_CHECK(x.dim() >= 1, "bias_gelu: x must have at least 1 dimension, got a scalar");
  const int64_t D = x.size(x.dim() - 1);
  STD_TORCH_CHECK(bias.dim() == 1 && bias.size(0) == D, "bias_gelu: bias must have shape [", D,
                  "] (x's last dimension), got ", kload::shape_str(bias));
  STD_TORCH_CHECK(x.device() == bias.device(), "bias_gelu: x and bias must be on the same device, got ",
                  kload::device_str(x), " and ", kload::device_str(bias));
  STD_TORCH_CHECK(x.scalar_type() == bias.scalar_type(), "bias_gelu: x and bias must have the same dtype, got ",
                  toString(x.scalar_type()), " and ", toString(bias.scalar_type()));
}

// The backward's inputs: x and bias as above, and grad matching x in shape, dtype and device.
inline void check_bias_gelu_backward(const Tensor& grad, const Tensor& x, const Tensor& bias) {
  using torch::headeronly::toString;
  check_bias_gelu(x, bias);
  bool same = grad.dim() == x.dim();
  for (int64_t i = 0; same && i < x.dim(); ++i) same = grad.size(i) == x.size(i);
  STD_TORCH_CHECK(same, "bias_gelu_backward: grad has shape ", kload::shape_str(grad), ", expected ",
                  kload::shape_str(x));
  STD_TORCH_CHECK(grad.device() == x.device(), "bias_gelu_backward: grad and x must be on the same device, got ",
                  kload::device_str(grad), " and ", kload::device_str(x));
  STD_TORCH_CHECK(grad.scalar_type() == x.scalar_type(),
                  "bias_gelu_backward: grad and x must have the same dtype, got ", toString(grad.scalar_type()),
                  " and ", toString(x.scalar_type()));
}

}  // namespace kload_bias_gelu
