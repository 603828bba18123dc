// mask_tiles.cuh: interval arithmetic for variant::mask_tile (attnlang/codegen/mask_tiles.py).
//
// A tile of (query, key) pairs is a box of positions; evaluating the mask over intervals
// says soundly whether every pair is masked (0, EMPTY: skip the tile), every pair visible
// (2, FULL: skip the per-element mask) or neither is known (1, PARTIAL).
//   IvI   an int interval [lo, hi] (64-bit: no overflow on products of positions)
//   IvF   a float interval; comparisons of floats widen it first by a margin, since the
//         per-element mask computes them in float32 with fast intrinsics
//   tri   0 false everywhere, 1 unknown, 2 true everywhere
// Host and device, so the CPU tests compile and check this header with a C++ compiler.
#pragma once
#ifndef ATTNLANG_HD
#define ATTNLANG_HD __host__ __device__ __forceinline__
#endif

namespace attnlang {
namespace mask_tiles {

constexpr long long kIntTop = 1LL << 40;  // bound of an unknown int: beyond any length

// +inf on the device (NVRTC has no __builtin_huge_valf) and on the host (the CPU tests).
ATTNLANG_HD float infinity() {
#ifdef __CUDA_ARCH__
  return __uint_as_float(0x7f800000u);
#else
  return __builtin_huge_valf();
#endif
}

struct IvI {
  long long lo, hi;
  ATTNLANG_HD static IvI point(long long x) { return {x, x}; }
  ATTNLANG_HD static IvI top() { return {-kIntTop, kIntTop}; }
};

struct IvF {
  float lo, hi;
  ATTNLANG_HD static IvF point(float x) { return {x, x}; }
  ATTNLANG_HD static IvF top() { return {-infinity(), infinity()}; }
};

ATTNLANG_HD long long mn(long long a, long long b) { return a < b ? a : b; }
ATTNLANG_HD long long mx(long long a, long long b) { return a > b ? a : b; }
ATTNLANG_HD long long clamp_top(long long x) { return mn(mx(x, -kIntTop), kIntTop); }
ATTNLANG_HD float fmn(float a, float b) { return a < b ? a : b; }
ATTNLANG_HD float fmx(float a, float b) { return a > b ? a : b; }
ATTNLANG_HD bool bad(float x) { return x != x; }  // NaN

ATTNLANG_HD IvF to_float(IvI a) { return {static_cast<float>(a.lo), static_cast<float>(a.hi)}; }
ATTNLANG_HD IvF to_float(IvF a) { return a; }

ATTNLANG_HD IvI iv_neg(IvI a) { return {-a.hi, -a.lo}; }
ATTNLANG_HD IvF iv_neg(IvF a) { return {-a.hi, -a.lo}; }
ATTNLANG_HD IvI iv_add(IvI a, IvI b) { return {clamp_top(a.lo + b.lo), clamp_top(a.hi + b.hi)}; }
ATTNLANG_HD IvF iv_add(IvF a, IvF b) { return {a.lo + b.lo, a.hi + b.hi}; }
ATTNLANG_HD IvI iv_sub(IvI a, IvI b) { return {clamp_top(a.lo - b.hi), clamp_top(a.hi - b.lo)}; }
ATTNLANG_HD IvF iv_sub(IvF a, IvF b) { return {a.lo - b.hi, a.hi - b.lo}; }

ATTNLANG_HD IvI iv_mul(IvI a, IvI b) {
  // Operands are clamped to +-2^40, so the corner products cannot overflow 2^63 when one
  // of them is small; unknown times unknown saturates to top.
  if (a.lo <= -kIntTop || a.hi >= kIntTop || b.lo <= -kIntTop || b.hi >= kIntTop) {
    if (!(a.lo == 0 && a.hi == 0) && !(b.lo == 0 && b.hi == 0)) return IvI::top();
  }
  const long long c0 = a.lo * b.lo, c1 = a.lo * b.hi, c2 = a.hi * b.lo, c3 = a.hi * b.hi;
  return {clamp_top(mn(mn(c0, c1), mn(c2, c3))), clamp_top(mx(mx(c0, c1), mx(c2, c3)))};
}
ATTNLANG_HD IvF iv_mul(IvF a, IvF b) {
  const float c0 = a.lo * b.lo, c1 = a.lo * b.hi, c2 = a.hi * b.lo, c3 = a.hi * b.hi;
  if (bad(c0) || bad(c1) || bad(c2) || bad(c3)) return IvF::top();  // 0 * inf
  return {fmn(fmn(c0, c1), fmn(c2, c3)), fmx(fmx(c0, c1), fmx(c2, c3))};
}

// Truncating division by a known nonzero divisor is monotone in the dividend; a run-time
// zero divisor yields 0 (LANGUAGE.md decisions); anything else is unknown.
ATTNLANG_HD IvI iv_div(IvI a, IvI b) {
  if (b.lo != b.hi) return IvI::top();
  if (b.lo == 0) return IvI::point(0);
  const long long q1 = a.lo / b.lo, q2 = a.hi / b.lo;
  return {mn(q1, q2), mx(q1, q2)};
}
ATTNLANG_HD IvF iv_div(IvF a, IvF b) {
  if (!(b.lo > 0.0f || b.hi < 0.0f)) return IvF::top();
  const float c0 = a.lo / b.lo, c1 = a.lo / b.hi, c2 = a.hi / b.lo, c3 = a.hi / b.hi;
  if (bad(c0) || bad(c1) || bad(c2) || bad(c3)) return IvF::top();
  return {fmn(fmn(c0, c1), fmn(c2, c3)), fmx(fmx(c0, c1), fmx(c2, c3))};
}
// C's %: |x % c| < |c|, with the sign of x.
ATTNLANG_HD IvI iv_mod(IvI a, IvI b) {
  if (b.lo != b.hi || b.lo == 0) return IvI::top();
  const long long m = (b.lo < 0 ? -b.lo : b.lo) - 1;
  // Within one period of one sign, x % c grows with x (a point is the smallest such range).
  if ((a.lo >= 0 || a.hi <= 0) && a.lo / b.lo == a.hi / b.lo) return {a.lo % b.lo, a.hi % b.lo};
  return {a.lo >= 0 ? 0 : -m, a.hi <= 0 ? 0 : m};
}
ATTNLANG_HD IvF iv_mod(IvF, IvF) { return IvF::top(); }
// Python's // and mod(): floor division by a fixed divisor is monotone in the dividend, and
// mod(x, c) lies between 0 and c (excluded) with the sign of c. A zero divisor yields 0.
ATTNLANG_HD long long floor_div_ll(long long a, long long b) {
  const long long q = a / b;
  return (a % b != 0 && (a < 0) != (b < 0)) ? q - 1 : q;
}
ATTNLANG_HD IvI iv_floordiv(IvI a, IvI b) {
  if (b.lo != b.hi) return IvI::top();
  if (b.lo == 0) return IvI::point(0);
  const long long q1 = floor_div_ll(a.lo, b.lo), q2 = floor_div_ll(a.hi, b.lo);
  return {mn(q1, q2), mx(q1, q2)};
}
ATTNLANG_HD IvF iv_floordiv(IvF, IvF) { return IvF::top(); }
ATTNLANG_HD IvI iv_floormod(IvI a, IvI b) {
  if (b.lo != b.hi) return IvI::top();
  const long long c = b.lo;
  if (c == 0) return IvI::point(0);
  // Within one period (one floor quotient), mod(x, c) grows with x.
  const long long q = floor_div_ll(a.lo, c);
  if (q == floor_div_ll(a.hi, c)) return {a.lo - q * c, a.hi - q * c};
  if (c > 0) return (a.lo >= 0 && a.hi < c) ? a : IvI{0, c - 1};
  return (a.hi <= 0 && a.lo > c) ? a : IvI{c + 1, 0};
}
ATTNLANG_HD IvF iv_floormod(IvF, IvF) { return IvF::top(); }

ATTNLANG_HD IvI iv_min(IvI a, IvI b) { return {mn(a.lo, b.lo), mn(a.hi, b.hi)}; }
ATTNLANG_HD IvF iv_min(IvF a, IvF b) { return {fmn(a.lo, b.lo), fmn(a.hi, b.hi)}; }
ATTNLANG_HD IvI iv_max(IvI a, IvI b) { return {mx(a.lo, b.lo), mx(a.hi, b.hi)}; }
ATTNLANG_HD IvF iv_max(IvF a, IvF b) { return {fmx(a.lo, b.lo), fmx(a.hi, b.hi)}; }
ATTNLANG_HD IvI iv_clamp(IvI x, IvI lo, IvI hi) { return iv_min(iv_max(x, lo), hi); }
ATTNLANG_HD IvF iv_clamp(IvF x, IvF lo, IvF hi) { return iv_min(iv_max(x, lo), hi); }
ATTNLANG_HD IvI iv_abs(IvI a) {
  const long long l = a.lo < 0 ? -a.lo : a.lo, h = a.hi < 0 ? -a.hi : a.hi;
  return {(a.lo < 0 && a.hi > 0) ? 0 : mn(l, h), mx(l, h)};
}
ATTNLANG_HD IvF iv_abs(IvF a) {
  const float l = fabsf(a.lo), h = fabsf(a.hi);
  return {(a.lo < 0.0f && a.hi > 0.0f) ? 0.0f : fmn(l, h), fmx(l, h)};
}
// A float interval widened by the margin that covers the fast intrinsics' error (comparisons
// and int() take it; an infinite bound stays infinite).
ATTNLANG_HD IvF widen(IvF a) {
  const float m = 1e-4f * fmx(fabsf(a.lo), fabsf(a.hi)) + 1e-6f;
  return {a.lo - m, a.hi + m};
}

// Monotone increasing functions map bounds to bounds (accurate versions: a bound is only
// a bound if it is not rounded past the fast per-element value; the comparison margin
// covers the difference).
ATTNLANG_HD IvF iv_floor(IvF a) { return {floorf(a.lo), floorf(a.hi)}; }
ATTNLANG_HD IvF iv_ceil(IvF a) { return {ceilf(a.lo), ceilf(a.hi)}; }
ATTNLANG_HD IvF iv_exp(IvF a) { return {expf(a.lo), expf(a.hi)}; }
ATTNLANG_HD IvF iv_exp2(IvF a) { return {exp2f(a.lo), exp2f(a.hi)}; }
ATTNLANG_HD IvF iv_tanh(IvF a) { return {tanhf(a.lo), tanhf(a.hi)}; }
ATTNLANG_HD IvF iv_sigmoid(IvF a) { return {1.0f / (1.0f + expf(-a.lo)), 1.0f / (1.0f + expf(-a.hi))}; }
ATTNLANG_HD IvF iv_softplus(IvF a) {
  return {fmx(a.lo, 0.0f) + log1pf(expf(-fabsf(a.lo))), fmx(a.hi, 0.0f) + log1pf(expf(-fabsf(a.hi)))};
}
// log and log2 grow on [0, inf) (log 0 = -inf); a negative argument gives NaN: unknown.
ATTNLANG_HD IvF iv_log(IvF a) {
  if (!(a.lo >= 0.0f)) return IvF::top();
  return {logf(a.lo), logf(a.hi)};
}
ATTNLANG_HD IvF iv_log2(IvF a) {
  if (!(a.lo >= 0.0f)) return IvF::top();
  return {log2f(a.lo), log2f(a.hi)};
}
// int(): truncation toward zero of the float, saturating at the int32 bounds, NaN -> 0
// (attnlang::float_to_int). Widened first like a comparison, so an argument the fast
// per-element arithmetic rounds across an integer never truncates outside the interval.
ATTNLANG_HD long long trunc_int32(float x) {
  if (!(x > -2147483648.0f)) return -2147483648LL;  // also -inf; NaN is caught by the caller
  if (!(x < 2147483648.0f)) return 2147483647LL;
  return static_cast<long long>(x);  // truncates toward zero
}
ATTNLANG_HD IvI iv_int(IvF a) {
  a = widen(a);
  if (bad(a.lo) || bad(a.hi)) return {-2147483648LL, 2147483647LL};
  return {trunc_int32(a.lo), trunc_int32(a.hi)};
}
ATTNLANG_HD IvI iv_where(int c, IvI a, IvI b) { return c == 2 ? a : c == 0 ? b : IvI{mn(a.lo, b.lo), mx(a.hi, b.hi)}; }
ATTNLANG_HD IvF iv_where(int c, IvF a, IvF b) { return c == 2 ? a : c == 0 ? b : IvF{fmn(a.lo, b.lo), fmx(a.hi, b.hi)}; }

// ---- comparisons -> tri ----
ATTNLANG_HD int tri_lt(IvI a, IvI b) { return a.hi < b.lo ? 2 : (a.lo >= b.hi ? 0 : 1); }
ATTNLANG_HD int tri_le(IvI a, IvI b) { return a.hi <= b.lo ? 2 : (a.lo > b.hi ? 0 : 1); }
ATTNLANG_HD int tri_eq(IvI a, IvI b) {
  if (a.lo == a.hi && b.lo == b.hi && a.lo == b.lo) return 2;
  return (a.hi < b.lo || b.hi < a.lo) ? 0 : 1;
}
ATTNLANG_HD int tri_lt(IvF a, IvF b) {
  a = widen(a); b = widen(b);
  if (bad(a.lo) || bad(a.hi) || bad(b.lo) || bad(b.hi)) return 1;
  return a.hi < b.lo ? 2 : (a.lo >= b.hi ? 0 : 1);
}
ATTNLANG_HD int tri_le(IvF a, IvF b) { return tri_lt(a, b); }  // widened: < and <= agree
ATTNLANG_HD int tri_eq(IvF a, IvF b) {
  a = widen(a); b = widen(b);
  if (bad(a.lo) || bad(a.hi) || bad(b.lo) || bad(b.hi)) return 1;
  return (a.hi < b.lo || b.hi < a.lo) ? 0 : 1;
}
template <class A, class B> ATTNLANG_HD int tri_gt(A a, B b) { return tri_lt(b, a); }
template <class A, class B> ATTNLANG_HD int tri_ge(A a, B b) { return tri_le(b, a); }
template <class A, class B> ATTNLANG_HD int tri_ne(A a, B b) { return 2 - tri_eq(a, b); }
ATTNLANG_HD int tri_same(int a, int b) { return (a == 1 || b == 1) ? 1 : (a == b ? 2 : 0); }
ATTNLANG_HD int tri_differ(int a, int b) { return 2 - tri_same(a, b); }
ATTNLANG_HD int tri_where(int c, int a, int b) { return c == 2 ? a : c == 0 ? b : (a == b ? a : 1); }
ATTNLANG_HD int tri_and(int a, int b) { return a < b ? a : b; }
ATTNLANG_HD int tri_or(int a, int b) { return a > b ? a : b; }

// The query heads of the tile's rows: those of one KV head under GQA.
template <class Index>
ATTNLANG_HD IvI heads_of(const Index& ix) {
  const long long group = ix.num_heads / ix.num_kv_heads;
  return {ix.kv_head * group, ix.kv_head * group + group - 1};
}

}  // namespace mask_tiles
}  // namespace attnlang
