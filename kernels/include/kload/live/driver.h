// kload/live/driver.h — the CUDA driver API as <kload/live.h> uses it: libcuda opened at the
// first launch (nothing CUDA at build time), every result code checked, and the launch device's
// primary context made current. Included by live.h, after live/abi.h.
#ifndef KLOAD_LIVE_DRIVER_H_
#define KLOAD_LIVE_DRIVER_H_

#include <dlfcn.h>

#include <atomic>
#include <string>

#pragma GCC visibility push(hidden)
namespace kload::live {
inline namespace KLOAD_LIVE_ABI {
namespace detail {

struct Driver {
  int (*launch)(void*, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, void*, void**, void**);
  int (*error_name)(int, const char**);
  int (*error_string)(int, const char**);
  int (*ctx_get_current)(void**);
  int (*ctx_set_current)(void*);
  int (*device_get)(int*, int);
  int (*primary_ctx_retain)(void**, int);
  int (*kernel_set_attribute)(int, int, void*, int);
  std::string error;
};

inline const Driver& driver() {
  static const Driver d = [] {
    Driver out{};
    void* lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
    if (!lib) {
      const char* why = dlerror();
      out.error = std::string("kload: the CUDA driver (libcuda.so.1) cannot be loaded: ") + (why ? why : "?");
      return out;
    }
    auto sym = [&](const char* name) {
      void* p = dlsym(lib, name);
      if (!p && out.error.empty()) out.error = std::string("kload: the CUDA driver has no ") + name;
      return p;
    };
    out.launch = reinterpret_cast<decltype(out.launch)>(sym("cuLaunchKernel"));
    out.error_name = reinterpret_cast<decltype(out.error_name)>(sym("cuGetErrorName"));
    out.error_string = reinterpret_cast<decltype(out.error_string)>(sym("cuGetErrorString"));
    out.ctx_get_current = reinterpret_cast<decltype(out.ctx_get_current)>(sym("cuCtxGetCurrent"));
    out.ctx_set_current = reinterpret_cast<decltype(out.ctx_set_current)>(sym("cuCtxSetCurrent"));
    out.device_get = reinterpret_cast<decltype(out.device_get)>(sym("cuDeviceGet"));
    out.primary_ctx_retain = reinterpret_cast<decltype(out.primary_ctx_retain)>(sym("cuDevicePrimaryCtxRetain"));
    out.kernel_set_attribute = reinterpret_cast<decltype(out.kernel_set_attribute)>(sym("cuKernelSetAttribute"));
    return out;
  }();
  KLOAD_LIVE_CHECK(d.error.empty(), d.error);
  return d;
}

inline void check(const Driver& d, int rc, const std::string& what) {
  if (rc == 0) return;
  const char *name = nullptr, *text = nullptr;
  d.error_name(rc, &name);
  d.error_string(rc, &text);
  KLOAD_LIVE_CHECK(false, what, ": ", name ? name : "CUDA error", ": ", text ? text : std::to_string(rc));
}

// A CUkernel launches in the thread's current context, which must be the launch device's primary
// context (torch's): it is checked at every launch (cuCtxGetCurrent, tens of nanoseconds) and set
// when it is another or none (a thread that made no CUDA call yet, another library's context).
inline void ensure_context(const Driver& d, int device) {
  static std::atomic<void*> primary[64];
  KLOAD_LIVE_CHECK(device >= 0 && device < 64, "kload: CUDA device ", device, " is out of range");
  void* want = primary[device].load(std::memory_order_acquire);
  if (!want) {
    int dev = 0;
    check(d, d.device_get(&dev, device), "kload: cuDeviceGet");
    check(d, d.primary_ctx_retain(&want, dev), "kload: cuDevicePrimaryCtxRetain");  // once per device
    void* none = nullptr;
    if (!primary[device].compare_exchange_strong(none, want)) want = none;
  }
  void* current = nullptr;
  check(d, d.ctx_get_current(&current), "kload: cuCtxGetCurrent");
  if (current != want) check(d, d.ctx_set_current(want), "kload: cuCtxSetCurrent");
}

}  // namespace detail
}  // namespace KLOAD_LIVE_ABI
}  // namespace kload::live
#pragma GCC visibility pop

#endif  // KLOAD_LIVE_DRIVER_H_
