    // prefill_item_end.cuh: the item's epilogue (normalisation, lse, partial states or the
    // output hook and out). Spliced verbatim at the end of both prefill kernels' item loop,
    // once every warp is done with the tiles.
    {
      // The epilogue reads its work item again, so that the fields only it needs do not hold
      // registers through the tile loop.
      const WorkItem w = read_work_item(item, work_request, work_kv_head, work_row_start,
                                        work_kv_start, work_kv_end, work_partial, qo_indptr,
                                        kv_indptr, kv_last_page_len, page_size, group, cascade);
      // Finish the lane's rows: quad sums, normalisation, lse (log2 units); (kFoldScales) the
      // V scale of the item's KV head.
      const float v_factor = kFoldScales ? kv_scales(params, w.kv_head).y : 1.0f;
      float row_lse2[kFragRows];
#pragma unroll
      for (int fr = 0; fr < kFragRows; ++fr) {
        const int b = fr >> 1, h = fr & 1;
        row_lse2[fr] = neg_inf();
        if constexpr (variant::kSoftmax) {
          const float d = quad_allreduce(st.d[fr], SumOp{});
          const bool any_visible = d > 0.0f;
          const float inv_d = any_visible ? v_factor / d : 0.0f;
          if (any_visible) row_lse2[fr] = st.m[fr] * score_scale + __log2f(d);
#pragma unroll
          for (int t = 0; t < kDimTiles; ++t) {
            st.o_frag[b][t][2 * h] *= inv_d;
            st.o_frag[b][t][2 * h + 1] *= inv_d;
          }
        } else if constexpr (kFoldScales) {
#pragma unroll
          for (int t = 0; t < kDimTiles; ++t) {
            st.o_frag[b][t][2 * h] *= v_factor;
            st.o_frag[b][t][2 * h + 1] *= v_factor;
          }
        }
      }

      if (w.partial >= 0) {
        // Split item: normalised o and log2 lse of each row straight from the fragments.
#pragma unroll
        for (int fr = 0; fr < kFragRows; ++fr) {
          const int b = fr >> 1, h = fr & 1;
          const int r = warp_row + 8 * fr + lane_row;
          if (r < w.rows) {
            float* const dst = partial_o + (static_cast<long long>(w.partial) + r) * kHeadDimVO;
#pragma unroll
            for (int t = 0; t < kDimTiles; ++t) {
              *reinterpret_cast<float2*>(dst + 8 * t + lane_col) =
                  make_float2(st.o_frag[b][t][2 * h], st.o_frag[b][t][2 * h + 1]);
            }
            if (lane_col == 0) partial_lse[w.partial + r] = row_lse2[fr];
          }
        }
      } else if constexpr (kOutputAsT) {
        // Final item, no output hook: lse from the fragments; o as T into shared memory (the
        // Q tile or the ring), two n-tiles of the warp's 16 rows per stmatrix, then 16-byte
        // copies to out.
        T* const out_smem = kOutputInQTile ? q_smem : reinterpret_cast<T*>(o_smem);
#pragma unroll
        for (int fr = 0; fr < kFragRows; ++fr) {
          const int r = warp_row + 8 * fr + lane_row;
          if (r < w.rows && lane_col == 0 && lse != nullptr) {
            const QueryRow qr = query_row(w, r, group, cascade);
            lse[static_cast<long long>(qr.token) * num_heads + qr.head] = row_lse2[fr] * kLn2;
          }
        }
        // Lane l addresses row l % 8 of matrix l / 8: rows + 8 (l / 8 % 2), n-tile + l / 16.
        const int st_row = warp_row + 8 * (ld_matrix & 1) + ld_row;
#pragma unroll
        for (int b = 0; b < kFragRows / 2; ++b) {
#pragma unroll
          for (int t = 0; t < kDimTiles; t += 2) {
            const unsigned frags[4] = {
                pack2<T>(st.o_frag[b][t][0], st.o_frag[b][t][1]),
                pack2<T>(st.o_frag[b][t][2], st.o_frag[b][t][3]),
                pack2<T>(st.o_frag[b][t + 1][0], st.o_frag[b][t + 1][1]),
                pack2<T>(st.o_frag[b][t + 1][2], st.o_frag[b][t + 1][3])};
            stmatrix_x4(smem_u32(out_smem + swizzle_out(st_row + 16 * b, t + (ld_matrix >> 1))), frags);
          }
        }
        compute_sync();
        PassRows<kGroups> rows(w, group_id, group);
#pragma unroll
        for (int pass = 0; pass < kRows / kGroups; ++pass, rows.next()) {
          const int r = group_id + pass * kGroups;
          if (r < w.rows) {  // uniform over the row's TX lanes
            const QueryRow qr = rows.row(w, cascade);
            T* const dst = out + (static_cast<long long>(qr.token) * num_heads + qr.head) * kHeadDimVO + dim0_vo;
#pragma unroll
            for (int c = 0; c < kLaneChunksVO; ++c) {
              *reinterpret_cast<uint4*>(dst + 8 * c) =
                  *reinterpret_cast<const uint4*>(out_smem + swizzle_out(r, tx * kLaneChunksVO + c));
            }
          }
        }
        compute_sync();  // the staging is free for the next item
      } else {
        // Final item: lse from the fragments; o through shared memory (fp32, swizzled), then the
        // output hook on TX-lane row groups and 16-byte stores of out.
#pragma unroll
        for (int fr = 0; fr < kFragRows; ++fr) {
          const int b = fr >> 1, h = fr & 1;
          const int r = warp_row + 8 * fr + lane_row;
          if (r < w.rows && lane_col == 0 && lse != nullptr) {
            const QueryRow qr = query_row(w, r, group, cascade);
            lse[static_cast<long long>(qr.token) * num_heads + qr.head] = row_lse2[fr] * kLn2;
          }
#pragma unroll
          for (int t = 0; t < kDimTiles; ++t) {
            const int col = 8 * t + lane_col;  // first of the lane's two columns
            *reinterpret_cast<float2*>(o_smem + swizzle_f32(r, col >> 2) + (col & 3)) =
                make_float2(st.o_frag[b][t][2 * h], st.o_frag[b][t][2 * h + 1]);
          }
        }
        compute_sync();
        PassRows<kGroups> rows(w, group_id, group);
#pragma unroll kOutputUnroll
        for (int pass = 0; pass < kRows / kGroups; ++pass, rows.next()) {
          const int r = group_id + pass * kGroups;
          if (r < w.rows) {  // uniform over the row's TX lanes
            const QueryRow qr = rows.row(w, cascade);
            float x[VEC_VO];  // elements dim0_vo .. + VEC_VO - 1: float chunks dim0_vo / 4 ..
#pragma unroll
            for (int c = 0; c < VEC_VO / 4; ++c) {
              const float4 f = *reinterpret_cast<const float4*>(o_smem + swizzle_f32(r, dim0_vo / 4 + c));
              x[4 * c] = f.x; x[4 * c + 1] = f.y; x[4 * c + 2] = f.z; x[4 * c + 3] = f.w;
            }
            if constexpr (variant::kHasOutput) {
              const Index ix = row_index(qr, w.kv_head, num_heads, num_kv_heads, sm_scale);
              variant::output<VEC_VO, TX>(x, dim0_vo, params, ix);
            }
            store_n<T>(out + (static_cast<long long>(qr.token) * num_heads + qr.head) * kHeadDimVO + dim0_vo, x);
          }
        }
        compute_sync();  // the staging (K/V stage memory) is free for the next item
      }
    }
