// vector_add/vector_add.h — the input checks shared by vector_add.cpp (CPU, Meta) and vector_add.cu (CUDA):
// one message per mistake, whatever the device.
#pragma once

#include <kload/kernel.h>

namespace kload_vector_add {

inline void check_vector_add(const at::Tensor& a, const at::Tensor& b) {
  TORCH_CHECK(a.device() == b.device(), "vector_add: a and b must be on the same device, got ", a.device(),
              " and ", b.device());
  TORCH_CHECK(a.scalar_type() == b.scalar_type(), "vector_add: a and b must have the same dtype, got ",
              a.scalar_type(), " and ", b.scalar_type());
  TORCH_CHECK(a.sizes() == b.sizes(), "vector_add: a and b must have the same shape, got ", a.sizes(), " and ",
              b.sizes());
}

}  // namespace kload_vector_add
