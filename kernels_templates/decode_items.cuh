// decode_items.cuh: what both decode kernels (decode.cu.j2 on CUDA cores, decode_mma.cu.j2
// on tensor cores) read of a work item: its fields and request lengths, a key's cache row,
// and the mask classes of its KV tiles. Included inside namespace attnlang::decode_kernel
// after kTileKeys (the keys of one tile, the unit of skipping) is defined.

// One work item plus the lengths of its request.
struct WorkItem {
  int batch;       // request index
  int kv_head;     // KV head; its query heads are kv_head * group .. + group - 1
  int row_start;   // first fused row
  int kv_start;    // first KV position
  int kv_end;      // one past the last KV position
  int partial;     // -1: write out/lse; else first partial row of the item
  int q_begin;     // token index of the request's first query in q / out
  int qo_len;      // the request's number of queries
  int kv_len;      // the request's KV length
  int page_begin;  // the request's first entry in kv_indices
};

__device__ __forceinline__ WorkItem read_work_item(
    const int item, const int* work_request, const int* work_kv_head, const int* work_row_start,
    const int* work_kv_start, const int* work_kv_end, const int* work_partial,
    const int* qo_indptr, const int* kv_indptr, const int* kv_last_page_len, const int page_size) {
  WorkItem w;
  w.batch = work_request[item];
  w.kv_head = work_kv_head[item];
  w.row_start = work_row_start[item];
  w.kv_start = work_kv_start[item];
  w.kv_end = work_kv_end[item];
  w.partial = work_partial[item];
  w.q_begin = qo_indptr[w.batch];
  w.qo_len = qo_indptr[w.batch + 1] - w.q_begin;
  w.kv_len = request_kv_len(kv_indptr, kv_last_page_len, w.batch, page_size);
  w.page_begin = kv_indptr[w.batch];
  return w;
}

// Row of (logical KV position pos, kv_head) in an NHD paged cache [num_pages, page_size,
// num_kv_heads, D], counted in rows of D elements. 64-bit: caches exceed 2^31 elements.
__device__ __forceinline__ long long paged_row(const int* kv_indices, const WorkItem& w,
                                               const int pos, const FastDivmod& page_size,
                                               const int num_kv_heads) {
  int page_in_list, slot;  // pos = page_in_list * page_size + slot
  page_size.divmod(pos, page_in_list, slot);
  const int page = kv_indices[w.page_begin + page_in_list];  // physical page holding pos
  const long long cache_token = static_cast<long long>(page) * page_size.divisor + slot;
  return cache_token * num_kv_heads + w.kv_head;
}

// Tile classes of variant::mask_tile (kernels_templates/mask_tiles.cuh).
constexpr int kTileAllMasked = 0;   // every (query, key) pair of the tile is masked: skip it
constexpr int kTileAllVisible = 2;  // every pair is visible: skip the per-key mask

// The KV tiles of a work item and their mask classes over the item's query positions
// [q_lo, q_hi]. Every thread computes the same classes from the same inputs, so the tile
// sequence (and every branch on it) is uniform over the CTA.
struct TileRange {
  const WorkItem& w;
  int num_tiles;
  int q_lo, q_hi;   // query positions of the item's rows
  Index tile_ix;    // the item's Index (no query head, no positions)
  bool all_visible = false;  // every pair of the item is visible (class_whole)

  // Class the item's keys at once, where that costs no more than a tile's class (the mask
  // scans no table over the keys: variant::kMaskTileScans). Every decode step under a causal
  // mask is all_visible: the tensor-core decode kernel attends it without the mask's code.
  __device__ __forceinline__ void class_whole(const variant::Params& params) {
    if constexpr (variant::kHasMask && !variant::kMaskTileScans) {
      all_visible = num_tiles > 0 && variant::mask_tile(q_lo, q_hi, w.kv_start, w.kv_end - 1,
                                                        params, tile_ix) == kTileAllVisible;
    }
  }

  __device__ __forceinline__ int mask_class(const int tile, const variant::Params& params) const {
    const int kv_lo = w.kv_start + tile * kTileKeys;           // first key of the tile
    const int kv_hi = imin(kv_lo + kTileKeys, w.kv_end) - 1;   // last key inside the item
    return variant::mask_tile(q_lo, q_hi, kv_lo, kv_hi, params, tile_ix);
  }
  // The first tile >= tile not entirely masked; num_tiles if none.
  __device__ __forceinline__ int next_visible(int tile, const variant::Params& params) const {
    if constexpr (variant::kHasMask) {
      while (!all_visible && tile < num_tiles && mask_class(tile, params) == kTileAllMasked) ++tile;
    }
    return tile;
  }
  // ... among tile, tile + stride, ... (a warp's share of the item: decode_mma.cu.j2).
  __device__ __forceinline__ int next_visible(int tile, const variant::Params& params,
                                              const int stride) const {
    if constexpr (variant::kHasMask) {
      while (!all_visible && tile < num_tiles && mask_class(tile, params) == kTileAllMasked) {
        tile += stride;
      }
    }
    return tile;
  }
};
