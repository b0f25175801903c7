// kload/split/device.h — what the device half of a split .cu gets in place of torch's
// host headers (loader/cusplit.py): the C10_* macros and the namespaces, so that a
// kernel's torch names resolve. The device-side headers of torch that a kernel names
// (c10/util/Half.h, ATen/core/TensorAccessor.h, ...) are added after this one, by
// name; torch's host API (at::Tensor, the factories, TORCH_CHECK) is not here, and a
// kernel that needs it is compiled whole, as before.
#pragma once

#include <c10/macros/Macros.h>

#include <cstddef>
#include <cstdint>

namespace c10 {}
namespace at { using namespace c10; }        // at::Half is c10::Half, as ATen says
namespace torch { using namespace at; }      // torch::PackedTensorAccessor32, as torch/types.h says
