// kload/kernel.h — the one header an op library includes.
//
//   #include <kload/kernel.h>
//   KLOAD_LIBRARY(m) { m.def("vector_add(Tensor a, Tensor b) -> Tensor"); }
//   KLOAD_IMPL(CPU, m) { m.impl("vector_add", &vector_add_cpu); }
//
// Lean on purpose: <torch/extension.h> pulls in all of libtorch's C++ API and
// pybind11 (~20 s per translation unit); ATen's Tensor and the registration API
// are all an op needs (~2-3 s).
//
// The operator namespace is not a compile-time constant: kload generates one
// small translation unit per build that defines kload::detail::ns(), so every
// build registers a fresh namespace (live reload in one process), while editing
// one source recompiles only that source.
#pragma once

// Tensor's methods come with it: a.add(b), a.new_empty(a.sizes()), a.new_zeros({n}),
// a.contiguous(). Free functions (at::empty_like, at::matmul, ...) each need
// #include <ATen/ops/NAME.h>: every one of those pulls in ATen/Context.h (~1 s),
// so this header includes none.
#include <ATen/core/Tensor.h>
#include <torch/library.h>

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
#define KLOAD_LIBRARY_(m, kind, uid)                                      \
  static void KLOAD_CONCAT(uid, _init)(torch::Library&);                  \
  static const torch::detail::TorchLibraryInit KLOAD_CONCAT(uid, _reg)(   \
      torch::Library::kind, &KLOAD_CONCAT(uid, _init), ::kload::detail::ns(), \
      std::nullopt, __FILE__, __LINE__);                                  \
  void KLOAD_CONCAT(uid, _init)(torch::Library & m)

// Registers implementations for one dispatch key (CPU, CUDA, Meta, Autograd,
// CompositeImplicitAutograd, ...). Any number, in any translation unit.
#define KLOAD_IMPL(k, m) KLOAD_IMPL_(k, m, KLOAD_CONCAT(kload_impl_##k##_, __COUNTER__))
#define KLOAD_IMPL_(k, m, uid)                                            \
  static void KLOAD_CONCAT(uid, _init)(torch::Library&);                  \
  static const torch::detail::TorchLibraryInit KLOAD_CONCAT(uid, _reg)(   \
      torch::Library::IMPL, &KLOAD_CONCAT(uid, _init), ::kload::detail::ns(), \
      std::make_optional(c10::DispatchKey::k), __FILE__, __LINE__);       \
  void KLOAD_CONCAT(uid, _init)(torch::Library & m)
