// CPU emulation of the CUDA subset attnlang's kernels use, so that CI (no GPU) runs the real
// rendered decode / merge sources against the NumPy reference (tests/codegen/emulator.py).
//
//   threads      one OS thread per CUDA thread of a block; blocks run one after another
//   __syncthreads  a barrier over the block
//   __shfl_sync (int, full warp), __shfl_xor_sync, __ballot_sync  a barrier over exactly the lanes named in
//                the mask (per warp and mask):
//                a lane missing from a shuffle it is named in deadlocks, which is reported
//                (exit 3) instead of silently exchanging garbage
//   cp.async     a per-thread queue of 16-byte copies, performed at issue (EMU_EAGER=1:
//                catches a stage refilled while still being read) or at the wait (default:
//                catches a stage read before its wait); misaligned copies abort (exit 5)
//   shared mem   filled with 0xff (NaN) bytes, so reading unwritten smem shows up
//   math         exact libm stand-ins for the fast intrinsics (ex2.approx, tanh.approx, ...)
//   half, bf16   bit-exact storage, round-to-nearest-even conversions
//
// The harness replaces the sources' inline PTX statements by the emu_* calls below.
#pragma once
#include <cstdint>
#include <cstring>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <thread>
#include <vector>
#include <deque>
#include <map>
#include <mutex>
using std::isfinite;  // a CUDA device function in the global namespace
#include <condition_variable>
#include <chrono>
#include <memory>
#include <atomic>

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __restrict__ __restrict
#define __align__(n) alignas(n)

struct dim3u { unsigned x = 0, y = 0, z = 0; };
inline thread_local dim3u threadIdx, blockIdx;
inline dim3u blockDim, gridDim;

struct float2 { float x, y; };
struct alignas(16) float4 { float x, y, z, w; };
struct alignas(16) uint4 { unsigned x, y, z, w; };
struct alignas(8) uint2 { unsigned x, y; };
inline float4 make_float4(float a, float b, float c, float d) { return {a, b, c, d}; }
inline float2 make_float2(float a, float b) { return {a, b}; }
inline uint2 make_uint2(unsigned a, unsigned b) { return {a, b}; }

struct half { uint16_t bits; };
struct __nv_bfloat16 { uint16_t bits; };
struct __half2 { half x, y; };
struct __nv_bfloat162 { __nv_bfloat16 x, y; };
inline float h2f(half h) { _Float16 f; memcpy(&f, &h.bits, 2); return (float)f; }
inline half f2h(float x) { _Float16 f = (_Float16)x; half h; memcpy(&h.bits, &f, 2); return h; }
inline float b2f(__nv_bfloat16 b) { uint32_t u = (uint32_t)b.bits << 16; float f; memcpy(&f, &u, 4); return f; }
inline __nv_bfloat16 f2b(float x) {
  uint32_t u; memcpy(&u, &x, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return {(uint16_t)0x7fc0};
  u += 0x7fffu + ((u >> 16) & 1u);
  return {(uint16_t)(u >> 16)};
}
inline float2 __half22float2(__half2 h) { return {h2f(h.x), h2f(h.y)}; }
inline __half2 __floats2half2_rn(float a, float b) { return {f2h(a), f2h(b)}; }
inline __half2 __hmul2(__half2 a, __half2 b) { return {f2h(h2f(a.x) * h2f(b.x)), f2h(h2f(a.y) * h2f(b.y))}; }
inline float2 __bfloat1622float2(__nv_bfloat162 h) { return {b2f(h.x), b2f(h.y)}; }
inline __nv_bfloat162 __floats2bfloat162_rn(float a, float b) { return {f2b(a), f2b(b)}; }

inline float __expf(float x) { return expf(x); }
inline float __fdividef(float a, float b) { return a / b; }
inline float __logf(float x) { return logf(x); }
inline float __log2f(float x) { return log2f(x); }
inline float rsqrtf(float x) { return 1.0f / sqrtf(x); }
inline void __sincosf(float x, float* s, float* c) { *s = sinf(x); *c = cosf(x); }
inline float __sinf(float x) { return sinf(x); }
// cvt.rzi.s32.f32: toward zero, saturating, NaN -> 0.
inline int __float2int_rz(float x) {
  if (x != x) return 0;
  if (x >= 2147483647.0f) return 2147483647;
  if (x <= -2147483648.0f) return -2147483647 - 1;
  return static_cast<int>(x);
}
inline float __cosf(float x) { return cosf(x); }
inline float __uint_as_float(unsigned u) { float f; memcpy(&f, &u, 4); return f; }
inline float __int_as_float(int i) { float f; memcpy(&f, &i, 4); return f; }
inline int __float_as_int(float f) { int i; memcpy(&i, &f, 4); return i; }
inline unsigned __float_as_uint(float f) { unsigned i; memcpy(&i, &f, 4); return i; }
// Byte i of the result is byte (s >> 4 i) & 7 of the pair {y, x} (x the low word): PRMT.
inline unsigned __byte_perm(unsigned x, unsigned y, unsigned s) {
  const unsigned long long v = ((unsigned long long)y << 32) | x;
  unsigned r = 0;
  for (int i = 0; i < 4; ++i) r |= (unsigned)((v >> (8 * ((s >> (4 * i)) & 7))) & 0xff) << (8 * i);
  return r;
}
template <typename T> inline T __ldg(const T* p) { return *p; }
inline unsigned __funnelshift_r(unsigned lo, unsigned hi, unsigned shift) {
  return static_cast<unsigned>(((static_cast<unsigned long long>(hi) << 32) | lo) >> (shift & 31));
}
inline size_t __cvta_generic_to_shared(const void* p) { return (size_t)p; }
inline unsigned __umulhi(unsigned a, unsigned b) { return (unsigned)(((uint64_t)a * b) >> 32); }
inline int __ffs(int x) { return __builtin_ffs(x); }
inline int __clz(int x) { return x == 0 ? 32 : __builtin_clz(static_cast<unsigned>(x)); }
// Inline PTX the harness does not emulate (other kernels' helpers): fatal if ever reached.
inline void emu_unsupported(int line) {
  fprintf(stderr, "EMU: inline PTX at line %d is not emulated\n", line);
  std::_Exit(6);
}

// ---------------------------------------------------------------- barriers
struct Barrier {
  std::mutex m; std::condition_variable cv; int count, waiting = 0; long gen = 0;
  explicit Barrier(int n) : count(n) {}
  void wait() {
    std::unique_lock<std::mutex> lk(m);
    long g = gen;
    if (++waiting == count) { waiting = 0; ++gen; cv.notify_all(); return; }
    if (!cv.wait_for(lk, std::chrono::seconds(60), [&] { return gen != g; })) {
      fprintf(stderr, "EMU DEADLOCK: barrier of %d waiting %d (thread %u,%u,%u block %u)\n", count, waiting,
              threadIdx.x, threadIdx.y, threadIdx.z, blockIdx.x);
      std::_Exit(3);
    }
  }
};

struct BlockState {
  std::vector<unsigned char> smem;
  Barrier block_barrier;
  std::mutex map_mutex;
  std::map<std::pair<int, unsigned>, std::unique_ptr<Barrier>> shfl_barriers;
  std::vector<float> shfl_vals;
  std::vector<int> shfl_ints;
  BlockState(int nthreads, size_t smem_bytes)
      : smem(smem_bytes + 64, 0xff), block_barrier(nthreads), shfl_vals(((nthreads + 31) / 32) * 32),
        shfl_ints(shfl_vals.size()) {}
  Barrier& shfl_barrier(int warp, unsigned mask) {
    std::lock_guard<std::mutex> lk(map_mutex);
    auto& b = shfl_barriers[{warp, mask}];
    if (!b) b.reset(new Barrier(__builtin_popcount(mask)));
    return *b;
  }
};
inline thread_local BlockState* tl_block = nullptr;
inline int emu_linear_tid() { return threadIdx.x + blockDim.x * (threadIdx.y + blockDim.y * threadIdx.z); }
inline unsigned emu_laneid() { return emu_linear_tid() % 32; }
inline unsigned char* emu_smem() {
  uintptr_t p = (uintptr_t)tl_block->smem.data();
  return (unsigned char*)((p + 15) & ~(uintptr_t)15);
}
inline void __syncthreads() { tl_block->block_barrier.wait(); }
// A shared-memory address is an offset into the block's shared memory here (smem_u32).
inline void* __cvta_shared_to_generic(size_t address) { return emu_smem() + address; }

inline float __shfl_xor_sync(unsigned mask, float v, int offset, int width = 32) {
  const int tid = emu_linear_tid(), lane = tid % 32, warp = tid / 32;
  if (!(mask & (1u << lane))) { fprintf(stderr, "EMU: lane %d not in shuffle mask %08x\n", lane, mask); std::_Exit(4); }
  const int src = lane ^ offset;
  if (!(mask & (1u << src)) || (src / width) != (lane / width)) { fprintf(stderr, "EMU: bad shuffle src\n"); std::_Exit(4); }
  Barrier& b = tl_block->shfl_barrier(warp, mask);
  tl_block->shfl_vals[warp * 32 + lane] = v;
  b.wait();
  float r = tl_block->shfl_vals[warp * 32 + src];
  b.wait();
  return r;
}

// A full-warp shuffle of an int from lane src_lane (every lane of the warp must take part).
inline int __shfl_sync(unsigned mask, int v, int src_lane) {
  const int tid = emu_linear_tid(), lane = tid % 32, warp = tid / 32;
  if (mask != 0xffffffffu) { fprintf(stderr, "EMU: partial shuffle\n"); std::_Exit(4); }
  Barrier& b = tl_block->shfl_barrier(warp, mask);
  tl_block->shfl_ints[warp * 32 + lane] = v;
  b.wait();
  const int r = tl_block->shfl_ints[warp * 32 + src_lane];
  b.wait();
  return r;
}

// __ballot_sync (full warp): the lanes' predicates through the int shuffle, lane by lane.
inline unsigned __ballot_sync(unsigned mask, bool pred) {
  unsigned r = 0;
  for (int l = 0; l < 32; ++l) r |= static_cast<unsigned>(__shfl_sync(mask, pred ? 1 : 0, l)) << l;
  return r;
}

// ---------------------------------------------------------------- cp.async
struct Copy { void* dst; const void* src; bool valid; int bytes; };
inline thread_local std::deque<std::vector<Copy>> tl_groups;
inline thread_local std::vector<Copy> tl_open;
inline bool emu_eager() { static int e = getenv("EMU_EAGER") ? atoi(getenv("EMU_EAGER")) : 0; return e; }
inline void emu_do(const Copy& c) { if (c.valid) memcpy(c.dst, c.src, c.bytes); else memset(c.dst, 0, c.bytes); }
inline void emu_cp_async(void* dst, const void* src, bool valid, int bytes = 16) {
  const uintptr_t align = (uintptr_t)bytes - 1;
  if (((uintptr_t)dst & align) || (valid && ((uintptr_t)src & align))) { fprintf(stderr, "EMU: misaligned cp.async\n"); std::_Exit(5); }
  if (emu_eager()) emu_do({dst, src, valid, bytes}); else tl_open.push_back({dst, src, valid, bytes});
}
inline void emu_commit() { tl_groups.push_back(tl_open); tl_open.clear(); }
inline void emu_wait(int n) {
  while ((int)tl_groups.size() > n) { for (auto& c : tl_groups.front()) emu_do(c); tl_groups.pop_front(); }
}

// ---------------------------------------------------------------- launch
template <typename... Params, typename... Args>
void emu_launch(void (*kernel)(Params...), unsigned grid, dim3u block, size_t smem, Args... args) {
  blockDim = block; gridDim = {grid, 1, 1};
  const int n = block.x * block.y * block.z;
  for (unsigned bx = 0; bx < grid; ++bx) {
    BlockState st(n, smem);
    std::vector<std::thread> threads;
    for (int t = 0; t < n; ++t) {
      threads.emplace_back([&, t] {
        threadIdx = {t % block.x, (t / block.x) % block.y, t / (block.x * block.y)};
        blockIdx = {bx, 0, 0};
        tl_block = &st; tl_groups.clear(); tl_open.clear();
        kernel(args...);
        if (!tl_groups.empty() || !tl_open.empty()) {
          // copies still pending at exit: legal on a GPU only if nothing reads them
          emu_wait(0); for (auto& c : tl_open) emu_do(c);
        }
      });
    }
    for (auto& th : threads) th.join();
  }
}
