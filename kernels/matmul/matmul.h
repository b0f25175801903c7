// matmul/matmul.h — the input checks shared by matmul.cpp's CPU, Meta and CUDA
// kernels: one message per mistake, whatever the device.
#pragma once

#include <kload/stable.h>

namespace kload_matmul {

using kload::Tensor;

inline void check_matmul(const Tensor& a, const Tensor& b) {
  STD_TORCH_CHECK(a.dim() == 2 && b.dim() == 2, "matmul: expected 2-D tensors [M, K] and [K, N], got shapes ",
                  kload::shape_str(a), " and ", kload::shape_str(b));
  STD_TORCH_CHECK(a.size(1) == b.size(0), "matmul: inner dimensions differ: a is ", kload::shape_str(a), ", b is ",
                  kload::shape_str(b));
  STD_TORCH_CHECK(a.device() == b.device(), "matmul: a and b must be on the same device, got ", kload::device_str(a),
                  " and ", kload::device_str(b));
  STD_TORCH_CHECK(a.scalar_type() == b.scalar_type(), "matmul: a and b must have the same dtype, got ",
                  torch::headeronly::toString(a.scalar_type()), " and ", torch::headeronly::toString(b.scalar_type()));
}

}  // namespace kload_matmul
