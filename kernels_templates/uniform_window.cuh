// uniform_window.cuh: the logits' tile-uniform terms of a work item's keys, in blocks of 32
// keys or whole tiles (attnlang/codegen/tile_uniform.py). Spliced into the decode and prefill kernels after
// the variant's hooks.
//
// variant::uniform_tile bounds the terms over one block with interval arithmetic: a few
// hundred instructions (accurate logs and divisions of the bounds), as much as a tile's
// softmax, so it is not run per block by every thread. Lane l of the warp evaluates block
// base + l once per 32 blocks; a block's answer is then shuffles from its lane. Tiles must be
// asked for in increasing order (both kernels walk their tiles so), by the whole warp.
#pragma once

namespace attnlang {

// kKeys: keys per block (the prefill kernel's steps are masked in blocks of 32 keys; decode
// takes whole tiles).
template <int kTileKeys, int kKeys = (kTileKeys < 32 ? kTileKeys : 32)>
struct UniformWindow {
  static constexpr int kBlockKeys = kKeys;
  static constexpr int kBlocks = kTileKeys / kKeys;  // blocks per tile
  static_assert(kBlocks * kKeys == kTileKeys && kBlocks <= 32, "a tile is whole blocks");

  int base = -(1 << 30);      // the block lane 0 evaluated
  bool lane_uniform = false;  // this lane's block: every term one value ...
  variant::Uniform lane_u{};  // ... these

  // Bit i: every term is one value over block i of tile `tile` (keys kv_start + tile
  // kTileKeys + kKeys i .., up to kv_end) and the queries [q_lo, q_hi]; its values in u[i].
  __device__ __forceinline__ unsigned get(const int tile, const int lane, const int kv_start,
                                          const int kv_end, const int q_lo, const int q_hi,
                                          const variant::Params& params, const Index& tile_ix,
                                          variant::Uniform (&u)[kBlocks]) {
    if constexpr (variant::kUniformTerms == 0) {
      return 0u;
    } else {
      unsigned bits = 0u;
#pragma unroll
      for (int i = 0; i < kBlocks; ++i) {
        const int block = tile * kBlocks + i;
        if (block >= base + 32) {  // uniform over the warp
          base = block;
          const int kv_lo = kv_start + (block + lane) * kKeys;
          lane_uniform = kv_lo < kv_end &&
                         variant::uniform_tile(q_lo, q_hi, kv_lo, imin(kv_lo + kKeys, kv_end) - 1,
                                               params, tile_ix, lane_u);
        }
        const int src = block - base;
#pragma unroll
        for (int k = 0; k < variant::kUniformTerms; ++k) {
          u[i].v[k] = __shfl_sync(0xffffffffu, lane_u.v[k], src);
        }
        bits |= static_cast<unsigned>(__shfl_sync(0xffffffffu, lane_uniform ? 1 : 0, src)) << i;
      }
      return bits;
    }
  }
};

}  // namespace attnlang
