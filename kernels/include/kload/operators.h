// kload/operators.h — Tensor's binary operators (a + b, 2 * x, a < b, ...) for a
// build without the precompiled <kload/kernel.h> (KLOAD_TRIM_OPERATORS, set by
// loader/trim.py), as <ATen/TensorOperators.h> defines them.
//
// That header takes at::empty_like from <ATen/ops/empty_like.h>, whose preamble
// (<ATen/Context.h>, <ATen/DeviceGuard.h>, ...) is ~2 s of a first build that calls
// no at:: function; here the same call goes through at::_ops::empty_like, which
// at::empty_like(y, at::MemoryFormat::Preserve) forwards to with no options.
// The same functions under the same names: a source that also includes
// <ATen/TensorOperators.h> fails to compile ("redefinition of"), and trim.py
// compiles it with the whole API.
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty_like_ops.h>
#include <c10/core/Scalar.h>

#include <optional>

namespace at {

inline Tensor kload_empty_like_(const Tensor& y) {
  return ::at::_ops::empty_like::call(y, std::nullopt, std::nullopt, std::nullopt, std::nullopt,
                                      at::MemoryFormat::Preserve);
}

#define KLOAD_FORALL_BINARY_OPS_(_)                                            \
  _(+, x.add(y), y.add(x))                                                     \
  _(*, x.mul(y), y.mul(x))                                                     \
  _(-, x.sub(y), ::at::kload_empty_like_(y).fill_(x).sub_(y))                  \
  _(/, x.div(y), ::at::kload_empty_like_(y).fill_(x).div_(y))                  \
  _(%, x.remainder(y), ::at::kload_empty_like_(y).fill_(x).remainder_(y))      \
  _(&, x.bitwise_and(y), y.bitwise_and(x))                                     \
  _(|, x.bitwise_or(y), y.bitwise_or(x))                                       \
  _(^, x.bitwise_xor(y), y.bitwise_xor(x))                                     \
  _(<, x.lt(y), y.gt(x))                                                       \
  _(<=, x.le(y), y.ge(x))                                                      \
  _(>, x.gt(y), y.lt(x))                                                       \
  _(>=, x.ge(y), y.le(x))                                                      \
  _(==, x.eq(y), y.eq(x))                                                      \
  _(!=, x.ne(y), y.ne(x))

#define KLOAD_DEFINE_OPERATOR_(op, body, reverse_scalar_body)   \
  inline Tensor operator op(const Tensor& x, const Tensor& y) { \
    return body;                                                \
  }                                                             \
  inline Tensor operator op(const Tensor& x, const Scalar& y) { \
    return body;                                                \
  }                                                             \
  inline Tensor operator op(const Scalar& x, const Tensor& y) { \
    return reverse_scalar_body;                                 \
  }

KLOAD_FORALL_BINARY_OPS_(KLOAD_DEFINE_OPERATOR_)
#undef KLOAD_DEFINE_OPERATOR_
#undef KLOAD_FORALL_BINARY_OPS_

}  // namespace at
