// tests/cuda_emu/emu.h — runs the shipped CUDA kernels on the CPU, so their index
// math (tiles, fragments, pipelines, edges, reductions) is checked where there is
// no GPU. g++ compiles a copy of each kernels/<op>/<op>.cu with this header forced
// in first (-include), after three textual rewrites (tests/cuda_emu/build.py):
//   kernel<<<grid, block, smem, stream>>>(args)  ->  ::kload_emu::launch(kernel, grid, block, smem, stream)(args)
//   extern __shared__ T name[];                  ->  T* name = (T*)::kload_emu::dynamic_shared();
//   kload/cuda/ptx.cuh                           ->  tests/cuda_emu/ptx.cuh (the PTX instructions, emulated)
//
// A launch runs its blocks one after another. A block's threads are fibers
// (ucontext) on this one OS thread, each running the kernel until it waits: at
// __syncthreads, or at a warp-wide instruction (ldmatrix, mma.sync), whose result
// the warp's last lane to arrive computes for all 32 from the PTX ISA's layouts.
// So the order of a run is fixed, and a wait no thread can end (a barrier some
// threads never reach) is reported, not hung.
//
// What it checks, as the GPU would fail (abort, with the block and thread):
// launch configurations (the last error, as cudaGetLastError returns it),
// dynamic shared memory over the opt-in limit, a warp whose lanes run different
// warp-wide instructions, misaligned or out-of-shared-memory ldmatrix and cp.async
// addresses, a deadlock. Dynamic shared memory starts each block as 0xFF bytes
// (NaN in every float type), so a tile read before it was written shows.
// cp.async copies land either when issued or only at the cp.async.wait_group that
// must wait for them (KLOAD_EMU_CP_ASYNC=eager / late): a kernel must be right
// under both. What it cannot check: timing, the memory model between blocks (they
// run in turn), the hardware's rounding inside mma (fp32 sums here).
#pragma once

#define __launch_bounds__(...)

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <math.h>
#include <sys/mman.h>
#include <ucontext.h>

#include <algorithm>
#include <cstdarg>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <map>
#include <string>
#include <vector>

#undef __shared__
#define __shared__ static  // one block at a time: a static is the block's shared memory

using std::max;  // CUDA's device min/max overloads
using std::min;

// cuda_runtime.h's overload for a kernel (nvcc only)
template <typename T>
cudaError_t cudaFuncSetAttribute(T* entry, cudaFuncAttribute attr, int value) {
  return ::cudaFuncSetAttribute(reinterpret_cast<const void*>(entry), attr, value);
}

namespace kload_emu {

[[noreturn]] void fail(const char* fmt, ...) __attribute__((format(printf, 1, 2)));

struct Thread {
  ucontext_t ctx;
  uint3 idx;
  int linear = 0, warp = 0, lane = 0;
  bool done = false;
  struct Copy {
    void* dst;
    const void* src;
    bool valid;
  };
  std::vector<Copy> open;                 // cp.async copies since the last commit_group
  std::vector<std::vector<Copy>> groups;  // committed, not yet waited for (oldest first)
};

// One warp-wide instruction in flight: each lane's operands in, its result out.
struct Lane {
  alignas(16) unsigned char in[64];
  alignas(16) unsigned char out[64];
};
struct Warp {
  int arrived = 0, lanes = 0;
  const char* op = nullptr;
  uint64_t generation = 0;
  Lane lane[32];
};

struct Runtime {
  dim3 grid, block;
  uint3 block_idx;
  Thread* current = nullptr;
  std::vector<Thread> threads;
  std::vector<Warp> warps;
  int live = 0, arrived = 0;  // __syncthreads: threads not exited, and those waiting
  uint64_t generation = 0, progress = 0;
  ucontext_t scheduler;
  unsigned char* smem = nullptr;  // dynamic shared memory of the running block
  size_t smem_bytes = 0;
  bool eager_copies = false;
  const std::function<void()>* body = nullptr;
  std::map<std::string, uint64_t> counts;  // what ran: "blocks", "threads", "__syncthreads", each instruction
};
inline Runtime rt;

inline void fail(const char* fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  std::fprintf(stderr, "kload_emu: block (%u, %u, %u)", rt.block_idx.x, rt.block_idx.y, rt.block_idx.z);
  if (rt.current)
    std::fprintf(stderr, " thread (%u, %u, %u)", rt.current->idx.x, rt.current->idx.y, rt.current->idx.z);
  std::fprintf(stderr, ": ");
  std::vfprintf(stderr, fmt, ap);
  std::fprintf(stderr, "\n");
  va_end(ap);
  std::fflush(stderr);
  std::abort();
}

inline void yield() { swapcontext(&rt.current->ctx, &rt.scheduler); }

inline void syncthreads() {
  ++rt.counts["__syncthreads"];
  const uint64_t gen = rt.generation;
  ++rt.progress;
  if (++rt.arrived == rt.live) {
    rt.arrived = 0;
    ++rt.generation;
    return;
  }
  while (rt.generation == gen) yield();
}

// The warp's lanes each give `in`; the last to arrive runs compute(ins, outs) for all
// of them; each gets its out. `op` names the instruction (all lanes must run the same).
template <typename In, typename Out, typename F>
Out warp_collective(const char* op, const In& in, F compute) {
  static_assert(sizeof(In) <= 64 && sizeof(Out) <= 64, "operands too large");
  Thread& t = *rt.current;
  Warp& w = rt.warps[t.warp];
  if (w.arrived == 0)
    w.op = op;
  else if (std::strcmp(w.op, op) != 0)
    fail("the lanes of warp %d run different warp-wide instructions (%s, %s)", t.warp, w.op, op);
  std::memcpy(w.lane[t.lane].in, &in, sizeof(In));
  const uint64_t gen = w.generation;
  ++rt.progress;
  if (++w.arrived == w.lanes) {
    ++rt.counts[op];
    In ins[32];
    Out outs[32];
    for (int l = 0; l < w.lanes; ++l) std::memcpy(&ins[l], w.lane[l].in, sizeof(In));
    compute(ins, outs, w.lanes);
    for (int l = 0; l < w.lanes; ++l) std::memcpy(w.lane[l].out, &outs[l], sizeof(Out));
    w.arrived = 0;
    ++w.generation;
  } else {
    while (w.generation == gen) yield();
  }
  Out out;
  std::memcpy(&out, w.lane[t.lane].out, sizeof(Out));
  return out;
}

inline bool in_dynamic_shared(const void* p, size_t bytes) {
  const auto* c = static_cast<const unsigned char*>(p);
  return rt.smem && c >= rt.smem && c + bytes <= rt.smem + rt.smem_bytes;
}

inline void* dynamic_shared() { return rt.smem; }

// -- the CUDA runtime's side -----------------------------------------------------------
struct Device {
  int sms = 4, cc = 90;
  int max_dynamic_smem = 227 * 1024;  // sm_90's opt-in limit per block
  cudaError_t last_error = cudaSuccess;
  std::map<const void*, int> smem_opt_in;  // cudaFuncAttributeMaxDynamicSharedMemorySize per kernel
};
inline Device device;

inline void set_error(cudaError_t e) {
  if (device.last_error == cudaSuccess) device.last_error = e;
}

inline void thread_entry() {
  (*rt.body)();
  Thread& t = *rt.current;
  t.done = true;
  ++rt.progress;
  t.groups.push_back(std::move(t.open));  // copies never waited for: the hardware lands them anyway
  for (auto& g : t.groups)
    for (auto& c : g) c.valid ? (void)std::memcpy(c.dst, c.src, 16) : (void)std::memset(c.dst, 0, 16);
  if (--rt.live > 0 && rt.arrived == rt.live) {  // the others wait at __syncthreads for no one else
    rt.arrived = 0;
    ++rt.generation;
  }
}

inline void run_block(size_t smem_bytes) {
  const int n = static_cast<int>(rt.block.x * rt.block.y * rt.block.z);
  constexpr size_t kStack = 256 * 1024;
  static unsigned char* stacks = nullptr;
  static int stack_count = 0;
  if (stack_count < n) {
    if (stacks) munmap(stacks, kStack * stack_count);
    void* m = mmap(nullptr, kStack * n, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (m == MAP_FAILED) fail("no memory for %d fiber stacks", n);
    stacks = static_cast<unsigned char*>(m);
    stack_count = n;
  }
  static std::vector<unsigned char> smem;
  smem.assign(smem_bytes, 0xFF);
  rt.smem = smem_bytes ? smem.data() : nullptr;
  rt.smem_bytes = smem_bytes;
  rt.threads.assign(n, Thread{});
  rt.warps.assign((n + 31) / 32, Warp{});
  for (int w = 0; w < static_cast<int>(rt.warps.size()); ++w) rt.warps[w].lanes = std::min(32, n - 32 * w);
  rt.live = n;
  rt.arrived = 0;
  ++rt.counts["blocks"];
  rt.counts["threads"] += n;
  for (int i = 0; i < n; ++i) {
    Thread& t = rt.threads[i];
    t.linear = i, t.warp = i / 32, t.lane = i % 32;
    t.idx = make_uint3(i % rt.block.x, (i / rt.block.x) % rt.block.y, i / (rt.block.x * rt.block.y));
    getcontext(&t.ctx);
    t.ctx.uc_stack.ss_sp = stacks + kStack * i;
    t.ctx.uc_stack.ss_size = kStack;
    t.ctx.uc_link = &rt.scheduler;
    makecontext(&t.ctx, thread_entry, 0);
  }
  int running = n;
  while (running > 0) {
    const uint64_t before = rt.progress;
    running = 0;
    for (Thread& t : rt.threads) {
      if (t.done) continue;
      rt.current = &t;
      swapcontext(&rt.scheduler, &t.ctx);
      running += !t.done;
    }
    rt.current = nullptr;
    if (running > 0 && rt.progress == before) {
      int at_barrier = rt.arrived;
      fail("deadlock: %d threads wait at __syncthreads, %d at warp-wide instructions, none can go on", at_barrier,
           running - at_barrier);
    }
  }
}

template <typename... P>
struct Launch {
  void (*kernel)(P...);
  dim3 grid, block;
  size_t smem;

  template <typename... A>
  void operator()(A&&... args) const {
    const unsigned threads = block.x * block.y * block.z;
    if (threads == 0 || threads > 1024 || block.z > 64 || grid.x == 0 || grid.y == 0 || grid.z == 0 ||
        grid.x > 0x7fffffffu || grid.y > 65535 || grid.z > 65535)
      return set_error(cudaErrorInvalidConfiguration);
    const auto opt = device.smem_opt_in.find(reinterpret_cast<const void*>(kernel));
    const size_t allowed = opt == device.smem_opt_in.end() ? 48 * 1024 : size_t(std::max(48 * 1024, opt->second));
    if (smem > allowed) return set_error(cudaErrorInvalidValue);
    const char* mode = std::getenv("KLOAD_EMU_CP_ASYNC");
    rt.eager_copies = mode && std::strcmp(mode, "eager") == 0;
    const std::function<void()> body = [&] { kernel(args...); };
    rt.body = &body;
    rt.grid = grid, rt.block = block;
    for (unsigned z = 0; z < grid.z; ++z)
      for (unsigned y = 0; y < grid.y; ++y)
        for (unsigned x = 0; x < grid.x; ++x) {
          rt.block_idx = make_uint3(x, y, z);
          run_block(smem);
        }
    rt.body = nullptr;
    rt.smem = nullptr;
  }
};

template <typename... P>
Launch<P...> launch(void (*kernel)(P...), dim3 grid, dim3 block, size_t smem = 0, cudaStream_t = nullptr) {
  return {kernel, grid, block, smem};
}

}  // namespace kload_emu

#define threadIdx (::kload_emu::rt.current->idx)
#define blockIdx (::kload_emu::rt.block_idx)
#define blockDim (::kload_emu::rt.block)
#define gridDim (::kload_emu::rt.grid)
#define __syncthreads() ::kload_emu::syncthreads()
