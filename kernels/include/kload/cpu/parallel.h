// kload/cpu/parallel.h — OpenMP loops on the runtime torch already loaded, with
// torch's thread count (torch.set_num_threads / get_num_threads), read through the
// stable ABI (torch 2.10 and later): no ATen header.
#pragma once

#include <omp.h>
#include <torch/csrc/stable/ops.h>

#include <algorithm>
#include <cstdint>

namespace kload {
namespace cpu {

// torch.get_num_threads()
inline int num_threads() { return static_cast<int>(torch::stable::get_num_threads()); }

// f(begin, end) on contiguous chunks of [0, n), one per thread; serial below `grain`.
template <typename F>
inline void parallel_chunks(int64_t n, int64_t grain, const F& f) {
  const int threads = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(num_threads(), n / std::max<int64_t>(grain, 1))));
  if (threads <= 1 || omp_in_parallel()) {
    f(int64_t(0), n);
    return;
  }
#pragma omp parallel num_threads(threads)
  {
    const int64_t t = omp_get_thread_num(), nt = omp_get_num_threads();
    const int64_t begin = n * t / nt, end = n * (t + 1) / nt;
    if (begin < end) f(begin, end);
  }
}

}  // namespace cpu
}  // namespace kload
