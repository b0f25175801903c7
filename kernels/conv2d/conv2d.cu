// conv2d — CUDA: direct convolution, one thread per output element (forward),
// per input element (grad_x) and per weight (grad_w); fp32 accumulation for
// half/bfloat16. Readable and exact, not tuned (cuDNN is the fast path).
#define KLOAD_LEAN  // nvcc has no precompiled headers: Tensor and the registration API only
#include <kload/kernel.h>
#include "conv2d.h"
#include <kload/cuda/common.cuh>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>

namespace {

using kload_conv2d::Geometry;

template <typename T>
__global__ void conv2d_forward_kernel(const T* __restrict__ x, const T* __restrict__ w, const T* __restrict__ bias,
                                      T* __restrict__ out, Geometry g) {
  using A = kload::cuda::acc_t<T>;
  const int64_t total = g.N * g.OC * g.OH * g.OW;
  CUDA_KERNEL_LOOP_TYPE(idx, total, int64_t) {
    const int64_t ow = idx % g.OW, oh = (idx / g.OW) % g.OH, oc = (idx / (g.OW * g.OH)) % g.OC,
                  n = idx / (g.OW * g.OH * g.OC);
    A sum = bias ? static_cast<A>(bias[oc]) : A(0);
    for (int64_t c = 0; c < g.C; ++c)
      for (int64_t i = 0; i < g.KH; ++i) {
        const int64_t h = oh * g.SH - g.PH + i;
        if (h < 0 || h >= g.H) continue;
        for (int64_t j = 0; j < g.KW; ++j) {
          const int64_t wi = ow * g.SW - g.PW + j;
          if (wi < 0 || wi >= g.W) continue;
          sum += static_cast<A>(x[((n * g.C + c) * g.H + h) * g.W + wi]) *
                 static_cast<A>(w[((oc * g.C + c) * g.KH + i) * g.KW + j]);
        }
      }
    out[idx] = static_cast<T>(sum);
  }
}

template <typename T>
__global__ void conv2d_grad_x_kernel(const T* __restrict__ grad, const T* __restrict__ w, T* __restrict__ gx, Geometry g) {
  using A = kload::cuda::acc_t<T>;
  const int64_t total = g.N * g.C * g.H * g.W;
  CUDA_KERNEL_LOOP_TYPE(idx, total, int64_t) {
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
          sum += static_cast<A>(grad[((n * g.OC + oc) * g.OH + oh) * g.OW + ow]) *
                 static_cast<A>(w[((oc * g.C + c) * g.KH + i) * g.KW + j]);
      }
    }
    gx[idx] = static_cast<T>(sum);
  }
}

template <typename T>
__global__ void conv2d_grad_w_kernel(const T* __restrict__ grad, const T* __restrict__ x, T* __restrict__ gw, Geometry g) {
  using A = kload::cuda::acc_t<T>;
  const int64_t total = g.OC * g.C * g.KH * g.KW;
  CUDA_KERNEL_LOOP_TYPE(idx, total, int64_t) {
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
          sum += static_cast<A>(grad[((n * g.OC + oc) * g.OH + oh) * g.OW + ow]) *
                 static_cast<A>(x[((n * g.C + c) * g.H + h) * g.W + wi]);
        }
      }
    gw[idx] = static_cast<T>(sum);
  }
}

Geometry check(const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& bias,
               at::IntArrayRef stride, at::IntArrayRef padding) {
  CHECK_CUDA(x);
  CHECK_CUDA(w);
  return kload_conv2d::check_conv2d(x, w, bias, stride, padding);
}

constexpr int kThreads = 256;

at::Tensor conv2d_cuda(const at::Tensor& x_in, const at::Tensor& w_in, const std::optional<at::Tensor>& bias_in,
                       at::IntArrayRef stride, at::IntArrayRef padding) {
  const Geometry g = check(x_in, w_in, bias_in, stride, padding);
  const c10::cuda::CUDAGuard guard(x_in.device());
  const at::Tensor x = x_in.contiguous(), w = w_in.contiguous();
  const bool has_bias = bias_in.has_value() && bias_in->defined();
  const at::Tensor bias = has_bias ? bias_in->contiguous() : at::Tensor();
  at::Tensor out = at::empty({g.N, g.OC, g.OH, g.OW}, x.options());
  if (out.numel() == 0) return out;
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "conv2d_cuda", [&] {
    conv2d_forward_kernel<scalar_t><<<kload::cuda::blocks_for(out.numel(), kThreads), kThreads, 0, stream>>>(
        x.const_data_ptr<scalar_t>(), w.const_data_ptr<scalar_t>(),
        has_bias ? bias.const_data_ptr<scalar_t>() : nullptr, out.mutable_data_ptr<scalar_t>(), g);
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return out;
}

std::tuple<at::Tensor, at::Tensor> conv2d_backward_cuda(const at::Tensor& grad_in, const at::Tensor& x_in,
                                                        const at::Tensor& w_in, at::IntArrayRef stride,
                                                        at::IntArrayRef padding) {
  const Geometry g = check(x_in, w_in, std::nullopt, stride, padding);
  CHECK_CUDA(grad_in);
  kload_conv2d::check_conv2d_grad(grad_in, g);
  const c10::cuda::CUDAGuard guard(x_in.device());
  const at::Tensor x = x_in.contiguous(), w = w_in.contiguous(), grad = grad_in.contiguous();
  at::Tensor gx = at::empty_like(x, at::MemoryFormat::Contiguous), gw = at::empty_like(w, at::MemoryFormat::Contiguous);
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "conv2d_backward_cuda", [&] {
    if (gx.numel())
      conv2d_grad_x_kernel<scalar_t><<<kload::cuda::blocks_for(gx.numel(), kThreads), kThreads, 0, stream>>>(
          grad.const_data_ptr<scalar_t>(), w.const_data_ptr<scalar_t>(), gx.mutable_data_ptr<scalar_t>(), g);
    if (gw.numel())
      conv2d_grad_w_kernel<scalar_t><<<kload::cuda::blocks_for(gw.numel(), kThreads), kThreads, 0, stream>>>(
          grad.const_data_ptr<scalar_t>(), x.const_data_ptr<scalar_t>(), gw.mutable_data_ptr<scalar_t>(), g);
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return {gx, gw};
}

}  // namespace

KLOAD_IMPL(CUDA, m) {
  m.impl("conv2d", &conv2d_cuda);
  m.impl("conv2d_backward", &conv2d_backward_cuda);
}
