// kload/live.h — C++ glue that launches NVRTC-compiled kernels by name.
//
// The glue (an op library: compiled once, with kload's precompiled header) registers the ops;
// the device code lives in a .cu of its own, compiled by NVRTC in ~0.1 s and swapped in place
// on every edit, under the same torch.ops names:
//
//   #include <kload/kernel.h>
//   #include <kload/live.h>
//   static kload::live::Kernel saxpy("saxpy<float>");   // at namespace scope: a name expression
//   at::Tensor saxpy_op(const at::Tensor& x, const at::Tensor& y, double a) {
//     TORCH_CHECK(x.dtype() == at::kFloat && y.dtype() == at::kFloat && x.sizes() == y.sizes());
//     auto xc = x.contiguous(), yc = y.contiguous();
//     auto out = at::empty_like(yc);
//     int64_t n = yc.numel();
//     if (n) saxpy[{(n + 255) / 256, 256}](out, xc, yc, float(a), n);   // [{grid, block(, shared)}]
//     return out;
//   }
//
//   ops = kload.load("saxpy_op.cpp", device_code="saxpy.cu")
//
// After the library loads, kload reads the names declared here, has NVRTC compile them (or
// finds them in the cache), and hands each Kernel its CUkernel and its parameter list. An edit
// of the device code compiles again and hands over the new kernels; the next call launches them.
//
// A launch: a tensor argument is its data pointer, anything else is passed by value. The
// arguments are checked against the kernel's parameters (count, size, float or not) before
// the driver is called, so `a` passed as a double to a `float a` is a TypeError, not a wrong
// answer. The PTX cannot tell more: a pointer and a 64-bit integer, or __half and bfloat16,
// look alike, and the kernel sees raw pointers, so dtypes, contiguity and sizes are the glue's
// to check (as above), as in any CUDA launch. It runs on torch's current stream of the tensors' device, under that device's guard.
// No CUDA header and no CUDA library is needed to compile this: the driver (libcuda) is
// opened at the first launch; a CPU build of torch compiles the glue too.
//
// Stable-ABI glue works the same: include <kload/stable.h> first, then this; a tensor argument
// is a kload::Tensor, and every error is a RuntimeError (the stable ABI has no other kind).
#ifndef KLOAD_LIVE_H_
#define KLOAD_LIVE_H_


#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <string>
#include <type_traits>
#include <vector>

#include "live/abi.h"     // per ABI: the tensor type, errors, guard, stream
#include "live/driver.h"  // the CUDA driver, opened at the first launch

// Everything below is private to the library that includes it (hidden: a second glue library in the
// process, even one in the global symbol scope, has its own registry and code), and the code that
// depends on the ABI lives in an inline namespace of its own (an op library and a stable one never
// share a definition).
#pragma GCC visibility push(hidden)
namespace kload::live {

// The slots: one registry per library, whichever ABI each of its sources uses.
namespace slots {

struct Param {
  char kind;  // 'f' float, 'u'/'s'/'b' integer, pointer or (with more bytes) a struct: from the PTX
  int size;
};

// What one slot launches; published once, never changed or freed (a launch on another thread
// may still hold the previous one).
struct Image {
  void* kernel = nullptr;     // CUkernel, or null: compiled but not loaded (reason says why)
  std::vector<Param> params;  // empty and unchecked when `checked` is false
  bool checked = false;
  std::string where, reason;  // the kernel file's name; why there is no kernel
};

struct Slot {
  std::string name;
  std::atomic<const Image*> image{nullptr};
};

inline std::mutex& registry_mutex() {
  static std::mutex m;
  return m;
}
inline std::vector<Slot*>& registry() {
  static std::vector<Slot*> all;  // never destroyed before the library: slots are leaked on purpose
  return all;
}

}  // namespace slots

inline namespace KLOAD_LIVE_ABI {

struct Dim3 {
  int64_t x = 1, y = 1, z = 1;
  Dim3(int64_t x_ = 1, int64_t y_ = 1, int64_t z_ = 1) : x(x_), y(y_), z(z_) {}  // NOLINT: an int is a Dim3
};

// kernel[{grid, block}] or kernel[{grid, block, shared_bytes}]; grid and block: an int or {x, y, z}.
struct Config {
  Dim3 grid, block;
  int64_t shared = 0;
};

namespace detail {

using slots::Image;
using slots::Param;
using slots::Slot;

// One argument as the launch sees it: kind 'f' (floating point), 'i' (integer, bool, pointer)
// or 's' (a struct by value), its size, and where its bytes are.
struct Arg {
  char kind;
  int size;
  const void* value;
  const TensorType* tensor;
};

template <class T>
Arg describe(const T& v) {
  static_assert(!std::is_array_v<T>, "kload::live: pass a pointer (or a tensor), not an array or a string literal");
  using U = std::decay_t<T>;
  if constexpr (is_tensor<U>) {
    return {'i', 8, nullptr, &v};
  } else if constexpr (std::is_floating_point_v<U>) {
    return {'f', int(sizeof(U)), &v, nullptr};
  } else if constexpr (std::is_integral_v<U> || std::is_enum_v<U> || std::is_pointer_v<U>) {
    return {'i', int(sizeof(U)), &v, nullptr};
  } else {
    static_assert(std::is_trivially_copyable_v<U>, "kload::live: a kernel argument must be a tensor, a number, "
                                                   "a pointer or a trivially copyable struct");
    return {'s', int(sizeof(U)), &v, nullptr};
  }
}

inline std::string param_text(const Param& p) {
  if (p.kind == 'f') return p.size == 4 ? "float" : p.size == 8 ? "double" : std::to_string(p.size) + "-byte float";
  if (p.size > 8 || p.kind == 'b') return std::to_string(p.size) + "-byte value";
  return std::to_string(p.size) + "-byte integer" + (p.size == 8 ? " or pointer" : "");
}

inline std::string arg_text(const Arg& a) {
  if (a.tensor) return "a tensor (its data pointer)";
  if (a.kind == 'f') return a.size == 4 ? "a float" : a.size == 8 ? "a double" : "a floating-point value";
  return "a " + std::to_string(a.size) + (a.kind == 's' ? "-byte struct" : "-byte integer");
}

inline void check_dims(const std::string& name, const char* what, const Dim3& d, const int64_t* top) {
  const int64_t v[3] = {d.x, d.y, d.z};
  for (int i = 0; i < 3; ++i)
    KLOAD_LIVE_CHECK_VALUE(v[i] >= 1 && v[i] <= top[i], "kload: ", name, ": ", what, ".", "xyz"[i], " = ", v[i],
                      "; CUDA allows 1 to ", top[i]);
}

// Checks the arguments against the parameters, finds the device, launches.
inline void launch(const Slot& slot, const Config& c, const Arg* args, size_t n) {
  const Image* img = slot.image.load(std::memory_order_acquire);
  KLOAD_LIVE_CHECK(img, "kload: kernel '", slot.name, "' has no device code: load the glue with kload.load(..., "
              "device_code=\"kernels.cu\"), and declare kload::live::Kernel objects at namespace scope");
  if (img->checked) {
    KLOAD_LIVE_CHECK_TYPE(img->params.size() == n, "kload: ", slot.name, " (", img->where, ") takes ",
                     img->params.size(), " arguments, the launch passes ", n);
    for (size_t i = 0; i < n; ++i) {
      const Param& p = img->params[i];
      KLOAD_LIVE_CHECK_TYPE(args[i].size == p.size && (args[i].kind == 'f') == (p.kind == 'f'), "kload: ", slot.name,
                       " (", img->where, "): argument ", i, " is ", arg_text(args[i]), ", the kernel takes a ",
                       param_text(p), " there (cast it to the kernel's type)");
    }
  }
  const TensorType* first = nullptr;
  for (size_t i = 0; i < n; ++i) {
    const TensorType* t = args[i].tensor;
    if (!t) continue;
    KLOAD_LIVE_CHECK_VALUE(t->is_cuda(), "kload: ", slot.name, ": argument ", i, " is a tensor on ", where(*t),
                           "; the kernel runs on a CUDA device");
    if (!first) first = t;
    KLOAD_LIVE_CHECK_VALUE(same_device(*t, *first), "kload: ", slot.name, ": argument ", i, " is on ", where(*t),
                           " and an earlier one on ", where(*first), "; they must share one device");
  }
  KLOAD_LIVE_CHECK_VALUE(first, "kload: ", slot.name, ": no tensor argument says which CUDA device to launch on");
  KLOAD_LIVE_CHECK(img->kernel, "kload: kernel '", slot.name, "' (", img->where, ") is not loaded: ", img->reason);

  const int device = static_cast<int>(first->get_device());
  Guard guard(device);
  void* stream = current_stream(device);
  const Driver& d = driver();
  ensure_context(d, device);
  if (c.shared > 48 * 1024) {  // more dynamic shared memory than the default needs the kernel's permission
    int dev = 0;
    check(d, d.device_get(&dev, device), "kload: cuDeviceGet");
    const int rc = d.kernel_set_attribute(8 /* CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES */,
                                          int(c.shared), img->kernel, dev);
    if (rc) check(d, rc, "kload: " + slot.name + ": " + std::to_string(c.shared) + " bytes of dynamic shared memory");
  }
  void* cells[16];  // tensors' data pointers
  void* ptrs[16];
  for (size_t i = 0; i < n; ++i) {
    if (args[i].tensor) {
      cells[i] = args[i].tensor->data_ptr();
      ptrs[i] = &cells[i];
    } else {
      ptrs[i] = const_cast<void*>(args[i].value);
    }
  }
  const int rc = d.launch(img->kernel, unsigned(c.grid.x), unsigned(c.grid.y), unsigned(c.grid.z),
                          unsigned(c.block.x), unsigned(c.block.y), unsigned(c.block.z), unsigned(c.shared),
                          stream, n ? ptrs : nullptr, nullptr);
  if (rc)
    check(d, rc, "kload: launching " + slot.name + " (" + img->where + ") with grid (" + std::to_string(c.grid.x) +
                     ", " + std::to_string(c.grid.y) + ", " + std::to_string(c.grid.z) + "), block (" +
                     std::to_string(c.block.x) + ", " + std::to_string(c.block.y) + ", " +
                     std::to_string(c.block.z) + "), " + std::to_string(c.shared) + " shared bytes");
}

}  // namespace detail

// A launch with its configuration checked: call it with the kernel's arguments.
class Launch {
 public:
  Launch(const detail::Slot& slot, const Config& c) : slot_(slot), config_(c) {}
  template <class... A>
  void operator()(const A&... args) const {
    static_assert(sizeof...(A) <= 16, "kload::live: at most 16 kernel arguments");
    const detail::Arg described[sizeof...(A) ? sizeof...(A) : 1] = {detail::describe(args)...};
    detail::launch(slot_, config_, described, sizeof...(A));
  }

 private:
  const detail::Slot& slot_;
  Config config_;
};

// One kernel of the device code, by its name expression ("saxpy", "scale<float>"): declare it at
// namespace scope (kload reads the names once the library is loaded), launch it with k[{grid, block}](args).
class Kernel {
 public:
  explicit Kernel(const char* name_expression) : slot_(new detail::Slot) {
    slot_->name = name_expression;
    std::lock_guard<std::mutex> lock(slots::registry_mutex());
    slots::registry().push_back(slot_);
  }
  Kernel(const Kernel&) = delete;
  Kernel& operator=(const Kernel&) = delete;

  Launch operator[](const Config& c) const {
    static const int64_t grid_max[3] = {(int64_t(1) << 31) - 1, 65535, 65535}, block_max[3] = {1024, 1024, 64};
    detail::check_dims(slot_->name, "grid", c.grid, grid_max);
    detail::check_dims(slot_->name, "block", c.block, block_max);
    const int64_t threads = c.block.x * c.block.y * c.block.z;
    KLOAD_LIVE_CHECK_VALUE(threads <= 1024, "kload: ", slot_->name, ": a block of ", threads,
                      " threads; CUDA allows at most 1024");
    KLOAD_LIVE_CHECK_VALUE(c.shared >= 0 && c.shared <= INT32_MAX, "kload: ", slot_->name, ": shared bytes = ",
                      c.shared);
    return Launch(*slot_, c);
  }
  const std::string& name() const { return slot_->name; }

 private:
  detail::Slot* slot_;  // leaked on purpose: it lives as long as the library
};

}  // namespace KLOAD_LIVE_ABI
}  // namespace kload::live
#pragma GCC visibility pop

// What kload (Python) calls on the loaded library: the names, then one bind per name.
extern "C" {
__attribute__((used, visibility("default"))) inline int kload_live_v1_count() {
  std::lock_guard<std::mutex> lock(kload::live::slots::registry_mutex());
  return int(kload::live::slots::registry().size());
}

__attribute__((used, visibility("default"))) inline const char* kload_live_v1_name(int i) {
  std::lock_guard<std::mutex> lock(kload::live::slots::registry_mutex());
  auto& r = kload::live::slots::registry();
  return i >= 0 && size_t(i) < r.size() ? r[size_t(i)]->name.c_str() : nullptr;
}

// kernel: a CUkernel or null; params: "u8 f4 b16" (kind and bytes, from the PTX), or "?" when
// unknown (no compile); where: the kernel file; reason: why kernel is null. Returns the number
// of slots bound (0: no Kernel has that name).
__attribute__((used, visibility("default"))) inline int kload_live_v1_bind(const char* name, void* kernel,
                                                                           const char* params, const char* where,
                                                                           const char* reason) {
  using namespace kload::live::slots;
  auto* img = new Image;  // never freed: see Image
  img->kernel = kernel;
  img->where = where ? where : "";
  img->reason = reason ? reason : "";
  img->checked = params && std::strcmp(params, "?") != 0;
  for (const char* p = params; img->checked && *p;) {
    while (*p == ' ') ++p;
    if (!*p) break;
    char* end = nullptr;
    const char kind = *p;
    const long size = std::strtol(p + 1, &end, 10);
    img->params.push_back({kind, int(size)});
    p = end;
  }
  std::lock_guard<std::mutex> lock(registry_mutex());
  int bound = 0;
  for (Slot* s : registry())
    if (s->name == name) {
      s->image.store(img, std::memory_order_release);
      ++bound;
    }
  if (!bound) delete img;
  return bound;
}
}

#undef KLOAD_LIVE_CHECK
#undef KLOAD_LIVE_CHECK_TYPE
#undef KLOAD_LIVE_CHECK_VALUE
#undef KLOAD_LIVE_ABI
#endif  // KLOAD_LIVE_H_
