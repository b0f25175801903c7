// bias_gelu — CUDA: y = gelu(x + bias) (exact, erf-based: F.gelu's default) and its
// backward; float, double, half and bfloat16 (fp32 math for the half types). No
// torch header: the checks, the allocation, the device guard and the stream are
// bias_gelu.cpp's glue.
//
// The math is eager torch's CUDA formula, in libdevice's erf and exp (not the CPU
// kernel's polynomials): gelu(z) = z/2 (1 + erf(z/sqrt 2)), and
// gelu'(z) = Phi(z) + z phi(z). Huge and NaN inputs give what eager gives
// (gelu'(3e38) = 1: z*z overflows, exp(-inf) = 0, z*0 = 0); at the infinities the
// mathematical limits, where eager's formula makes inf * 0 = NaN (finite() below).
//
// The fast kernels are bound by memory. x is viewed as [rows, D], bias is [D]:
//   - a block is (tx, ty) threads: threadIdx.x walks one row's columns, 16 bytes
//     (V elements) per thread where x, bias and the outputs are 16-byte aligned
//     and D % V == 0, one element otherwise; threadIdx.y and the grid's y walk
//     the rows. A thread loads its bias vector once and keeps it in registers for
//     every row it visits: forward reads x once, bias once per thread, writes y
//     once (8 bytes per fp32 element, eager's x + bias then gelu moves 20).
//   - the grid is sized from the SM count (8 blocks of 256 threads per SM).
//   - backward writes grad_x and adds each grad_x value (rounded to T, as eager's
//     sum sees it) to a per-thread column sum in registers. The block then sums
//     its threads' columns in shared memory and writes one partial row per block
//     row (gridDim.y rows of D, fp32 or fp64) to a workspace; a second small
//     kernel adds the partial rows per column, in a fixed order: no atomics, and
//     the same bits every run.
// The simple kernels (KLOAD_KERNELS_IMPL=simple) are the first version: one
// element per thread, bias[i % D], and grad_bias as torch's column sum in the glue.
#include <kload/cuda/launch.cuh>

namespace {

using kload::cuda::acc_t;
using kload::cuda::from_acc;
using kload::cuda::to_acc;

constexpr int kThreads = 256;

// z clamped to the finite range where it multiplies an exact 0 (Phi(-inf), phi(+-inf)):
// the limits gelu(-inf) = 0, gelu'(+inf) = 1, gelu'(-inf) = 0 instead of inf * 0 = NaN,
// as the CPU kernel gives them (a NaN z stays NaN: comparisons with NaN are false)
template <typename A>
__device__ __forceinline__ A finite(A z) {
  const A big = sizeof(A) == 8 ? A(1.7976931348623157e+308) : A(3.40282347e+38f);
  return z > big ? big : z < -big ? -big : z;
}

template <typename A>
__device__ __forceinline__ A gelu(A z) {
  return A(0.5) * finite(z) * (A(1) + erf(z * A(0.70710678118654752440)));
}

template <typename A>
__device__ __forceinline__ A gelu_grad(A z) {  // Phi(z) + z phi(z)
  const A cdf = A(0.5) * (A(1) + erf(z * A(0.70710678118654752440)));
  const A pdf = A(0.39894228040143267794) * exp(A(-0.5) * z * z);
  return cdf + finite(z) * pdf;
}

// V elements of T, loaded and stored as one instruction (16 bytes; V = 1: one element)
template <typename T, int V>
struct alignas(sizeof(T) * V) Pack {
  T v[V];
};

// -- the fast kernels -------------------------------------------------------------

// Thread (tx, ty) of block (bx, by) takes column pack c = bx * blockDim.x + tx and
// rows by * blockDim.y + ty, then every gridDim.y * blockDim.y rows after it.
template <typename T, int V>
__global__ void __launch_bounds__(kThreads) bias_gelu_forward_kernel(const T* __restrict__ x,
                                                                    const T* __restrict__ bias, T* __restrict__ y,
                                                                    int64_t rows, int64_t D) {
  using A = acc_t<T>;
  using P = Pack<T, V>;
  const int64_t c = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (c >= D / V) return;
  const P pb = reinterpret_cast<const P*>(bias)[c];
  A b[V];
#pragma unroll
  for (int e = 0; e < V; ++e) b[e] = to_acc(pb.v[e]);
  const int64_t step = int64_t(gridDim.y) * blockDim.y;
#pragma unroll 2
  for (int64_t r = int64_t(blockIdx.y) * blockDim.y + threadIdx.y; r < rows; r += step) {
    const int64_t i = r * (D / V) + c;  // in packs
    const P px = reinterpret_cast<const P*>(x)[i];
    P py;
#pragma unroll
    for (int e = 0; e < V; ++e) py.v[e] = from_acc<T>(gelu(to_acc(px.v[e]) + b[e]));
    reinterpret_cast<P*>(y)[i] = py;
  }
}

// grad_x = grad * gelu'(x + bias); partial[blockIdx.y, j] = this block's sum of grad_x[:, j].
template <typename T, int V>
__global__ void __launch_bounds__(kThreads) bias_gelu_backward_kernel(
    const T* __restrict__ grad, const T* __restrict__ x, const T* __restrict__ bias, T* __restrict__ grad_x,
    acc_t<T>* __restrict__ partial, int64_t rows, int64_t D) {
  using A = acc_t<T>;
  using P = Pack<T, V>;
  __shared__ A red[kThreads][V];
  const int64_t c = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  const bool valid = c < D / V;  // no early return: the block meets at __syncthreads below
  A sum[V], b[V];
#pragma unroll
  for (int e = 0; e < V; ++e) sum[e] = A(0), b[e] = A(0);
  if (valid) {
    const P pb = reinterpret_cast<const P*>(bias)[c];
#pragma unroll
    for (int e = 0; e < V; ++e) b[e] = to_acc(pb.v[e]);
    const int64_t step = int64_t(gridDim.y) * blockDim.y;
#pragma unroll(sizeof(T) == 8 ? 1 : 2)  // (float64 unrolled twice spills registers on sm_90)
    for (int64_t r = int64_t(blockIdx.y) * blockDim.y + threadIdx.y; r < rows; r += step) {
      const int64_t i = r * (D / V) + c;
      const P pg = reinterpret_cast<const P*>(grad)[i];
      const P px = reinterpret_cast<const P*>(x)[i];
      P pgx;
#pragma unroll
      for (int e = 0; e < V; ++e) {
        pgx.v[e] = from_acc<T>(to_acc(pg.v[e]) * gelu_grad(to_acc(px.v[e]) + b[e]));
        sum[e] += to_acc(pgx.v[e]);  // the rounded value: what eager's column sum adds
      }
      reinterpret_cast<P*>(grad_x)[i] = pgx;
    }
  }
  // the block's rows (threadIdx.y) summed per column, in a fixed order
  const int t = threadIdx.y * blockDim.x + threadIdx.x;
#pragma unroll
  for (int e = 0; e < V; ++e) red[t][e] = sum[e];
  __syncthreads();
  if (threadIdx.y == 0 && valid) {
    for (int ty = 1; ty < blockDim.y; ++ty)
#pragma unroll
      for (int e = 0; e < V; ++e) sum[e] += red[ty * blockDim.x + threadIdx.x][e];
#pragma unroll
    for (int e = 0; e < V; ++e) partial[int64_t(blockIdx.y) * D + c * V + e] = sum[e];
  }
}

// grad_bias[j] = sum over p of partial[p, j], p in order.
template <typename T>
__global__ void __launch_bounds__(kThreads) bias_grad_reduce_kernel(const acc_t<T>* __restrict__ partial,
                                                                   T* __restrict__ grad_bias, int64_t parts,
                                                                   int64_t D) {
  KLOAD_KERNEL_LOOP(j, D) {
    acc_t<T> s = 0;
    for (int64_t p = 0; p < parts; ++p) s += partial[p * D + j];
    grad_bias[j] = from_acc<T>(s);
  }
}

// The fast kernels' launch shape for n elements of rows of D, V elements per thread.
struct Shape {
  dim3 block, grid;
};

Shape shape_for(int64_t n, int64_t D, int V) {
  const int64_t rows = n / D, packs = D / V;
  int tx = 1;
  while (tx < kThreads && tx < packs) tx *= 2;  // a power of two up to 256: whole rows in one block when short
  const int ty = kThreads / tx;
  const int64_t gx = (packs + tx - 1) / tx;
  const int sms = kload::cuda::device_info().sms;
  const int64_t want = std::max<int64_t>(1, (sms > 0 ? int64_t(sms) * 8 : 1024) / std::max<int64_t>(gx, 1));
  const int64_t gy = std::max<int64_t>(1, std::min<int64_t>({(rows + ty - 1) / ty, want, 65535}));
  return {dim3(tx, ty), dim3(static_cast<unsigned>(gx), static_cast<unsigned>(gy))};
}

// The elements per thread: 16 bytes where every pointer allows it, else 1.
template <typename T>
int pack_for(int64_t D, std::initializer_list<const void*> ptrs) {
  constexpr int V = 16 / sizeof(T);
  bool ok = D % V == 0;
  for (const void* p : ptrs) ok = ok && reinterpret_cast<uintptr_t>(p) % 16 == 0;
  return ok ? V : 1;
}

// -- the simple kernels (KLOAD_KERNELS_IMPL=simple) ------------------------------

template <typename T>
__global__ void bias_gelu_forward_simple_kernel(const T* __restrict__ x, const T* __restrict__ bias,
                                                T* __restrict__ y, int64_t n, int64_t D) {
  KLOAD_KERNEL_LOOP(i, n) y[i] = from_acc<T>(gelu(to_acc(x[i]) + to_acc(bias[i % D])));
}

template <typename T>
__global__ void bias_gelu_backward_simple_kernel(const T* __restrict__ grad, const T* __restrict__ x,
                                                 const T* __restrict__ bias, T* __restrict__ grad_x, int64_t n,
                                                 int64_t D) {
  KLOAD_KERNEL_LOOP(i, n) grad_x[i] = from_acc<T>(to_acc(grad[i]) * gelu_grad(to_acc(x[i]) + to_acc(bias[i % D])));
}

}  // namespace

KLOAD_LAUNCHER const char* kload_bias_gelu_cuda(int dtype, const void* x, const void* bias, void* y, int64_t n,
                                                int64_t D, void* stream) {
  if (n == 0 || D == 0) return nullptr;
  const kload::cuda::Impl impl = kload::cuda::kernels_impl();
  if (impl == kload::cuda::Impl::invalid) return KLOAD_KERNELS_IMPL_ERROR;
  const cudaStream_t s = kload::cuda::stream(stream);
  return kload::cuda::dispatch(dtype, [&](auto tag) {
    using T = decltype(tag);
    const T* px = static_cast<const T*>(x);
    const T* pb = static_cast<const T*>(bias);
    T* py = static_cast<T*>(y);
    if (impl == kload::cuda::Impl::simple) {
      bias_gelu_forward_simple_kernel<T><<<kload::cuda::blocks_for(n, kThreads), kThreads, 0, s>>>(px, pb, py, n, D);
      return;
    }
    constexpr int V = 16 / sizeof(T);
    const int v = pack_for<T>(D, {x, bias, y});
    const Shape sh = shape_for(n, D, v);
    if (v == V)
      bias_gelu_forward_kernel<T, V><<<sh.grid, sh.block, 0, s>>>(px, pb, py, n / D, D);
    else
      bias_gelu_forward_kernel<T, 1><<<sh.grid, sh.block, 0, s>>>(px, pb, py, n / D, D);
  });
}

// The workspace kload_bias_gelu_backward_cuda needs, in bytes, for these pointers
// (their alignment picks the kernel, and the kernel its grid). 0 for the simple
// kernels (KLOAD_KERNELS_IMPL=simple), whose grad_bias the glue computes.
KLOAD_LAUNCHER const char* kload_bias_gelu_backward_workspace(int dtype, const void* grad, const void* x,
                                                              const void* bias, const void* grad_x, int64_t n,
                                                              int64_t D, int64_t* bytes) {
  *bytes = 0;
  const kload::cuda::Impl impl = kload::cuda::kernels_impl();
  if (impl == kload::cuda::Impl::invalid) return KLOAD_KERNELS_IMPL_ERROR;
  if (n == 0 || D == 0 || impl == kload::cuda::Impl::simple) return nullptr;
  return kload::cuda::dispatch(dtype, [&](auto tag) {
    using T = decltype(tag);
    const Shape sh = shape_for(n, D, pack_for<T>(D, {grad, x, bias, grad_x}));
    *bytes = int64_t(sh.grid.y) * D * int64_t(sizeof(acc_t<T>));
  });
}

// With a workspace (the bytes kload_bias_gelu_backward_workspace gave, 16-byte
// aligned): the fast kernels, grad_x and grad_bias. Without (nullptr, when it gave
// 0): the simple kernel, grad_x only. The workspace decides, not KLOAD_KERNELS_IMPL
// read again: the glue's grad_bias follows the same decision even if the variable
// changes in between.
KLOAD_LAUNCHER const char* kload_bias_gelu_backward_cuda(int dtype, const void* grad, const void* x, const void* bias,
                                                         void* grad_x, void* grad_bias, void* workspace, int64_t n,
                                                         int64_t D, void* stream) {
  if (n == 0 || D == 0) return nullptr;
  const cudaStream_t s = kload::cuda::stream(stream);
  return kload::cuda::dispatch(dtype, [&](auto tag) {
    using T = decltype(tag);
    using A = acc_t<T>;
    const T* pg = static_cast<const T*>(grad);
    const T* px = static_cast<const T*>(x);
    const T* pb = static_cast<const T*>(bias);
    T* pgx = static_cast<T*>(grad_x);
    if (workspace == nullptr) {
      bias_gelu_backward_simple_kernel<T><<<kload::cuda::blocks_for(n, kThreads), kThreads, 0, s>>>(pg, px, pb, pgx,
                                                                                                 n, D);
      return;
    }
    constexpr int V = 16 / sizeof(T);
    const int v = pack_for<T>(D, {grad, x, bias, grad_x});
    const Shape sh = shape_for(n, D, v);
    A* partial = static_cast<A*>(workspace);
    if (v == V)
      bias_gelu_backward_kernel<T, V><<<sh.grid, sh.block, 0, s>>>(pg, px, pb, pgx, partial, n / D, D);
    else
      bias_gelu_backward_kernel<T, 1><<<sh.grid, sh.block, 0, s>>>(pg, px, pb, pgx, partial, n / D, D);
    bias_grad_reduce_kernel<T><<<kload::cuda::blocks_for_sms(D, kThreads), kThreads, 0, s>>>(
        partial, static_cast<T*>(grad_bias), int64_t(sh.grid.y), D);
  });
}
