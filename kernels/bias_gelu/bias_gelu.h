// bias_gelu/bias_gelu.h — the input checks shared by bias_gelu.cpp (CPU, Meta) and bias_gelu.cu (CUDA):
// one message per mistake, whatever the device.
#pragma once

#include <kload/kernel.h>

namespace kload_bias_gelu {

inline void check_bias_gelu(const at::Tensor& x, const at::Tensor& bias) {
  TORCH_CHECK(x.dim() >= 1, "bias_gelu: x must have at least 1 dimension, got a scalar");
  TORCH_CHECK(bias.dim() == 1 && bias.size(0) == x.size(-1), "bias_gelu: bias must have shape [", x.size(-1),
              "] (x's last dimension), got ", bias.sizes());
  TORCH_CHECK(x.device() == bias.device(), "bias_gelu: x and bias must be on the same device, got ", x.device(),
              " and ", bias.device());
  TORCH_CHECK(x.scalar_type() == bias.scalar_type(), "bias_gelu: x and bias must have the same dtype, got ",
              x.scalar_type(), " and ", bias.scalar_type());
}

// The backward's inputs: x and bias as above, and grad matching x in shape, dtype and device.
inline void check_bias_gelu_backward(const at::Tensor& grad, const at::Tensor& x, const at::Tensor& bias) {
  check_bias_gelu(x, bias);
  TORCH_CHECK(grad.sizes() == x.sizes(), "bias_gelu_backward: grad has shape ", grad.sizes(), ", expected ",
              x.sizes());
  TORCH_CHECK(grad.device() == x.device(), "bias_gelu_backward: grad and x must be on the same device, got ",
              grad.device(), " and ", x.device());
  TORCH_CHECK(grad.scalar_type() == x.scalar_type(), "bias_gelu_backward: grad and x must have the same dtype, got ",
              grad.scalar_type(), " and ", x.scalar_type());
}

}  // namespace kload_bias_gelu
