// ============================================================================================
// attnlang common device code: what the hooks and kernels compute with (the language's int
// and table semantics, masks' classes, fast math, row groups, rope). Spliced into every
// kernel source by a Jinja include, followed by machine.cuh (what they ask of the machine);
// the rendered .cu is self-contained apart from CUDA's own fp16/bf16 headers.
//
// Symbols defined here (namespace attnlang):
//   Index                    what a hook may read besides its input (INTERNALS.md)
//   kLog2e, kLn2             log2(e) and ln(2) as floats
//   kMinNormal               the smallest normal float (a floor for scales: 0 * -inf is NaN)
//   neg_inf()                -inf
//   ceil_div(a, b)           ceil(a / b) for a >= 0, b > 0
//   request_kv_len(...)      a request's KV length from its page list (paged BSR layout)
//   table_at, span_tri       a table read (0 outside); a bool table's class over a stretch
//   bytes_tri(p, a, b)       the class of bytes p[a..b], 16 bytes to a load
//   pair_bit, pair_tile      an element / a box's class of a per-pair mask (bool[q, kv])
//   PairWindow, make_pair_window<kKeys>   a row's bits over a tile, loaded once
//   ilog2(n)                 floor(log2 n), constexpr
//   imin imax iabs           int min / max / abs
//   ex2_approx tanh_approx   MUFU ex2.approx.ftz.f32 / tanh.approx.f32 (inline PTX)
//   sigmoid softplus         built from the fast exp (LANGUAGE.md section 7)
//   group_mask<TX>()         the warp lanes of the calling thread's TX-lane row group
//   group_allreduce<TX>(v,op)  butterfly over the TX lanes of the group (every lane gets it)
//   group_sum/mean/max/min<VEC, TX>(t)   reduce a float[VEC] per lane over the row group
//   rope_rotate_half<VEC, TX>, rope_interleaved<VEC, TX>   rotary embedding of a row
//
// Row groups: a head vector of kHeadDim elements lives in TX consecutive lanes of one warp
// (TX a power of two <= 32, so the group is aligned), VEC consecutive elements per lane:
// lane `tx` of the group holds elements [dim0, dim0 + VEC), dim0 = tx * VEC. Shuffles name
// only the group's lanes, so a group may call a hook while the rest of the warp does not.
// ============================================================================================
#include <cuda_fp16.h>
#include <cuda_bf16.h>

namespace attnlang {

// Everything a hook may read besides its own input; built by the kernel per row / key.
// Fields a stage cannot see (LANGUAGE.md section 4) hold -1.
struct PairWindow;
struct Index {
  int batch, head, kv_head, qo_len, kv_len, q_pos, kv_pos;
  int num_heads, num_kv_heads;
  float sm_scale;
  // A per-pair mask's bits of this row over the tile, when the kernel loaded them
  // (variant::pair_window); pair_bit then reads them, not memory.
  const PairWindow* pair_window = nullptr;
  // The request's block summary of that mask, when the kernel found it once per work item
  // (variant::pair_blocks); pair_tile then skips the header.
  const unsigned char* pair_blocks = nullptr;
  // The prefill kernel's distance table (variant::distance_term): this row's entry for the
  // tile's last key; the entry of key c of the tile is distance_row - c.
  int distance_row = 0;
};

inline constexpr float kLog2e = 1.4426950408889634f;
inline constexpr float kLn2 = 0.6931471805599453f;
inline constexpr float kMinNormal = 1.17549435e-38f;

__device__ __forceinline__ float neg_inf() { return __uint_as_float(0xff800000u); }

__device__ __forceinline__ int ceil_div(int a, int b) { return (a + b - 1) / b; }

// floor(log2(n)) for n >= 1, at compile time.
__host__ __device__ constexpr int ilog2(int n) { return n > 1 ? 1 + ilog2(n / 2) : 0; }

__device__ __forceinline__ int imin(int a, int b) { return a < b ? a : b; }
__device__ __forceinline__ int imax(int a, int b) { return a > b ? a : b; }
__device__ __forceinline__ int iabs(int a) { return a < 0 ? -a : a; }

// Int division as LANGUAGE.md defines it: a zero divisor yields 0 (a discarded where()
// branch must not trap); `/` and `%` truncate (C), `//` and mod() floor (Python).
__device__ __forceinline__ int idiv(int a, int b) { return b == 0 ? 0 : a / b; }
__device__ __forceinline__ int imod(int a, int b) { return b == 0 ? 0 : a % b; }
__device__ __forceinline__ int floor_div(int a, int b) {
  if (b == 0) return 0;
  const int q = a / b;
  return (a % b != 0 && (a < 0) != (b < 0)) ? q - 1 : q;
}
__device__ __forceinline__ int floor_mod(int a, int b) {
  if (b == 0) return 0;
  const int r = a % b;
  return (r != 0 && (r < 0) != (b < 0)) ? r + b : r;
}
__device__ __forceinline__ float floor_mod(float a, float b) { return a - b * floorf(a / b); }

// Shifts: a count outside 0..31 shifts every bit out; << wraps in int32.
__device__ __forceinline__ int shl(int a, int n) {
  return static_cast<unsigned>(n) < 32u ? static_cast<int>(static_cast<unsigned>(a) << n) : 0;
}
__device__ __forceinline__ int shr(int a, int n) {
  return static_cast<unsigned>(n) < 32u ? a >> n : (a < 0 ? -1 : 0);
}

// sin and cos of any float, as rope does it: x / (2 pi) = hi + lo is reduced exactly in
// turns (the product's rounding error recovered by an fma) to f in [-1/2, 1/2], then the
// MUFU sine of 2 pi f (|arg| <= pi): ~1e-6 absolute error at any |x| below 2^24, where
// sinf's large-argument path would need a stack frame and a table in global memory.
__device__ __forceinline__ float turns_fraction(const float x) {
  const float hi = 0.15915493667125702f, lo = 6.4206382432985265e-09f;
  const float p = x * hi;
  return (p - rintf(p)) + (fmaf(x, hi, -p) + x * lo);
}
__device__ __forceinline__ float sin_reduced(const float x) {
  return __sinf(6.283185307179586f * turns_fraction(x));
}
__device__ __forceinline__ float cos_reduced(const float x) {
  return __cosf(6.283185307179586f * turns_fraction(x));
}

// x / c for a divisor the same over the whole launch (constants, scalar params), through
// its reciprocal, which the compiler folds or hoists: IEEE's division costs ~10 instructions
// and a slow-path call per score. One FMA correction step (Markstein) gives IEEE's quotient,
// so exact quotients stay exact (int(float(kv_pos) / 41.0) at 41 is 1, not 0); only subnormal
// x or quotients may differ, by an ulp. An overflowed or infinite quotient keeps x * (1 / c).
__device__ __forceinline__ float div_invariant(const float x, const float c) {
  const float r = 1.0f / c;
  const float q0 = x * r;
  const float q = fmaf(fmaf(-q0, c, x), r, q0);
  return isfinite(q) ? q : q0;
}

// int(x): toward zero, saturating at the int32 range, NaN -> 0. That is PTX's cvt.rzi.s32.f32
// itself (float-to-int conversions saturate, NaN converts to 0; checked on the H100), half
// the time of the same rule written with compares (benchmarks/NOTES.md).
__device__ __forceinline__ int float_to_int(float x) { return __float2int_rz(x); }

// An element of a row-major table param, given (index, extent) per axis: 0 (false) when any
// computed index is outside its extent, so no index reads out of bounds. An axis of a named
// extent passes its index as `Known`: the kernel built it in range (head < num_heads, ...), so
// it is not tested again. The first axis's extent only bounds its index.
struct Known {
  int index;
};
__device__ __forceinline__ bool table_offset(int&) { return true; }
template <typename... Axes>
__device__ __forceinline__ bool table_offset(int& flat, int index, int extent, Axes... rest) {
  flat = flat * extent + index;
  const bool inside = static_cast<unsigned>(index) < static_cast<unsigned>(extent);
  return table_offset(flat, rest...) && inside;
}
template <typename... Axes>
__device__ __forceinline__ bool table_offset(int& flat, Known axis, int extent, Axes... rest) {
  flat = flat * extent + axis.index;
  return table_offset(flat, rest...);
}
// The load is unconditional (element 0 stands in for an index outside; every table has one):
// equal reads of one tile, such as a bias at a tile-uniform bucket, are then one load, where
// a load behind each element's own branch stays one per element.
template <typename T, typename... Axes>
__device__ __forceinline__ T table_at(const T* __restrict__ table, Axes... axes) {
  int flat = 0;
  const bool inside = table_offset(flat, axes...);
  const T value = table[inside ? flat : 0];
  return inside ? value : T(0);
}

// The class of the bytes p[a .. b] (a <= b; 0 all zero, 1 mixed, 2 all nonzero), 16 bytes
// to a load where p is aligned and four loads to a test: a tile's stretch of a bool table is
// 64-128 bytes, and a byte at a time was a chain of dependent loads that cost Longformer's
// prefill most of its time (benchmarks/NOTES.md).
__device__ __forceinline__ bool has_zero_byte(const unsigned w) {
  return ((w - 0x01010101u) & ~w & 0x80808080u) != 0u;
}

__device__ __forceinline__ int bytes_tri(const unsigned char* __restrict__ p, const int a,
                                         const int b) {
  bool any = false, all = true;
  int i = a;
  for (; i <= b && (reinterpret_cast<unsigned long long>(p + i) & 15u) != 0u; ++i) {
    const bool x = __ldg(p + i) != 0;
    any = any || x;
    all = all && x;
  }
  for (; i + 63 <= b && (all || !any); i += 64) {
    uint4 w[4];
#pragma unroll
    for (int c = 0; c < 4; ++c) w[c] = __ldg(reinterpret_cast<const uint4*>(p + i) + c);
#pragma unroll
    for (int c = 0; c < 4; ++c) {
      any = any || (w[c].x | w[c].y | w[c].z | w[c].w) != 0u;
      all = all && !(has_zero_byte(w[c].x) || has_zero_byte(w[c].y) ||
                     has_zero_byte(w[c].z) || has_zero_byte(w[c].w));
    }
  }
  for (; i + 15 <= b && (all || !any); i += 16) {
    const uint4 w = __ldg(reinterpret_cast<const uint4*>(p + i));
    any = any || (w.x | w.y | w.z | w.w) != 0u;
    all = all && !(has_zero_byte(w.x) || has_zero_byte(w.y) || has_zero_byte(w.z) ||
                   has_zero_byte(w.w));
  }
  for (; i <= b && (all || !any); ++i) {
    const bool x = __ldg(p + i) != 0;
    any = any || x;
    all = all && x;
  }
  return all ? 2 : any ? 1 : 0;
}

// The class of a bool table over the positions [lo, hi] along its last axis (the mask
// analysis's tri: 0 every one false, 1 mixed, 2 every one true), for `is_global[batch,
// kv_pos]` over a tile's keys: axes as table_at's for the other indices. Positions outside
// the axis, and other indices outside the table, read false. The scan stops once mixed.
template <typename... Axes>
__device__ __forceinline__ int span_tri(const unsigned char* __restrict__ table, const int lo,
                                        const int hi, const int extent, Axes... axes) {
  int flat = 0;
  if (!table_offset(flat, axes..., Known{0}, extent)) return 0;
  const int a = imax(lo, 0), b = imin(hi, extent - 1);
  if (a > b) return 0;  // the whole stretch is outside the axis: false
  const int cls = bytes_tri(table + flat, a, b);
  // Positions outside the axis read false: the stretch is then at most mixed.
  return cls == 2 && (lo < 0 || hi >= extent) ? 1 : cls;
}

// A per-pair mask (`param m: bool[q, kv]`), packed by plan() (attnlang/runtime/pairmask.py)
// into one buffer: a header of int64 {requests B, bits offset, blocks offset, (block_q,
// block_kv) as two int32}, then int64 word_start[B] and block_start[B]. Request b's matrix
// [qo_len, kv_len] is row-major bits from word word_start[b] of the bits (bit i of a word is
// its i-th element); its block summary holds a byte per block_q x block_kv block, row-major:
// bit 0 some element is true, bit 1 some is false.
// A row's bits for the keys [kv_lo, kv_lo + kKeys) of a tile, realigned so that bit i of
// word k is key kv_lo + 32 k + i: a masked tile reads its row's bits once, not per element.
struct PairWindow {
  unsigned word[4];
  int kv_lo;
};

__device__ __forceinline__ bool pair_window_bit(const PairWindow& win, const int col) {
  const int rel = col - win.kv_lo;  // 0 .. kKeys - 1
  const unsigned word = rel < 32 ? win.word[0] : rel < 64 ? win.word[1]
                        : rel < 96 ? win.word[2] : win.word[3];
  return (word >> (rel & 31)) & 1u;
}

// Element (row, col) of the request's matrix; false outside it (the rows a tile pads with).
__device__ __forceinline__ bool pair_bit(const unsigned char* base, const Index& ix,
                                         const int row, const int col) {
  if (ix.pair_window != nullptr) return pair_window_bit(*ix.pair_window, col);
  if (static_cast<unsigned>(row) >= static_cast<unsigned>(ix.qo_len) ||
      static_cast<unsigned>(col) >= static_cast<unsigned>(ix.kv_len)) {
    return false;
  }
  const long long* head = reinterpret_cast<const long long*>(base);
  const unsigned* bits = reinterpret_cast<const unsigned*>(base + head[1]);
  const long long bit = head[4 + ix.batch] * 32 + static_cast<long long>(row) * ix.kv_len + col;
  return (bits[bit >> 5] >> (bit & 31)) & 1u;
}

// The window of ix's row (q_row) for the keys [kv_lo, kv_lo + kKeys): ceil(kKeys / 32) + 1
// words loaded (plan() pads the bits, so the last may run past them), funnel-shifted into
// place. Rows outside the request get an empty window. A caller whose keys are kv_lo plus
// compile-time offsets makes every pair_window_bit a constant shift.
template <int kKeys>
__device__ __forceinline__ PairWindow make_pair_window(const unsigned char* base, const Index& ix,
                                                       const int kv_lo) {
  constexpr int kWords = (kKeys + 31) / 32;
  static_assert(kWords <= 4, "windows of at most 4 words");
  PairWindow win;
  win.kv_lo = kv_lo;
#pragma unroll
  for (int k = 0; k < 4; ++k) win.word[k] = 0u;
  const int row = ix.q_pos - (ix.kv_len - ix.qo_len);
  if (static_cast<unsigned>(row) >= static_cast<unsigned>(ix.qo_len)) return win;
  const long long* head = reinterpret_cast<const long long*>(base);
  const unsigned* bits = reinterpret_cast<const unsigned*>(base + head[1]);
  const long long first = head[4 + ix.batch] * 32 + static_cast<long long>(row) * ix.kv_len + kv_lo;
  const unsigned* words = bits + (first >> 5);
  const unsigned shift = static_cast<unsigned>(first & 31);
  unsigned raw[kWords + 1];
#pragma unroll
  for (int k = 0; k <= kWords; ++k) raw[k] = words[k];
#pragma unroll
  for (int k = 0; k < kWords; ++k) win.word[k] = __funnelshift_r(raw[k], raw[k + 1], shift);
  return win;
}

// Summary blocks of 16 rows x 32 keys (pairmask.BLOCK_Q, BLOCK_KV; a test keeps them equal).
inline constexpr int kPairBlockQ = 16, kPairBlockKV = 32;

// Request ix.batch's block summary in the buffer (what pair_tile reads).
__device__ __forceinline__ const unsigned char* pair_blocks_of(const unsigned char* base,
                                                               const Index& ix) {
  const long long* head = reinterpret_cast<const long long*>(base);
  return base + head[2] + head[4 + head[0] + ix.batch];
}

// The class of rows [row_lo, row_hi] x keys [col_lo, col_hi] of the request's matrix (0 all
// false, 1 mixed, 2 all true) from the summary bytes of the blocks covering it.
__device__ __forceinline__ int pair_tile(const unsigned char* base, const Index& ix, int row_lo,
                                         int row_hi, int col_lo, int col_hi) {
  constexpr int block_q = kPairBlockQ, block_kv = kPairBlockKV;
  const unsigned char* blocks = ix.pair_blocks != nullptr ? ix.pair_blocks
                                                          : pair_blocks_of(base, ix);
  row_lo = imax(row_lo, 0), row_hi = imin(row_hi, ix.qo_len - 1);
  col_lo = imax(col_lo, 0), col_hi = imin(col_hi, ix.kv_len - 1);
  if (row_lo > row_hi || col_lo > col_hi) return 1;
  const int blocks_per_row = ceil_div(ix.kv_len, block_kv);
  unsigned seen = 0;  // bit 0: a true element, bit 1: a false one
  for (int qb = row_lo / block_q; qb <= row_hi / block_q && seen != 3; ++qb) {
    for (int kb = col_lo / block_kv; kb <= col_hi / block_kv; ++kb) {
      seen |= blocks[qb * blocks_per_row + kb];
    }
  }
  return seen == 1 ? 2 : (seen == 2 ? 0 : 1);
}

// Length of request `batch`'s KV sequence: full pages plus the last page's valid tokens.
__device__ __forceinline__ int request_kv_len(const int* kv_indptr, const int* kv_last_page_len,
                                              const int batch, const int page_size) {
  const int num_pages = kv_indptr[batch + 1] - kv_indptr[batch];
  return num_pages > 0 ? (num_pages - 1) * page_size + kv_last_page_len[batch] : 0;
}

// ---------------------------------------------------------------------------- fast math

// 2^x on the MUFU unit; ex2_approx(-inf) = +0, which the online softmax relies on.
__device__ __forceinline__ float ex2_approx(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

__device__ __forceinline__ float tanh_approx(float x) {
  float y;
  asm("tanh.approx.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

// 1 / (1 + e^-x); e^-x overflows to inf for x << 0 and 1 / inf = 0, the right limit. The
// fast division (a reciprocal, 2 ulp): an IEEE one per score is ~10 instructions and a
// slow-path branch.
__device__ __forceinline__ float sigmoid(float x) { return __fdividef(1.0f, 1.0f + __expf(-x)); }

// log(1 + e^x) = max(x, 0) + log1p(e^-|x|): no overflow, accurate for x << 0 too.
__device__ __forceinline__ float softplus(float x) {
  return fmaxf(x, 0.0f) + log1pf(__expf(-fabsf(x)));
}

// ---------------------------------------------------------------------------- row groups

// The warp lanes of the calling thread's group of TX lanes.
template <int TX>
__device__ __forceinline__ unsigned group_mask() {
  static_assert(TX >= 1 && TX <= 32 && (TX & (TX - 1)) == 0, "TX: a power of two <= 32");
  if constexpr (TX == 32) {
    return 0xffffffffu;
  } else {
    unsigned lane;
    asm("mov.u32 %0, %%laneid;" : "=r"(lane));
    const unsigned group_first_lane = lane & ~unsigned(TX - 1);
    return ((1u << TX) - 1u) << group_first_lane;
  }
}

struct SumOp { __device__ __forceinline__ float operator()(float a, float b) const { return a + b; } };
struct MaxOp { __device__ __forceinline__ float operator()(float a, float b) const { return fmaxf(a, b); } };
struct MinOp { __device__ __forceinline__ float operator()(float a, float b) const { return fminf(a, b); } };

// Butterfly over the TX lanes of the group: at each step lane l combines with l ^ offset,
// so every lane ends with the same, bitwise identical value (op is commutative).
template <int TX, typename Op>
__device__ __forceinline__ float group_allreduce(float v, Op op) {
  const unsigned mask = group_mask<TX>();
#pragma unroll
  for (int offset = TX / 2; offset >= 1; offset /= 2) {
    v = op(v, __shfl_xor_sync(mask, v, offset, TX));
  }
  return v;
}

template <int VEC, int TX, typename Op>
__device__ __forceinline__ float group_reduce(const float (&t)[VEC], Op op) {
  float lane_value = t[0];
#pragma unroll
  for (int i = 1; i < VEC; ++i) lane_value = op(lane_value, t[i]);
  return group_allreduce<TX>(lane_value, op);
}

template <int VEC, int TX>
__device__ __forceinline__ float group_sum(const float (&t)[VEC]) { return group_reduce<VEC, TX>(t, SumOp{}); }
template <int VEC, int TX>
__device__ __forceinline__ float group_mean(const float (&t)[VEC]) {
  // A power-of-two length has an exact reciprocal; others (192) take a true division.
  constexpr int kLen = VEC * TX;
  const float sum = group_reduce<VEC, TX>(t, SumOp{});
  return (kLen & (kLen - 1)) == 0 ? sum * (1.0f / float(kLen)) : sum / float(kLen);
}
template <int VEC, int TX>
__device__ __forceinline__ float group_max(const float (&t)[VEC]) { return group_reduce<VEC, TX>(t, MaxOp{}); }
template <int VEC, int TX>
__device__ __forceinline__ float group_min(const float (&t)[VEC]) { return group_reduce<VEC, TX>(t, MinOp{}); }

// ---------------------------------------------------------------------------- rope
//
// angle(j) = pos * theta^(-2 j / head_dim) for frequency index j. Positions reach 1e5 and
// more, where a float32 angle is off by ~1e-2 rad and fast sin/cos are useless. So the
// angle is reduced exactly in turns: g = theta^(-2j/D) / (2 pi) is computed in double and
// split into float hi + lo; pos * g = hi_prod + err + pos * lo (err exact by fma); its
// fractional part f in [-1/2, 1/2] is exact to ~1e-7 turns, and __sincosf(2 pi f) is
// accurate (|arg| <= pi): ~1e-6 rad at any position below 2^24.
//
// g depends only on (theta, the lane's elements), not on pos. It is computed with the
// branch-free double helpers below (pure arithmetic and bit operations: no libdevice call,
// no branch), so when theta is a literal or a kernel param the compiler can hoist it out
// of the kernels' loops, and the per-call cost is a few float ops and two MUFU ops per
// element.

// The helpers below use plain operators, not fma() (an intrinsic that NVVM neither folds nor
// hoists; the compiler still contracts a * b + c into FMAs), and memcpy bit casts (plain
// LLVM bitcasts), so that they fold for literal inputs and hoist out of loops.
__device__ __forceinline__ long long double_bits(const double x) {
  long long bits;
  memcpy(&bits, &x, sizeof(bits));
  return bits;
}
__device__ __forceinline__ double bits_double(const long long bits) {
  double x;
  memcpy(&x, &bits, sizeof(x));
  return x;
}

// 1 / d for d in [1 + sqrt(1/2), 1 + sqrt(2)]: minimax linear seed (1.5% error), then four
// Newton steps (error squares each step: 2e-4, 5e-8, 3e-15, rounding).
__device__ __forceinline__ double rcp_on_log_range(const double d) {
  double r = 0.9850615 - 0.239016 * d;
  #pragma unroll
  for (int step = 0; step < 4; ++step) r = r + r * (1.0 - d * r);
  return r;
}

// log2(x) for normal x > 0, branch-free, ~2e-16 absolute error.
// x = 2^e * m, m in [sqrt(1/2), sqrt(2)); ln m = 2 atanh(u), u = (m - 1) / (m + 1), |u| <= 0.172.
__device__ __forceinline__ double log2_pure(const double x) {
  const long long bits = double_bits(x);
  int e = static_cast<int>((bits >> 52) & 0x7ff) - 1023;
  double m = bits_double((bits & 0x000fffffffffffffLL) | 0x3ff0000000000000LL);
  const bool above = m > 1.4142135623730951;
  m = above ? 0.5 * m : m;
  e += above ? 1 : 0;
  const double u = (m - 1.0) * rcp_on_log_range(m + 1.0);
  const double w = u * u;  // <= 0.0295: 12 terms of atanh(u) / u = sum w^k / (2k + 1)
  double series = 1.0 / 23.0;
  #pragma unroll
  for (int k = 10; k >= 0; --k) series = series * w + 1.0 / (2 * k + 1);
  const double ln_m = 2.0 * u * series;
  return static_cast<double>(e) + ln_m * 1.4426950408889634074;  // log2(e)
}

// 2^y for |y| < 1000, branch-free, ~2e-16 relative error.
// y = n + f, n = rint(y), |f| <= 1/2; 2^f = e^t, t = f ln 2, by its Taylor series to t^13.
__device__ __forceinline__ double exp2_pure(const double y) {
  constexpr double kRoundMagic = 6755399441055744.0;  // 1.5 * 2^52: (y + C) - C = rint(y)
  const double n = (y + kRoundMagic) - kRoundMagic;
  const double t = (y - n) * 0.69314718055994530942;
  double series = 1.0 / 6227020800.0;  // 1 / 13!
  double inv_factorial = 1.0 / 6227020800.0;
  #pragma unroll
  for (int k = 13; k >= 1; --k) {
    inv_factorial *= k;  // 1 / (k - 1)!
    series = series * t + inv_factorial;
  }
  return bits_double(double_bits(series) + (static_cast<long long>(n) << 52));
}

// The fractional turns of pos * (g_hi + g_lo), in [-0.5, 0.5].
__device__ __forceinline__ float rope_turns(const int pos, const float g_hi, const float g_lo) {
  const float p = static_cast<float>(pos);            // exact for |pos| < 2^24
  const float prod = p * g_hi;
  const float prod_err = fmaf(p, g_hi, -prod);        // p * g_hi - prod, exactly
  const float whole_turns = rintf(prod);
  return (prod - whole_turns) + (prod_err + p * g_lo);  // prod - rint(prod) is exact
}

// cos/sin of pos * theta^(-2 j / head_dim) for j = j0 + k, k < N (0 <= j0 < head_dim / 2).
template <int N, int kHeadDimRope>
__device__ __forceinline__ void rope_cos_sin(const int j0, const int pos, const float theta,
                                             float (&cos_out)[N], float (&sin_out)[N]) {
  constexpr double kInvTwoPi = 0.15915494309189533577;
  // inv_freq(j) = 2^(j * y), y = -2 / D * log2(theta); successive j differ by 2^y.
  const double y = -2.0 / kHeadDimRope * log2_pure(static_cast<double>(theta));
  const double ratio = exp2_pure(y);
  double turns_per_pos = exp2_pure(j0 * y) * kInvTwoPi;  // turns per position, j = j0
#pragma unroll
  for (int k = 0; k < N; ++k) {
    const float g_hi = static_cast<float>(turns_per_pos);
    const float g_lo = static_cast<float>(turns_per_pos - static_cast<double>(g_hi));
    const float angle = 6.283185307179586f * rope_turns(pos, g_hi, g_lo);  // |angle| <= pi
    __sincosf(angle, &sin_out[k], &cos_out[k]);
    turns_per_pos *= ratio;
  }
}

// Rotate-half (NeoX / Llama): pairs (d, d + D/2). Element d + D/2 of a row sits in lane
// tx ^ (TX/2) of the group at the same register index, since D/2 = (TX/2) * VEC.
//   d <  D/2: out_d = x_d cos(a_j) - x_{d+D/2} sin(a_j)      j = d mod D/2
//   d >= D/2: out_d = x_d cos(a_j) + x_{d-D/2} sin(a_j)
template <int VEC, int TX>
__device__ __forceinline__ void rope_rotate_half(float (&out)[VEC], const float (&x)[VEC],
                                                 const int dim0, const int pos, const float theta) {
  static_assert(TX >= 2, "rotate-half rope needs the row spread over >= 2 lanes");
  constexpr int kHalf = VEC * TX / 2;
  const unsigned mask = group_mask<TX>();
  const bool first_half = dim0 < kHalf;
  const int j0 = first_half ? dim0 : dim0 - kHalf;  // frequency index of element dim0
  float c[VEC], s[VEC];
  rope_cos_sin<VEC, VEC * TX>(j0, pos, theta, c, s);
#pragma unroll
  for (int i = 0; i < VEC; ++i) {
    const float partner = __shfl_xor_sync(mask, x[i], TX / 2, TX);
    out[i] = first_half ? x[i] * c[i] - partner * s[i] : x[i] * c[i] + partner * s[i];
  }
}

// Interleaved (GPT-J): pairs (2j, 2j + 1) in the same lane (dim0 and VEC are even).
//   out_{2j} = x_{2j} cos(a_j) - x_{2j+1} sin(a_j);  out_{2j+1} = x_{2j+1} cos(a_j) + x_{2j} sin(a_j)
template <int VEC, int TX>
__device__ __forceinline__ void rope_interleaved(float (&out)[VEC], const float (&x)[VEC],
                                                 const int dim0, const int pos, const float theta) {
  static_assert(VEC % 2 == 0, "interleaved rope needs pairs within a lane");
  constexpr int kPairs = VEC / 2;
  float c[kPairs], s[kPairs];
  rope_cos_sin<kPairs, VEC * TX>(dim0 / 2, pos, theta, c, s);
#pragma unroll
  for (int k = 0; k < kPairs; ++k) {
    const float even = x[2 * k], odd = x[2 * k + 1];
    out[2 * k] = even * c[k] - odd * s[k];
    out[2 * k + 1] = odd * c[k] + even * s[k];
  }
}

}  // namespace attnlang
