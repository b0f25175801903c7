// vector_add/vector_add.h — the input checks shared by vector_add.cpp's CPU, Meta and
// CUDA kernels: one message per mistake, whatever the device.
#pragma once

#include <kload/stable.h>

namespace kload_vector_add {

using kload::Tensor;

inline void check_vector_add(const Tensor& a, const Tensor& b) {
  STD_TORCH_CHECK(a.device() == b.device(), "vector_add: a and b must be on the same device, got ",
                  kload::device_str(a), " and ", kload::device_str(b));
  STD_TORCH_CHECK(a.scalar_type() == b.scalar_type(), "vector_add: a and b must have the same dtype, got ",
                  torch::headeronly::toString(a.scalar_type()), " and ", torch::headeronly::toString(b.scalar_type()));
  bool same = a.dim() == b.dim();
  for (int64_t i = 0; same && i < a.dim(); ++i) same = a.size(i) == b.size(i);
  STD_TORCH_CHECK(same, "vector_add: a and b must have the same shape, got ", kload::shape_str(a), " and ",
                  kload::shape_str(b));
}

}  // namespace kload_vector_add
