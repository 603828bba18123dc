// prefill_mma.cuh: the mma.sync path (sm_80 and every target without wgmma): a warp folds
// one step of kSubKeys keys into its rows' state, Q K^T and P V from ldmatrix fragments.
// Spliced verbatim by prefill_common.cu.j2 inside namespace attnlang::prefill_kernel, after its
// constants (kTileKeys, kSubKeys, kRows, ...) and work items: not a header of its own.

// Fold one tile into the warp's state. k_stage / v_stage: the tile in shared memory; kMasked:
// evaluate the guard and mask per element. q_addr: the warp's first Q row in shared memory
// (read when Q is not in registers). kBlocks: the row blocks holding rows of the item (the
// others are left as they are: a short item, such as a decode step's GQA group, fills only
// the first 16 rows of a warp and need not pay for the rest).
template <bool kMasked, int kBlocks>
__device__ __forceinline__ void attend_tile(WarpState& st,
                                            const unsigned (&q_frag)[kRowBlocks][kQFragSteps][4],
                                            const unsigned q_addr, const LaneOffsets& off,
                                            const T* k_stage, const T* v_stage,
                                            const int tile_start, const int kv_end,
                                            const int lane, const float sm_scale,
                                            const float score_scale,
                                            const variant::Params& params,
                                            const Index (&row_ix)[kFragRows],
                                            const TileTerms& terms) {
  const int lane_col = 2 * (lane & 3);

  // S = Q K^T (operand layouts: LaneOffsets). Each K fragment serves every row block.
  float s_frag[kRowBlocks][kKeyTiles][4];
#pragma unroll
  for (int b = 0; b < kBlocks; ++b) {
#pragma unroll
    for (int j = 0; j < kKeyTiles; ++j) {
#pragma unroll
      for (int c = 0; c < 4; ++c) s_frag[b][j][c] = 0.0f;
    }
  }
  const unsigned k_base = smem_u32(k_stage);
#pragma unroll
  for (int kk = 0; kk < kQkSteps; ++kk) {
    unsigned a[kRowBlocks][4];  // Q's A fragments of k-step kk
#pragma unroll
    for (int b = 0; b < kBlocks; ++b) {
      if constexpr (kQInRegisters) {
#pragma unroll
        for (int i = 0; i < 4; ++i) a[b][i] = q_frag[b][kk][i];
      } else {
        ldmatrix_x4(a[b], ld_address(q_addr, off.q, kk, 16 * b));
      }
    }
#pragma unroll
    for (int jp = 0; jp < kKeyTiles / 2; ++jp) {
      unsigned kb[4];
      ldmatrix_x4(kb, ld_address(k_base, off.k, kk, 16 * jp));
#pragma unroll
      for (int b = 0; b < kBlocks; ++b) {
        Mma<T>::m16n8k16(s_frag[b][2 * jp], a[b], kb[0], kb[1]);
        Mma<T>::m16n8k16(s_frag[b][2 * jp + 1], a[b], kb[2], kb[3]);
      }
    }
  }

  transform_scores<kMasked ? kElementMask : kNoMask, kBlocks>(s_frag, tile_start, kv_end,
                                                              lane_col, sm_scale, params, row_ix,
                                                              terms);

  if constexpr (variant::kSoftmax) {
    float rescale[kFragRows];
    softmax_step<kBlocks>(st, s_frag, score_scale, rescale);
    rescale_o<kBlocks>(st, rescale);
  }

  // O += P V. P's A fragment of k-step kv is S n-tiles 2 kv (a0, a1) and 2 kv + 1 (a2, a3);
  // each V fragment serves every row block.
  const unsigned v_base = smem_u32(v_stage);
#pragma unroll
  for (int kv = 0; kv < kPvSteps; ++kv) {
    unsigned p_frag[kRowBlocks][4];
#pragma unroll
    for (int b = 0; b < kBlocks; ++b) {
      p_frag[b][0] = pack2<T>(s_frag[b][2 * kv][0], s_frag[b][2 * kv][1]);
      p_frag[b][1] = pack2<T>(s_frag[b][2 * kv][2], s_frag[b][2 * kv][3]);
      p_frag[b][2] = pack2<T>(s_frag[b][2 * kv + 1][0], s_frag[b][2 * kv + 1][1]);
      p_frag[b][3] = pack2<T>(s_frag[b][2 * kv + 1][2], s_frag[b][2 * kv + 1][3]);
    }
#pragma unroll
    for (int tp = 0; tp < kDimTiles / 2; ++tp) {
      unsigned vb[4];
      ldmatrix_x4_trans(vb, ld_address<kHeadDimVO>(v_base, off.v, tp, 16 * kv));
#pragma unroll
      for (int b = 0; b < kBlocks; ++b) {
        Mma<T>::m16n8k16(st.o_frag[b][2 * tp], p_frag[b], vb[0], vb[1]);
        Mma<T>::m16n8k16(st.o_frag[b][2 * tp + 1], p_frag[b], vb[2], vb[3]);
      }
    }
  }
}
