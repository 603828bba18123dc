// prefill_tiles.cuh: a work item's KV tiles, which to visit (the tile cursor) and how they
// reach shared memory (page lookups, cp.async copies, the key/value hooks applied in place).
// Spliced verbatim by prefill_common.cu.j2 inside namespace attnlang::prefill_kernel, after its
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

// The item's KV range and the positions of its first and last query (for mask_tile; a
// cascade item's rows are several requests': the lowest and highest q_pos among them).
__device__ __forceinline__ TileSpan item_span(const WorkItem& w, const int group) {
  const int q_pos0 = w.kv_len - w.qo_len;  // q_pos of query 0
  TileSpan span;
  span.kv_start = w.kv_start;
  span.kv_end = w.kv_end;
  span.num_tiles = w.kv_end > w.kv_start ? ceil_div(w.kv_end - w.kv_start, kTileKeys) : 0;
  span.q_lo = kCascade ? w.q_lo : q_pos0 + w.row_start / group;
  span.q_hi = kCascade ? w.q_hi : q_pos0 + (w.row_start + w.rows - 1) / group;
  return span;
}

// The Index mask_tile sees for an item's tiles: no single head (the rows span up to `group`
// heads) and no single position; a per-pair mask's block summary, once per item.
__device__ __forceinline__ Index tile_index(const WorkItem& w, const int num_heads,
                                            const int num_kv_heads, const float sm_scale,
                                            const variant::Params& params) {
  Index ix{w.batch, /*head=*/-1, w.kv_head, w.qo_len, w.kv_len, /*q_pos=*/-1, /*kv_pos=*/-1,
           num_heads, num_kv_heads, sm_scale};
  if constexpr (variant::kPairWindow) ix.pair_blocks = variant::pair_blocks(params, ix);
  return ix;
}

// mask_tile for tile t over the query positions [q_lo, q_hi]; tiles reaching past kv_end are
// never "full" (their tail keys need the pos < kv_end guard).
__device__ __forceinline__ int classify_tile(const TileSpan& span, const int t, const int q_lo,
                                             const int q_hi, const variant::Params& params,
                                             const Index& tile_ix) {
  const int kv_lo = span.kv_start + t * kTileKeys;
  const bool runs_past_end = kv_lo + kTileKeys > span.kv_end;
  const int kv_hi = (runs_past_end ? span.kv_end : kv_lo + kTileKeys) - 1;
  const int cls = tile_mask(q_lo, q_hi, kv_lo, kv_hi, params, tile_ix);
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

// With kLoaders TX-lane row groups copying a tile (the CTA's kGroups, or the producer
// warpgroup's kProducerGroups), group group_id copies keys group_id, group_id + kLoaders, ...
//
// Where this thread's key rows of a tile live: the cache token (page * page_size + slot) of
// every key row it copies of the tile starting at tile_start (positions past kv_end are
// clamped to kv_end - 1: a valid address, its copy is zero-filled). Branch-free, so all
// the page-table loads are in flight at once; the main loop calls it before the barrier
// that precedes the copies, so their latency hides behind the wait. One register per row,
// held across the barrier.
// The cache token (page * page_size + slot) of the item's KV position pos.
__device__ __forceinline__ int cache_token(const int* kv_indices, const WorkItem& w, const int pos,
                                           const FastDivmod& page_div) {
  int page_index, slot;
  page_div.divmod(pos, page_index, slot);
  return __ldg(kv_indices + static_cast<unsigned>(w.page_begin + page_index)) * static_cast<int>(page_div.divisor) + slot;
}

template <int kLoaders>
struct TileRows {
  int token[kTileKeys / kLoaders];
  __device__ __forceinline__ int operator()(const int pass) const { return token[pass]; }
};

template <int kLoaders>
__device__ __forceinline__ void tile_rows(TileRows<kLoaders>& rows, const int* kv_indices,
                                          const WorkItem& w, const int tile_start,
                                          const int group_id, const FastDivmod& page_div) {
#pragma unroll
  for (int pass = 0; pass < kTileKeys / kLoaders; ++pass) {
    const int pos = imin(tile_start + group_id + pass * kLoaders, w.kv_end - 1);
    rows.token[pass] = cache_token(kv_indices, w, pos, page_div);
  }
}

// 16-byte cp.async to a shared-memory address (as cp_async_16; valid == false zero-fills).
__device__ __forceinline__ void cp_async_16_shared(const unsigned dst, const void* src, const bool valid) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n"
               :: "r"(dst), "l"(src), "r"(valid ? 16 : 0) : "memory");
}

// 8 bytes likewise (cp_async_8): an fp8 cache's chunk.
__device__ __forceinline__ void cp_async_8_shared(const unsigned dst, const void* src, const bool valid) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 8, %2;\n"
               :: "r"(dst), "l"(src), "r"(valid ? 8 : 0) : "memory");
}

// Issue the cp.async copies of the tile starting at tile_start into one stage: group group_id
// copies keys group_id, group_id + kLoaders, ..., lane tx its chunks of each (kLaneChunks of K
// from chunk tx * kLaneChunks, kLaneChunksVO of V likewise), from the cache token of each
// pass's row, `rows(pass)` (TileRows, or the producer's WarpTileRows).
// k_row / v_row: this thread's first element of the item's KV head in cache token 0
// (k_cache + kv_head * kHeadDim + tx * VEC, v_cache likewise in kHeadDimVO); k_token_bytes /
// v_token_bytes: bytes per cache token (all KV heads). Per row: the token (one IMAD), one 64-bit IMAD.WIDE per source, and the shared
// destinations are the stage address plus an immediate. Positions >= kv_end are zero-filled.
// An fp8 cache's chunk (8 elements, 8 bytes) goes to the start of its 16-byte stage chunk.
template <int kLoaders, typename Rows>
__device__ __forceinline__ void load_tile(const unsigned k_stage, const unsigned v_stage,
                                          const KvT* k_row, const KvT* v_row,
                                          const Rows& rows, const int kv_end,
                                          const int tile_start, const int group_id, const int tx,
                                          const int k_token_bytes, const int v_token_bytes) {
  const char* const k_src = reinterpret_cast<const char*>(k_row);
  const char* const v_src = reinterpret_cast<const char*>(v_row);
#pragma unroll
  for (int pass = 0; pass < kTileKeys / kLoaders; ++pass) {
    const int key = group_id + pass * kLoaders;
    const bool valid = tile_start + key < kv_end;
    const long long token = rows(pass);
#pragma unroll
    for (int c = 0; c < kLaneChunks; ++c) {
      const unsigned dst = 2u * static_cast<unsigned>(swizzle<kTileKeys>(key, tx * kLaneChunks + c));  // bytes (T is 2 bytes)
      const char* const src = k_src + token * k_token_bytes + 8 * sizeof(KvT) * c;
      if constexpr (kKvFp8) cp_async_8_shared(k_stage + dst, src, valid);
      else cp_async_16_shared(k_stage + dst, src, valid);
    }
#pragma unroll
    for (int c = 0; c < kLaneChunksVO; ++c) {
      const unsigned dst = 2u * static_cast<unsigned>(swizzle<kTileKeys, kHeadDimVO>(key, tx * kLaneChunksVO + c));
      const char* const src = v_src + token * v_token_bytes + 8 * sizeof(KvT) * c;
      if constexpr (kKvFp8) cp_async_8_shared(v_stage + dst, src, valid);
      else cp_async_16_shared(v_stage + dst, src, valid);
    }
  }
}

// (kKvFp8) The chunks of load_tile's mapping for kLoaders row groups (those this thread
// copied, or with a producer a share of the tile: a chunk's bytes sit in the chunk itself, so
// any thread may convert it), from e4m3 to T times the KV head's scales (kFoldScales: without
// them, which q and the output carry instead), in place, once the copies have landed; every
// row, so rows past kv_end become zeros as a T cache's zero-fill leaves them.
template <int kLoaders>
__device__ __forceinline__ void dequantize_tile(T* k_stage, T* v_stage, const int group_id,
                                                const int tx, const float2 scale) {
#pragma unroll
  for (int pass = 0; pass < kTileKeys / kLoaders; ++pass) {
    const int key = group_id + pass * kLoaders;
#pragma unroll
    for (int c = 0; c < kLaneChunks; ++c) {
      T* const chunk = k_stage + swizzle<kTileKeys>(key, tx * kLaneChunks + c);
      if constexpr (kFoldScales) {
        convert8(chunk);
      } else {
        dequantize8(chunk, scale.x);
      }
    }
#pragma unroll
    for (int c = 0; c < kLaneChunksVO; ++c) {
      T* const chunk = v_stage + swizzle<kTileKeys, kHeadDimVO>(key, tx * kLaneChunksVO + c);
      if constexpr (kFoldScales) {
        convert8(chunk);
      } else {
        dequantize8(chunk, scale.y);
      }
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

// ---------------------------------------------------------------------------- producer



// The cache tokens of a producer warp's rows of a tile, one per lane: the warp's kWarpGroups
// row groups copy kRowsPerWarp keys of each tile, and lane j looks up the token of the j-th
// (pass j / kWarpGroups, group j % kWarpGroups); a pass's row then comes by shuffle, so the
// producer holds one register of them, not one per pass (it has few: kProducerRegisters).
template <int kRowLanes = TX>
struct WarpTileRows {
  static constexpr int kGroups = kProducer ? kProducerThreads / kRowLanes : 1;  // producer row groups
  static constexpr int kWarpGroups = 32 / kRowLanes;
  static constexpr int kPasses = kTileKeys / kGroups;
  static constexpr int kRowsPerWarp = kWarpGroups * kPasses;
  int token;     // this lane's row's token
  int group_in;  // this thread's row group within the warp
  __device__ __forceinline__ int operator()(const int pass) const {
    return __shfl_sync(0xffffffffu, token, pass * kWarpGroups + group_in);
  }
};

template <int kRowLanes = TX>
__device__ __forceinline__ WarpTileRows<kRowLanes> warp_tile_rows(
    const int* kv_indices, const WorkItem& w, const int tile_start, const int warp,
    const int lane, const FastDivmod& page_div) {
  using Rows = WarpTileRows<kRowLanes>;
  static_assert(!kProducer || (Rows::kRowsPerWarp <= 32 && 32 % kRowLanes == 0),
                "a lane per row of the warp");
  const int j = lane % Rows::kRowsPerWarp;
  const int key = warp * Rows::kWarpGroups + j % Rows::kWarpGroups +
                  (j / Rows::kWarpGroups) * Rows::kGroups;
  Rows rows;
  rows.token = cache_token(kv_indices, w, imin(tile_start + key, w.kv_end - 1), page_div);
  rows.group_in = lane / kRowLanes;
  return rows;
}

// (kFp8Rows) An fp8 tile as whole rows of bytes: kRawLanes lanes per row, each copying 16
// bytes (piece j: elements 16 j .. 16 j + 15, the chunks 2 j and 2 j + 1) with one full-width
// cp.async.cg, so a warp instruction moves 512 bytes as a T cache's do (8-byte copies moved
// 256 and capped the producer near 8 bytes per cycle: benchmarks/NOTES.md). Piece j of key
// `key` lands at column block j / 8, row key, byte 16 (j % 8) of a value and 16 ((j % 8) XOR
// (key % 8)) of a key (the 128-byte swizzle: where kFp8Qk's wgmma reads the raw keys, and
// where a TMA box of keys puts them): the row's raw bytes fill its slots in the first column
// blocks, which dequantize_rows then rewrites as T (kFp8Qk: the values only).
template <typename Rows>
__device__ __forceinline__ void load_rows_fp8(const unsigned k_stage, const unsigned v_stage,
                                              const char* k_row, const char* v_row,
                                              const Rows& rows, const int kv_end,
                                              const int tile_start, const int group_id,
                                              const int piece, const int k_token_bytes,
                                              const int v_token_bytes) {
  static_assert(Rows::kGroups % 8 == 0, "a thread's keys share their low 3 bits (the swizzle)");
  const unsigned dst0 = (piece >> 3) * (kTileKeys * 128) + group_id * 128;
  const unsigned k_dst = k_stage + dst0 + 16 * ((piece ^ group_id) & 7);
  const unsigned v_dst = v_stage + dst0 + 16 * (piece & 7);
#pragma unroll
  for (int pass = 0; pass < Rows::kPasses; ++pass) {
    const int key = group_id + pass * Rows::kGroups;
    const bool valid = tile_start + key < kv_end;
    const long long token = rows(pass);
    const unsigned step = pass * Rows::kGroups * 128;
    cp_async_16_shared(k_dst + step, k_row + token * k_token_bytes, valid);
    cp_async_16_shared(v_dst + step, v_row + token * v_token_bytes, valid);
  }
}

// (kFp8Rows) The raw rows of a tile (load_rows_fp8) as T, by kConverters threads (the
// computing ones, or the producer's: kProducerConverts), kRawLanes to a row (one warp's
// lanes): each reads its piece, the row's lanes meet (__syncwarp: the T chunks overwrite the
// raw bytes of other pieces), then writes the piece's two chunks where the wgmma layout wants
// them; times the scales unless kFoldScales. kParts: the tile's keys (kConvertKeys), values
// (kConvertValues) or both. kAhead: each pass's loads are issued before the pass before it
// stores (other rows: no hazard; the compiler cannot move them, the stores may alias), so
// their latency hides under that pass's conversion (the producer's: 5-8% faster).
constexpr int kConvertKeys = 1, kConvertValues = 2;
template <int kConverters, int kParts = kConvertKeys | kConvertValues, bool kAhead = false>
__device__ __forceinline__ void dequantize_rows(T* k_stage, T* v_stage, const int tid,
                                                const float2 scale) {
  constexpr bool kKeys = (kParts & kConvertKeys) != 0, kValues = (kParts & kConvertValues) != 0;
  constexpr int kRowsPerPass = kConverters / kRawLanes;
  constexpr int kPasses = kTileKeys / kRowsPerPass;
  static_assert(kRowsPerPass % 8 == 0, "a thread's rows share their low 3 bits (the swizzle)");
  const int piece = tid % kRawLanes;
  const int raw0 = (piece >> 3) * (kTileKeys * 64);  // elements of T
  // The piece's place in its row: a key's swizzled by the row (whose low 3 bits are the same in
  // every pass: kRowsPerPass is a multiple of 8).
  const int k_raw0 = raw0 + 8 * ((piece ^ (tid / kRawLanes)) & 7), v_raw0 = raw0 + 8 * (piece & 7);
  const float k_factor = kFoldScales ? 1.0f : scale.x, v_factor = kFoldScales ? 1.0f : scale.y;
  uint4 k_raw, v_raw;  // this pass's pieces
  const auto load = [&](const int pass, uint4& k, uint4& v) {
    const int key = tid / kRawLanes + pass * kRowsPerPass;
    if constexpr (kKeys) k = *reinterpret_cast<const uint4*>(k_stage + k_raw0 + key * 64);
    if constexpr (kValues) v = *reinterpret_cast<const uint4*>(v_stage + v_raw0 + key * 64);
  };
  if constexpr (kAhead) load(0, k_raw, v_raw);
#pragma unroll
  for (int pass = 0; pass < kPasses; ++pass) {
    const int key = tid / kRawLanes + pass * kRowsPerPass;
    if constexpr (!kAhead) load(pass, k_raw, v_raw);
    __syncwarp();
    uint4 k_next = k_raw, v_next = v_raw;  // (kAhead) the next pass's
    if (kAhead && pass + 1 < kPasses) load(pass + 1, k_next, v_next);
    if constexpr (kKeys) {
      store_e4m3x8(k_stage + swizzle<kTileKeys>(key, 2 * piece), k_raw.x, k_raw.y, k_factor);
      store_e4m3x8(k_stage + swizzle<kTileKeys>(key, 2 * piece + 1), k_raw.z, k_raw.w, k_factor);
    }
    if constexpr (kValues) {
      store_e4m3x8(v_stage + swizzle<kTileKeys, kHeadDimVO>(key, 2 * piece), v_raw.x, v_raw.y,
                   v_factor);
      store_e4m3x8(v_stage + swizzle<kTileKeys, kHeadDimVO>(key, 2 * piece + 1), v_raw.z,
                   v_raw.w, v_factor);
    }
    if constexpr (kAhead) {
      k_raw = k_next;
      v_raw = v_next;
    }
  }
}

// (kDeferValues) A tile's values, still e4m3 in their stage, converted by the computing
// threads while the tile's S = Q K^T (and the pending P V) run on the tensor cores: only its
// keys are converted before the barrier S waits for. The tile's P V reads them a tile later,
// after the next tile's barrier has published them (the item's last, after the tile loop).
// Called by every computing thread, on every path through the tile (a warpgroup that skips
// the tile still converts its share). Not with split keys (decode steps): a 4-row step's S
// is too short to hide anything, and deferring cost them 3% (benchmarks/NOTES.md).
struct DeferredValues {
  T* v_stage;
  int tid;
  bool skip;  // split keys, or the producer converts
  float2 scale;

  __device__ __forceinline__ void operator()() const {
    if constexpr (kDeferValues) {
      if (!skip) dequantize_rows<kThreads, kConvertValues>(nullptr, v_stage, tid, scale);
    }
  }
};

// (kFp8Qk) One query row r as e4m3 hi and lo rows at their places in the Q tile (Q_hi over its
// first column blocks, Q_lo kQLoBytes on; 128-byte rows, swizzled as wgmma reads them), from
// this lane's VEC values x (elements tx VEC .., bf16 values) times 2^e: e brings the row's
// largest |x| into [2^7, 2^8), inside e4m3's normal range. hi rounds a value to 4 significant
// bits and lo holds the other 4 of its 8, exactly, down to 2^-9 of the row's largest (below,
// e4m3's subnormal step 2^-9 rounds lo). The row's first lane writes 2^-e k_scale to
// factors[r]: a raw score times it is the score (floored at kMinNormal, as the kernel's
// score_scale is). The row's TX lanes meet in the max's shuffles, so each has read its chunks
// of the bf16 row before any of them writes over it.
__device__ __forceinline__ void split_query_row(const float (&x)[VEC], const int r, const int tx,
                                                const float k_scale, unsigned char* const q_tile,
                                                float* const factors) {
  float top = 0.0f;
#pragma unroll
  for (int i = 0; i < VEC; ++i) top = fmaxf(top, fabsf(x[i]));
  top = group_allreduce<TX>(top, MaxOp{});
  // top = 2^E (1 + f): e = 7 - E (capped so 2^e stays a float; a zero row's 0).
  const int e = top > 0.0f ? imin(134 - static_cast<int>(__float_as_uint(top) >> 23), 126) : 0;
  const float scale = __uint_as_float(static_cast<unsigned>(127 + e) << 23);
#pragma unroll
  for (int p = 0; p < VEC / 8; ++p) {  // 8 values, 8 bytes of hi and of lo, at a time
    unsigned pair[4];  // split_e4m3x2 of values 2 i, 2 i + 1
#pragma unroll
    for (int i = 0; i < 4; ++i) pair[i] = split_e4m3x2(x[8 * p + 2 * i] * scale, x[8 * p + 2 * i + 1] * scale);
    const int col = tx * VEC + 8 * p;  // the piece's first byte in the row
    const int at = (col >> 7) * (kRows * 128) + r * 128 + ((((col >> 4) ^ r) & 7) << 4) + (col & 15);
    *reinterpret_cast<uint2*>(q_tile + at) =
        make_uint2(__byte_perm(pair[0], pair[1], 0x5410), __byte_perm(pair[2], pair[3], 0x5410));
    *reinterpret_cast<uint2*>(q_tile + kQLoBytes + at) =
        make_uint2(__byte_perm(pair[0], pair[1], 0x7632), __byte_perm(pair[2], pair[3], 0x7632));
  }
  // (At least the smallest normal float: a factor of 0 would make a row's -inf max a NaN.)
  if (tx == 0) {
    factors[r] = fmaxf(__uint_as_float(static_cast<unsigned>(127 - e) << 23) * k_scale, kMinNormal);
  }
}
