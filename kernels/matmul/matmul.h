// matmul/matmul.h — the input checks shared by matmul.cpp (CPU, Meta) and matmul.cu (CUDA):
// one message per mistake, whatever the device.
#pragma once

#include <kload/kernel.h>

namespace kload_matmul {

inline void check_matmul(const at::Tensor& a, const at::Tensor& b) {
  TORCH_CHECK(a.dim() == 2 && b.dim() == 2, "matmul: expected 2-D tensors [M, K] and [K, N], got shapes ",
              a.sizes(), " and ", b.sizes());
  TORCH_CHECK(a.size(1) == b.size(0), "matmul: inner dimensions differ: a is ", a.sizes(), ", b is ", b.sizes());
  TORCH_CHECK(a.device() == b.device(), "matmul: a and b must be on the same device, got ", a.device(), " and ",
              b.device());
  TORCH_CHECK(a.scalar_type() == b.scalar_type(), "matmul: a and b must have the same dtype, got ",
              a.scalar_type(), " and ", b.scalar_type());
}

}  // namespace kload_matmul
