// kload/live/abi.h — the part of <kload/live.h> that depends on the ABI of the glue: an op library
// (ATen: at::Tensor, c10's guard and stream, TORCH_CHECK) or, after <kload/stable.h>, the stable
// ABI (kload::Tensor, the stable guard, torch's stream looked up at run time, RuntimeError). Each
// lives in an inline namespace of its own, so the two never share a definition. Included by live.h.
#ifndef KLOAD_LIVE_ABI_H_
#define KLOAD_LIVE_ABI_H_

#include <dlfcn.h>

#include <cstdint>
#include <string>
#include <type_traits>

#ifdef KLOAD_STABLE_H_
#define KLOAD_LIVE_ABI stable_v1
#else
#define KLOAD_LIVE_ABI aten_v1
#endif

#ifdef KLOAD_STABLE_H_  // stable-ABI glue (<kload/stable.h> first): its Tensor, guard and errors
#include <torch/csrc/stable/accelerator.h>

#include <sstream>
#include <stdexcept>
namespace kload::live {
inline namespace KLOAD_LIVE_ABI {
namespace detail {
template <class... A>
__attribute__((visibility("hidden"))) std::string cat(const A&... parts) {
  std::ostringstream s;
  (s << ... << parts);
  return s.str();
}
}  // namespace detail
}  // namespace KLOAD_LIVE_ABI
}  // namespace kload::live
// std::runtime_error with kload's message alone (STD_TORCH_CHECK would put this header's file:line first)
#define KLOAD_LIVE_CHECK(cond, ...) \
  do {                              \
    if (!(cond)) throw std::runtime_error(::kload::live::detail::cat(__VA_ARGS__)); \
  } while (0)
#define KLOAD_LIVE_CHECK_TYPE KLOAD_LIVE_CHECK   // the stable ABI raises RuntimeError only
#define KLOAD_LIVE_CHECK_VALUE KLOAD_LIVE_CHECK
#else                   // an op library: ATen's
#include <ATen/core/TensorBase.h>
#include <c10/core/DeviceGuard.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <c10/util/Exception.h>
#define KLOAD_LIVE_CHECK TORCH_CHECK
#define KLOAD_LIVE_CHECK_TYPE TORCH_CHECK_TYPE
#define KLOAD_LIVE_CHECK_VALUE TORCH_CHECK_VALUE
#endif

#pragma GCC visibility push(hidden)
namespace kload::live {
inline namespace KLOAD_LIVE_ABI {
namespace detail {

// What a launch needs of a tensor, the device guard and torch's current stream, per ABI.
#ifdef KLOAD_STABLE_H_
using TensorType = torch::stable::Tensor;
template <class U>
constexpr bool is_tensor = std::is_same_v<U, torch::stable::Tensor>;
inline std::string where(const TensorType& t) { return kload::device_str(t); }
inline bool same_device(const TensorType& a, const TensorType& b) {
  return a.is_cuda() == b.is_cuda() && a.get_device_index() == b.get_device_index();
}
using Guard = torch::stable::accelerator::DeviceGuard;
// aoti_torch_get_current_cuda_stream is in libtorch_cuda, which a glue without .cu sources does not
// link: it is looked up in the process at the first launch (a CPU torch never gets that far).
inline void* current_stream(int index) {
  using Fn = int32_t (*)(int32_t, void**);
  static const Fn fn = [] {
    void* lib = dlopen("libtorch_cuda.so", RTLD_NOW | RTLD_NOLOAD);
    return lib ? reinterpret_cast<Fn>(dlsym(lib, "aoti_torch_get_current_cuda_stream")) : nullptr;
  }();
  KLOAD_LIVE_CHECK(fn, "kload: torch's CUDA library (libtorch_cuda.so) is not loaded in this process");
  void* stream = nullptr;
  KLOAD_LIVE_CHECK(fn(index, &stream) == 0, "kload: no current CUDA stream for device ", index);
  return stream;
}
#else
using TensorType = at::TensorBase;
template <class U>
constexpr bool is_tensor = std::is_base_of_v<at::TensorBase, U>;
inline std::string where(const TensorType& t) { return t.device().str(); }
inline bool same_device(const TensorType& a, const TensorType& b) { return a.device() == b.device(); }
struct Guard {
  c10::DeviceGuard guard;
  explicit Guard(int index) : guard(c10::Device(c10::DeviceType::CUDA, static_cast<c10::DeviceIndex>(index))) {}
};
inline void* current_stream(int index) {
  const auto* impl = c10::impl::getDeviceGuardImpl(c10::DeviceType::CUDA);
  return impl->getStreamNativeHandle(
      impl->getStream(c10::Device(c10::DeviceType::CUDA, static_cast<c10::DeviceIndex>(index))));
}
#endif

}  // namespace detail
}  // namespace KLOAD_LIVE_ABI
}  // namespace kload::live
#pragma GCC visibility pop

#endif  // KLOAD_LIVE_ABI_H_
