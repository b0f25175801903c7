// vector_add's CUDA kernel for the op library of vector_add.cpp, written as most CUDA
// users write it: ATen's whole API (<kload/kernel.h>) and ATen's CUDA context in the
// .cu, a template kernel, its launcher with AT_DISPATCH, and KLOAD_IMPL(CUDA, m). Load
// both; CUDA tensors then take this kernel, CPU tensors the .cpp's:
//
//   ops = kload.load("examples/vector_add.cpp", "examples/vector_add_cuda.cu")
//
// kload compiles it in two halves (docs/design.md, "a .cu in two halves"): the launcher
// by g++ with the #include block precompiled, the kernel by nvcc without torch's host
// headers, so an edit of either rebuilds in seconds.
#include <kload/kernel.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>

// --- kernel ---------------------------------------------------------------------------

template <typename scalar_t>
__global__ void vector_add_kernel(const scalar_t* __restrict__ a, const scalar_t* __restrict__ b,
                                  scalar_t* __restrict__ out, int64_t n) {
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n; i += (int64_t)blockDim.x * gridDim.x)
    out[i] = a[i] + b[i];
}

// --- launcher -------------------------------------------------------------------------

at::Tensor vector_add_cuda(const at::Tensor& a, const at::Tensor& b) {
  CHECK_INPUT(a);
  CHECK_INPUT(b);
  TORCH_CHECK(a.sizes() == b.sizes(), "vector_add: a and b must have the same shape, got ", a.sizes(), " and ",
              b.sizes());
  TORCH_CHECK(a.scalar_type() == b.scalar_type(), "vector_add: a and b must have one dtype, got ", a.scalar_type(),
              " and ", b.scalar_type());
  TORCH_CHECK(a.device() == b.device(), "vector_add: a and b must be on one device, got ", a.device(), " and ",
              b.device());
  const c10::cuda::CUDAGuard guard(a.device());
  auto out = at::empty_like(a);
  const int64_t n = a.numel();
  if (n == 0) return out;
  const int threads = 256;
  const int blocks = static_cast<int>(std::min<int64_t>((n + threads - 1) / threads, 65535));
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, a.scalar_type(), "vector_add_cuda", [&] {
    vector_add_kernel<scalar_t><<<blocks, threads, 0, at::cuda::getCurrentCUDAStream()>>>(
        a.data_ptr<scalar_t>(), b.data_ptr<scalar_t>(), out.data_ptr<scalar_t>(), n);
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return out;
}

KLOAD_IMPL(CUDA, m) { m.impl("vector_add", &vector_add_cuda); }
