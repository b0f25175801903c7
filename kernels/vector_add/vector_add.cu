// vector_add — CUDA: out = a + b; float, double, half and bfloat16 (fp32 math for
// the half types). No torch header: the checks, the allocation, the device guard
// and the stream are vector_add.cpp's glue.
//
// The fast kernel is bound by memory: 12 bytes move per fp32 element, and the
// goal is the device's copy bandwidth. So:
//   - 16-byte loads and stores (float4, 8 halves, 2 doubles): a quarter of the
//     memory instructions of scalar code. They need the three pointers to share
//     their offset modulo 16; the first `head` elements (up to the next 16-byte
//     boundary: a tensor sliced at an odd element) and the last ones (the tail)
//     are added one at a time.
//   - each thread issues kUnroll independent 16-byte loads of a and of b before it
//     adds and stores them: more bytes in flight per thread;
//   - a grid sized from the SM count (8 blocks of 256 threads per SM: full
//     occupancy), each thread looping over the vectors (grid-stride), instead of
//     one thread per element and n / 256 blocks.
// The simple kernel (KLOAD_KERNELS_IMPL=simple) is the first version: one element
// per thread, grid-stride.
#include <kload/cuda/launch.cuh>

namespace {

using kload::cuda::from_acc;
using kload::cuda::to_acc;

constexpr int kThreads = 256;
constexpr int kUnroll = 4;  // 16-byte vectors per thread per iteration

// 16 bytes of T, loaded and stored as one instruction
template <typename T>
struct alignas(16) Vec16 {
  static constexpr int kSize = 16 / sizeof(T);
  T v[kSize];
};

template <typename T>
__device__ __forceinline__ Vec16<T> add(const Vec16<T>& a, const Vec16<T>& b) {
  Vec16<T> r;
#pragma unroll
  for (int e = 0; e < Vec16<T>::kSize; ++e) r.v[e] = from_acc<T>(to_acc(a.v[e]) + to_acc(b.v[e]));
  return r;
}

// Elements [0, head) and [head + 16-byte vectors, n) one by one; the vectors in
// between 16 bytes at a time. a + head, b + head and out + head are 16-byte aligned.
template <typename T>
__global__ void __launch_bounds__(kThreads) vector_add_vec_kernel(const T* __restrict__ a, const T* __restrict__ b,
                                                                 T* __restrict__ out, int64_t n, int64_t head) {
  using V = Vec16<T>;
  const int64_t tid = int64_t(blockIdx.x) * blockDim.x + threadIdx.x, stride = int64_t(blockDim.x) * gridDim.x;
  const int64_t nvec = (n - head) / V::kSize;
  const V* va = reinterpret_cast<const V*>(a + head);
  const V* vb = reinterpret_cast<const V*>(b + head);
  V* vo = reinterpret_cast<V*>(out + head);
  int64_t i = tid;
  for (; i + (kUnroll - 1) * stride < nvec; i += kUnroll * stride) {
    V x[kUnroll], y[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) x[u] = va[i + u * stride];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) y[u] = vb[i + u * stride];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) vo[i + u * stride] = add(x[u], y[u]);
  }
  for (; i < nvec; i += stride) vo[i] = add(va[i], vb[i]);
  // the head and the tail: fewer than 2 * 16 bytes' worth, one element per thread
  const int64_t tail0 = head + nvec * V::kSize, rest = head + (n - tail0);
  for (int64_t j = tid; j < rest; j += stride) {
    const int64_t e = j < head ? j : tail0 + (j - head);
    out[e] = from_acc<T>(to_acc(a[e]) + to_acc(b[e]));
  }
}

// Any alignment: one element per thread per iteration, same SM-sized grid.
template <typename T>
__global__ void __launch_bounds__(kThreads) vector_add_scalar_kernel(const T* __restrict__ a,
                                                                    const T* __restrict__ b, T* __restrict__ out,
                                                                    int64_t n) {
  KLOAD_KERNEL_LOOP(i, n) out[i] = from_acc<T>(to_acc(a[i]) + to_acc(b[i]));
}

// The first version (KLOAD_KERNELS_IMPL=simple): the same loop, n / 256 blocks.
template <typename T>
__global__ void vector_add_simple_kernel(const T* __restrict__ a, const T* __restrict__ b, T* __restrict__ out,
                                         int64_t n) {
  KLOAD_KERNEL_LOOP(i, n) out[i] = from_acc<T>(to_acc(a[i]) + to_acc(b[i]));
}

}  // namespace

KLOAD_LAUNCHER const char* kload_vector_add_cuda(int dtype, const void* a, const void* b, void* out, int64_t n,
                                                 void* stream) {
  if (n == 0) return nullptr;
  const kload::cuda::Impl impl = kload::cuda::kernels_impl();
  if (impl == kload::cuda::Impl::invalid) return KLOAD_KERNELS_IMPL_ERROR;
  const cudaStream_t s = kload::cuda::stream(stream);
  return kload::cuda::dispatch(dtype, [&](auto tag) {
    using T = decltype(tag);
    const T* pa = static_cast<const T*>(a);
    const T* pb = static_cast<const T*>(b);
    T* po = static_cast<T*>(out);
    if (impl == kload::cuda::Impl::simple) {
      // the tutorial's section 4.1 passes these the other way round: blocks first, then threads per block
      vector_add_simple_kernel<T><<<kload::cuda::blocks_for(n, kThreads), kThreads, 0, s>>>(pa, pb, po, n);
      return;
    }
    const uintptr_t offset = reinterpret_cast<uintptr_t>(pa) % 16;
    const bool same_offset = reinterpret_cast<uintptr_t>(pb) % 16 == offset &&
                             reinterpret_cast<uintptr_t>(po) % 16 == offset && offset % sizeof(T) == 0;
    if (same_offset) {
      const int64_t head = std::min<int64_t>(n, static_cast<int64_t>((16 - offset) % 16 / sizeof(T)));
      const int64_t vectors = (n - head) / Vec16<T>::kSize;
      const int blocks = kload::cuda::blocks_for_sms(std::max<int64_t>(1, vectors), kThreads);
      vector_add_vec_kernel<T><<<blocks, kThreads, 0, s>>>(pa, pb, po, n, head);
    } else {  // e.g. a sliced at an odd element, b and out freshly allocated
      vector_add_scalar_kernel<T><<<kload::cuda::blocks_for_sms(n, kThreads), kThreads, 0, s>>>(pa, pb, po, n);
    }
  });
}
