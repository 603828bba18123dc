// Warp collectives of the prefill kernel on top of emulator_shim.h (tests/codegen/
// emulator_prefill.py): every lane of the warp deposits its operands in a per-warp exchange
// area, the warp meets at a barrier, each lane computes its own results from the PTX ISA's
// fragment tables, and the warp meets again before the area is reused.
//   __any_sync, __syncwarp   full-warp masks only (__shfl_sync, __ballot_sync: emulator_shim.h)
//   ldmatrix .x4 (.trans)   lanes 8i .. 8i+7 address the rows of matrix i; lane l receives
//                     (row l/4, cols 2(l%4) + {0,1}) of each, or the transpose
//   mma m16n8k16      bf16 / f16 inputs, fp32 accumulation (exact products, float sums)
//   movmatrix .trans  an 8x8 matrix of 16-bit values in fragment layout, transposed
// Shared-memory "addresses" are byte offsets from the block's emulated shared memory.
#pragma once
inline int __ffs(unsigned x) { return x ? __builtin_ctz(x) + 1 : 0; }
struct EmuXchg { unsigned long long v[32][16]; };
static EmuXchg g_xchg[64];
inline void emu_warp_sync() {
  const int tid = emu_linear_tid(), warp = tid / 32;
  tl_block->shfl_barrier(warp, 0xffffffffu).wait();
}
inline int __any_sync(unsigned mask, bool pred) { return __ballot_sync(mask, pred) != 0; }
// (The producer's release_stage: compiled, never run on the emulated mma.sync path.)
inline void __syncwarp(unsigned = 0xffffffffu) { emu_warp_sync(); }
inline uint16_t emu_ld16(unsigned off) { uint16_t x; memcpy(&x, emu_smem() + off, 2); return x; }
inline void emu_ldmatrix(unsigned (&r)[4], unsigned addr, bool trans) {
  const int tid = emu_linear_tid(), lane = tid % 32, warp = tid / 32;
  if (addr & 15) { fprintf(stderr, "EMU: misaligned ldmatrix\n"); std::_Exit(5); }
  g_xchg[warp].v[lane][0] = addr; emu_warp_sync();
  for (int i = 0; i < 4; ++i) {
    uint16_t lo, hi;
    if (!trans) {
      unsigned row = (unsigned)g_xchg[warp].v[8 * i + lane / 4][0];
      lo = emu_ld16(row + 2 * (2 * (lane % 4))); hi = emu_ld16(row + 2 * (2 * (lane % 4) + 1));
    } else {
      unsigned r0 = (unsigned)g_xchg[warp].v[8 * i + 2 * (lane % 4)][0];
      unsigned r1 = (unsigned)g_xchg[warp].v[8 * i + 2 * (lane % 4) + 1][0];
      lo = emu_ld16(r0 + 2 * (lane / 4)); hi = emu_ld16(r1 + 2 * (lane / 4));
    }
    r[i] = (unsigned)lo | ((unsigned)hi << 16);
  }
  emu_warp_sync();
}
template <bool kBf16> inline float emu_h(unsigned w, int half_) {
  uint16_t b = half_ ? (w >> 16) : (w & 0xffff);
  if (kBf16) { __nv_bfloat16 x{b}; return b2f(x); } else { half x{b}; return h2f(x); }
}
template <bool kBf16>
inline void emu_mma(float (&c)[4], const unsigned (&a)[4], unsigned b0, unsigned b1) {
  const int tid = emu_linear_tid(), lane = tid % 32, warp = tid / 32;
  auto& X = g_xchg[warp].v;
  for (int i = 0; i < 4; ++i) X[lane][i] = a[i];
  X[lane][4] = b0; X[lane][5] = b1;
  emu_warp_sync();
  const int g = lane / 4, t = 2 * (lane % 4);
  float A[2][16], B[16][2];
  for (int tt = 0; tt < 4; ++tt) {  // lanes 4g + tt hold row g cols 2tt.., row g+8
    const int l = 4 * g + tt;
    for (int e = 0; e < 2; ++e) {
      A[0][2 * tt + e] = emu_h<kBf16>(X[l][0], e); A[1][2 * tt + e] = emu_h<kBf16>(X[l][1], e);
      A[0][2 * tt + 8 + e] = emu_h<kBf16>(X[l][2], e); A[1][2 * tt + 8 + e] = emu_h<kBf16>(X[l][3], e);
    }
  }
  for (int n = 0; n < 2; ++n) {  // B column t + n lives in lanes 4 (t + n) + tt
    for (int tt = 0; tt < 4; ++tt) {
      const int l = 4 * (t + n) + tt;
      for (int e = 0; e < 2; ++e) {
        B[2 * tt + e][n] = emu_h<kBf16>((unsigned)X[l][4], e);
        B[2 * tt + 8 + e][n] = emu_h<kBf16>((unsigned)X[l][5], e);
      }
    }
  }
  emu_warp_sync();
  for (int h = 0; h < 2; ++h) for (int n = 0; n < 2; ++n) {
    float s = c[2 * h + n];
    for (int k = 0; k < 16; ++k) s += A[h][k] * B[k][n];
    c[2 * h + n] = s;
  }
}
inline unsigned emu_movmatrix_trans(unsigned x) {
  const int tid = emu_linear_tid(), lane = tid % 32, warp = tid / 32;
  auto& X = g_xchg[warp].v;
  X[lane][0] = x;
  emu_warp_sync();
  // Lane (g, t) receives M[2t][g] and M[2t + 1][g]; M[r][c] is half c % 2 of lane 4 r + c / 2.
  const int g = lane / 4, t = lane % 4;
  const unsigned lo = ((unsigned)X[4 * (2 * t) + g / 2][0] >> (16 * (g % 2))) & 0xffffu;
  const unsigned hi = ((unsigned)X[4 * (2 * t + 1) + g / 2][0] >> (16 * (g % 2))) & 0xffffu;
  emu_warp_sync();
  return lo | (hi << 16);
}
