// ============================================================================================
// Hopper warpgroup mma (wgmma, sm_90a): shared-memory descriptors, fences and the commit /
// wait of asynchronous groups. Spliced into the prefill source with this instance's
// wgmma_qk / wgmma_pv wrappers (attnlang/codegen/render.py generates those: their operand
// lists are as long as the accumulators). Only the wgmma path (prefill_wgmma.cu.j2) calls them.
//
// Symbols (namespace attnlang):
//   sw128_desc(addr, lead, stride)   descriptor of a 128-byte-swizzled operand tile
//   wgmma_fence()                    order earlier register writes before the next wgmma
//   wgmma_commit(), wgmma_wait<N>()  close a group of wgmmas; wait until <= N groups are
//                                    still running
//   fence_async_shared()             make this thread's shared-memory writes (st.shared,
//                                    cp.async) visible to wgmma, which reads through the
//                                    async proxy; a barrier after it publishes them
//   pin(r)                           a compiler fence on accumulator registers: reads after
//                                    a wgmma_wait stay after it
//
// Operand tiles (PTX ISA, "Shared memory matrix layout", 128-byte swizzle): a tile of 16-bit
// elements is stored as column blocks of 64 elements (128 bytes per row); within a block, row
// r's 16-byte chunk c lies at r * 128 + ((c ^ (r % 8)) << 4), every block 1024-byte aligned,
// so the hardware's swizzle (address bits 4-6 XOR bits 7-9) finds it. Read K-major (rows are
// M or N, the contraction runs along the row): 8-row groups 1024 bytes apart (stride), one
// k-step of 16 elements is 32 bytes further along the row, the next 64 elements the next
// column block. Read MN-major (V: the contraction runs over rows): 8-row groups 1024 bytes
// apart (stride), the next 64 columns the next column block (lead).
// ============================================================================================

namespace attnlang {

// Bits 0-13: address / 16; 16-29: leading byte offset / 16; 32-45: stride byte offset / 16;
// 62-63: layout (1 = 128-byte swizzle). The base-offset bits stay 0: tiles are 1024-aligned.
__device__ __forceinline__ unsigned long long sw128_desc(const unsigned addr, const unsigned lead_bytes,
                                                         const unsigned stride_bytes) {
  return static_cast<unsigned long long>((addr & 0x3FFFFu) >> 4) |
         (static_cast<unsigned long long>(lead_bytes >> 4) << 16) |
         (static_cast<unsigned long long>(stride_bytes >> 4) << 32) | (1ull << 62);
}

// The descriptor of the same tile `bytes` further on (a k-step or column block inside it):
// the address field only. Computed once per tile, a descriptor then costs one add per wgmma
// instead of the masks and shifts of sw128_desc. Shared addresses stay below 2^18, so the
// 14-bit field never carries into the next, nor the low word into the high one.
__device__ __forceinline__ unsigned long long desc_at(const unsigned long long desc,
                                                      const unsigned bytes) {
  const unsigned low = static_cast<unsigned>(desc) + (bytes >> 4);  // no carry: see above
  return (desc & 0xFFFFFFFF00000000ull) | low;
}

__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }

__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }

template <int N>
__device__ __forceinline__ void wgmma_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" :: "n"(N) : "memory");
}

__device__ __forceinline__ void fence_async_shared() {
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}

// ---- warp specialisation: mbarriers, named barriers, register reallocation

// An mbarrier at shared address `bar` expecting `count` arrivals per phase.
__device__ __forceinline__ void mbar_init(const unsigned bar, const unsigned count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" :: "r"(bar), "r"(count) : "memory");
}

// One arrival (release: this thread's earlier accesses happen before the phase completes).
__device__ __forceinline__ void mbar_arrive(const unsigned bar) {
  asm volatile("mbarrier.arrive.release.cta.shared::cta.b64 _, [%0];\n" :: "r"(bar) : "memory");
}

// One arrival once every cp.async this thread issued before it has landed (not counted in
// advance: `count` includes it).
__device__ __forceinline__ void mbar_arrive_on_copies(const unsigned bar) {
  asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];\n" :: "r"(bar) : "memory");
}

// Wait until the phase of parity `parity` has completed (acquire).
__device__ __forceinline__ void mbar_wait(const unsigned bar, const unsigned parity) {
  unsigned done;
  do {
    asm volatile("{\n.reg .pred p;\nmbarrier.try_wait.parity.acquire.cta.shared::cta.b64 p, [%1], %2;\n"
                 "selp.u32 %0, 1, 0, p;\n}\n"
                 : "=r"(done) : "r"(bar), "r"(parity) : "memory");
  } while (!done);
}

// Named barriers (id 0 is __syncthreads): wait for `threads` arrivals, or only arrive.
__device__ __forceinline__ void named_sync(const unsigned id, const unsigned threads) {
  asm volatile("bar.sync %0, %1;\n" :: "r"(id), "r"(threads) : "memory");
}
__device__ __forceinline__ void named_arrive(const unsigned id, const unsigned threads) {
  asm volatile("bar.arrive %0, %1;\n" :: "r"(id), "r"(threads) : "memory");
}

// Hand registers between warpgroups (every warp of the warpgroup executes it).
template <int kRegs>
__device__ __forceinline__ void registers_grow() {
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" :: "n"(kRegs));
}
template <int kRegs>
__device__ __forceinline__ void registers_shrink() {
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" :: "n"(kRegs));
}

template <int N>
__device__ __forceinline__ void pin(float (&r)[N][4]) {
#pragma unroll
  for (int j = 0; j < N; ++j) {
#pragma unroll
    for (int c = 0; c < 4; ++c) asm volatile("" : "+f"(r[j][c]) :: "memory");
  }
}

}  // namespace attnlang
