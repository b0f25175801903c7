// tests/cuda_emu/ptx.cuh — kload/cuda/ptx.cuh's functions on the CPU, for the
// emulator (emu.h): the same names and signatures, computed from the PTX ISA's
// definitions, not from gemm.cuh's use of them:
//   - ldmatrix .m8n8 .x4 (.trans) .b16: lanes 8i .. 8i+7 give the row addresses of
//     matrix i; lane l receives, in register i, row l/4 and columns 2(l%4), 2(l%4)+1
//     of matrix i (of its transpose with .trans), the lower column in the low half;
//     the extra passes bank conflicts cost are counted;
//   - mma.m16n8k16 (f16, bf16) and mma.m16n8k8 (tf32), row.col, f32 accumulators:
//     the fragments of "Matrix Fragments for mma.m16n8k16 / m16n8k8", with
//     groupID = lane >> 2 and threadID_in_group = lane % 4;
//   - cp.async: a 16-byte copy, or 16 zero bytes with src-size 0, that lands when
//     issued (KLOAD_EMU_CP_ASYNC=eager) or at the wait_group that must see it; the
//     bank conflicts of a warp's stores (its lanes' n-th copies) are counted;
//   - cvt.rna.tf32.f32: round to 10 mantissa bits, to nearest, ties away from zero.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <cstring>
#include <type_traits>

#define KLOAD_CUDA_SM80 1

namespace kload {
namespace cuda {
namespace ptx {

using ::kload_emu::fail;
using ::kload_emu::rt;

inline void cp_async16(void* dst, const void* src, bool valid) {
  if (reinterpret_cast<uintptr_t>(dst) % 16 || !::kload_emu::in_shared(dst, 16))
    fail("cp.async: destination %p is not 16 aligned bytes of the block's shared memory", dst);
  if (src == nullptr || reinterpret_cast<uintptr_t>(src) % 16)
    fail("cp.async: source %p is not a 16-byte aligned address", src);
  ++rt.counts["cp.async"];
  {  // the warp's lanes' n-th cp.async together: their shared-memory stores' bank conflicts
    ::kload_emu::Thread& t = *rt.current;
    ::kload_emu::Warp& w = rt.warps[t.warp];
    const uint64_t n = t.copies_issued++;
    auto& s = w.copies[n];
    s.at[t.lane] = reinterpret_cast<uintptr_t>(dst);
    if (++s.count == w.lanes) {
      rt.counts["cp.async bank conflicts"] += ::kload_emu::bank_conflicts_16(s.at, w.lanes);
      w.copies.erase(n);
    }
  }
  if (rt.eager_copies)
    ::kload_emu::land({dst, src, valid});
  else
    rt.current->open.push_back({dst, src, valid});
}

inline void cp_async_commit() {
  ::kload_emu::Thread& t = *rt.current;
  t.groups.push_back(std::move(t.open));
  t.open.clear();
}

template <int N>
inline void cp_async_wait() {  // every committed group but the newest N has landed
  ::kload_emu::Thread& t = *rt.current;
  while (t.groups.size() > static_cast<size_t>(N)) {
    for (const auto& c : t.groups.front()) ::kload_emu::land(c);
    t.groups.erase(t.groups.begin());
  }
}

struct Regs4 {
  uint32_t r[4];
};

inline void ldmatrix(uint32_t (&r)[4], const void* p, bool trans, const char* op) {
  const Regs4 out = ::kload_emu::warp_collective<const void*, Regs4>(
      op, p, [trans](const void* const* rows, Regs4* outs, int lanes) {
        if (lanes != 32) fail("ldmatrix.x4 in a warp of %d threads", lanes);
        for (int l = 0; l < 32; ++l)
          if (reinterpret_cast<uintptr_t>(rows[l]) % 16 || !::kload_emu::in_shared(rows[l], 16))
            fail("ldmatrix: lane %d's row address %p is not 16 aligned bytes of shared memory", l, rows[l]);
        // shared memory's 32 banks of 4 bytes: each 8 x 8 matrix is one 128-byte read of the rows
        // of 8 lanes, in one pass when the rows lie on different banks (counted otherwise)
        uintptr_t row_at[32];
        for (int l = 0; l < 32; ++l) row_at[l] = reinterpret_cast<uintptr_t>(rows[l]);
        rt.counts["ldmatrix bank conflicts"] += ::kload_emu::bank_conflicts_16(row_at, 32);
        auto at = [&](int matrix, int row, int col) {
          uint16_t v;
          std::memcpy(&v, static_cast<const unsigned char*>(rows[8 * matrix + row]) + 2 * col, 2);
          return uint32_t(v);
        };
        for (int l = 0; l < 32; ++l)
          for (int i = 0; i < 4; ++i) {
            const int g = l >> 2, t = l & 3;
            outs[l].r[i] = trans ? at(i, 2 * t, g) | at(i, 2 * t + 1, g) << 16
                                 : at(i, g, 2 * t) | at(i, g, 2 * t + 1) << 16;
          }
      });
  std::memcpy(r, out.r, sizeof(r));
}
inline void ldmatrix_x4(uint32_t (&r)[4], const void* p) { ldmatrix(r, p, false, "ldmatrix.x4"); }
inline void ldmatrix_x4_trans(uint32_t (&r)[4], const void* p) { ldmatrix(r, p, true, "ldmatrix.x4.trans"); }

// the element types' bits, as the tensor core reads them
inline float from_bits(uint32_t bits16, __nv_bfloat16*) {
  const uint32_t u = bits16 << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
inline float from_bits(uint32_t bits16, __half*) {
  __half_raw raw;
  raw.x = static_cast<unsigned short>(bits16);
  return __half2float(__half(raw));
}
inline float tf32_value(uint32_t bits) {  // the low 13 bits are not part of a tf32
  const uint32_t u = bits & 0xffffe000u;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

struct MmaIn {
  uint32_t a[4], b[2];
  float c[4];
};
struct Acc {
  float d[4];
};

// D = A B + C over one warp; A [16][K] and B [K][8] gathered from the lanes' fragments
template <typename T>
inline void mma(float (&d)[4], const uint32_t (&a)[4], const uint32_t (&b)[2]) {
  constexpr bool kTf32 = std::is_same<T, float>::value;
  constexpr int K = kTf32 ? 8 : 16;
  MmaIn in;
  std::memcpy(in.a, a, sizeof(in.a));
  std::memcpy(in.b, b, sizeof(in.b));
  std::memcpy(in.c, d, sizeof(in.c));
  const Acc out = ::kload_emu::warp_collective<MmaIn, Acc>(
      kTf32 ? "mma.m16n8k8.tf32" : std::is_same<T, __half>::value ? "mma.m16n8k16.f16" : "mma.m16n8k16.bf16", in,
      [](const MmaIn* ins, Acc* outs, int lanes) {
        if (lanes != 32) fail("mma.sync in a warp of %d threads", lanes);
        float A[16][16], B[16][8], C[16][8];
        for (int l = 0; l < 32; ++l) {
          const int g = l >> 2, t = l & 3;
          const MmaIn& f = ins[l];
          if constexpr (kTf32) {
            A[g][t] = tf32_value(f.a[0]);
            A[g + 8][t] = tf32_value(f.a[1]);
            A[g][t + 4] = tf32_value(f.a[2]);
            A[g + 8][t + 4] = tf32_value(f.a[3]);
            B[t][g] = tf32_value(f.b[0]);
            B[t + 4][g] = tf32_value(f.b[1]);
          } else {
            T* tag = nullptr;
            for (int h = 0; h < 2; ++h) {  // the low half first
              const int shift = 16 * h;
              A[g][2 * t + h] = from_bits((f.a[0] >> shift) & 0xffff, tag);
              A[g + 8][2 * t + h] = from_bits((f.a[1] >> shift) & 0xffff, tag);
              A[g][2 * t + 8 + h] = from_bits((f.a[2] >> shift) & 0xffff, tag);
              A[g + 8][2 * t + 8 + h] = from_bits((f.a[3] >> shift) & 0xffff, tag);
              B[2 * t + h][g] = from_bits((f.b[0] >> shift) & 0xffff, tag);
              B[2 * t + 8 + h][g] = from_bits((f.b[1] >> shift) & 0xffff, tag);
            }
          }
          C[g][2 * t] = f.c[0];
          C[g][2 * t + 1] = f.c[1];
          C[g + 8][2 * t] = f.c[2];
          C[g + 8][2 * t + 1] = f.c[3];
        }
        for (int l = 0; l < 32; ++l) {
          const int g = l >> 2, t = l & 3;
          auto dot = [&](int m, int n) {
            double s = C[m][n];
            for (int k = 0; k < K; ++k) s += double(A[m][k]) * double(B[k][n]);
            return float(s);
          };
          outs[l] = {{dot(g, 2 * t), dot(g, 2 * t + 1), dot(g + 8, 2 * t), dot(g + 8, 2 * t + 1)}};
        }
      });
  std::memcpy(d, out.d, sizeof(d));
}

inline uint32_t to_tf32(float x) {
  uint32_t u;
  std::memcpy(&u, &x, 4);
  if ((u & 0x7f800000u) == 0x7f800000u) return (u & 0x007fffffu) ? 0x7fffffffu : u;  // NaN, +-inf
  return (u + 0x1000u) & 0xffffe000u;  // sign and magnitude: adding half an ulp rounds ties away from zero
}

}  // namespace ptx
}  // namespace cuda
}  // namespace kload
