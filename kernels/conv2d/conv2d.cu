// conv2d — CUDA: forward, grad_x and grad_w of an NCHW convolution (groups 1,
// dilation 1); fp32 accumulation for half/bfloat16. No torch header: the checks,
// the allocation, the device guard and the stream are conv2d.cpp's glue.
//
// Forward, half / bfloat16 on sm_80+ (KLOAD_KERNELS_IMPL unset or "fast"): an
// implicit GEMM on the matmul's tensor-core tiles (kload/cuda/gemm.cuh):
//   out[p, oc] = sum over k of A[p, k] * W[oc, k], p = (n, oh, ow), k = (i, j, c),
// where A[p, k] = x[n, c, oh*SH - PH + i, ow*SW - PW + j] is never written out: the
// tile loader reads it from x. To make those reads 16-byte copies, x is first
// transposed to NHWC (one pass over x; c is then contiguous for fixed (i, j), so 8
// consecutive k are 16 contiguous bytes) and w to [OC][KH][KW][C], both into a
// workspace the glue allocates (kload_conv2d_workspace). Padding is a zero-filling
// copy. The epilogue adds the bias and writes NCHW directly. Needs C % 8 == 0 (16
// bytes of channels at one (i, j)); other C (a first layer's 3) take the direct
// kernel: an element-loading GEMM variant cost more compile time (2.5 s of ptxas)
// than it would save there.
// Everything else (fp32, fp64, older GPUs, the backward, KLOAD_KERNELS_IMPL=simple):
// the direct kernels below, one thread per output element (forward), per input
// element (grad_x) and per weight (grad_w): readable and exact, not tuned.
#include <kload/cuda/gemm.cuh>
#include <kload/cuda/launch.cuh>

#include "conv2d_geometry.h"

#include <type_traits>

namespace {

using kload::cuda::from_acc;
using kload::cuda::to_acc;
using kload_conv2d::Geometry;

constexpr int kThreads = 256;

template <typename T>
__global__ void conv2d_forward_kernel(const T* __restrict__ x, const T* __restrict__ w, const T* __restrict__ bias,
                                      T* __restrict__ out, Geometry g) {
  using A = kload::cuda::acc_t<T>;
  using kload::cuda::to_acc;
  const int64_t total = g.N * g.OC * g.OH * g.OW;
  KLOAD_KERNEL_LOOP(idx, total) {
    const int64_t ow = idx % g.OW, oh = (idx / g.OW) % g.OH, oc = (idx / (g.OW * g.OH)) % g.OC,
                  n = idx / (g.OW * g.OH * g.OC);
    A sum = bias ? to_acc(bias[oc]) : A(0);
    for (int64_t c = 0; c < g.C; ++c)
      for (int64_t i = 0; i < g.KH; ++i) {
        const int64_t h = oh * g.SH - g.PH + i;
        if (h < 0 || h >= g.H) continue;
        for (int64_t j = 0; j < g.KW; ++j) {
          const int64_t wi = ow * g.SW - g.PW + j;
          if (wi < 0 || wi >= g.W) continue;
          sum += to_acc(x[((n * g.C + c) * g.H + h) * g.W + wi]) *
                 to_acc(w[((oc * g.C + c) * g.KH + i) * g.KW + j]);
        }
      }
    out[idx] = kload::cuda::from_acc<T>(sum);
  }
}

template <typename T>
__global__ void conv2d_grad_x_kernel(const T* __restrict__ grad, const T* __restrict__ w, T* __restrict__ gx, Geometry g) {
  using A = kload::cuda::acc_t<T>;
  using kload::cuda::to_acc;
  const int64_t total = g.N * g.C * g.H * g.W;
  KLOAD_KERNEL_LOOP(idx, total) {
    const int64_t wi = idx % g.W, h = (idx / g.W) % g.H, c = (idx / (g.W * g.H)) % g.C, n = idx / (g.W * g.H * g.C);
    A sum = 0;
    for (int64_t i = 0; i < g.KH; ++i) {
      const int64_t th = h + g.PH - i;
      if (th < 0 || th % g.SH) continue;
      const int64_t oh = th / g.SH;
      if (oh >= g.OH) continue;
      for (int64_t j = 0; j < g.KW; ++j) {
        const int64_t tw = wi + g.PW - j;
        if (tw < 0 || tw % g.SW) continue;
        const int64_t ow = tw / g.SW;
        if (ow >= g.OW) continue;
        for (int64_t oc = 0; oc < g.OC; ++oc)
          sum += to_acc(grad[((n * g.OC + oc) * g.OH + oh) * g.OW + ow]) *
                 to_acc(w[((oc * g.C + c) * g.KH + i) * g.KW + j]);
      }
    }
    gx[idx] = kload::cuda::from_acc<T>(sum);
  }
}

template <typename T>
__global__ void conv2d_grad_w_kernel(const T* __restrict__ grad, const T* __restrict__ x, T* __restrict__ gw, Geometry g) {
  using A = kload::cuda::acc_t<T>;
  using kload::cuda::to_acc;
  const int64_t total = g.OC * g.C * g.KH * g.KW;
  KLOAD_KERNEL_LOOP(idx, total) {
    const int64_t j = idx % g.KW, i = (idx / g.KW) % g.KH, c = (idx / (g.KW * g.KH)) % g.C,
                  oc = idx / (g.KW * g.KH * g.C);
    A sum = 0;
    for (int64_t n = 0; n < g.N; ++n)
      for (int64_t oh = 0; oh < g.OH; ++oh) {
        const int64_t h = oh * g.SH - g.PH + i;
        if (h < 0 || h >= g.H) continue;
        for (int64_t ow = 0; ow < g.OW; ++ow) {
          const int64_t wi = ow * g.SW - g.PW + j;
          if (wi < 0 || wi >= g.W) continue;
          sum += to_acc(grad[((n * g.OC + oc) * g.OH + oh) * g.OW + ow]) *
                 to_acc(x[((n * g.C + c) * g.H + h) * g.W + wi]);
        }
      }
    gw[idx] = kload::cuda::from_acc<T>(sum);
  }
}

// -- the implicit GEMM (half / bfloat16, sm_80+) -----------------------------------

// x[n] as [C][H*W] -> xt[n] as [H*W][C], through 32 x 32 tiles of shared memory (both
// sides coalesced; + 1 column: no bank conflicts reading the tile's columns).
template <typename T>
__global__ void nchw_to_nhwc_kernel(const T* __restrict__ x, T* __restrict__ xt, int64_t C, int64_t HW) {
  __shared__ T tile[32][33];
  const int64_t n = blockIdx.z, c0 = int64_t(blockIdx.y) * 32, s0 = int64_t(blockIdx.x) * 32;
  const T* src = x + n * C * HW;
  T* dst = xt + n * C * HW;
  for (int r = threadIdx.y; r < 32; r += blockDim.y) {  // read rows c, columns s
    const int64_t c = c0 + r, sp = s0 + threadIdx.x;
    if (c < C && sp < HW) tile[r][threadIdx.x] = src[c * HW + sp];
  }
  __syncthreads();
  for (int r = threadIdx.y; r < 32; r += blockDim.y) {  // write rows s, columns c
    const int64_t sp = s0 + r, c = c0 + threadIdx.x;
    if (c < C && sp < HW) dst[sp * C + c] = tile[threadIdx.x][r];
  }
}

// w [OC][C][KH][KW] -> wt [OC][KH][KW][C] (small: one thread per weight)
template <typename T>
__global__ void weight_to_ohwi_kernel(const T* __restrict__ w, T* __restrict__ wt, Geometry g) {
  const int64_t total = g.OC * g.C * g.KH * g.KW;
  KLOAD_KERNEL_LOOP(idx, total) {  // idx in wt's order
    const int64_t c = idx % g.C, j = (idx / g.C) % g.KW, i = (idx / (g.C * g.KW)) % g.KH,
                  oc = idx / (g.C * g.KW * g.KH);
    wt[idx] = w[((oc * g.C + c) * g.KH + i) * g.KW + j];
  }
}

// The GEMM's view of the convolution: M = N*OH*OW pixels, N = OC, K = KH*KW*C, with A
// gathered from the NHWC input and B the [OC][K] weights (k contiguous). Sizes in
// int32 (the launcher checks they fit): the gather's divisions are 32-bit.
template <typename Elem>
struct ConvProblem {
  using T = Elem;
  static constexpr bool kBKContiguous = true;
  const T* x;     // NHWC
  const T* w;     // [OC][KH][KW][C]
  const T* bias;  // [OC] or nullptr
  T* out;         // NCHW
  int64_t M, N, K;
  int C, H, W, KW, SH, SW, PH, PW, OHW, OW;

  struct Row {
    const T* image;  // x's image n, or nullptr past M
    int ih0, iw0;    // the input position of the window's top left corner
  };
  __device__ const T* any() const { return x; }
  __device__ Row a_row(int64_t m) const {
    if (m >= M) return {nullptr, 0, 0};
    const int p = static_cast<int>(m), n = p / OHW, rest = p - n * OHW, oh = rest / OW, ow = rest - oh * OW;
    return {x + int64_t(n) * H * W * C, oh * SH - PH, ow * SW - PW};
  }
  // k = (i * KW + j) * C + c
  __device__ const T* at(const Row& r, int64_t k) const {
    if (!r.image || k >= K) return nullptr;
    const int kk = static_cast<int>(k), ij = kk / C, c = kk - ij * C, i = ij / KW, j = ij - i * KW;
    const int ih = r.ih0 + i, iw = r.iw0 + j;
    return ih >= 0 && ih < H && iw >= 0 && iw < W ? r.image + (int64_t(ih) * W + iw) * C + c : nullptr;
  }
  __device__ const T* a_chunk(const Row& r, int64_t k) const { return at(r, k); }  // C % 8 == 0: one (i, j)
  // (the element-wise path's accessors: gemm_kernel<.., false> is not instantiated for convolutions)
  __device__ T a_at(const Row& r, int64_t k) const {
    const T* q = at(r, k);
    return q ? *q : from_acc<T>(0.f);
  }
  __device__ const T* b_chunk(int64_t oc, int64_t k) const { return oc < N && k < K ? w + oc * K + k : nullptr; }
  __device__ T b_at(int64_t k, int64_t oc) const { return oc < N && k < K ? w[oc * K + k] : from_acc<T>(0.f); }
  __device__ void store(int64_t m, int64_t oc, float v) const {
    if (m >= M || oc >= N) return;
    const int64_t n = m / OHW, rest = m - n * OHW;
    if (bias) v += to_acc(bias[oc]);
    out[(n * N + oc) * OHW + rest] = from_acc<T>(v);
  }
};

// Whether the forward runs as the implicit GEMM: half or bfloat16, C % 8 == 0, the
// fast kernels, sm_80+, and sizes that fit its int32 index math.
bool use_implicit_gemm(int dtype, const Geometry& g) {
  if ((dtype != KLOAD_FLOAT16 && dtype != KLOAD_BFLOAT16) || g.C % 8 != 0) return false;
  if (kload::cuda::kernels_impl() != kload::cuda::Impl::fast || kload::cuda::device_info().cc < 80) return false;
  const int64_t lim = int64_t(1) << 30;
  return g.N * g.OH * g.OW < lim && g.N * g.C * g.H * g.W < lim && g.ckk() < lim && g.OC < lim &&
         g.N < 65536 && (g.C + 31) / 32 < 65536;  // the NHWC transpose's grid: z = N, y = C / 32
}

inline size_t align16(size_t bytes) {
  return (bytes + 15) / 16 * 16;
}

}  // namespace

// The workspace kload_conv2d_cuda needs, in bytes: the NHWC copy of x and the
// reordered weights for the implicit GEMM, else 0.
KLOAD_LAUNCHER const char* kload_conv2d_workspace(int dtype, Geometry g, int64_t* bytes) {
  *bytes = 0;
  const kload::cuda::Impl impl = kload::cuda::kernels_impl();
  if (impl == kload::cuda::Impl::invalid) return KLOAD_KERNELS_IMPL_ERROR;
  if (g.N * g.OC * g.OH * g.OW == 0 || !use_implicit_gemm(dtype, g)) return nullptr;
  *bytes = static_cast<int64_t>(align16(size_t(g.N * g.C * g.H * g.W) * 2) + size_t(g.OC * g.ckk()) * 2);
  return nullptr;
}

// workspace: kload_conv2d_workspace's bytes (16-byte aligned), or nullptr when it said 0
KLOAD_LAUNCHER const char* kload_conv2d_cuda(int dtype, const void* x, const void* w, const void* bias, void* out,
                                             void* workspace, Geometry g, void* stream) {
  const int64_t total = g.N * g.OC * g.OH * g.OW;
  if (total == 0) return nullptr;
  const kload::cuda::Impl impl = kload::cuda::kernels_impl();
  if (impl == kload::cuda::Impl::invalid) return KLOAD_KERNELS_IMPL_ERROR;
  const cudaStream_t s = kload::cuda::stream(stream);
  const bool igemm = workspace != nullptr && use_implicit_gemm(dtype, g);
  const char* error = nullptr;
  const char* launch_error = kload::cuda::dispatch(dtype, [&](auto tag) {
    using T = decltype(tag);
    if (igemm && sizeof(T) == 2) {
      using Elem = typename std::conditional<sizeof(T) == 2, T, __half>::type;  // (never float or double here)
      const Elem* px = static_cast<const Elem*>(x);
      Elem* xt = static_cast<Elem*>(workspace);
      Elem* wt = reinterpret_cast<Elem*>(static_cast<char*>(workspace) + align16(size_t(g.N * g.C * g.H * g.W) * 2));
      const int64_t HW = g.H * g.W;
      nchw_to_nhwc_kernel<Elem><<<dim3(static_cast<unsigned>((HW + 31) / 32), static_cast<unsigned>((g.C + 31) / 32),
                                       static_cast<unsigned>(g.N)),
                                  dim3(32, 8), 0, s>>>(px, xt, g.C, HW);
      const int64_t nw = g.OC * g.ckk();
      weight_to_ohwi_kernel<Elem><<<kload::cuda::blocks_for(nw, kThreads), kThreads, 0, s>>>(
          static_cast<const Elem*>(w), wt, g);
      const ConvProblem<Elem> p{xt, wt, static_cast<const Elem*>(bias), static_cast<Elem*>(out),
                                g.N * g.OH * g.OW, g.OC, g.ckk(),
                                int(g.C), int(g.H), int(g.W), int(g.KW), int(g.SH), int(g.SW), int(g.PH), int(g.PW),
                                int(g.OH * g.OW), int(g.OW)};
      error = kload::cuda::gemm::launch_aligned(p, s);  // C % 8 == 0: every chunk is 16 aligned bytes
      return;
    }
    conv2d_forward_kernel<T><<<kload::cuda::blocks_for(total, kThreads), kThreads, 0, s>>>(
        static_cast<const T*>(x), static_cast<const T*>(w), static_cast<const T*>(bias), static_cast<T*>(out), g);
  });
  return error ? error : launch_error;
}

// grad_x or grad_w may be null (an empty tensor): its kernel is not launched
KLOAD_LAUNCHER const char* kload_conv2d_backward_cuda(int dtype, const void* grad, const void* x, const void* w,
                                                      void* grad_x, void* grad_w, Geometry g, void* stream) {
  const int64_t nx = g.N * g.C * g.H * g.W, nw = g.OC * g.C * g.KH * g.KW;
  return kload::cuda::dispatch(dtype, [&](auto tag) {
    using T = decltype(tag);
    const cudaStream_t s = kload::cuda::stream(stream);
    if (grad_x && nx)
      conv2d_grad_x_kernel<T><<<kload::cuda::blocks_for(nx, kThreads), kThreads, 0, s>>>(
          static_cast<const T*>(grad), static_cast<const T*>(w), static_cast<T*>(grad_x), g);
    if (grad_w && nw)
      conv2d_grad_w_kernel<T><<<kload::cuda::blocks_for(nw, kThreads), kThreads, 0, s>>>(
          static_cast<const T*>(grad), static_cast<const T*>(x), static_cast<T*>(grad_w), g);
  });
}
