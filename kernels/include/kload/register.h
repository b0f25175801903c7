// kload/register.h — the registration API of <kload/kernel.h> in a build without
// its precompiled header (KLOAD_LIGHT_REGISTER, set by loader/trim.py).
//
// <torch/library.h> costs ~3 s to parse here, two thirds of a trimmed first build.
// torch's stable C shim registers the same way without it: a library handle,
// m.def(schema), and boxed kernels of the form void(StableIValue*, nargs, nouts).
// This header gives the two calls op libraries make, on the same m:
//
//   KLOAD_LIBRARY(m) { m.def("axpy(Tensor x, Tensor y, float a) -> Tensor"); }
//   KLOAD_IMPL(CPU, m) { m.impl("axpy", &axpy); }
//
// and boxes an ATen kernel itself. A kernel's arguments may be Tensor (by value,
// const& or &), int64_t, double and bool; it returns Tensor, a std::tuple of
// Tensors or nothing. loader/trim.py takes this path only for sources whose
// schemas use those types alone and whose registration is these two calls; it
// passes each schema's argument and return kinds (KLOAD_LIGHT_SCHEMAS), and
// m.impl checks the kernel's C++ types against them when it compiles (torch::Library
// checks the inferred schema when the library opens, and its throw aborts the
// process). Anything else (another type, TORCH_FN, a fallback, a torch:: name)
// compiles with <torch/library.h>. What the shim refuses at registration (a second
// def of one op) is thrown as a std::runtime_error with torch's message; kernel.h's
// kload_register() catches it (registration runs when kload asks, not in dlopen).
//
// A Tensor crosses the shim as an AtenTensorHandle: an owned heap at::Tensor
// (torch/csrc/inductor/aoti_torch/utils.h, tensor_handle_to_tensor_pointer).
// int64_t, double and bool cross as their bytes (torch/csrc/stable's from/to).
#pragma once

#include <ATen/core/Tensor.h>
#include <torch/csrc/inductor/aoti_torch/c/shim.h>
#include <torch/csrc/stable/c/shim.h>
#include <torch/headeronly/version.h>

#include <array>
#include <cstdint>
#include <cstring>
#include <optional>
#include <stdexcept>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>

namespace kload {
namespace light {
namespace {  // internal linkage: each translation unit has its own kernel slots

template <class T>
StableIValue bits(T v) {
  static_assert(sizeof(T) <= sizeof(StableIValue), "kload: a value wider than a StableIValue");
  StableIValue s = 0;
  std::memcpy(&s, &v, sizeof(T));
  return s;
}

template <class T>
T unbits(StableIValue s) {
  T v;
  std::memcpy(&v, &s, sizeof(T));
  return v;
}

inline at::Tensor take_tensor(StableIValue s) {  // the kernel owns the handle it is given
  at::Tensor* p = reinterpret_cast<at::Tensor*>(unbits<AtenTensorHandle>(s));
  at::Tensor t = std::move(*p);
  aoti_torch_delete_tensor_object(unbits<AtenTensorHandle>(s));
  return t;
}

inline StableIValue give_tensor(at::Tensor t) {  // the caller owns the handle it gets
  return bits(reinterpret_cast<AtenTensorHandle>(new at::Tensor(std::move(t))));
}

template <class T>
constexpr bool is_tensor = std::is_same_v<std::remove_cv_t<std::remove_reference_t<T>>, at::Tensor>;

// An argument: its kind (as kload's schema table writes it) and how it is unboxed.
template <class T, class = void>
struct Arg {
  static_assert(sizeof(T) == 0,
                "kload: KLOAD_WHOLE_API: this kernel argument type needs <torch/library.h>");
};
template <class T>
struct Arg<T, std::enable_if_t<is_tensor<T>>> {
  static constexpr char kind = 'T';
  static at::Tensor get(StableIValue s) { return take_tensor(s); }
};
template <class T>
struct Arg<T, std::enable_if_t<std::is_same_v<std::decay_t<T>, int64_t>>> {
  static constexpr char kind = 'i';
  static int64_t get(StableIValue s) { return unbits<int64_t>(s); }
};
template <class T>
struct Arg<T, std::enable_if_t<std::is_same_v<std::decay_t<T>, double>>> {
  static constexpr char kind = 'd';
  static double get(StableIValue s) { return unbits<double>(s); }
};
template <class T>
struct Arg<T, std::enable_if_t<std::is_same_v<std::decay_t<T>, bool>>> {
  static constexpr char kind = 'b';
  static bool get(StableIValue s) { return unbits<bool>(s); }
};

template <class R>
struct Ret {
  static_assert(sizeof(R) == 0, "kload: KLOAD_WHOLE_API: this kernel return type needs <torch/library.h>");
};
template <>
struct Ret<void> {
  static constexpr size_t count = 0;
};
template <>
struct Ret<at::Tensor> {
  static constexpr size_t count = 1;
  static void put(StableIValue* s, at::Tensor r) { s[0] = give_tensor(std::move(r)); }
};
template <>
struct Ret<at::Tensor&> : Ret<at::Tensor> {};
// A scalar return: never in a schema this path takes (loader/registration.py admits
// `-> Tensor` returns only), so m.impl's check reports it at the user's line
// (`int64_t f(...)` for `-> Tensor`) instead of the whole API failing as the library opens.
template <class R, char K>
struct ScalarRet {
  static constexpr size_t count = 1;
  static constexpr char kind = K;
  static void put(StableIValue* s, R r) { s[0] = bits(r); }  // never runs: the kinds differ
};
template <class R, class = void>
struct RetKind {
  static constexpr char value = 'T';
};
template <class R>
struct RetKind<R, std::void_t<decltype(Ret<R>::kind)>> {
  static constexpr char value = Ret<R>::kind;
};
template <>
struct Ret<int64_t> : ScalarRet<int64_t, 'i'> {};
template <>
struct Ret<double> : ScalarRet<double, 'd'> {};
template <>
struct Ret<bool> : ScalarRet<bool, 'b'> {};
template <>
struct Ret<const at::Tensor&> : Ret<at::Tensor> {};
template <class... T>
struct Ret<std::tuple<T...>> {
  static_assert((is_tensor<T> && ...), "kload: KLOAD_WHOLE_API: a tuple of non-Tensors needs <torch/library.h>");
  static constexpr size_t count = sizeof...(T);
  static void put(StableIValue* s, std::tuple<T...> r) {
    std::apply([s](auto&... t) {
      size_t i = 0;
      ((s[i++] = give_tensor(t)), ...);
    }, r);
  }
};

[[noreturn]] inline void fail(const std::string& what) { throw std::runtime_error("kload: " + what); }

inline std::string torch_says() {  // the shim's last exception (torch 2.13 keeps it)
#if TORCH_ABI_VERSION >= ((2ULL << 56) | (13ULL << 48))
  const char* what = torch_exception_get_what_without_backtrace();
  if (what && *what) return std::string(": ") + what;
#endif
  return "";
}

[[noreturn]] inline void failed(const std::string& what) {  // caught by kload_register (kernel.h)
  throw std::runtime_error(what);
}

constexpr int kSlots = 64;  // kernels of one C++ signature per translation unit

template <class R, class... A>
struct Kernel {
  using Fn = R (*)(A...);
  static inline Fn fns[kSlots] = {};
  static inline int used = 0;

  // the kinds as the schema table writes them: "TTd>T"
  static constexpr std::array<char, sizeof...(A) + Ret<R>::count + 2> kinds = [] {
    std::array<char, sizeof...(A) + Ret<R>::count + 2> k{};
    size_t i = 0;
    ((k[i++] = Arg<A>::kind), ...);
    k[i++] = '>';
    for (size_t r = 0; r < Ret<R>::count; ++r) k[i++] = RetKind<R>::value;
    k[i] = '\0';
    return k;
  }();

  template <size_t... I>
  static void run(Fn f, StableIValue* s, std::index_sequence<I...>) {
    // Braced initialization unboxes left to right; each Tensor is owned here.
    std::tuple<decltype(Arg<A>::get(0))...> args{Arg<A>::get(s[I])...};
    if constexpr (std::is_void_v<R>) {
      f(std::get<I>(args)...);
    } else {
      Ret<R>::put(s, f(std::get<I>(args)...));
    }
  }

  template <int I>
  static void boxed(StableIValue* s, uint64_t nargs, uint64_t nouts) {
    if (nargs != sizeof...(A) || nouts != Ret<R>::count) {
      fail("the registered schema has " + std::to_string(nargs) + " arguments and " + std::to_string(nouts) +
           " returns; the kernel takes " + std::to_string(sizeof...(A)) + " and returns " +
           std::to_string(Ret<R>::count));
    }
    run(fns[I], s, std::index_sequence_for<A...>{});
  }

  template <int... I>
  static constexpr auto table(std::integer_sequence<int, I...>) {
    return std::array<void (*)(StableIValue*, uint64_t, uint64_t), sizeof...(I)>{&boxed<I>...};
  }

  static void (*slot(Fn f))(StableIValue*, uint64_t, uint64_t) {
    static constexpr auto boxes = table(std::make_integer_sequence<int, kSlots>{});
    for (int i = 0; i < used; ++i) {
      if (fns[i] == f) return boxes[i];
    }
    if (used == kSlots) return nullptr;
    fns[used] = f;
    return boxes[used++];
  }
};

template <class R, class... A>
Kernel<R, A...> kernel_of(R (*)(A...));

// The schemas' kinds, from loader/trim.py: {"op", "TTd>T"}, ...
struct Kinds {
  const char* op;
  const char* kinds;
};
#ifdef KLOAD_LIGHT_SCHEMAS
constexpr Kinds kSchemas[] = {KLOAD_LIGHT_SCHEMAS};
#else
constexpr Kinds kSchemas[] = {{"", ""}};
#endif

constexpr bool same(const char* a, const char* b) {
  while (*a && *a == *b) ++a, ++b;
  return *a == *b;
}

// Not constexpr: reached while the name below is checked at compile time, each is the
// error the compiler shows, at the user's m.impl line.
inline void the_kernels_cpp_types_do_not_match_the_kinds_of_its_schema_in_KLOAD_LIGHT_SCHEMAS() {}
inline void m_impl_names_an_op_that_no_m_def_of_this_library_declares() {}

// m.impl's op name, checked when it is compiled against the kernel's C++ types.
template <class Fn>
struct Op {
  const char* name;
  consteval Op(const char* n) : name(n) {  // NOLINT: converts the literal, as std::format_string does
    for (const Kinds& k : kSchemas) {
      if (same(k.op, n)) {
        if (!same(k.kinds, decltype(kernel_of(Fn{}))::kinds.data())) {
          the_kernels_cpp_types_do_not_match_the_kinds_of_its_schema_in_KLOAD_LIGHT_SCHEMAS();
        }
        return;
      }
    }
    m_impl_names_an_op_that_no_m_def_of_this_library_declares();
  }
};

template <class F>
using fn_of = decltype(+std::declval<std::decay_t<F>&>());  // a function, a pointer, a capture-less lambda

class Library {
 public:
  enum Kind { DEF, IMPL, FRAGMENT };  // as torch::Library's, so kernel.h's macros serve both

  Library(Kind kind, const char* ns, std::optional<c10::DispatchKey> key, const char* file, uint32_t line) {
    AOTITorchError err = kind == IMPL  ? aoti_torch_library_init_impl(ns, c10::toString(*key), file, line, &lib_)
                         : kind == DEF ? aoti_torch_library_init_def(ns, file, line, &lib_)
                                       : aoti_torch_library_init_fragment(ns, file, line, &lib_);
    if (err != AOTI_TORCH_SUCCESS) {
      lib_ = nullptr;
      failed(std::string("registering the library at ") + file + " failed" + torch_says());
    }
  }
  Library(const Library&) = delete;
  Library& operator=(const Library&) = delete;
  ~Library() {
    if (lib_) aoti_torch_delete_library_object(lib_);
  }

  Library& def(const char* schema) {
    if (lib_ && aoti_torch_library_def(lib_, schema) != AOTI_TORCH_SUCCESS) {
      failed(std::string("m.def(\"") + schema + "\") failed" + torch_says());
    }
    return *this;
  }

  template <class F>
  Library& impl(Op<fn_of<F>> op_name, F&& f) {
    const char* op = op_name.name;
    fn_of<F> fn = +f;
    using K = decltype(kernel_of(fn));
    if (!lib_) return *this;
    auto boxed = K::slot(fn);
    if (!boxed) {
      failed(std::string("more than 64 kernels of one C++ signature in one file, at m.impl(\"") + op + "\")");
      return *this;
    }
#if TORCH_ABI_VERSION >= ((2ULL << 56) | (10ULL << 48))
    AOTITorchError err = torch_library_impl(lib_, op, boxed, TORCH_ABI_VERSION);
#else
    AOTITorchError err = aoti_torch_library_impl(lib_, op, boxed);
#endif
    if (err != AOTI_TORCH_SUCCESS) failed(std::string("m.impl(\"") + op + "\") failed" + torch_says());
    return *this;
  }

 private:
  TorchLibraryHandle lib_ = nullptr;
};

}  // namespace
}  // namespace light
}  // namespace kload
