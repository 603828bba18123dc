    // prefill_item_queries.cuh: the item's queries through the query hook, published to every
    // computing warp. Spliced verbatim by both prefill kernels once the item's first tiles are
    // in flight (kAhead, the tiles ahead of Q's commit group, is each path's).
    // Q has landed (the tiles behind it need not have): the chunks this thread copied go
    // through the query hook and take the sign of sm_scale, in place (overlapping the first
    // tiles' loads); the barrier publishes them. Not unrolled: it runs once per item, and an
    // unrolled hook per pass costs code and registers the tile loop needs.
    cp_async_wait<kProducer ? 0 : kAhead>();
    // The sign of sm_scale and (kFoldScales) the K scale of the item's KV head go into Q
    // (kFp8Qk: into the rows' factors, so that q stays exact in hi + lo).
    const float q_factor = kFoldScales && !kFp8Qk ? q_sign * kv_scale.x : q_sign;
    unsigned char* const q_bytes = reinterpret_cast<unsigned char*>(q_smem);
    float* const q_row_factors_out = distance_smem;  // (kFp8Qk: no distance table)
    if (variant::kHasQuery || q_factor != 1.0f || kFp8Qk) {  // uniform
#pragma unroll 1
      for (int pass = 0; pass < kRows / kGroups; ++pass) {
        const int r = group_id + pass * kGroups;
        if (r >= w.rows) break;  // uniform over the row's TX lanes; later passes are past it too
        float x[VEC];
#pragma unroll
        for (int c = 0; c < kLaneChunks; ++c) {
          load8<T>(q_smem + swizzle<kRows>(r, tx * kLaneChunks + c), chunk8(x, c));
        }
        if constexpr (variant::kHasQuery) {
          const QueryRow qr = query_row(w, r, group, cascade);
          const Index ix = row_index(qr, w.kv_head, num_heads, num_kv_heads, sm_scale);
          variant::query<VEC, TX>(x, dim0, params, ix);
        }
#pragma unroll
        for (int i = 0; i < VEC; ++i) x[i] *= q_factor;
        if constexpr (kFp8Qk) {
          split_query_row(x, r, tx, kv_scale.x, q_bytes, q_row_factors_out);
        } else {
#pragma unroll
          for (int c = 0; c < kLaneChunks; ++c) {
            store8<T>(q_smem + swizzle<kRows>(r, tx * kLaneChunks + c), chunk8(x, c));
          }
        }
      }
    }
    if constexpr (kWgmma) fence_async_shared();  // Q is read by wgmma (the async proxy)
    compute_sync();
