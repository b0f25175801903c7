// kload/stable.h — op libraries on PyTorch's stable ABI (torch >= 2.10): about a
// second to compile, and a binary that later torch releases load unchanged.
//
//   #include <kload/stable.h>
//   using kload::Tensor;
//   Tensor scale(const Tensor& x, double a) {
//     KLOAD_CHECK_CPU(x);
//     Tensor out = torch::stable::empty_like(x);
//     ...
//     return out;
//   }
//   KLOAD_LIBRARY(m) { m.def("scale(Tensor x, float a) -> Tensor"); }
//   KLOAD_IMPL(CPU, m) { m.impl("scale", TORCH_BOX(&scale)); }
//
// Only headers of the stable set are included (torch/csrc/stable, torch/headeronly):
// no ATen, no c10, no pybind11, no Python. kload compiles with
// -DTORCH_TARGET_VERSION=<the oldest torch it targets> and checks after each build
// that the library imports no C++ symbol of torch and none of Python's.
//
// Registration happens when kload asks, not when the library is opened: the
// KLOAD_LIBRARY / KLOAD_IMPL blocks are recorded at load time, and kload then
// calls kload_stable_register() with the namespace to use. That lets one cached
// binary serve any namespace, and lets a rebuild whose schemas are unchanged
// register only its kernels under the op names a process already holds
// (torch.ops.<ns>.<op> keeps working and runs the new code).
#ifndef KLOAD_STABLE_H_
#define KLOAD_STABLE_H_

#include <torch/csrc/stable/library.h>
#include <torch/csrc/stable/ops.h>
#include <torch/csrc/stable/tensor.h>
#include <torch/headeronly/core/Dispatch_v2.h>
#include <torch/headeronly/core/ScalarType.h>
#include <torch/headeronly/util/Exception.h>

#include <array>
#include <cstdint>
#include <cstring>
#include <exception>
#include <optional>
#include <string_view>
#include <tuple>
#include <type_traits>
#include <sstream>
#include <string>
#include <vector>

#define KLOAD_HIDDEN __attribute__((visibility("hidden")))

namespace kload {

using Tensor = torch::stable::Tensor;
using ScalarType = torch::headeronly::ScalarType;

// "[2, 3]": for messages.
inline std::string shape_str(const Tensor& t) {
  std::ostringstream s;
  s << '[';
  for (int64_t i = 0; i < t.dim(); ++i) s << (i ? ", " : "") << t.size(i);
  s << ']';
  return s.str();
}

inline std::string device_str(const Tensor& t) {
  if (t.is_cpu()) return "cpu";
  if (t.is_cuda()) return "cuda:" + std::to_string(static_cast<int>(t.get_device()));
  int32_t type = 0;
  if (aoti_torch_get_device_type(t.get(), &type) == AOTI_TORCH_SUCCESS && type == aoti_torch_device_type_meta())
    return "meta";
  return "device " + std::to_string(static_cast<int>(t.get_device()));
}

namespace detail {

enum class Kind : int { DEF = 0, FRAGMENT = 1, IMPL = 2 };

class Library;
using InitFn = void (*)(Library&);
using BoxedFn = void (*)(StableIValue*, uint64_t, uint64_t);

// -- TORCH_BOX with its C++ types kept --------------------------------------------------
// torch's boxer reads each StableIValue as the kernel's C++ type says: an int64_t kernel
// for a `float` argument reads a double's bits as an integer, a Tensor for a `float`
// dereferences them as a handle. kload's TORCH_BOX is the same boxer and also says what
// the kernel takes; kload compares that with the schema before it registers anything.

// A C++ parameter or return type as torch prints a schema's type ("" : not compared).
template <class T>
struct SchemaType {
  static constexpr const char* name = "";
};
#define KLOAD_SCHEMA_TYPE_(T, text)              \
  template <>                                    \
  struct SchemaType<T> {                         \
    static constexpr const char* name = text;    \
  };
KLOAD_SCHEMA_TYPE_(torch::stable::Tensor, "Tensor")
KLOAD_SCHEMA_TYPE_(std::optional<torch::stable::Tensor>, "Optional[Tensor]")
KLOAD_SCHEMA_TYPE_(int64_t, "int")
KLOAD_SCHEMA_TYPE_(std::optional<int64_t>, "Optional[int]")
KLOAD_SCHEMA_TYPE_(double, "float")
KLOAD_SCHEMA_TYPE_(std::optional<double>, "Optional[float]")
KLOAD_SCHEMA_TYPE_(bool, "bool")
KLOAD_SCHEMA_TYPE_(std::optional<bool>, "Optional[bool]")
KLOAD_SCHEMA_TYPE_(torch::headeronly::ScalarType, "int")
KLOAD_SCHEMA_TYPE_(std::vector<int64_t>, "List[int]")
KLOAD_SCHEMA_TYPE_(torch::headeronly::HeaderOnlyArrayRef<int64_t>, "List[int]")
KLOAD_SCHEMA_TYPE_(std::string_view, "str")
KLOAD_SCHEMA_TYPE_(std::string, "str")
#undef KLOAD_SCHEMA_TYPE_

template <class T>
using bare_t = std::remove_cv_t<std::remove_reference_t<T>>;

template <class R>
struct Returns {
  static std::string text() { return SchemaType<bare_t<R>>::name; }
};
template <>
struct Returns<void> {
  static std::string text() { return ""; }
};
template <class... R>
struct Returns<std::tuple<R...>> {
  static std::string text() {
    std::string out;
    ((out += (out.empty() ? "" : ",") + std::string(SchemaType<bare_t<R>>::name)), ...);
    return out;
  }
};

template <class F>
struct Signature;
template <class R, class... A>
struct Signature<R(A...)> {
  // "Tensor,float>Tensor": the arguments, then the returns
  static std::string text() {
    std::string out;
    bool first = true;
    ((out += (first ? "" : ","), out += SchemaType<bare_t<A>>::name, first = false), ...);
    return out + ">" + Returns<R>::text();
  }
};

template <class FuncT, FuncT* func>
struct Boxed {
  operator BoxedFn() const { return &torch::stable::detail::boxer<FuncT, func>::boxed_fn; }  // NOLINT: as torch's
  static std::string types() { return Signature<FuncT>::text(); }
};

struct Block {
  Kind kind;
  const char* key;  // dispatch key of an IMPL block ("CPU", "CUDA", "Meta", ...)
  InitFn init;
  const char* file;
  uint32_t line;
};

// One registry per library binary (hidden: two builds loaded in one process never share it).
KLOAD_HIDDEN inline std::vector<Block>& blocks() {
  static std::vector<Block> b;
  return b;
}

struct Record {
  Record(Kind kind, const char* key, InitFn init, const char* file, uint32_t line) {
    blocks().push_back(Block{kind, key, init, file, line});
  }
};

// What a KLOAD_LIBRARY / KLOAD_IMPL block receives as `m`. It either registers
// (with the stable C shim, checking every error code) or only describes what it
// would register, so that kload can compare schemas before touching the dispatcher.
class Library {
 public:
  Library(TorchLibraryHandle lib, std::string* describe, const char* key)
      : lib_(lib), describe_(describe), key_(key) {}

  Library& def(const char* schema) {
    if (describe_) {
      *describe_ += std::string("def\t") + schema + "\n";
    } else if (aoti_torch_library_def(lib_, schema) != AOTI_TORCH_SUCCESS) {
      STD_TORCH_CHECK(false, "could not register the schema \"", schema, "\"");
    }
    return *this;
  }

  template <class FuncT, FuncT* func>
  Library& impl(const char* name, Boxed<FuncT, func> boxed) {
    return impl(name, static_cast<BoxedFn>(boxed), Boxed<FuncT, func>::types());
  }

  Library& impl(const char* name, BoxedFn fn, const std::string& types = "") {
    if (describe_) {
      *describe_ += std::string("impl\t") + (key_ ? key_ : "") + "\t" + name + "\t" + types + "\n";
      return *this;
    }
#if TORCH_FEATURE_VERSION >= TORCH_VERSION_2_10_0
    const AOTITorchError err = torch_library_impl(lib_, name, fn, TORCH_ABI_VERSION);
#else
    const AOTITorchError err = aoti_torch_library_impl(lib_, name, fn);
#endif
    STD_TORCH_CHECK(err == AOTI_TORCH_SUCCESS, "could not register the ", key_ ? key_ : "", " kernel of ", name);
    return *this;
  }

 private:
  TorchLibraryHandle lib_;
  std::string* describe_;
  const char* key_;
};

// Library objects live as long as the process: the dispatcher refers to them.
KLOAD_HIDDEN inline std::vector<TorchLibraryHandle>& handles() {
  static std::vector<TorchLibraryHandle> h;
  return h;
}

KLOAD_HIDDEN inline std::string& text() {
  static std::string t;
  return t;
}

}  // namespace detail
}  // namespace kload

// TORCH_BOX(&fn): torch's boxer, with fn's C++ types kept for the check above (it still
// converts to the boxed function pointer torch's own StableLibrary::impl takes).
#ifdef TORCH_BOX
#undef TORCH_BOX
#endif
#define TORCH_BOX(func) \
  ::kload::detail::Boxed<std::remove_pointer_t<std::remove_reference_t<decltype(func)>>, (func)> {}

// -- the entry points kload calls (through ctypes) after opening the library ------

// The stable ABI version this binary was compiled for (TORCH_FEATURE_VERSION).
extern "C" __attribute__((used, visibility("default"))) inline uint64_t kload_stable_target() {
  return static_cast<uint64_t>(TORCH_FEATURE_VERSION);
}

// "def\t<schema>" and "impl\t<key>\t<op>\t<types>" lines: what registering would do
// (types: "Tensor,float>Tensor" as TORCH_BOX saw the kernel, "" for another boxed function).
extern "C" __attribute__((used, visibility("default"))) inline const char* kload_stable_describe() {
  using namespace kload::detail;
  std::string& out = text();
  out.clear();
  try {
    for (const Block& b : blocks()) {
      Library m(nullptr, &out, b.kind == Kind::IMPL ? b.key : nullptr);
      b.init(m);
    }
  } catch (const std::exception& e) {
    out = std::string("error\t") + e.what() + "\n";
  } catch (...) {
    out = "error\tunknown exception\n";
  }
  return out.c_str();
}

// Register the recorded blocks under namespace `ns`; with impl_only, only the
// KLOAD_IMPL blocks (the schemas are already registered there). Returns nullptr,
// or the error (no exception crosses into Python).
extern "C" __attribute__((used, visibility("default"))) inline const char* kload_stable_register(
    const char* ns, int impl_only) {
  using namespace kload::detail;
  std::string& err = text();
  try {
    bool defined = false;
    for (const Block& b : blocks()) {
      if (impl_only && b.kind != Kind::IMPL) continue;
      TorchLibraryHandle lib = nullptr;
      AOTITorchError rc;
      if (b.kind == Kind::IMPL) {
        rc = aoti_torch_library_init_impl(ns, b.key, b.file, b.line, &lib);
      } else if (b.kind == Kind::DEF && !defined) {
        rc = aoti_torch_library_init_def(ns, b.file, b.line, &lib);
        defined = true;
      } else {
        rc = aoti_torch_library_init_fragment(ns, b.file, b.line, &lib);
      }
      if (rc != AOTI_TORCH_SUCCESS || lib == nullptr) {
        err = std::string(b.file) + ":" + std::to_string(b.line) + ": could not open the library block for "
              "namespace " + ns;
        return err.c_str();
      }
      handles().push_back(lib);
      Library m(lib, nullptr, b.kind == Kind::IMPL ? b.key : nullptr);
      try {
        b.init(m);
      } catch (const std::exception& e) {
        err = std::string(b.file) + ":" + std::to_string(b.line) + ": " + e.what();
        return err.c_str();
      }
    }
  } catch (const std::exception& e) {
    err = e.what();
    return err.c_str();
  } catch (...) {
    err = "unknown exception while registering";
    return err.c_str();
  }
  return nullptr;
}

#define KLOAD_CONCAT_(a, b) a##b
#define KLOAD_CONCAT(a, b) KLOAD_CONCAT_(a, b)

#define KLOAD_STABLE_BLOCK_(kind, key, m, uid)                                                     \
  static void KLOAD_CONCAT(uid, _init)(::kload::detail::Library&);                                 \
  static const ::kload::detail::Record KLOAD_CONCAT(uid, _rec)(::kload::detail::Kind::kind, key,    \
                                                               &KLOAD_CONCAT(uid, _init), __FILE__, \
                                                               __LINE__);                           \
  static void KLOAD_CONCAT(uid, _init)(::kload::detail::Library & m)

// The library's schemas: m.def("op(Tensor x) -> Tensor"). KLOAD_FRAGMENT for more blocks.
#define KLOAD_LIBRARY(m) KLOAD_STABLE_BLOCK_(DEF, nullptr, m, KLOAD_CONCAT(kload_def_, __COUNTER__))
#define KLOAD_FRAGMENT(m) KLOAD_STABLE_BLOCK_(FRAGMENT, nullptr, m, KLOAD_CONCAT(kload_frag_, __COUNTER__))
// Kernels for one dispatch key (CPU, CUDA, Meta, CompositeExplicitAutograd, ...):
// m.impl("op", TORCH_BOX(&fn)).
#define KLOAD_IMPL(k, m) KLOAD_STABLE_BLOCK_(IMPL, #k, m, KLOAD_CONCAT(kload_impl_##k##_, __COUNTER__))

// -- input checks, with the messages a user needs (a RuntimeError in Python) ------
#define KLOAD_CHECK(cond, ...) STD_TORCH_CHECK(cond, __VA_ARGS__)
#define KLOAD_CHECK_CPU(x) STD_TORCH_CHECK((x).is_cpu(), #x " must be a CPU tensor, got one on ", ::kload::device_str(x))
#define KLOAD_CHECK_CUDA(x) \
  STD_TORCH_CHECK((x).is_cuda(), #x " must be a CUDA tensor, got one on ", ::kload::device_str(x))
#define KLOAD_CHECK_CONTIGUOUS(x) STD_TORCH_CHECK((x).is_contiguous(), #x " must be contiguous")
#define KLOAD_CHECK_DTYPE(x, dtype)                                                                     \
  STD_TORCH_CHECK((x).scalar_type() == (dtype), #x " must be ", ::torch::headeronly::toString(dtype), \
                  ", got ", ::torch::headeronly::toString((x).scalar_type()))
#define KLOAD_CHECK_DIM(x, n) \
  STD_TORCH_CHECK((x).dim() == (n), #x " must have ", n, " dimensions, got shape ", ::kload::shape_str(x))
// the classic names, for code moved from <torch/extension.h>
#ifndef CHECK_CUDA
#define CHECK_CUDA(x) KLOAD_CHECK_CUDA(x)
#endif
#ifndef CHECK_CONTIGUOUS
#define CHECK_CONTIGUOUS(x) KLOAD_CHECK_CONTIGUOUS(x)
#endif
#ifndef CHECK_INPUT
#define CHECK_INPUT(x)                                                 \
  do {                                                                 \
    STD_TORCH_CHECK((x).defined(), #x " must be a defined tensor");    \
    KLOAD_CHECK_CONTIGUOUS(x);                                         \
  } while (0)
#endif

namespace kload {

// a and b: same device, dtype and shape (one message per mistake).
inline void check_same(const Tensor& a, const Tensor& b, const char* op) {
  STD_TORCH_CHECK(a.is_cpu() == b.is_cpu() && a.get_device() == b.get_device(), op,
                  ": inputs must be on the same device, got ", device_str(a), " and ", device_str(b));
  STD_TORCH_CHECK(a.scalar_type() == b.scalar_type(), op, ": inputs must have the same dtype, got ",
                  torch::headeronly::toString(a.scalar_type()), " and ",
                  torch::headeronly::toString(b.scalar_type()));
  bool same = a.dim() == b.dim();
  for (int64_t i = 0; same && i < a.dim(); ++i) same = a.size(i) == b.size(i);
  STD_TORCH_CHECK(same, op, ": inputs must have the same shape, got ", shape_str(a), " and ", shape_str(b));
}

}  // namespace kload

namespace kload {

// -- allocation fast paths -------------------------------------------------------
// Each torch::stable op is a boxed dispatcher call looked up by name:
// torch::stable::new_empty costs ~4 us on a 2-core VM, where the classic API's
// at::empty_like costs ~1.5 us. These two skip the dispatcher.


// x itself when it is contiguous (no call at all: at::Tensor::contiguous checks
// first too), a contiguous copy otherwise.
inline Tensor as_contiguous(const Tensor& x) { return x.is_contiguous() ? x : torch::stable::contiguous(x); }

// An uninitialized contiguous tensor of `sizes` with x's dtype and device (what
// torch::stable::new_empty(x, sizes) gives), through the stable C shim's
// aoti_torch_empty_strided: on the CPU that is at::detail::empty_strided_cpu, no
// dispatcher; elsewhere (CUDA, Meta) at::empty_strided on x's device.
inline Tensor empty(const Tensor& x, torch::headeronly::IntHeaderOnlyArrayRef sizes) {
  constexpr size_t kMaxDims = 16;
  if (sizes.size() > kMaxDims) return torch::stable::new_empty(x, sizes);
  std::array<int64_t, kMaxDims> strides;
  int64_t stride = 1;
  for (size_t i = sizes.size(); i-- > 0;) {
    strides[i] = stride;
    stride *= sizes[i] > 1 ? sizes[i] : 1;  // torch's contiguous strides: a size 0 or 1 counts as 1
  }
  int32_t dtype = 0, device_type = 0, device_index = 0;
  STD_TORCH_CHECK(aoti_torch_get_dtype(x.get(), &dtype) == AOTI_TORCH_SUCCESS &&
                      aoti_torch_get_device_type(x.get(), &device_type) == AOTI_TORCH_SUCCESS &&
                      aoti_torch_get_device_index(x.get(), &device_index) == AOTI_TORCH_SUCCESS,
                  "kload::empty: could not read the tensor's dtype and device");
  AtenTensorHandle out = nullptr;
  STD_TORCH_CHECK(aoti_torch_empty_strided(static_cast<int64_t>(sizes.size()), sizes.data(), strides.data(), dtype,
                                           device_type, device_index, &out) == AOTI_TORCH_SUCCESS,
                  "kload::empty: could not allocate a tensor of ", sizes.size(), " dimensions on ", device_str(x));
  return Tensor(out);
}

// empty(x, x.sizes()): a contiguous tensor shaped, typed and placed like x.
inline Tensor empty_like(const Tensor& x) { return empty(x, x.sizes()); }

}  // namespace kload

// -- CUDA, from the .cpp glue (g++, no CUDA header) ------------------------------
// A stable CUDA op is two files: <op>.cu holds the kernels and an extern "C"
// launcher and includes no torch header (nvcc compiles it in ~1 s); <op>.cpp checks
// the inputs, allocates, and calls the launcher on the current stream under a
// device guard. kload defines KLOAD_WITH_CUDA for the .cpp when the .cu is built.
#ifdef KLOAD_WITH_CUDA
#include <torch/csrc/stable/accelerator.h>
extern "C" AOTITorchError aoti_torch_get_current_cuda_stream(int32_t device_index, void** ret_stream);

namespace kload {

// Makes x's GPU current for this scope (torch's device guard).
using DeviceGuard = torch::stable::accelerator::DeviceGuard;

// The current CUDA stream of x's device, as the cudaStream_t a launcher takes.
inline void* cuda_stream(const Tensor& x) {
  void* stream = nullptr;
  STD_TORCH_CHECK(aoti_torch_get_current_cuda_stream(x.get_device_index(), &stream) == AOTI_TORCH_SUCCESS,
                  "could not get the current CUDA stream of ", device_str(x));
  return stream;
}

}  // namespace kload

// A launcher returns nullptr, or the CUDA error string of its launch.
#define KLOAD_CHECK_LAUNCH(call)                                              \
  do {                                                                        \
    const char* kload_launch_error_ = (call);                                 \
    STD_TORCH_CHECK(kload_launch_error_ == nullptr, #call ": CUDA error: ", \
                    kload_launch_error_ ? kload_launch_error_ : "");          \
  } while (0)
#endif  // KLOAD_WITH_CUDA

// Dtype dispatch over the headeronly ScalarType: `scalar_t` inside the body.
//   KLOAD_DISPATCH_FLOATING(x.scalar_type(), "op", [&] { kernel<scalar_t>(...); });
#define KLOAD_DISPATCH_FLOATING(type, name, ...) THO_DISPATCH_V2(type, name, AT_WRAP(__VA_ARGS__), AT_FLOATING_TYPES)
#define KLOAD_DISPATCH_FLOATING_AND_HALF(type, name, ...)                                           \
  THO_DISPATCH_V2(type, name, AT_WRAP(__VA_ARGS__), AT_FLOATING_TYPES, torch::headeronly::ScalarType::Half, \
                  torch::headeronly::ScalarType::BFloat16)

#endif  // KLOAD_STABLE_H_
