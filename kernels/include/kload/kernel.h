// kload/kernel.h — the one header an op library includes: the whole ATen C++ API
// and kload's registration macros.
//
//   #include <kload/kernel.h>
//   at::Tensor axpy(const at::Tensor& x, const at::Tensor& y, double a) { return x * a + y; }
//   KLOAD_LIBRARY(m) { m.def("axpy(Tensor x, Tensor y, float a) -> Tensor"); }
//   KLOAD_IMPL(CPU, m) { m.impl("axpy", &axpy); }
//
// It gives Tensor operators and methods, at:: functions and factories
// (at::empty_like, at::zeros, at::matmul, ...), c10 types, TORCH_CHECK,
// AT_DISPATCH_*, at::parallel_for and torch::Library. g++ takes ~12 s to parse
// all of that, so kload precompiles this header once per compiler and flag set
// into its cache; a source whose FIRST #include is <kload/kernel.h> then
// compiles in ~3 s. (Nothing but comments, blank lines and #line may come
// before it, and no #define: GCC cannot use a precompiled header after either.)
//
// nvcc cannot use a precompiled header. A .cu file that defines KLOAD_LEAN
// before including this gets only Tensor and the registration API (then
// #include <ATen/ops/NAME.h> for each at:: function it calls), which nvcc
// parses several times faster.
//
// The operator namespace is not a compile-time constant: kload generates one
// small translation unit per build that defines kload::detail::ns(), so every
// build registers a fresh namespace (live reload in one process), while editing
// one source recompiles only that source.
#ifndef KLOAD_KERNEL_H_
#define KLOAD_KERNEL_H_

#ifdef KLOAD_LEAN
#include <ATen/core/Tensor.h>
#elif defined(KLOAD_TRIMMED)
// A build without this header precompiled (the first, before it is; loader/trim.py):
// Tensor with its methods and operators; the generated header that defines
// KLOAD_TRIMMED (and AT_PER_OPERATOR_HEADERS) adds the rest of <ATen/ATen.h> that
// the sources use and <ATen/ops/NAME.h> for each function they name.
#include <ATen/core/ATenGeneral.h>
#include <ATen/core/Scalar.h>
#include <ATen/Device.h>
#include <ATen/Tensor.h>
#ifdef KLOAD_TRIM_OPERATORS
#include "operators.h"  // the same operators without <ATen/ops/empty_like.h>'s preamble
#else
#include <ATen/TensorOperators.h>
#endif
#include <c10/core/Allocator.h>
#include <c10/core/Layout.h>
#include <c10/core/Storage.h>
#include <c10/core/TensorOptions.h>
#include <c10/util/Exception.h>
#else
#include <ATen/ATen.h>       // operators, methods, at:: functions and factories, AT_DISPATCH_*
#include <ATen/Parallel.h>   // at::parallel_for, at::get_num_threads
#endif
#ifdef KLOAD_LIGHT_REGISTER
#include "register.h"  // m.def and m.impl through torch's C shim, without <torch/library.h>
#else
#include <torch/library.h>
#endif

#include <optional>

#include "checks.h"

namespace kload {
namespace detail {
// Defined in the translation unit kload generates for each build. Hidden, so a
// process that loaded several builds never binds one build's call to another's.
__attribute__((visibility("hidden"))) const char* ns();
}  // namespace detail
}  // namespace kload

#define KLOAD_CONCAT_(a, b) a##b
#define KLOAD_CONCAT(a, b) KLOAD_CONCAT_(a, b)

// Declares the library's schemas: m.def("op(Tensor x) -> Tensor").
// At most one per library (as with TORCH_LIBRARY); use KLOAD_FRAGMENT for more.
#define KLOAD_LIBRARY(m) KLOAD_LIBRARY_(m, DEF, KLOAD_CONCAT(kload_def_, __COUNTER__))
#define KLOAD_FRAGMENT(m) KLOAD_LIBRARY_(m, FRAGMENT, KLOAD_CONCAT(kload_frag_, __COUNTER__))
// Registers implementations for one dispatch key (CPU, CUDA, Meta, Autograd,
// CompositeImplicitAutograd, ...). Any number, in any translation unit.
#define KLOAD_IMPL(k, m) KLOAD_IMPL_(k, m, KLOAD_CONCAT(kload_impl_##k##_, __COUNTER__))

namespace kload {
namespace detail {
#ifdef KLOAD_LIGHT_REGISTER  // a first build: registered through torch's C shim (kload/register.h)
using Library = ::kload::light::Library;
using LibraryInit = ::kload::light::Init;
#else
using Library = ::torch::Library;
using LibraryInit = ::torch::detail::TorchLibraryInit;
#endif
}  // namespace detail
}  // namespace kload

#define KLOAD_LIBRARY_(m, kind, uid)                                          \
  static void KLOAD_CONCAT(uid, _init)(::kload::detail::Library&);            \
  static const ::kload::detail::LibraryInit KLOAD_CONCAT(uid, _reg)(          \
      ::kload::detail::Library::kind, &KLOAD_CONCAT(uid, _init), ::kload::detail::ns(), \
      std::nullopt, __FILE__, __LINE__);                                      \
  void KLOAD_CONCAT(uid, _init)(::kload::detail::Library & m)

#define KLOAD_IMPL_(k, m, uid)                                                \
  static void KLOAD_CONCAT(uid, _init)(::kload::detail::Library&);            \
  static const ::kload::detail::LibraryInit KLOAD_CONCAT(uid, _reg)(          \
      ::kload::detail::Library::IMPL, &KLOAD_CONCAT(uid, _init), ::kload::detail::ns(), \
      std::make_optional(c10::DispatchKey::k), __FILE__, __LINE__);           \
  void KLOAD_CONCAT(uid, _init)(::kload::detail::Library & m)

#endif  // KLOAD_KERNEL_H_
