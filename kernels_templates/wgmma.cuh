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
//   mbar_*, named_*, registers_*     the producer's pipeline: mbarriers, named barriers,
//                                    setmaxnreg
//   tensor_map_for, tma_load_3d      a CTA's TMA tensor map in global memory; one box copy
//   stmatrix_x4(addr, r)             four 8x8 16-bit matrices registers -> shared (the
//                                    inverse of ldmatrix_x4: the same lanes, the same rows)
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

// Expect `bytes` more to land through the copy engine in the current phase (no arrival).
__device__ __forceinline__ void mbar_expect(const unsigned bar, const unsigned bytes) {
  asm volatile("mbarrier.expect_tx.relaxed.cta.shared::cta.b64 [%0], %1;\n"
               :: "r"(bar), "r"(bytes) : "memory");
}

// ---- TMA: tensor maps in global memory, boxes copied by the copy engine

// Write this CTA's tensor map at `dst` (global, 128-byte aligned): the host's template `tmpl`
// with its global address replaced by `base`, through 128 bytes of shared memory at `scratch`
// (128-byte aligned), then fenced for this CTA's use (release into the tensor-map proxy, then
// acquire). Every lane of one warp calls it; that warp may then issue tma_load_3d with it.
__device__ __forceinline__ void tensor_map_for(unsigned char* dst, const unsigned char* tmpl,
                                               const void* base, const unsigned scratch,
                                               const int lane) {
  if (lane < 8) {
    const uint4 v = reinterpret_cast<const uint4*>(tmpl)[lane];
    asm volatile("st.shared.v4.u32 [%0], { %1, %2, %3, %4 };\n"
                 :: "r"(scratch + 16 * lane), "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w) : "memory");
  }
  __syncwarp();
  if (lane == 0) {
    asm volatile("tensormap.replace.tile.global_address.shared::cta.b1024.b64 [%0], %1;\n"
                 :: "r"(scratch), "l"(base) : "memory");
  }
  __syncwarp();
  asm volatile("{\n.reg .u64 g;\ncvta.to.global.u64 g, %0;\n"
               "tensormap.cp_fenceproxy.global.shared::cta.tensormap::generic.release.cta.sync.aligned"
               " [g], [%1], 128;\n}\n" :: "l"(dst), "r"(scratch) : "memory");
  asm volatile("fence.proxy.tensormap::generic.acquire.cta [%0], 128;\n" :: "l"(dst) : "memory");
}

// Copy the box at coordinates (c0, c1, c2) of the tensor map `map` (global) to shared address
// `dst`; its bytes count towards the mbarrier `bar`'s expected transactions.
__device__ __forceinline__ void tma_load_3d(const unsigned dst, const void* map, const int c0,
                                            const int c1, const int c2, const unsigned bar) {
  asm volatile("cp.async.bulk.tensor.3d.shared::cluster.global.tile.mbarrier::complete_tx::bytes"
               " [%0], [%1, { %2, %3, %4 }], [%5];\n"
               :: "r"(dst), "l"(map), "r"(c0), "r"(c1), "r"(c2), "r"(bar) : "memory");
}

// Named barriers (id 0 is __syncthreads): wait for `threads` arrivals, or only arrive.
// stmatrix .x4 (sm_90): lanes 8i .. 8i+7 give the row addresses (16 bytes each) of 8x8
// matrix i, whose register i each lane holds as an mma accumulator pair: row lane / 4,
// columns 2 (lane % 4) + {0, 1}.
__device__ __forceinline__ void stmatrix_x4(const unsigned smem_addr, const unsigned (&r)[4]) {
  asm volatile("stmatrix.sync.aligned.m8n8.x4.shared.b16 [%0], { %1, %2, %3, %4 };\n"
               :: "r"(smem_addr), "r"(r[0]), "r"(r[1]), "r"(r[2]), "r"(r[3]) : "memory");
}

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
