// conv2d — CUDA: direct convolution, one thread per output element (forward),
// per input element (grad_x) and per weight (grad_w); fp32 accumulation for
// half/bfloat16. Readable and exact, not tuned (cuDNN is the fast path). No torch
// header: the checks, the allocation, the device guard and the stream are
// conv2d.cpp's glue.
#include <kload/cuda/launch.cuh>
#include "conv2d_geometry.h"

namespace {

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

}  // namespace

KLOAD_LAUNCHER const char* kload_conv2d_cuda(int dtype, const void* x, const void* w, const void* bias, void* out,
                                             Geometry g, void* stream) {
  const int64_t total = g.N * g.OC * g.OH * g.OW;
  if (total == 0) return nullptr;
  return kload::cuda::dispatch(dtype, [&](auto tag) {
    using T = decltype(tag);
    conv2d_forward_kernel<T><<<kload::cuda::blocks_for(total, kThreads), kThreads, 0, kload::cuda::stream(stream)>>>(
        static_cast<const T*>(x), static_cast<const T*>(w), static_cast<const T*>(bias), static_cast<T*>(out), g);
  });
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
