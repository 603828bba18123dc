// prefill_scores.cuh: what both paths do to one tile's scores: their fragment layout
// (ldmatrix lane offsets), the logits and mask hooks per score, with the tile-uniform
// terms or the distance table where the tile has them, and the online softmax.
// Spliced verbatim by prefill_common.cu.j2 inside namespace attnlang::prefill_kernel, after its
// constants (kTileKeys, kSubKeys, kRows, ...) and work items: not a header of its own.

// ---------------------------------------------------------------------------- one tile

// Byte offsets of the rows and chunks this lane addresses in its ldmatrix instructions.
// Operand X's address for chunk c = 2 step + (the lane's matrix bit) of a row group whose
// first row row0 is a multiple of 8 is (ld_address)
//   base + (off.X ^ ((step % 4) << 5)) + 2 (64 (step / 4) + row0 D)
// with off.X = 2 (row D) + ((bit ^ ld_row) << 4), D the operand's row length (kHeadDim for Q
// and K, kHeadDimVO for V): the swizzle XORs only the low 3
// bits of c with the row's low 3 bits (ld_row), (2 i + bit) ^ ld_row = 2 i ^ (bit ^ ld_row),
// and the row term has no bits below 128 bytes, so one register per operand and a LOP3 per
// address serve every step (four offsets per operand cost 12 registers the tile loop needs).
//   q: A fragment of k-step kk    matrix i: rows 8 (i % 2) + ld_row, chunk 2 kk + i / 2
//   k: B of k-step kk, n-tiles 2 jp, 2 jp + 1   matrix i: keys 16 jp + 8 (i / 2) + ld_row,
//      chunk 2 kk + i % 2 -> b0, b1 of n-tile 2 jp, then of 2 jp + 1
//   v: B (.trans) of k-step kv, O n-tiles 2 tp, 2 tp + 1   matrix i: keys 16 kv + 8 (i % 2)
//      + ld_row, chunk 2 tp + i / 2 -> b0, b1 of n-tile 2 tp, then of 2 tp + 1 (q's lane
//      offsets over rows of kHeadDimVO: the same register when the head dims agree)
struct LaneOffsets {
  unsigned q, k, v;
};

__device__ __forceinline__ LaneOffsets lane_offsets(const int ld_matrix, const int ld_row) {
  const int low_row = 8 * (ld_matrix & 1) + ld_row;  // rows of matrices 0, 2 | 1, 3
  const int high_row = 8 * (ld_matrix >> 1) + ld_row;  // rows of matrices 0, 1 | 2, 3
  const int low_chunk = ((ld_matrix >> 1) ^ ld_row) << 4;
  return {static_cast<unsigned>(2 * low_row * kHeadDim + low_chunk),
          static_cast<unsigned>(2 * high_row * kHeadDim + (((ld_matrix & 1) ^ ld_row) << 4)),
          static_cast<unsigned>(2 * low_row * kHeadDimVO + low_chunk)};
}

// The shared address a lane gives ldmatrix for `step` of the row group at row0 (above), in
// a tile of rows of kRowElems elements.
template <int kRowElems = kHeadDim>
__device__ __forceinline__ unsigned ld_address(const unsigned base, const unsigned lane_offset,
                                               const int step, const int row0) {
  return base + (lane_offset ^ static_cast<unsigned>((step % 4) << 5)) +
         2 * (64 * (step / 4) + row0 * kRowElems);
}

// The per-lane state of the warp's rows: in row block b the lane holds rows lane_row (h = 0)
// and lane_row + 8 (h = 1), fragment rows fr = 2 b + h.
struct WarpState {
  float o_frag[kRowBlocks][kDimTiles][4];
  float m[kFragRows];  // running max score (raw units), -inf: nothing visible yet
  float d[kFragRows];  // this lane's part of the running sum of 2^((s - m) * score_scale)
};

// How a step's scores are masked: not at all (every pair visible), by 32-key column block
// (every block of the step all visible or all hidden: bit i of `columns` for keys 32 i ..
// 32 i + 31), or per element (the mask hook).
constexpr int kNoMask = 0, kColumnMask = 1, kElementMask = 2;

// How a step's logits are evaluated. kScoreTerms: the logits hook per score. kUniformTerms:
// the logits' tile-uniform terms are the values in `uni` over the whole step
// (variant::uniform_tile), so variant::logits_uniform stands in for the hook. kTableTerms:
// the distance term of key c of the step (0 .. kSubKeys - 1) is dist[ix.distance_row - c],
// the tile's table (DistanceTable::at) seen from the step, and variant::logits_distance
// stands in.
constexpr int kScoreTerms = 0, kUniformTerms = 1, kTableTerms = 2;
struct TileTerms {
  bool uniform;          // uniform over the rows deciding together
  variant::Uniform uni;  // the terms' values where uniform
  const float* dist;     // nullptr: the tile has no distance table
  // kUniformTerms: the lane's rows' parts of the logits (variant::uniform_rows), when the
  // caller evaluated them ahead; nullptr: evaluated in place.
  const variant::UniformRows* rows = nullptr;

  // Does a tile with a distance term need it per score: neither tile-uniform nor in the
  // table (its distances did not fit: a cascade item's rows, a large GQA group)? On the
  // wgmma path such tiles take one instantiation of their own, every score masked per
  // element: the term per score (T5's log) in every tile kind had made the kernel 1.6x as
  // large and spilled, 3-4% of T5's time (benchmarks/NOTES.md). (On the mma.sync path
  // ptxas spilled more with that instance apart: each tile kind keeps its own.)
  __device__ __forceinline__ bool per_score() const {
    return kWgmma && variant::kDistanceTerm && !uniform && dist == nullptr;
  }
};

// Scores of one tile for this lane's elements: s_frag[b][j][c] is (row 16 b + lane_row +
// 8 (c / 2), key 8 j + lane_col + c % 2), for the first kBlocks row blocks. Applies the logits
// hook (and, softmax off, sm_scale) and, kMask permitting, the guard (pos < kv_end) and the
// column bits or the per-element mask: invisible -> -inf (softmax) or 0 (weights). A per-pair
// mask's bits are read a row at a time (variant::pair_window), not per element, from the
// lane's first column: each element then sits at a compile-time offset (8 j + c), one shift.
// kTerms: how the logits are evaluated (TileTerms): per score, with the tile-uniform terms'
// values, or with the distance term read from the tile's table.
template <int kMask, int kBlocks, int kTerms>
__device__ __forceinline__ void transform_scores_as(float (&s_frag)[kRowBlocks][kKeyTiles][4],
                                                 const int tile_start, const int kv_end,
                                                 const int lane_col, const float sm_scale,
                                                 const variant::Params& params,
                                                 const Index (&row_ix)[kFragRows],
                                                 const TileTerms& terms,
                                                 const unsigned columns = 0u) {
  constexpr bool kMasked = kMask == kElementMask;
  PairWindow window[kFragRows];
  if constexpr (kMasked && variant::kPairWindow) {
#pragma unroll
    for (int fr = 0; fr < 2 * kBlocks; ++fr) {
      window[fr] = variant::pair_window<kSubKeys>(params, row_ix[fr], tile_start + lane_col);
    }
  }
#pragma unroll
  for (int b = 0; b < kBlocks; ++b) {
#pragma unroll
    for (int j = 0; j < kKeyTiles; ++j) {
#pragma unroll
      for (int c = 0; c < 4; ++c) {
        const int pos = tile_start + 8 * j + lane_col + (c & 1);  // the element's kv_pos
        Index ix = row_ix[2 * b + (c >> 1)];
        ix.kv_pos = pos;
        if constexpr (kMasked && variant::kPairWindow) ix.pair_window = &window[2 * b + (c >> 1)];
        float s = s_frag[b][j][c];
        if constexpr (kTerms == kUniformTerms) {
          s = terms.rows != nullptr
                  ? variant::logits_uniform_rows(s * sm_scale, params, ix, terms.uni,
                                                 terms.rows[2 * b + (c >> 1)])
                  : variant::logits_uniform(s * sm_scale, params, ix, terms.uni);
        } else if constexpr (kTerms == kTableTerms) {
          const float t = terms.dist[ix.distance_row - lane_col - 8 * j - (c & 1)];
          s = variant::logits_distance(s * sm_scale, params, ix, t);
        } else if constexpr (variant::kHasLogits) {
          s = variant::logits(s * sm_scale, params, ix);
        } else if constexpr (!variant::kSoftmax) {
          s *= sm_scale;
        }
        if constexpr (kMasked) {
          bool visible = pos < kv_end;
          if constexpr (variant::kHasMask) visible = visible && variant::mask(params, ix);
          s = visible ? s : (variant::kSoftmax ? neg_inf() : 0.0f);
        } else if constexpr (kMask == kColumnMask) {
          const bool visible = pos < kv_end && ((columns >> (j / 4)) & 1u);  // 4 n-tiles a block
          s = visible ? s : (variant::kSoftmax ? neg_inf() : 0.0f);
        }
        s_frag[b][j][c] = s;
      }
    }
  }
}

// transform_scores_as with the tile-uniform logits where terms.uniform (a branch uniform over
// the rows deciding together), else with the distance table where the tile has one (on the
// wgmma path every tile that reaches here does: TileTerms::per_score), else per score.
template <int kMask, int kBlocks>
__device__ __forceinline__ void transform_scores(float (&s_frag)[kRowBlocks][kKeyTiles][4],
                                                 const int tile_start, const int kv_end,
                                                 const int lane_col, const float sm_scale,
                                                 const variant::Params& params,
                                                 const Index (&row_ix)[kFragRows],
                                                 const TileTerms& terms,
                                                 const unsigned columns = 0u) {
  if (variant::kUniformTerms > 0 && terms.uniform) {
    transform_scores_as<kMask, kBlocks, kUniformTerms>(s_frag, tile_start, kv_end, lane_col,
                                                       sm_scale, params, row_ix, terms, columns);
  } else if (variant::kDistanceTerm && (kWgmma || terms.dist != nullptr)) {
    transform_scores_as<kMask, kBlocks, kTableTerms>(s_frag, tile_start, kv_end, lane_col,
                                                     sm_scale, params, row_ix, terms, columns);
  } else {
    transform_scores_as<kMask, kBlocks, kScoreTerms>(s_frag, tile_start, kv_end, lane_col,
                                                     sm_scale, params, row_ix, terms, columns);
  }
}

// The online softmax over one step's scores (after transform_scores), for the first kBlocks
// row blocks: each row's new max, rescale[fr] = the factor for its old o and d (exactly 1
// when the max did not move), d updated, and s_frag replaced by the weights
// p = 2^(s score_scale - m score_scale). score_scale: one for every row, or (kFp8Qk) a row's
// own per fragment row.
__device__ __forceinline__ float row_scale(const float scale, int) { return scale; }
__device__ __forceinline__ float row_scale(const float (&scale)[kFragRows], const int fr) {
  return scale[fr];
}
template <int kBlocks, typename Scale>
__device__ __forceinline__ void softmax_step(WarpState& st, float (&s_frag)[kRowBlocks][kKeyTiles][4],
                                             const Scale& scales, float (&rescale)[kFragRows]) {
#pragma unroll
  for (int fr = 0; fr < 2 * kBlocks; ++fr) {
    const int b = fr >> 1, h = fr & 1;
    const float score_scale = row_scale(scales, fr);
    float m_new = st.m[fr];
#pragma unroll
    for (int j = 0; j < kKeyTiles; ++j) {
      m_new = fmaxf(m_new, fmaxf(s_frag[b][j][2 * h], s_frag[b][j][2 * h + 1]));
    }
    m_new = quad_allreduce(m_new, MaxOp{});
    // Offset of the exp2 arguments; 0 while the row has no visible key (m_new = -inf), so
    // no -inf - -inf: masked scores give 2^-inf = 0 and the old state (0) is scaled by 0.
    const float offset = m_new == neg_inf() ? 0.0f : m_new * score_scale;
    rescale[fr] = m_new == st.m[fr] ? 1.0f : ex2_approx(st.m[fr] * score_scale - offset);
    st.m[fr] = m_new;
    st.d[fr] *= rescale[fr];
#pragma unroll
    for (int j = 0; j < kKeyTiles; ++j) {
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const float p = ex2_approx(fmaf(s_frag[b][j][2 * h + e], score_scale, -offset));
        s_frag[b][j][2 * h + e] = p;
        st.d[fr] += p;
      }
    }
  }
}

// softmax_step for a tile whose logits are s sm_scale + offset[fr] (sm_scale >= 0, every
// score visible; kUniformAdditive): a row's max is its raw max times sm_scale plus its
// offset, and p = 2^(s sm_scale log2 e + (offset - m) log2 e), one FFMA per score as
// without a logits hook. m stays in logit units, as the logits path keeps it.
template <int kBlocks>
__device__ __forceinline__ void softmax_step_offset(WarpState& st,
                                                    float (&s_frag)[kRowBlocks][kKeyTiles][4],
                                                    const float sm_scale,
                                                    const float (&offset)[kFragRows],
                                                    float (&rescale)[kFragRows]) {
  const float factor = sm_scale * kLog2e;
#pragma unroll
  for (int fr = 0; fr < 2 * kBlocks; ++fr) {
    const int b = fr >> 1, h = fr & 1;
    float raw = neg_inf();
#pragma unroll
    for (int j = 0; j < kKeyTiles; ++j) {
      raw = fmaxf(raw, fmaxf(s_frag[b][j][2 * h], s_frag[b][j][2 * h + 1]));
    }
    raw = quad_allreduce(raw, MaxOp{});
    const float m_new = fmaxf(st.m[fr], fmaf(raw, sm_scale, offset[fr]));
    rescale[fr] = m_new == st.m[fr] ? 1.0f : ex2_approx((st.m[fr] - m_new) * kLog2e);
    st.m[fr] = m_new;
    st.d[fr] *= rescale[fr];
    const float shift = (offset[fr] - m_new) * kLog2e;
#pragma unroll
    for (int j = 0; j < kKeyTiles; ++j) {
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const float p = ex2_approx(fmaf(s_frag[b][j][2 * h + e], factor, shift));
        s_frag[b][j][2 * h + e] = p;
        st.d[fr] += p;
      }
    }
  }
}

// o *= rescale for the first kBlocks row blocks, a block only when some row of it has a new
// maximum (a warp vote, so the branch is uniform): past the first tiles a row's max rarely
// moves, and the kRowBlocks * kHeadDim / 2 FMULs per lane are a fifth of a tile's
// instructions. Skipping a factor of exactly 1 changes no bit.
template <int kBlocks>
__device__ __forceinline__ void rescale_o(WarpState& st, const float (&rescale)[kFragRows]) {
#pragma unroll
  for (int b = 0; b < kBlocks; ++b) {
    if (__any_sync(0xffffffffu, rescale[2 * b] != 1.0f || rescale[2 * b + 1] != 1.0f)) {
#pragma unroll
      for (int t = 0; t < kDimTiles; ++t) {
#pragma unroll
        for (int c = 0; c < 4; ++c) st.o_frag[b][t][c] *= rescale[2 * b + (c >> 1)];
      }
    }
  }
}
