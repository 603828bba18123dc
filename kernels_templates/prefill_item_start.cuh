    // prefill_item_start.cuh: a work item's fields, the ranges its tiles are decided on, and its
    // queries' copy into shared memory. Spliced verbatim at the top of both prefill kernels'
    // item loop (prefill_mma.cu.j2, prefill_wgmma.cu.j2).
    // (kFieldsAhead: read at the end of the item before.)
    const WorkItem w = fields_read ? next_fields
                                   : read_work_item(item, work_request, work_kv_head,
                                                    work_row_start, work_kv_start, work_kv_end,
                                                    work_partial, qo_indptr, kv_indptr,
                                                    kv_last_page_len, page_size, group, cascade);
    fields_read = false;
    // Query positions of the CTA's rows and of this warp's rows (ranges for mask_tile).
    const int q_pos0 = w.kv_len - w.qo_len;  // q_pos of query 0
    // Split keys: both warpgroups attend the first one's rows, taking alternate tiles.
    const bool split = split_keys(w.rows);  // uniform over the CTA
    const int tile_warp_row = split ? (warp_row & 63) : warp_row;  // the rows this warp attends
    const int warp_rows = imin(kWarpRows, w.rows - tile_warp_row);  // <= 0: the warp has no rows
    // All of the warp's rows in its first row block (decode steps, short prompts): the
    // other blocks' mmas and softmax are skipped (uniform over the warp).
    const bool one_block = kRowBlocks > 1 && warp_rows <= 16;
    // The rows deciding together per tile (kRefineRows: the warp, or its warpgroup).
    const int refine_row = kRefineRows * (tile_warp_row / kRefineRows);
    const int refine_rows = imin(kRefineRows, w.rows - refine_row);  // <= 0: none
    const TileSpan span = item_span(w, group);
    // (A cascade item's rows are several requests': their q_pos range is the item's.)
    const int refine_q_lo =
        kCascade ? span.q_lo : q_pos0 + (w.row_start + refine_row) / group;
    const int refine_q_hi =
        kCascade ? span.q_hi : q_pos0 + (w.row_start + refine_row + imax(refine_rows, 1) - 1) / group;
    const Index tile_ix = tile_index(w, num_heads, num_kv_heads, sm_scale, params);
    TileCursor cursor{-32, 0u, 0u};
    // The distance term's table (distance_table.cuh): per query head of the KV head's group
    // where the term reads the head. Where one tile's distances do not fit, there is none
    // (the term is then per score).
    const int distance_heads = variant::kDistanceByHead ? group : 1;
    const int tile_distances = span.q_hi - span.q_lo + kTileKeys;
    DistanceTable distance_table(distance_smem, distance_heads);
    const bool distance_fits =
        variant::kDistanceTerm && kTileTerms && distance_table.fits(tile_distances);
    // The logits' tile-uniform terms per tile, over the rows deciding together; with a
    // distance table over all of the CTA's rows, since the table then serves every row of a
    // tile where they are not one value (one window: its interval tests cost).
    UniformWindow<kTileKeys> uniform_window;
    const int terms_q_lo = distance_fits ? span.q_lo : refine_q_lo;
    const int terms_q_hi = distance_fits ? span.q_hi : refine_q_hi;
    // This thread's chunks of the item's KV head in cache token 0 (load_tile).
    const KvT* const k_row = k_cache + w.kv_head * kHeadDim + dim0;
    const KvT* const v_row = v_cache + w.kv_head * kHeadDimVO + dim0_vo;
    const float2 kv_scale = kv_scales(params, w.kv_head);  // (kKvFp8) the item's KV head's

    // Q: the item's rows copied as they are into shared memory (zero-filled past the last row),
    // the oldest commit group: every load in flight at once, no registers held.
#pragma unroll
    for (int pass = 0; pass < kRows / kGroups; ++pass) {
      const int r = group_id + pass * kGroups;
      const bool valid = r < w.rows;  // uniform over the row's TX lanes
      const QueryRow qr = query_row(w, valid ? r : 0, group, cascade);
      const T* const src = q + (static_cast<long long>(qr.token) * num_heads + qr.head) * kHeadDim + dim0;
#pragma unroll
      for (int c = 0; c < kLaneChunks; ++c) {
        cp_async_16_shared(smem_u32(q_smem + swizzle<kRows>(r, tx * kLaneChunks + c)), src + 8 * c, valid);
      }
    }
    cp_async_commit();
