// distance_table.cuh: the prefill kernel's table of the logits' distance term
// (attnlang/codegen/distance_terms.py) over a work item's KV tiles. Spliced into
// prefill_common.cu.j2 in namespace attnlang::prefill_kernel, after prefill_scores.cuh.
//
// The term depends on a score's distance q_pos - kv_pos (and, kDistanceByHead, its query
// head) only, so one table over a range of distances serves every tile whose scores fall in
// it. Entry h * stride + (d - lo) is the term at distance d for query head head0 + h (h is 0
// without kDistanceByHead). A tile whose distances are not all held fills the table anew,
// with the tiles ahead whose terms vary (tiles with tile-uniform terms read none) as far as
// its capacity allows: T5's band (the diagonal tile and the one or two before it) then fills
// once per work item, and sandwich's (no head in it) once per 69 tiles. With a producer the
// kernel fills it for a work item's last varying tiles before the item's first barrier
// (varying_tail), so T5's band needs no fill in the tile loop.
//
// A fill in the tile loop is two barriers of the computing threads (none may still read the
// old entries; every new one in place), and puts the two computing warpgroups, which run
// out of step there, in step: T5 prefill S4096 0.88x of causal with its band filled in the
// loop, 0.90x before it (benchmarks/NOTES.md). A shape with a distance term gives the table
// a K stage's shared memory (config.template_shape's distance_table): 8,928 floats at head
// dim 128, where the 736 of other shapes hold one tile's distances at 4 query heads per KV
// head.

// Entries a thread evaluates in one straight run: their table reads in flight together
// (behind a branch each, every read was waited for before the next began). With a producer
// the first run's reads are in flight during the barrier before the stores; the mma.sync
// path's registers hold 3 without spilling more.
constexpr int kDistanceRun = kProducer ? 5 : 3;

struct DistanceTable {
  float* table;          // kDistanceFloats of shared memory
  int stride;            // floats from one head's entries to the next: distances it holds
  int lo = 0x7fffffff;   // the distances held: lo .. hi (none at first)
  int hi = -0x7fffffff;

  // The table for `heads` query heads (the KV head's group with kDistanceByHead, else 1). A
  // head's entries start 8 banks after the previous head's (mod 32): at 4 query heads per KV
  // head the rows a warp reads at once (4 heads x 2 queries) then hit 32 distinct banks.
  __device__ __forceinline__ DistanceTable(float* const region, const int heads)
      : table(region) {
    const int most = kDistanceFloats / heads;
    stride = heads == 1 ? most : most - ((most - 8) & 31);
  }

  // Can a tile's distances fit at all? (Else the term is evaluated per score.)
  __device__ __forceinline__ bool fits(const int distances) const { return distances <= stride; }

  // Does the table hold the distances d0 .. d1 (a tile's)? Filled in the tile loop only (no
  // producer), it does where it reaches down to d0: the item's tiles come in increasing
  // order, so each one's distances are below those of the tile that filled it.
  __device__ __forceinline__ bool holds(const int d0, const int d1) const {
    return lo <= d0 && (!kProducer || d1 <= hi);
  }

  // The table seen from a tile whose lowest distance is d0 (the CTA's first query less the
  // tile's last key): Index::distance_row - c is then key c's entry (prefill_scores.cuh).
  __device__ __forceinline__ const float* at(const int d0) const { return table + (d0 - lo); }

  // Fill the table with the distances new_lo .. new_hi (at most stride of them); every
  // computing thread calls it, and a compute_sync() after it publishes the entries.
  // kSyncFirst: one before the first store too (no thread may still read the old table), the
  // first entries' reads in flight meanwhile.
  template <bool kSyncFirst>
  __device__ __forceinline__ void fill(const int new_lo, const int new_hi, const int heads,
                                       const int head0, const variant::Params& params,
                                       const Index& ix) {
    lo = new_lo;
    hi = new_hi;
    const int n = new_hi - new_lo + 1;
    const int entries = heads * n;
    int e0 = 0;
    if constexpr (kSyncFirst) {
      fill_run<kDistanceRun, true>(e0, entries, n, head0, params, ix);
      e0 = kDistanceRun * kThreads;
    }
    for (; e0 < entries; e0 += kDistanceRun * kThreads) {
      fill_run<kDistanceRun, false>(e0, entries, n, head0, params, ix);
    }
  }

 private:
  // Entries e0 + threadIdx.x + k kThreads (k < kCount) evaluated, then stored (kSync: after
  // compute_sync). kCount is the fewest runs that cover what is left (a branch uniform over
  // the CTA): a costly term (sandwich's 64 cosines) is not evaluated for entries past the
  // table. A lane past it evaluates the last entry instead of branching around the evaluation.
  template <int kCount, bool kSync>
  __device__ __forceinline__ void fill_run(const int e0, const int entries, const int n,
                                           const int head0, const variant::Params& params,
                                           Index ix) const {
    if constexpr (kCount > 1) {
      if (entries - e0 <= (kCount - 1) * kThreads) {
        fill_run<kCount - 1, kSync>(e0, entries, n, head0, params, ix);
        return;
      }
    }
    const int thread = static_cast<int>(threadIdx.x);
    float values[kCount];
    int slots[kCount];
#pragma unroll
    for (int k = 0; k < kCount; ++k) {
      const int e = imin(e0 + thread + k * kThreads, entries - 1);
      const int h = variant::kDistanceByHead ? e / n : 0;
      const int i = e - h * n;
      ix.head = head0 + h;
      values[k] = variant::distance_term(lo + i, params, ix);
      slots[k] = h * stride + i;
    }
    if constexpr (kSync) compute_sync();
#pragma unroll
    for (int k = 0; k < kCount; ++k) {
      if (e0 + thread + k * kThreads < entries) table[slots[k]] = values[k];
    }
  }
};

// The first of a work item's `tiles` tiles from which on every tile's terms vary (the last
// one's included), as far as one window over its last 32 tiles sees; `tiles` where the last
// tile's terms are one value, or where the run reaches back past the window (its start
// unseen), or without tile-uniform terms (every tile varies: the tile loop's fills, from its
// first tile on, follow the barrier that publishes Q anyway). An item of 32 tiles or fewer is
// seen whole by `window`, the tile loop's, which then evaluates none of them again. Called by
// the whole warp.
template <int kTileKeys>
__device__ __forceinline__ int varying_tail(UniformWindow<kTileKeys>& window, const int tiles,
                                            const int lane, const int kv_start,
                                            const int kv_end, const int q_lo, const int q_hi,
                                            const variant::Params& params, const Index& tile_ix) {
  if constexpr (variant::kUniformTerms == 0) {
    return tiles;
  } else {
    if (tiles <= 0) return tiles;  // no keys (uniform over the warp)
    const int base = imax(tiles - 32, 0);
    variant::Uniform values;
    unsigned bits;
    if (base == 0) {
      window.get(0, lane, kv_start, kv_end, q_lo, q_hi, params, tile_ix, values);
      bits = window.uniform_bits;
    } else {
      UniformWindow<kTileKeys> probe;
      probe.get(base, lane, kv_start, kv_end, q_lo, q_hi, params, tile_ix, values);
      bits = probe.uniform_bits;
    }
    const int seen = tiles - base;  // 1 .. 32
    const unsigned uniform = bits & (seen == 32 ? ~0u : (1u << seen) - 1u);
    if ((uniform >> (seen - 1)) & 1u) return tiles;   // the last tile's terms are one value
    if (uniform == 0u) return base == 0 ? 0 : tiles;  // all seen vary
    return base + 32 - __clz(uniform);                // past the last uniform tile
  }
}
