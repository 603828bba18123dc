    // prefill_item_rows.cuh: this lane's rows of the item with their Index, the keys' Index, and
    // the softmax state. Spliced verbatim by both prefill kernels before their tile loop.
    // This lane's rows (fr = 2 b + h: row 16 b + lane_row + 8 h of the warp) and their Index.
    Index row_ix[kFragRows];
#pragma unroll
    for (int fr = 0; fr < kFragRows; ++fr) {
      const QueryRow qr = query_row(w, tile_warp_row + 8 * fr + lane_row, group, cascade);
      row_ix[fr] = row_index(qr, w.kv_head, num_heads, num_kv_heads, sm_scale);
      // The row's entry for the tile's last key (rows past w.rows read the last query's).
      const int head_entries =
          variant::kDistanceByHead ? (qr.head - w.kv_head * group) * distance_table.stride : 0;
      row_ix[fr].distance_row = head_entries + imin(qr.q_pos, span.q_hi) - span.q_lo + kTileKeys - 1;
    }
    // Keys see no query head or position.
    const Index kv_ix{w.batch, /*head=*/-1, w.kv_head, w.qo_len, w.kv_len, /*q_pos=*/-1,
                      /*kv_pos=*/-1, num_heads, num_kv_heads, sm_scale};

    WarpState st;
#pragma unroll
    for (int b = 0; b < kRowBlocks; ++b) {
#pragma unroll
      for (int t = 0; t < kDimTiles; ++t) {
#pragma unroll
        for (int c = 0; c < 4; ++c) st.o_frag[b][t][c] = 0.0f;
      }
    }
#pragma unroll
    for (int fr = 0; fr < kFragRows; ++fr) {
      st.m[fr] = neg_inf();
      st.d[fr] = 0.0f;
    }
