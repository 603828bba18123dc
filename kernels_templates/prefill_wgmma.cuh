// prefill_wgmma.cuh: the wgmma path (sm_90a): a warpgroup folds a whole tile into its 64
// rows, its P V issued behind the next tile's Q K^T, and partial tiles classed per
// 32-key column block.
// Spliced verbatim by prefill_common.cu.j2 inside namespace attnlang::prefill_kernel, after its
// constants (kTileKeys, kSubKeys, kRows, ...) and work items: not a header of its own.

// ---------------------------------------------------------------------------- wgmma path

// A warpgroup's O += P V still to issue: the weights P of the last tile it attended (A
// fragments of T, this warp's 16 rows) and that tile's V stage. It is issued behind the next
// tile's S = Q K^T (FA3's intra-warpgroup overlap: the tensor cores run one tile's P V while
// the warps run the next tile's softmax), so a V stage stays in use one tile longer (kLag).
struct PendingPv {
  unsigned p[kPvSteps][4];
  unsigned v_stage;  // shared address of the V stage
  bool active;       // uniform over the warpgroup
};

// Issue the pending O += P V as one commit group (the caller has run wgmma_fence). Keys
// 16 kv .. + 15 are two 8-row groups of the V tile (stride 1024 bytes); the head dims run
// over its column blocks (lead: a block is kTileKeys rows of 128 bytes).
__device__ __forceinline__ void issue_pv(WarpState& st, const PendingPv& pv) {
  const unsigned long long v_desc = sw128_desc(pv.v_stage, kTileKeys * 128, 1024);
#pragma unroll
  for (int kv = 0; kv < kPvSteps; ++kv) {
    wgmma_pv(st.o_frag[0], pv.p[kv], desc_at(v_desc, kv * 16 * 128), 1);
  }
  wgmma_commit();
}

// Finish the pending O += P V now: the warpgroup skips a tile, or the item ends.
__device__ __forceinline__ void flush_pv(WarpState& st, PendingPv& pv) {
  if (!pv.active) return;  // uniform over the warpgroup
  wgmma_fence();
  issue_pv(st, pv);
  wgmma_wait<0>();
  pin(st.o_frag[0]);
  pv.active = false;
}

// (kPingPong) Warpgroup wg's turn to issue: wait for it, then pass it to the other (ids as
// immediates: a barrier id held in a register through the tile loop spilled ALiBi's kernel).
__device__ __forceinline__ void turn_wait(const int wg) {
  if (wg == 0) {
    named_sync(kTurnBarrier, 256);
  } else {
    named_sync(kTurnBarrier + 1, 256);
  }
}
__device__ __forceinline__ void turn_pass(const int wg) {
  if (wg == 0) {
    named_arrive(kTurnBarrier + 1, 256);
  } else {
    named_arrive(kTurnBarrier, 256);
  }
}

// Fold one tile into the warpgroup's state (this warp's 16 rows of it): S = Q K^T is issued,
// the pending P V of the previous tile behind it (kOverlap: pv.active); this tile's softmax
// runs while that P V does; o is rescaled once it has landed, and this tile's P becomes the
// pending one. kOverlap is a compile-time flag, not a branch: ptxas serialises every wgmma
// when accumulators are read on a path it cannot prove waited. kMask and columns as in
// transform_scores.
// q_tile: shared address of the warpgroup's first Q row in column block 0; k_stage /
// v_stage: the tile's stages. convert_values: (kDeferValues) the tile's values, converted
// while its matmuls run. K-step kk of S reads 32 bytes along the 128-byte rows of
// column block kk / 4 of Q and K (K-major, 8-row groups 1024 bytes apart): 16 T values, or
// (kFp8Qk) 32 e4m3 values of Q_hi, then of Q_lo, and of the raw keys; their raw scores
// times row_factor (this lane's rows') are the scores: folded into the softmax's scale, or
// multiplied in before a logits hook or, softmax off, sm_scale.
template <int kMask, bool kOverlap, int kTerms = -1>
__device__ __forceinline__ void wgmma_tile(WarpState& st, PendingPv& pv, const unsigned q_tile,
                                           const unsigned k_stage, const unsigned v_stage,
                                           const int tile_start, const int kv_end, const int lane,
                                           const float sm_scale, const float score_scale,
                                           const variant::Params& params,
                                           const Index (&row_ix)[kFragRows],
                                           const unsigned columns, const TileTerms& terms,
                                           const DeferredValues& convert_values,
                                           const float (&row_factor)[kFragRows], const int wg) {
  // Tile-uniform tiles: the rows' parts of the logits (a table read each for T5) before the
  // matmul, whose time hides their latency (after it, it was exposed: benchmarks/NOTES.md).
  // A tile-uniform unmasked tile whose logits are the score plus a row's offset (T5's bias)
  // skips the logits per score (kUniformAdditive; the kernel sends it here with sm_scale >= 0).
  constexpr bool kAdditive = kTerms == kUniformTerms && kMask == kNoMask &&
                             variant::kUniformAdditive && variant::kSoftmax;
  variant::UniformRows rows[kFragRows];
  TileTerms tile_terms = terms;
  if constexpr (kTerms == kUniformTerms) {
#pragma unroll
    for (int fr = 0; fr < kFragRows; ++fr) {
      rows[fr] = variant::uniform_rows(params, row_ix[fr], terms.uni);
    }
    tile_terms.rows = rows;
  }
  float s_frag[kRowBlocks][kKeyTiles][4];
  const unsigned long long q_desc = sw128_desc(q_tile, 16, 1024);
  const unsigned long long k_desc = sw128_desc(k_stage, 16, 1024);
  if constexpr (kPingPong) turn_wait(wg);
  wgmma_fence();
  if constexpr (kFp8Qk) {
#pragma unroll
    for (int kk = 0; kk < 2 * kQkSteps8; ++kk) {  // Q_hi's k-steps, then Q_lo's
      const int step = kk % kQkSteps8;
      const unsigned q_off = (kk / kQkSteps8) * kQLoBytes + (step >> 2) * (kRows * 128) + (step & 3) * 32;
      const unsigned k_off = (step >> 2) * (kTileKeys * 128) + (step & 3) * 32;
      wgmma_qk_e4m3(s_frag[0], desc_at(q_desc, q_off), desc_at(k_desc, k_off), kk > 0);
    }
  } else {
#pragma unroll
    for (int kk = 0; kk < kQkSteps; ++kk) {
      const unsigned q_off = (kk >> 2) * (kRows * 128) + (kk & 3) * 32;
      const unsigned k_off = (kk >> 2) * (kTileKeys * 128) + (kk & 3) * 32;
      wgmma_qk(s_frag[0], desc_at(q_desc, q_off), desc_at(k_desc, k_off),
               kk > 0);  // the first k-step writes S (its old contents are never read)
    }
  }
  wgmma_commit();
  if constexpr (kOverlap) issue_pv(st, pv);
  if constexpr (kPingPong) turn_pass(wg);
  convert_values();
  if constexpr (kOverlap) {
    wgmma_wait<1>();  // S has landed (groups complete in order); P V may still run
  } else {
    wgmma_wait<0>();
  }
  pin(s_frag[0]);
  constexpr bool kRowScaled = kFp8Qk && variant::kSoftmax && !variant::kHasLogits;
  if constexpr (kFp8Qk && !kRowScaled) {
#pragma unroll
    for (int j = 0; j < kKeyTiles; ++j) {
#pragma unroll
      for (int c = 0; c < 4; ++c) s_frag[0][j][c] *= row_factor[c >> 1];
    }
  }
  float rescale[kFragRows];
  if constexpr (kAdditive) {
    // Logits s sm_scale + a row's offset: no hook per score, the offset joins the softmax's.
    float offset[kFragRows];
#pragma unroll
    for (int fr = 0; fr < kFragRows; ++fr) {
      offset[fr] = variant::logits_uniform_offset(params, row_ix[fr], terms.uni, rows[fr]);
    }
    softmax_step_offset<1>(st, s_frag, sm_scale, offset, rescale);
  } else {
    if constexpr (kTerms >= 0) {
      transform_scores_as<kMask, 1, kTerms>(s_frag, tile_start, kv_end, 2 * (lane & 3),
                                            sm_scale, params, row_ix, tile_terms, columns);
    } else {
      transform_scores<kMask, 1>(s_frag, tile_start, kv_end, 2 * (lane & 3), sm_scale, params,
                                 row_ix, terms, columns);
    }
    if constexpr (kRowScaled) {
      float scales[kFragRows];
#pragma unroll
      for (int fr = 0; fr < kFragRows; ++fr) {
        scales[fr] = fmaxf(score_scale * row_factor[fr], kMinNormal);  // as score_scale
      }
      softmax_step<1>(st, s_frag, scales, rescale);
    } else if constexpr (variant::kSoftmax) {
      softmax_step<1>(st, s_frag, score_scale, rescale);
    }
  }
  if constexpr (kOverlap) {
    wgmma_wait<0>();
    pin(st.o_frag[0]);
  }
  if constexpr (variant::kSoftmax) rescale_o<1>(st, rescale);
  // P's A fragment of k-step kv: S n-tiles 2 kv (a0, a1) and 2 kv + 1 (a2, a3), as in attend_tile.
#pragma unroll
  for (int kv = 0; kv < kPvSteps; ++kv) {
    pv.p[kv][0] = pack2<T>(s_frag[0][2 * kv][0], s_frag[0][2 * kv][1]);
    pv.p[kv][1] = pack2<T>(s_frag[0][2 * kv][2], s_frag[0][2 * kv][3]);
    pv.p[kv][2] = pack2<T>(s_frag[0][2 * kv + 1][0], s_frag[0][2 * kv + 1][1]);
    pv.p[kv][3] = pack2<T>(s_frag[0][2 * kv + 1][2], s_frag[0][2 * kv + 1][3]);
  }
  pv.v_stage = v_stage;
  pv.active = true;
}

// Split keys: warpgroup 1's state of the shared rows (its tiles) is merged into warpgroup 0's
// (the others): both rescaled to the larger max, then added; softmax off, just added. Thread t
// of warpgroup 1 hands its fragments to thread t - 128 through shared memory (value-major, so
// a warp's stores and loads are 32 consecutive floats). Ends with the computing threads'
// barrier: the epilogue may reuse the memory.
__device__ __forceinline__ void split_merge(WarpState& st, float* const merge_smem, const int tid,
                                            const float score_scale) {
  constexpr int kOValues = kDimTiles * 4;
  const int slot = tid & 127;
  if (tid >= 128) {
#pragma unroll
    for (int t = 0; t < kDimTiles; ++t) {
#pragma unroll
      for (int c = 0; c < 4; ++c) merge_smem[(4 * t + c) * 128 + slot] = st.o_frag[0][t][c];
    }
#pragma unroll
    for (int fr = 0; fr < kFragRows; ++fr) {
      merge_smem[(kOValues + fr) * 128 + slot] = st.m[fr];
      merge_smem[(kOValues + kFragRows + fr) * 128 + slot] = st.d[fr];
    }
  }
  compute_sync();
  if (tid < 128) {
    float a0[kFragRows], a1[kFragRows];
#pragma unroll
    for (int fr = 0; fr < kFragRows; ++fr) {
      a0[fr] = a1[fr] = 1.0f;
      if constexpr (variant::kSoftmax) {
        const float m1 = merge_smem[(kOValues + fr) * 128 + slot];
        const float d1 = merge_smem[(kOValues + kFragRows + fr) * 128 + slot];
        const float m = fmaxf(st.m[fr], m1);
        if (m != neg_inf()) {  // else both states are empty (o = 0, d = 0): nothing to scale
          a0[fr] = ex2_approx((st.m[fr] - m) * score_scale);
          a1[fr] = ex2_approx((m1 - m) * score_scale);
        }
        st.m[fr] = m;
        st.d[fr] = st.d[fr] * a0[fr] + d1 * a1[fr];
      }
    }
#pragma unroll
    for (int t = 0; t < kDimTiles; ++t) {
#pragma unroll
      for (int c = 0; c < 4; ++c) {
        const float o1 = merge_smem[(4 * t + c) * 128 + slot];
        st.o_frag[0][t][c] = st.o_frag[0][t][c] * a0[c >> 1] + o1 * a1[c >> 1];
      }
    }
  }
  compute_sync();
}

// The class of the keys [kv_lo, kv_lo + kSubKeys) for the queries [q_lo, q_hi] of the rows
// deciding together (0 skip, 1 masked, 2 unmasked): 2 when the CTA found the whole tile
// unmasked; keys running past kv_end always need the guard.
__device__ __forceinline__ int refine_class(const bool cta_full, const int kv_lo, const int kv_end,
                                            const int q_lo, const int q_hi,
                                            const variant::Params& params, const Index& tile_ix) {
  if (cta_full) return 2;
  const bool runs_past_end = kv_lo + kSubKeys > kv_end;
  const int kv_hi = (runs_past_end ? kv_end : kv_lo + kSubKeys) - 1;
  const int cls = tile_mask(q_lo, q_hi, kv_lo, kv_hi, params, tile_ix);
  return (cls == 2 && runs_past_end) ? 1 : cls;
}

// A step the rows deciding together see partially, classed per 32-key column block: true
// with `columns` (bit i: keys kv_lo + 32 i .. + 31 all visible) when every block is all
// visible or all hidden, so the step masks by column (kColumnMask) and never evaluates the
// mask per element (block-sparse layouts, a window's far blocks); false when some block is
// mixed. Blocks past kv_end stay hidden (the guard keeps their keys so).
__device__ __forceinline__ bool refine_columns(unsigned& columns, const int kv_lo,
                                               const int kv_end, const int q_lo, const int q_hi,
                                               const variant::Params& params,
                                               const Index& tile_ix) {
  columns = 0u;
#pragma unroll
  for (int i = 0; i < kSubKeys / 32; ++i) {
    const int lo = kv_lo + 32 * i;
    if (lo >= kv_end) break;
    const int cls = tile_mask(q_lo, q_hi, lo, imin(lo + 32, kv_end) - 1, params, tile_ix);
    if (cls == 1) return false;
    columns |= static_cast<unsigned>(cls == 2) << i;
  }
  return true;
}
