// vector_add — CUDA: one thread per element, grid-stride loop; float, double,
// half and bfloat16 (fp32 math for the half types). No torch header: the checks,
// the allocation, the device guard and the stream are vector_add.cpp's glue.
#include <kload/cuda/launch.cuh>

namespace {

template <typename T>
__global__ void vector_add_kernel(const T* __restrict__ a, const T* __restrict__ b, T* __restrict__ out, int64_t n) {
  using kload::cuda::from_acc;
  using kload::cuda::to_acc;
  KLOAD_KERNEL_LOOP(i, n) out[i] = from_acc<T>(to_acc(a[i]) + to_acc(b[i]));
}

}  // namespace

KLOAD_LAUNCHER const char* kload_vector_add_cuda(int dtype, const void* a, const void* b, void* out, int64_t n,
                                                 void* stream) {
  if (n == 0) return nullptr;
  // the tutorial's section 4.1 passes these the other way round: blocks first, then threads per block
  const int threads = 256;
  const int blocks = kload::cuda::blocks_for(n, threads);
  return kload::cuda::dispatch(dtype, [&](auto tag) {
    using T = decltype(tag);
    vector_add_kernel<T><<<blocks, threads, 0, kload::cuda::stream(stream)>>>(
        static_cast<const T*>(a), static_cast<const T*>(b), static_cast<T*>(out), n);
  });
}
