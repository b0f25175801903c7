// tests/cuda_emu/launch.h — the emulator's launches (part of emu.h): the device the
// runtime functions describe (runtime.cpp), and each block's threads as fibers, run
// in the order KLOAD_EMU_ORDER asks for until every one has returned.
#pragma once

namespace kload_emu {

struct Device {
  int sms = 4, cc = 90;
  int max_dynamic_smem = 99 * 1024;  // the smallest opt-in limit of sm_80+ GPUs (sm_86, sm_89)
  cudaError_t last_error = cudaSuccess;
  std::map<const void*, int> smem_opt_in;  // cudaFuncAttributeMaxDynamicSharedMemorySize per kernel
};
inline Device device;

inline void set_error(cudaError_t e) {
  if (device.last_error == cudaSuccess) device.last_error = e;
}

enum class Order { lockstep, warps, warps_reversed };

inline void thread_entry() {
  (*rt.body)();
  Thread& t = *rt.current;
  t.done = true;
  ++rt.progress;
  t.groups.push_back(std::move(t.open));  // copies never waited for: the hardware lands them anyway
  for (const auto& g : t.groups)
    for (const Copy& c : g) land(c);
  --rt.live;
  if (rt.arrived > 0)
    fail("returned while %d threads of the block wait at __syncthreads: every thread must reach each barrier",
         rt.arrived);
}

// Dynamic shared memory of `bytes` that ends where an unreadable page starts, 0xFF
inline unsigned char* dynamic_smem(size_t bytes) {
  static std::map<size_t, unsigned char*> made;  // by size: a launch's blocks share one
  const size_t page = 4096, room = (bytes + page - 1) / page * page;
  unsigned char*& p = made[bytes];
  if (p == nullptr) {
    void* m = mmap(nullptr, room + page, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (m == MAP_FAILED || mprotect(static_cast<unsigned char*>(m) + room, page, PROT_NONE) != 0)
      fail("no memory for %zu bytes of shared memory", bytes);
    p = static_cast<unsigned char*>(m) + (room - bytes) / 16 * 16;
  }
  std::memset(p, 0xFF, bytes);
  return p;
}

inline bool runnable(const Thread& t) { return !t.done && !(t.at_barrier && t.waits_for == rt.generation); }

inline void resume(Thread& t) {
  rt.current = &t;
  swapcontext(&rt.scheduler, &t.ctx);
  rt.current = nullptr;
}

inline void run_block(size_t smem_bytes, Order order) {
  const int n = block_threads();
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
  rt.smem = smem_bytes ? dynamic_smem(smem_bytes) : nullptr;
  rt.smem_bytes = smem_bytes;
  for (const Arena& a : rt.arenas) std::memset(a.p, 0xFF, a.bytes);
  rt.threads.assign(n, Thread{});
  rt.warps.assign((n + 31) / 32, Warp{});
  const int nwarps = static_cast<int>(rt.warps.size());
  for (int w = 0; w < nwarps; ++w) rt.warps[w].lanes = std::min(32, n - 32 * w);
  rt.live = n;
  rt.arrived = 0;
  ++rt.counts["blocks"];
  rt.counts["threads"] += n;
  for (int i = 0; i < n; ++i) {
    Thread& t = rt.threads[i];
    t.warp = i / 32, t.lane = i % 32;
    t.idx = make_uint3(i % rt.block.x, (i / rt.block.x) % rt.block.y, i / (rt.block.x * rt.block.y));
    getcontext(&t.ctx);
    t.ctx.uc_stack.ss_sp = stacks + kStack * i;
    t.ctx.uc_stack.ss_size = kStack;
    t.ctx.uc_link = &rt.scheduler;
    makecontext(&t.ctx, thread_entry, 0);
  }
  while (rt.live > 0) {
    const uint64_t before = rt.progress;
    if (order == Order::lockstep) {  // one turn each, thread after thread
      for (Thread& t : rt.threads)
        if (!t.done) resume(t);
    } else {  // each warp as far as it goes (to a barrier, or stuck), one warp after another
      for (int k = 0; k < nwarps; ++k) {
        const int w = order == Order::warps ? k : nwarps - 1 - k;
        for (uint64_t seen = ~uint64_t(0); seen != rt.progress;) {
          seen = rt.progress;
          for (int i = 32 * w; i < std::min(n, 32 * w + 32); ++i)
            if (runnable(rt.threads[i])) resume(rt.threads[i]);
        }
      }
    }
    if (rt.live > 0 && rt.progress == before)
      fail("deadlock: %d threads wait at __syncthreads, %d at warp-wide instructions, none can go on", rt.arrived,
           rt.live - rt.arrived);
  }
  for (int w = 0; w < nwarps; ++w)  // the lanes' n-th cp.async met n-th ones: else the count was wrong
    if (!rt.warps[w].copies.empty())
      fail("the lanes of warp %d issued different numbers of cp.async: their bank conflicts were not counted", w);
}

inline Order order_from_env() {
  const char* v = std::getenv("KLOAD_EMU_ORDER");
  if (v == nullptr || *v == '\0' || std::strcmp(v, "lockstep") == 0) return Order::lockstep;
  if (std::strcmp(v, "warps") == 0) return Order::warps;
  if (std::strcmp(v, "warps-reversed") == 0) return Order::warps_reversed;
  fail("KLOAD_EMU_ORDER must be lockstep, warps or warps-reversed, not %s", v);
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
    const char* copies = std::getenv("KLOAD_EMU_CP_ASYNC");
    rt.eager_copies = copies && std::strcmp(copies, "eager") == 0;
    const Order order = order_from_env();
    const std::function<void()> body = [&] { kernel(args...); };
    rt.body = &body;
    rt.grid = grid, rt.block = block;
    for (unsigned z = 0; z < grid.z; ++z)
      for (unsigned y = 0; y < grid.y; ++y)
        for (unsigned x = 0; x < grid.x; ++x) {
          rt.block_idx = make_uint3(x, y, z);
          run_block(smem, order);
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
