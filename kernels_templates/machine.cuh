// ============================================================================================
// What attnlang's kernels ask of the machine: 16-byte packs of T, asynchronous copies, fp8
// conversions, dependent launches, division by a run-time constant, mma.sync fragments.
// Spliced into every kernel source right after common.cuh (whose helpers and CUDA headers it
// uses) by a Jinja include.
//
// Symbols defined here (namespace attnlang):
//   Vec<T>, IsBf16<T>        16-byte packs of T <-> float[8] (global / shared memory); bf16?
//   cp_async_16, cp_async_8, cp_async_commit, cp_async_wait<N>, cp_async_wait_all   (sm_80+)
//   fp8x4_to_float, dequantize8<T>   float8 e4m3 -> float; an fp8 cache chunk in place
//   e4m3x4_to_half2x2        four e4m3 values -> two f16x2 (exact; the bit path off sm_89)
//   float2_to_e4m3x2, split_e4m3x2   two floats -> e4m3 (RN, saturated); as hi + lo (sm_89+)
//   store_e4m3x8<T>          eight e4m3 values (two words) -> one chunk of T, times a scale
//   convert8<T>              the same without a scale (the kernel folds it elsewhere)
//   launch_dependents, wait_for_prerequisites   programmatic dependent launch (sm_90+)
//   leaves_idle, has_no_items   a CTA without work returns before the wait (sm_90+)
//   FastDivmod               n / d and n % d by a run-time d with a multiply-high (page_size)
//   quad_allreduce(v, op)    butterfly over the 4 lanes of an mma quad (lanes 4k .. 4k+3)
//   smem_u32(ptr)            the 32-bit shared-window address of a shared-memory pointer
//   ldmatrix_x4, ldmatrix_x4_trans   four 8x8 16-bit matrices shared -> registers (sm_75+)
//   Mma<T>::m16n8k16(acc, a, b0, b1)  acc += A(16x16) B(16x8), fp32 accumulate (sm_80+)
//   pack2<T>(lo, hi)         two floats -> one 32-bit register of T (lo in the low half)
// ============================================================================================
namespace attnlang {

// ---------------------------------------------------------------------------- 16-byte packs

// Conversions of 8 elements packed in 16 bytes (uint4) to and from float registers.
template <typename T> struct Vec;

template <> struct Vec<half> {
  static constexpr int kSize = 8;
  static __device__ __forceinline__ float2 to_float2(unsigned w) {
    __half2 h;
    *reinterpret_cast<unsigned*>(&h) = w;
    return __half22float2(h);
  }
  static __device__ __forceinline__ unsigned from_float2(float a, float b) {
    const __half2 h = __floats2half2_rn(a, b);
    return *reinterpret_cast<const unsigned*>(&h);
  }
};

// Is U bf16? (Paths that treat bf16 as the top half of a float, or need its 8 bits.)
template <typename U> struct IsBf16 { static constexpr bool value = false; };
template <> struct IsBf16<__nv_bfloat16> { static constexpr bool value = true; };

template <> struct Vec<__nv_bfloat16> {
  static constexpr int kSize = 8;
  static __device__ __forceinline__ float2 to_float2(unsigned w) {
    __nv_bfloat162 h;
    *reinterpret_cast<unsigned*>(&h) = w;
    return __bfloat1622float2(h);
  }
  static __device__ __forceinline__ unsigned from_float2(float a, float b) {
    const __nv_bfloat162 h = __floats2bfloat162_rn(a, b);
    return *reinterpret_cast<const unsigned*>(&h);
  }
};

template <typename T>
__device__ __forceinline__ void unpack8(const uint4 raw, float (&x)[8]) {
  const float2 f0 = Vec<T>::to_float2(raw.x), f1 = Vec<T>::to_float2(raw.y);
  const float2 f2 = Vec<T>::to_float2(raw.z), f3 = Vec<T>::to_float2(raw.w);
  x[0] = f0.x; x[1] = f0.y; x[2] = f1.x; x[3] = f1.y;
  x[4] = f2.x; x[5] = f2.y; x[6] = f3.x; x[7] = f3.y;
}

template <typename T>
__device__ __forceinline__ uint4 pack8(const float (&x)[8]) {
  uint4 raw;
  raw.x = Vec<T>::from_float2(x[0], x[1]);
  raw.y = Vec<T>::from_float2(x[2], x[3]);
  raw.z = Vec<T>::from_float2(x[4], x[5]);
  raw.w = Vec<T>::from_float2(x[6], x[7]);
  return raw;
}

// 8 elements at a 16-byte aligned address (global or shared) <-> float[8].
template <typename T>
__device__ __forceinline__ void load8(const T* ptr, float (&x)[8]) {
  unpack8<T>(*reinterpret_cast<const uint4*>(ptr), x);
}
template <typename T>
__device__ __forceinline__ void store8(T* ptr, const float (&x)[8]) {
  *reinterpret_cast<uint4*>(ptr) = pack8<T>(x);
}

// 8 floats at a 16-byte aligned address <-> float[8], as two 16-byte accesses.
__device__ __forceinline__ void load8f(const float* ptr, float (&x)[8]) {
  const float4 a = reinterpret_cast<const float4*>(ptr)[0];
  const float4 b = reinterpret_cast<const float4*>(ptr)[1];
  x[0] = a.x; x[1] = a.y; x[2] = a.z; x[3] = a.w;
  x[4] = b.x; x[5] = b.y; x[6] = b.z; x[7] = b.w;
}
__device__ __forceinline__ void store8f(float* ptr, const float (&x)[8]) {
  reinterpret_cast<float4*>(ptr)[0] = make_float4(x[0], x[1], x[2], x[3]);
  reinterpret_cast<float4*>(ptr)[1] = make_float4(x[4], x[5], x[6], x[7]);
}

// A lane's row elements in whole 16-byte chunks (N = 8 n): chunk c of x is x[8 c .. 8 c + 7],
// and the contiguous forms below move N elements at a 16-byte aligned address.
template <int N>
__device__ __forceinline__ float (&chunk8(float (&x)[N], const int c))[8] {
  static_assert(N % 8 == 0, "whole 16-byte chunks");
  return *reinterpret_cast<float(*)[8]>(x + 8 * c);
}
template <int N>
__device__ __forceinline__ const float (&chunk8(const float (&x)[N], const int c))[8] {
  static_assert(N % 8 == 0, "whole 16-byte chunks");
  return *reinterpret_cast<const float(*)[8]>(x + 8 * c);
}
template <typename T, int N>
__device__ __forceinline__ void load_n(const T* ptr, float (&x)[N]) {
#pragma unroll
  for (int c = 0; c < N / 8; ++c) load8<T>(ptr + 8 * c, chunk8(x, c));
}
template <typename T, int N>
__device__ __forceinline__ void store_n(T* ptr, const float (&x)[N]) {
#pragma unroll
  for (int c = 0; c < N / 8; ++c) store8<T>(ptr + 8 * c, chunk8(x, c));
}
template <int N>
__device__ __forceinline__ void load_nf(const float* ptr, float (&x)[N]) {
#pragma unroll
  for (int c = 0; c < N / 8; ++c) load8f(ptr + 8 * c, chunk8(x, c));
}
template <int N>
__device__ __forceinline__ void store_nf(float* ptr, const float (&x)[N]) {
#pragma unroll
  for (int c = 0; c < N / 8; ++c) store8f(ptr + 8 * c, chunk8(x, c));
}

// ---------------------------------------------------------------------------- cp.async

// Copy 16 bytes global -> shared, bypassing L1 (.cg). valid == false writes 16 zero bytes
// and reads nothing (src-size 0), so guarded rows hold zeros, never stale data.
__device__ __forceinline__ void cp_async_16(void* smem_dst, const void* gmem_src, const bool valid) {
  const unsigned dst = static_cast<unsigned>(__cvta_generic_to_shared(smem_dst));
  const int src_bytes = valid ? 16 : 0;
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n"
               :: "r"(dst), "l"(gmem_src), "r"(src_bytes) : "memory");
}

// Copy 8 bytes global -> shared (.ca: .cg takes only 16), as cp_async_16: an fp8 cache's
// 8 elements, put at the start of the 16-byte chunk their T values will fill (dequantize8).
__device__ __forceinline__ void cp_async_8(void* smem_dst, const void* gmem_src, const bool valid) {
  const unsigned dst = static_cast<unsigned>(__cvta_generic_to_shared(smem_dst));
  const int src_bytes = valid ? 8 : 0;
  asm volatile("cp.async.ca.shared.global [%0], [%1], 8, %2;\n"
               :: "r"(dst), "l"(gmem_src), "r"(src_bytes) : "memory");
}

__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }

// Wait until at most N of this thread's committed groups are still in flight.
template <int N>
__device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;\n" :: "n"(N) : "memory"); }

__device__ __forceinline__ void cp_async_wait_all() { asm volatile("cp.async.wait_all;\n" ::: "memory"); }

// ---------------------------------------------------------------------------- fp8 caches

// Four float8 e4m3 values (OCP e4m3fn: bias 7, no infinities, S.1111.111 is NaN), byte i of
// w -> x[i], exactly. sm_89+ converts pairs in hardware; elsewhere from the bits.
__device__ __forceinline__ void fp8x4_to_float(const unsigned w, float* x) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
  unsigned lo, hi;  // f16x2 of bytes 0, 1 and of bytes 2, 3 (the lower byte in the low half)
  asm("{\n.reg .b16 a, b;\nmov.b32 {a, b}, %2;\ncvt.rn.f16x2.e4m3x2 %0, a;\n"
      "cvt.rn.f16x2.e4m3x2 %1, b;\n}\n" : "=r"(lo), "=r"(hi) : "r"(w));
  const float2 f0 = Vec<half>::to_float2(lo), f1 = Vec<half>::to_float2(hi);
  x[0] = f0.x; x[1] = f0.y; x[2] = f1.x; x[3] = f1.y;
#else
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const unsigned b = (w >> (8 * i)) & 0xffu, e = (b >> 3) & 15u, m = b & 7u;
    // Normal: 2^(e - 7) (1 + m / 8) as float bits; subnormal: m 2^-9.
    float v = e ? __uint_as_float(((e + 120u) << 23) | (m << 20)) : static_cast<float>(m) * 0.001953125f;
    if (e == 15u && m == 7u) v = __uint_as_float(0x7fc00000u);
    x[i] = (b & 0x80u) ? -v : v;
  }
#endif
}

// Two e4m3 values placed at bits 15..8 and 31..24 -> f16x2, exactly, without the hardware
// conversion: sign to bit 15, exponent and mantissa to bits 13..7 make the f16 of the value
// times 2^-8 (subnormals too), one f16x2 multiply by 2^8 restores it, and S.1111.111 (an
// e4m3fn NaN, which would read 480) is made a NaN.
__device__ __forceinline__ unsigned e4m3x2_placed_to_half2(const unsigned placed) {
  const unsigned bits = (placed & 0x80008000u) | ((placed >> 1) & 0x3f803f80u);
  const __half2 scaled = __hmul2(*reinterpret_cast<const __half2*>(&bits),
                                 __floats2half2_rn(256.0f, 256.0f));
  const unsigned nan = (((placed & 0x7f007f00u) + 0x01000100u) & 0x80008000u) >> 15;
  return *reinterpret_cast<const unsigned*>(&scaled) | nan * 0x7e00u;
}

// Four e4m3 values (byte i of w) -> two f16x2, bytes 0, 1 in `lo` and 2, 3 in `hi` (the lower
// byte in the low half), exactly: every e4m3 value is an f16 value. sm_89+ converts pairs in
// hardware.
__device__ __forceinline__ void e4m3x4_to_half2x2(const unsigned w, unsigned& lo, unsigned& hi) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
  asm("{\n.reg .b16 a, b;\nmov.b32 {a, b}, %2;\ncvt.rn.f16x2.e4m3x2 %0, a;\n"
      "cvt.rn.f16x2.e4m3x2 %1, b;\n}\n" : "=r"(lo), "=r"(hi) : "r"(w));
#else
  lo = e4m3x2_placed_to_half2(__byte_perm(w, 0, 0x1404));  // bytes 0, 1 to bits 15..8, 31..24
  hi = e4m3x2_placed_to_half2(__byte_perm(w, 0, 0x3424));
#endif
}

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
// Two floats -> e4m3 (x0 in the low byte), rounded to nearest even, saturated to +-448 (sm_89+).
__device__ __forceinline__ unsigned float2_to_e4m3x2(const float x0, const float x1) {
  unsigned short r;
  asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;\n" : "=h"(r) : "f"(x1), "f"(x0));
  return r;
}

// x0, x1 as the sum of two e4m3 pairs, hi + lo (the low byte x0's): hi rounds x, lo rounds what
// hi left, so hi + lo carries 8 significant bits, a bf16's, where x stays within e4m3's
// normal range (|x| <= 448). Returns hi | lo << 16.
__device__ __forceinline__ unsigned split_e4m3x2(const float x0, const float x1) {
  const unsigned hi = float2_to_e4m3x2(x0, x1);
  unsigned back;  // hi as f16x2, exactly
  asm("cvt.rn.f16x2.e4m3x2 %0, %1;\n" : "=r"(back) : "h"(static_cast<unsigned short>(hi)));
  const float2 h = Vec<half>::to_float2(back);
  return hi | float2_to_e4m3x2(x0 - h.x, x1 - h.y) << 16;
}
#else
// (Only kFp8Qk kernels call it, which are sm_90a's.)
__device__ __forceinline__ unsigned split_e4m3x2(float, float) {
  asm volatile("trap;");
  return 0u;
}
#endif

// Eight e4m3 values (two words, the lower byte first) as one chunk of T, times `scale`.
template <typename T>
__device__ __forceinline__ void store_e4m3x8(T* chunk, const unsigned lo, const unsigned hi,
                                             const float scale) {
  float x[8];
  fp8x4_to_float(lo, x);
  fp8x4_to_float(hi, x + 4);
#pragma unroll
  for (int i = 0; i < 8; ++i) x[i] *= scale;
  store8<T>(chunk, x);
}

// The 8 e4m3 values a copy put at the start of a 16-byte chunk of shared memory become its 8
// values of T, times `scale`, in place. Only the chunk itself is read and written, so
// whoever converts a chunk (its copying thread, or one of the computing warps beside a
// producer) needs no other thread's data.
template <typename T>
__device__ __forceinline__ void dequantize8(T* chunk, const float scale) {
  const uint2 raw = *reinterpret_cast<const uint2*>(chunk);
  store_e4m3x8(chunk, raw.x, raw.y, scale);
}

// dequantize8 without the scale (the kernel applies it elsewhere): into half on sm_89+ the
// hardware's f16x2 are the values already; other types through float.
template <typename T>
__device__ __forceinline__ void convert8(T* chunk) {
  dequantize8(chunk, 1.0f);
}

template <>
__device__ __forceinline__ void convert8<half>(half* chunk) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
  const uint2 raw = *reinterpret_cast<const uint2*>(chunk);
  uint4 out;
  asm("{\n.reg .b16 a, b, c, d;\nmov.b32 {a, b}, %4;\nmov.b32 {c, d}, %5;\n"
      "cvt.rn.f16x2.e4m3x2 %0, a;\ncvt.rn.f16x2.e4m3x2 %1, b;\n"
      "cvt.rn.f16x2.e4m3x2 %2, c;\ncvt.rn.f16x2.e4m3x2 %3, d;\n}\n"
      : "=r"(out.x), "=r"(out.y), "=r"(out.z), "=r"(out.w) : "r"(raw.x), "r"(raw.y));
  *reinterpret_cast<uint4*>(chunk) = out;
#else
  dequantize8(chunk, 1.0f);
#endif
}

// ---------------------------------------------------------------------------- dependent launch
//
// Programmatic dependent launch (sm_90+; no-ops before): run() launches every kernel with
// CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION (attnlang.runtime.launches), so a
// kernel's CTAs may start while the kernel before it in the stream still runs, once every CTA
// of that one has called launch_dependents (which each of attnlang's kernels does first) or
// exited. wait_for_prerequisites returns once the kernel before has completed and its writes
// are visible: a kernel reads before it only what the plan alone decides (its arrays were
// copied before either kernel ran; never q, the cache or the params, which the hooks read):
// whether this CTA has work (leaves_idle), the merge kernel its rows' slots, the tensor-core
// decode kernel its first work item. A kernel launched without the attribute returns from
// the wait at once.
__device__ __forceinline__ void launch_dependents() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
#endif
}
__device__ __forceinline__ void wait_for_prerequisites() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;\n" ::: "memory");
#endif
}

// Whether a CTA with no work in this launch (idle) may return at once, before the wait: every
// idle CTA but the grid's first (sm_90+). Returning frees its SM for the next kernel's CTAs,
// which would otherwise wait there until the kernel before this one completes (a graph holds
// launches with no work: a plan without decode rows still launches the decode kernel). The
// first CTA waits all the same, so this grid still completes only after the one before it,
// which the next kernel, waiting on this one alone, relies on. Before sm_90 kernels do not
// overlap, and idle CTAs run on as they always did.
__device__ __forceinline__ bool leaves_idle(const bool idle) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  return idle && (blockIdx.x | blockIdx.y | blockIdx.z) != 0;
#else
  return false;
#endif
}
// Whether this CTA has no work items (work_indptr, the plan's array; sm_90+, for leaves_idle).
// The two loads are opaque to the compiler, so it does not keep their values for the kernel's
// own reads of the same words later: holding them from here on cost the prefill kernel spills.
__device__ __forceinline__ bool has_no_items(const int* work_indptr) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  int first, end;
  asm volatile("ld.global.nc.s32 %0, [%2];\n\tld.global.nc.s32 %1, [%2+4];\n"
               : "=r"(first), "=r"(end) : "l"(work_indptr + blockIdx.x));
  return first == end;
#else
  return false;
#endif
}

// ---------------------------------------------------------------------------- fast divmod

// n / d and n % d for 0 <= n < 2^31 and a run-time 1 <= d < 2^31 (Granlund-Montgomery):
// with s = ceil(log2 d) and m = floor(2^32 (2^s - d) / d) + 1, n / d = (umulhi(n, m) + n) >> s.
// umulhi(n, m) <= n < 2^31, so the sum never wraps. Built once per thread (one 64-bit
// division), then a multiply-high, an add and a shift per use instead of ~20 instructions.
struct FastDivmod {
  unsigned divisor, multiplier, shift;

  __device__ __forceinline__ explicit FastDivmod(const int d) : divisor(static_cast<unsigned>(d)) {
    shift = 0;
    while ((1u << shift) < divisor) ++shift;
    const unsigned long long two_s = 1ull << shift;
    multiplier = static_cast<unsigned>(((two_s - divisor) << 32) / divisor + 1);
  }
  __device__ __forceinline__ int div(const int n) const {
    const unsigned un = static_cast<unsigned>(n);
    return static_cast<int>((__umulhi(un, multiplier) + un) >> shift);
  }
  __device__ __forceinline__ void divmod(const int n, int& quotient, int& remainder) const {
    quotient = div(n);
    remainder = n - quotient * static_cast<int>(divisor);
  }
};

// ---------------------------------------------------------------------------- mma fragments
//
// Fragments of mma.sync.aligned.m16n8k16.row.col (PTX ISA, "Matrix fragments for mma.m16n8k16").
// In a warp, lane l has quad row  lane_row = l / 4  (0..7)  and  quad column  lane_col = 2 (l % 4):
//   A 16x16 (row-major), 4 x 32-bit registers of two 16-bit elements (low half = lower column):
//     a0: (lane_row,     lane_col + {0,1})    a1: (lane_row + 8, lane_col + {0,1})
//     a2: (lane_row,     lane_col + 8 + {0,1}) a3: (lane_row + 8, lane_col + 8 + {0,1})
//   B 16x8 (k x n, "col": two k-consecutive elements per register):
//     b0: (k = lane_col + {0,1}, n = lane_row)   b1: (k = lane_col + 8 + {0,1}, n = lane_row)
//   C/D 16x8 fp32:
//     c0, c1: (lane_row, lane_col + {0,1})      c2, c3: (lane_row + 8, lane_col + {0,1})
// ldmatrix .x4: lanes 8i .. 8i+7 give the row addresses (16 bytes each) of 8x8 matrix i, and
// register i receives matrix i with lane l holding (row l / 4, columns 2 (l % 4) + {0,1}) -- the
// a/b layouts above; .trans delivers the transpose: (rows 2 (l % 4) + {0,1}, column l / 4).

// Every lane of the quad (the 4 lanes sharing lane_row) ends with op over the quad.
template <typename Op>
__device__ __forceinline__ float quad_allreduce(float v, Op op) {
  v = op(v, __shfl_xor_sync(0xffffffffu, v, 1));
  v = op(v, __shfl_xor_sync(0xffffffffu, v, 2));
  return v;
}

__device__ __forceinline__ unsigned smem_u32(const void* ptr) {
  return static_cast<unsigned>(__cvta_generic_to_shared(ptr));
}

// The caller's barrier orders these reads after the writes that filled the tile; volatile
// keeps them in program order with respect to it.
__device__ __forceinline__ void ldmatrix_x4(unsigned (&r)[4], const unsigned smem_addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 { %0, %1, %2, %3 }, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(smem_addr));
}
__device__ __forceinline__ void ldmatrix_x4_trans(unsigned (&r)[4], const unsigned smem_addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 { %0, %1, %2, %3 }, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(smem_addr));
}

template <typename T> struct Mma;

template <> struct Mma<__nv_bfloat16> {
  static __device__ __forceinline__ void m16n8k16(float (&c)[4], const unsigned (&a)[4],
                                                  const unsigned b0, const unsigned b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
        "{ %0, %1, %2, %3 }, { %4, %5, %6, %7 }, { %8, %9 }, { %0, %1, %2, %3 };\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
};

template <> struct Mma<half> {
  static __device__ __forceinline__ void m16n8k16(float (&c)[4], const unsigned (&a)[4],
                                                  const unsigned b0, const unsigned b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 "
        "{ %0, %1, %2, %3 }, { %4, %5, %6, %7 }, { %8, %9 }, { %0, %1, %2, %3 };\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
};

// Two floats -> one register of two T (round to nearest), `lo` in the low 16 bits: the
// element with the lower column index of an A fragment pair.
template <typename T>
__device__ __forceinline__ unsigned pack2(const float lo, const float hi) {
  return Vec<T>::from_float2(lo, hi);
}

}  // namespace attnlang
