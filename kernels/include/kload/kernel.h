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

#include <memory>
#include <optional>
#include <string>
#include <vector>

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
#define KLOAD_LIBRARY(m) KLOAD_BLOCK_(m, DEF, std::nullopt, KLOAD_CONCAT(kload_def_, __COUNTER__))
#define KLOAD_FRAGMENT(m) KLOAD_BLOCK_(m, FRAGMENT, std::nullopt, KLOAD_CONCAT(kload_frag_, __COUNTER__))
// Registers implementations for one dispatch key (CPU, CUDA, Meta, Autograd,
// CompositeImplicitAutograd, ...). Any number, in any translation unit.
#define KLOAD_IMPL(k, m) \
  KLOAD_BLOCK_(m, IMPL, std::make_optional(c10::DispatchKey::k), KLOAD_CONCAT(kload_impl_##k##_, __COUNTER__))

// Registration runs when kload asks, not while the library opens.
//
// torch's TORCH_LIBRARY registers from a static initializer: a kernel whose C++
// types do not match its schema, a schema torch cannot parse or a second def of
// one op throws there, during dlopen, where nothing can catch it, and the
// process aborts. Here each block is only recorded as the library opens; kload
// then calls kload_register(), which registers every block under the build's
// namespace inside a try/catch. On an error it unregisters what it had
// registered (torch::Library's destructor does) and returns the message, so the
// mistake is a Python exception and the process keeps the last good build.
namespace kload {
namespace detail {
#ifdef KLOAD_LIGHT_REGISTER  // a first build: registered through torch's C shim (kload/register.h)
using Library = ::kload::light::Library;
#else
using Library = ::torch::Library;
#endif

// One block, type-erased: the light Library has internal linkage (each translation
// unit its own kernel slots), and the list below is one per binary.
struct Block {
  void* (*open)(int kind, const char* ns, std::optional<c10::DispatchKey> key, const char* file, uint32_t line);
  void (*close)(void*);
  void (*init)(void*);
  int kind;
  std::optional<c10::DispatchKey> key;
  const char* file;
  uint32_t line;
};

template <class L>
void* open_library(int kind, const char* ns, std::optional<c10::DispatchKey> key, const char* file, uint32_t line) {
  return new L(static_cast<typename L::Kind>(kind), ns, key, file, line);
}
template <class L>
void close_library(void* lib) {
  delete static_cast<L*>(lib);
}
template <class L, void (*F)(L&)>
void run_block(void* lib) {
  F(*static_cast<L*>(lib));
}
template <void (*F)(Library&)>
Block block(Library::Kind kind, std::optional<c10::DispatchKey> key, const char* file, uint32_t line) {
  return Block{&open_library<Library>, &close_library<Library>, &run_block<Library, F>, static_cast<int>(kind), key,
               file, line};
}

// Hidden: two builds in one process never share the list.
__attribute__((visibility("hidden"))) inline std::vector<Block>& blocks() {
  static std::vector<Block> b;
  return b;
}

struct Record {
  explicit Record(const Block& b) { blocks().push_back(b); }
};

// Registers every block under this build's namespace. Returns nullptr, or
// "file:line\tmessage" of the block that failed, having unregistered the rest.
__attribute__((visibility("hidden"))) inline const char* register_blocks() {
  static std::string error;
  static auto* kept = new std::vector<void*>();  // the dispatcher refers to these until the process ends
  std::vector<std::pair<void*, void (*)(void*)>> made;
  const Block* at = nullptr;
  error.clear();
  try {
    for (const Block& b : blocks()) {
      at = &b;
      made.emplace_back(b.open(b.kind, ns(), b.key, b.file, b.line), b.close);
      b.init(made.back().first);
    }
  } catch (const c10::Error& e) {
    error = e.what_without_backtrace();
  } catch (const std::exception& e) {
    error = e.what();
  } catch (...) {
    error = "an exception that is not a std::exception";
  }
  if (!error.empty()) {
    error = std::string(at ? at->file : "?") + ":" + std::to_string(at ? at->line : 0) + "\t" + error;
    for (; !made.empty(); made.pop_back()) made.back().second(made.back().first);  // newest first
    return error.c_str();
  }
  for (auto& lib : made) kept->push_back(lib.first);
  return nullptr;
}
}  // namespace detail
}  // namespace kload

// What kload calls (through ctypes) once the library is open, once per binary.
extern "C" __attribute__((used, visibility("default"))) inline const char* kload_register() {
  return ::kload::detail::register_blocks();
}

#define KLOAD_BLOCK_(m, kind, key, uid)                                                                 \
  static void KLOAD_CONCAT(uid, _init)(::kload::detail::Library&);                                      \
  static const ::kload::detail::Record KLOAD_CONCAT(uid, _rec)(                                         \
      ::kload::detail::block<&KLOAD_CONCAT(uid, _init)>(::kload::detail::Library::kind, key, __FILE__, __LINE__)); \
  void KLOAD_CONCAT(uid, _init)(::kload::detail::Library & m)

#endif  // KLOAD_KERNEL_H_
