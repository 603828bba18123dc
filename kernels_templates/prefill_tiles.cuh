// prefill_tiles.cuh: a work item's KV tiles, which to visit (the tile cursor) and how they
// reach shared memory (page lookups, cp.async copies, the key/value hooks applied in place).
// Spliced verbatim by prefill.cu.j2 inside namespace attnlang::prefill_kernel, after its
// constants (kTileKeys, kSubKeys, kRows, ...) and work items: not a header of its own.

// ---------------------------------------------------------------------------- tile schedule

// The KV tiles of an item: tile t covers positions [kv_start + t N, min(kv_start + (t+1) N,
// kv_end)). The cursor yields the tiles that are not fully masked for the CTA's queries, in
// order, with their class; every thread of the CTA walks it identically.
struct TileCursor {
  int base;          // tile index of bit 0 of the masks below
  unsigned visible;  // bit j: tile base + j is not fully masked and not yet returned
  unsigned full;     // bit j: tile base + j needs no per-element mask
};

struct TileSpan {
  int kv_start, kv_end, num_tiles;
  int q_lo, q_hi;  // positions of the CTA's first and last query
};

// mask_tile for tile t over the query positions [q_lo, q_hi]; tiles reaching past kv_end are
// never "full" (their tail keys need the pos < kv_end guard).
__device__ __forceinline__ int classify_tile(const TileSpan& span, const int t, const int q_lo,
                                             const int q_hi, const variant::Params& params,
                                             const Index& tile_ix) {
  const int kv_lo = span.kv_start + t * kTileKeys;
  const bool runs_past_end = kv_lo + kTileKeys > span.kv_end;
  const int kv_hi = (runs_past_end ? span.kv_end : kv_lo + kTileKeys) - 1;
  const int cls = variant::mask_tile(q_lo, q_hi, kv_lo, kv_hi, params, tile_ix);
  return (cls == 2 && runs_past_end) ? 1 : cls;
}

// The next visible tile as tile * 4 + class (1 partial, 2 full), or -1 past the last. Lane l
// classifies tile base + l; a ballot gives the warp the 32 answers at once.
__device__ __forceinline__ int next_tile(TileCursor& cursor, const TileSpan& span, const int lane,
                                         const variant::Params& params, const Index& tile_ix) {
  while (cursor.visible == 0) {
    cursor.base += 32;
    if (cursor.base >= span.num_tiles) return -1;
    const int t = cursor.base + lane;
    const int cls = t < span.num_tiles ? classify_tile(span, t, span.q_lo, span.q_hi, params, tile_ix) : 0;
    cursor.visible = __ballot_sync(0xffffffffu, cls != 0);
    cursor.full = __ballot_sync(0xffffffffu, cls == 2);
  }
  const int bit = __ffs(cursor.visible) - 1;
  cursor.visible &= cursor.visible - 1;
  return ((cursor.base + bit) << 2) | (((cursor.full >> bit) & 1u) ? 2 : 1);
}

// ---------------------------------------------------------------------------- K/V tiles

// Rows of a tile each thread copies: group group_id copies keys group_id, group_id + kGroups, ...
constexpr int kLoadPasses = kTileKeys / kGroups;

// Where this thread's key rows of a tile live: the cache token (page * page_size + slot) of
// every key row it copies of the tile starting at tile_start (positions past kv_end are
// clamped to kv_end - 1: a valid address, its copy is zero-filled). Branch-free, so all
// kLoadPasses page-table loads are in flight at once; the main loop calls it before the
// barrier that precedes the copies, so their latency hides behind the wait. One register per
// row, held across the barrier.
struct TileRows {
  int token[kLoadPasses];
};

__device__ __forceinline__ void tile_rows(TileRows& rows, const int* kv_indices,
                                          const WorkItem& w, const int tile_start,
                                          const int group_id, const FastDivmod& page_div) {
#pragma unroll
  for (int pass = 0; pass < kLoadPasses; ++pass) {
    const int pos = imin(tile_start + group_id + pass * kGroups, w.kv_end - 1);
    int page_index, slot;
    page_div.divmod(pos, page_index, slot);
    rows.token[pass] = __ldg(kv_indices + static_cast<unsigned>(w.page_begin + page_index)) * static_cast<int>(page_div.divisor) + slot;
  }
}

// 16-byte cp.async to a shared-memory address (as cp_async_16; valid == false zero-fills).
__device__ __forceinline__ void cp_async_16_shared(const unsigned dst, const void* src, const bool valid) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n"
               :: "r"(dst), "l"(src), "r"(valid ? 16 : 0) : "memory");
}

// Issue the cp.async copies of the tile starting at tile_start into one stage: group group_id
// copies keys group_id, group_id + kGroups, ..., lane tx its chunks of each (kLaneChunks of K
// from chunk tx * kLaneChunks, kLaneChunksVO of V likewise), from the rows tile_rows found.
// k_row / v_row: this thread's first element of the item's KV head in cache token 0
// (k_cache + kv_head * kHeadDim + tx * VEC, v_cache likewise in kHeadDimVO); k_token_bytes /
// v_token_bytes: bytes per cache token (all KV heads). Per row: the token (one IMAD), one 64-bit IMAD.WIDE per source, and the shared
// destinations are the stage address plus an immediate. Positions >= kv_end are zero-filled.
__device__ __forceinline__ void load_tile(const unsigned k_stage, const unsigned v_stage,
                                          const T* k_row, const T* v_row,
                                          const TileRows& rows, const int kv_end,
                                          const int tile_start, const int group_id, const int tx,
                                          const int k_token_bytes, const int v_token_bytes) {
  const char* const k_src = reinterpret_cast<const char*>(k_row);
  const char* const v_src = reinterpret_cast<const char*>(v_row);
#pragma unroll
  for (int pass = 0; pass < kLoadPasses; ++pass) {
    const int key = group_id + pass * kGroups;
    const bool valid = tile_start + key < kv_end;
    const long long token = rows.token[pass];
#pragma unroll
    for (int c = 0; c < kLaneChunks; ++c) {
      const unsigned dst = 2u * static_cast<unsigned>(swizzle<kTileKeys>(key, tx * kLaneChunks + c));  // bytes (T is 2 bytes)
      cp_async_16_shared(k_stage + dst, k_src + token * k_token_bytes + 16 * c, valid);
    }
#pragma unroll
    for (int c = 0; c < kLaneChunksVO; ++c) {
      const unsigned dst = 2u * static_cast<unsigned>(swizzle<kTileKeys, kHeadDimVO>(key, tx * kLaneChunksVO + c));
      cp_async_16_shared(v_stage + dst, v_src + token * v_token_bytes + 16 * c, valid);
    }
  }
}

// Apply the key / value hooks to the chunks this thread copied (load_tile's mapping). After
// cp_async_wait a thread's own copies are visible to it; the caller's barrier publishes the
// result. Rows past kv_end stay 0.
__device__ __forceinline__ void transform_tile(T* k_stage, T* v_stage, const WorkItem& w,
                                               const int tile_start, const int group_id,
                                               const int tx, const variant::Params& params,
                                               Index kv_ix) {
#pragma unroll
  for (int pass = 0; pass < kTileKeys / kGroups; ++pass) {
    const int key = group_id + pass * kGroups;
    const int pos = tile_start + key;
    if (pos >= w.kv_end) break;  // uniform over the row's group; later rows are past it too
    kv_ix.kv_pos = pos;
    if constexpr (variant::kHasKey) {
      float x[VEC];
#pragma unroll
      for (int c = 0; c < kLaneChunks; ++c) {
        load8<T>(k_stage + swizzle<kTileKeys>(key, tx * kLaneChunks + c), chunk8(x, c));
      }
      variant::key<VEC, TX>(x, tx * VEC, params, kv_ix);
#pragma unroll
      for (int c = 0; c < kLaneChunks; ++c) {
        store8<T>(k_stage + swizzle<kTileKeys>(key, tx * kLaneChunks + c), chunk8(x, c));
      }
    }
    if constexpr (variant::kHasValue) {
      float x[VEC_VO];
#pragma unroll
      for (int c = 0; c < kLaneChunksVO; ++c) {
        load8<T>(v_stage + swizzle<kTileKeys, kHeadDimVO>(key, tx * kLaneChunksVO + c), chunk8(x, c));
      }
      variant::value<VEC_VO, TX>(x, tx * VEC_VO, params, kv_ix);
#pragma unroll
      for (int c = 0; c < kLaneChunksVO; ++c) {
        store8<T>(v_stage + swizzle<kTileKeys, kHeadDimVO>(key, tx * kLaneChunksVO + c), chunk8(x, c));
      }
    }
  }
}
