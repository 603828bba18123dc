      // prefill_tile_terms.cuh: a tile's logits terms (tile-uniform ones, else the distance
      // table, refilled where the tile leaves it). Spliced verbatim into both prefill kernels'
      // tile loop once the tile is published.
      // The tile's logits: tile-uniform terms, else the distance table where it fits.
      TileTerms terms{false, {}, nullptr};
      if constexpr (kTileTerms) {
        terms.uniform = uniform_window.get(tile, lane, w.kv_start, w.kv_end, terms_q_lo,
                                           terms_q_hi, params, tile_ix, terms.uni);
      }
      if (distance_fits && !terms.uniform) {  // uniform over the CTA
        const int d0 = span.q_lo - (tile_start + kTileKeys - 1);  // the tile's distances
        const int d1 = span.q_hi - tile_start;
        if (!distance_table.holds(d0, d1)) {
          // Down to the last tile of the run whose terms vary (in the window, in the item).
          const int run_end = imin(tile + uniform_window.varying_run(tile), span.num_tiles);
          const int lo = imax(span.q_lo - (w.kv_start + run_end * kTileKeys - 1),
                              d1 - distance_table.stride + 1);
          // Every read of the last table was before the barrier above; with a producer no
          // barrier comes between, so the fill has one before its stores.
          distance_table.fill<kProducer>(lo, d1, distance_heads, w.kv_head * group, params,
                                         tile_ix);
          compute_sync();
        }
        terms.dist = distance_table.at(d0);
      }
