// saxpy.cu — device code only, for kload.cuda_module (NVRTC): out = a * x + y.
#include <kload/cuda/live.cuh>

using kload::live::from_acc;
using kload::live::to_acc;

template <typename T>
__global__ void saxpy(T* out, const T* x, const T* y, float a, int64_t n) {
  KLOAD_KERNEL_LOOP(i, n) out[i] = from_acc<T>(a * to_acc(x[i]) + to_acc(y[i]));
}
