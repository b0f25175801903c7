// tests/cuda_emu/emu.h — runs the shipped CUDA kernels on the CPU, so their index
// math (tiles, fragments, pipelines, edges, reductions) is checked where there is
// no GPU. g++ compiles a copy of each kernels/<op>/<op>.cu with this header forced
// in first (-include), after these textual rewrites (tests/cuda_emu/emu_build.py):
//   kernel<<<grid, block, smem, stream>>>(args)  ->  ::kload_emu::launch(kernel, grid, block, smem, stream)(args)
//   extern __shared__ T name[];                  ->  T* name = (T*)::kload_emu::dynamic_shared();
//   __shared__ T name[dims];                     ->  T (&name)[dims] = ::kload_emu::static_shared<T[dims], site>();
//   KLOAD_LAUNCHER (hidden)                      ->  extern "C", exported (check.py calls the launchers)
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
// dynamic shared memory over 99 KB (the smallest opt-in limit of sm_80+ GPUs:
// sm_86 and sm_89), a warp whose lanes run different warp-wide instructions,
// misaligned or out-of-shared-memory ldmatrix and cp.async addresses, a
// __syncthreads that not every thread of the block reaches, a deadlock. Shared
// memory, static and dynamic, starts each block as 0xFF bytes (NaN in every float
// type), so a tile read before it was written shows; dynamic shared memory ends
// at an unreadable page. Two knobs vary what a kernel must be right under:
//   KLOAD_EMU_CP_ASYNC=late (default) | eager: cp.async copies land only at the
//     cp.async.wait_group that must wait for them (a wait too short reads old
//     bytes), or when issued (a copy into a stage another warp still reads
//     overwrites it at once);
//   KLOAD_EMU_ORDER=lockstep (default) | warps | warps-reversed: the block's threads
//     take turns one at a time, or each warp runs as far as it can (to the next
//     __syncthreads) before the next warp, in order or from the last: a warp that
//     runs ahead of the others, as real warps do, shows a missing barrier.
// What it cannot check: timing, the memory model between blocks (they run in
// turn), the hardware's rounding inside mma (fp32 sums here).
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
#define __shared__ static  // (emu_build.py rewrites every __shared__ declaration: see static_shared)

using std::max;  // CUDA's device min/max overloads
using std::min;

// cuda_runtime.h's overload for a kernel (nvcc only)
template <typename T>
cudaError_t cudaFuncSetAttribute(T* entry, cudaFuncAttribute attr, int value) {
  return ::cudaFuncSetAttribute(reinterpret_cast<const void*>(entry), attr, value);
}

namespace kload_emu {

[[noreturn]] void fail(const char* fmt, ...) __attribute__((format(printf, 1, 2)));

struct Copy {  // one cp.async: 16 bytes from src, or 16 zeros (src-size 0)
  void* dst;
  const void* src;
  bool valid;
};
inline void land(const Copy& c) { c.valid ? (void)std::memcpy(c.dst, c.src, 16) : (void)std::memset(c.dst, 0, 16); }

struct Thread {
  ucontext_t ctx;
  uint3 idx;
  int warp = 0, lane = 0;
  bool done = false;
  bool at_barrier = false;  // waiting at __syncthreads for `waits_for` to pass
  uint64_t waits_for = 0;
  uint64_t copies_issued = 0;  // cp.async instructions so far
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
  struct Stores {  // the shared-memory addresses of the lanes' n-th cp.async of the block
    int count = 0;
    uintptr_t at[32];
  };
  std::map<uint64_t, Stores> copies;
};

struct Arena {  // a static __shared__ variable's storage
  unsigned char* p;
  size_t bytes;
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
  std::vector<Arena> arenas;      // every static __shared__ variable met so far
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

inline int block_threads() { return static_cast<int>(rt.block.x * rt.block.y * rt.block.z); }

inline void syncthreads() {
  ++rt.counts["__syncthreads"];
  if (rt.live != block_threads())
    fail("__syncthreads after %d of the block's threads returned: every thread must reach each barrier",
         block_threads() - rt.live);
  const uint64_t gen = rt.generation;
  ++rt.progress;
  if (++rt.arrived == rt.live) {
    rt.arrived = 0;
    ++rt.generation;
    return;
  }
  Thread& t = *rt.current;
  t.at_barrier = true, t.waits_for = gen;
  while (rt.generation == gen) yield();
  t.at_barrier = false;
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

// -- shared memory -------------------------------------------------------------------
// `__shared__ T name[dims];` is rewritten (emu_build.py) to a reference to the storage of
// static_shared<T[dims], site>(): one per declaration and type, poisoned (0xFF) when
// first met and at the start of every block after.
template <typename A, int kSite>
A& static_shared() {
  alignas(64) static A storage;
  static const bool registered = [] {
    std::memset(static_cast<void*>(&storage), 0xFF, sizeof(A));
    rt.arenas.push_back({reinterpret_cast<unsigned char*>(&storage), sizeof(A)});
    return true;
  }();
  (void)registered;
  return storage;
}

inline void* dynamic_shared() { return rt.smem; }

// Extra passes over shared memory of 16-byte accesses at `at` by `lanes` lanes: the banks
// serve a quarter-warp (8 lanes, 128 bytes) a pass when their addresses differ in bits 4-6.
inline int bank_conflicts_16(const uintptr_t* at, int lanes) {
  int extra = 0;
  for (int q = 0; q < lanes; q += 8) {
    int on[8] = {}, worst = 0;
    for (int l = q; l < std::min(lanes, q + 8); ++l) worst = std::max(worst, ++on[(at[l] >> 4) & 7]);
    extra += worst - 1;
  }
  return extra;
}

// [p, p + bytes) lies in the block's shared memory, dynamic or static
inline bool in_shared(const void* p, size_t bytes) {
  const auto* c = static_cast<const unsigned char*>(p);
  if (rt.smem && c >= rt.smem && c + bytes <= rt.smem + rt.smem_bytes) return true;
  for (const Arena& a : rt.arenas)
    if (c >= a.p && c + bytes <= a.p + a.bytes) return true;
  return false;
}

}  // namespace kload_emu

#include "launch.h"

#define threadIdx (::kload_emu::rt.current->idx)
#define blockIdx (::kload_emu::rt.block_idx)
#define blockDim (::kload_emu::rt.block)
#define gridDim (::kload_emu::rt.grid)
#define __syncthreads() ::kload_emu::syncthreads()
