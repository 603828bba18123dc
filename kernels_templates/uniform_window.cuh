// uniform_window.cuh: the logits' tile-uniform terms of a work item's KV tiles, 32 tiles at a
// time (attnlang/codegen/tile_uniform.py). Spliced into the decode and prefill kernels after
// the variant's hooks.
//
// variant::uniform_tile bounds the terms over one tile with interval arithmetic: a few hundred
// instructions (accurate logs and divisions of the bounds), as much as a tile's softmax, so it
// is not run per tile by every thread. Lane l of the warp evaluates tile base + l once per 32
// tiles; a tile's answer is then a bit of their ballot, its values a shuffle from its lane.
// Tiles must be asked for in increasing order (both kernels walk their tiles so), by the whole
// warp.
#pragma once

namespace attnlang {

template <int kTileKeys>
struct UniformWindow {
  int base = -(1 << 30);       // the tile lane 0 evaluated
  unsigned uniform_bits = 0u;  // bit l: every term is one value over tile base + l ...
  variant::Uniform lane_u{};   // ... these, for this lane's tile

  // Are the terms one value each over tile `tile` (keys kv_start + tile kTileKeys, up to
  // kv_end) and the queries [q_lo, q_hi]? A bit of the window's ballot; their values go to
  // u (one shuffle per term).
  __device__ __forceinline__ bool get(const int tile, const int lane, const int kv_start,
                                      const int kv_end, const int q_lo, const int q_hi,
                                      const variant::Params& params, const Index& tile_ix,
                                      variant::Uniform& u) {
    if constexpr (variant::kUniformTerms == 0) {
      return false;
    } else {
      if (tile >= base + 32) {  // uniform over the warp
        base = tile;
        const int kv_lo = kv_start + (tile + lane) * kTileKeys;
        const bool lane_uniform =
            kv_lo < kv_end && variant::uniform_tile(q_lo, q_hi, kv_lo,
                                                    imin(kv_lo + kTileKeys, kv_end) - 1, params,
                                                    tile_ix, lane_u);
        uniform_bits = __ballot_sync(0xffffffffu, lane_uniform);
      }
#pragma unroll
      for (int k = 0; k < variant::kUniformTerms; ++k) {
        u.v[k] = __shfl_sync(0xffffffffu, lane_u.v[k], tile - base);
      }
      return (uniform_bits >> (tile - base)) & 1u;
    }
  }

  // How many tiles in a row from `tile` (the last one asked for, not uniform) have terms that
  // are not one value each, as far as the window sees: 1 at least, up to the window's end;
  // every tile without tile-uniform terms.
  __device__ __forceinline__ int varying_run(const int tile) const {
    if constexpr (variant::kUniformTerms == 0) {
      return 1 << 30;
    } else {
      const unsigned uniform_ahead = uniform_bits >> (tile - base);
      return uniform_ahead == 0u ? 32 - (tile - base) : __ffs(uniform_ahead) - 1;
    }
  }
};

}  // namespace attnlang
