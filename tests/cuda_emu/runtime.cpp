// tests/cuda_emu/runtime.cpp — the CUDA runtime functions the shipped launchers
// call, answered by the emulator (emu.h): one device, KLOAD_EMU_SMS multiprocessors
// (4 unless set: small grids, so grid-stride loops go round), compute capability 9.0.
#include "emu.h"

using kload_emu::device;

extern "C" {

cudaError_t cudaGetLastError() {
  const cudaError_t e = device.last_error;
  device.last_error = cudaSuccess;
  return e;
}

const char* cudaGetErrorString(cudaError_t e) {
  switch (e) {
    case cudaSuccess: return "no error";
    case cudaErrorInvalidValue: return "invalid argument";
    case cudaErrorInvalidConfiguration: return "invalid configuration argument";
    default: return "unknown error";
  }
}

cudaError_t cudaGetDevice(int* dev) {
  *dev = 0;
  return cudaSuccess;
}

cudaError_t cudaDeviceGetAttribute(int* value, cudaDeviceAttr attr, int dev) {
  if (dev != 0) return cudaErrorInvalidDevice;
  static const int sms = [] {
    const char* v = std::getenv("KLOAD_EMU_SMS");
    return v && std::atoi(v) > 0 ? std::atoi(v) : 4;
  }();
  switch (attr) {
    case cudaDevAttrMultiProcessorCount: *value = sms; return cudaSuccess;
    case cudaDevAttrComputeCapabilityMajor: *value = device.cc / 10; return cudaSuccess;
    case cudaDevAttrComputeCapabilityMinor: *value = device.cc % 10; return cudaSuccess;
    default: return cudaErrorInvalidValue;
  }
}

cudaError_t cudaFuncSetAttribute(const void* func, cudaFuncAttribute attr, int value) {
  if (attr != cudaFuncAttributeMaxDynamicSharedMemorySize) return cudaErrorInvalidValue;
  if (value < 0 || value > device.max_dynamic_smem) return cudaErrorInvalidValue;
  device.smem_opt_in[func] = value;
  return cudaSuccess;
}

// how many of `what` ran since the last call with reset != 0 ("blocks", "threads",
// "__syncthreads", "cp.async", "ldmatrix.x4", "mma.m16n8k16.bf16", ...): the checks
// assert that the path they meant to test is the one that ran
uint64_t kload_emu_count(const char* what, int reset) {
  uint64_t n = 0;
  const auto it = kload_emu::rt.counts.find(what);
  if (it != kload_emu::rt.counts.end()) n = it->second;
  if (reset) kload_emu::rt.counts.clear();
  return n;
}

}  // extern "C"
