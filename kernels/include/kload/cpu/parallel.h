// kload/cpu/parallel.h — parallel loops with torch's thread count (torch.set_num_threads /
// get_num_threads), read through the stable ABI (torch 2.10 and later): no ATen header.
// Under -fopenmp (g++): OpenMP on the runtime torch already loaded (libgomp), so a process has
// one. Without it (clang, whose -fopenmp would link LLVM's libomp beside torch's libgomp: build
// with -fopenmp-simd): torch's own thread pool, through torch::stable::parallel_for.
#pragma once

#ifdef _OPENMP
#include <omp.h>
#endif
#include <torch/csrc/stable/ops.h>

#include <algorithm>
#include <cstdint>

namespace kload {
namespace cpu {

// torch.get_num_threads()
inline int num_threads() { return static_cast<int>(torch::stable::get_num_threads()); }

// f(t, threads) for each t in [0, threads), side by side: f's work for thread t of threads.
template <typename F>
inline void parallel_threads(int threads, const F& f) {
#ifdef _OPENMP
#pragma omp parallel num_threads(threads)
  f(int64_t(omp_get_thread_num()), int64_t(omp_get_num_threads()));
#else
  torch::stable::parallel_for(0, threads, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) f(t, int64_t(threads));
  });
#endif
}

// f(begin, end) on contiguous chunks of [0, n), one per thread; serial below `grain`.
template <typename F>
inline void parallel_chunks(int64_t n, int64_t grain, const F& f) {
  const int threads = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(num_threads(), n / std::max<int64_t>(grain, 1))));
#ifdef _OPENMP
  if (threads <= 1 || omp_in_parallel()) {
#else
  if (threads <= 1) {
#endif
    f(int64_t(0), n);
    return;
  }
  parallel_threads(threads, [&](int64_t t, int64_t nt) {
    const int64_t begin = n * t / nt, end = n * (t + 1) / nt;
    if (begin < end) f(begin, end);
  });
}

}  // namespace cpu
}  // namespace kload
