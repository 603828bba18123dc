// prefill_producer.cuh: the producer warpgroup of the wgmma path (kProducer): it walks the
// CTA's work items in the computing warps' order and fills the ring of K/V stages, by
// cp.async or by TMA, and (an fp8 cache copied by TMA) converts each tile to T in place.
// Spliced verbatim by prefill_common.cu.j2 inside namespace attnlang::prefill_kernel, after
// prefill_tiles.cuh (the tile cursor and the copies it uses): not a header of its own.

// The producer warpgroup (kProducer; `ptid` its thread, 0 .. kProducerThreads - 1): walks the
// CTA's work items and their visible tiles in the order the computing warps do and copies
// each into the ring, the n-th tile of the CTA (over all its items) into V stage n % kStages
// and K stage n % kKStages, once the computing warps have released the tiles those stages held
// (`k_empty` and `v_empty`, one arrival per warp: a K is done a tile before its V, and the K
// ring may be shorter); `full` completes when every producer thread's copies have landed.
// Before an item's first tile it waits for the last item's epilogue where that used the
// ring's memory (epilogue_holds_ring); otherwise the item's first tiles land during it. The
// page-table loads of a tile are issued before the waits.
// kTma: whole tiles by TMA (this CTA's maps written: producer_tensor_maps); `full` then completes
// when every producer thread has arrived and the boxes' bytes have landed.
// An fp8 cache's tiles land as bytes. Copied by cp.async (pages of 8 or 1 token), the computing
// warps dequantise them: the producer never waits on its copies, so a ring's worth of tiles
// stays in flight (waiting on each to convert it ran prefill at 0.47x of bf16 against 0.71x).
// kTma (kProducerConverts): the copies land on `landed` instead, and the producer, whose threads
// the copy engine has freed, converts each tile once it has landed, then arrives on `full`
// (0.62x -> 0.73-0.83x of bf16: benchmarks/NOTES.md).
template <bool kTma>
__device__ __forceinline__ void produce_items(
    const KvT* k_cache, const KvT* v_cache, const int* kv_indices, const int* work_indptr,
    const int* work_request, const int* work_kv_head, const int* work_row_start,
    const int* work_kv_start, const int* work_kv_end, const int* work_partial,
    const int* qo_indptr, const int* kv_indptr, const int* kv_last_page_len,
    const int num_heads, const int num_kv_heads, const int page_size, const float sm_scale,
    const variant::Params& params, const Cascade& cascade, const unsigned k_smem,
    const unsigned v_smem,
    const unsigned full_bar, const unsigned k_empty_bar, const unsigned v_empty_bar,
    const unsigned landed_bar, const unsigned char* const tma_maps, const int ptid) {
  const int lane = ptid & 31;
  const int group_id = ptid / TX, tx = ptid % TX;
  const int group = num_heads / num_kv_heads;
  const FastDivmod page_div(page_size);
  const int k_token_bytes = num_kv_heads * kHeadDim * static_cast<int>(sizeof(KvT));
  const int v_token_bytes = num_kv_heads * kHeadDimVO * static_cast<int>(sizeof(KvT));
  const unsigned copy_bar = kTma && kProducerConverts ? landed_bar : full_bar;
  // The ring's next slots; laps * kStages (k_laps * kKStages) tiles have filled V (K) so far.
  int stage = 0, k_stage = 0, laps = 0, k_laps = 0;
  const int first_item = work_indptr[blockIdx.x], end_item = work_indptr[blockIdx.x + 1];
  // The next item's fields are read before the barrier that waits for this item's epilogue,
  // so their two dependent loads land during the wait rather than after it.
  WorkItem next{};
  if (first_item < end_item) {
    next = read_work_item(first_item, work_request, work_kv_head, work_row_start,
                          work_kv_start, work_kv_end, work_partial, qo_indptr, kv_indptr,
                          kv_last_page_len, page_size, group, cascade);
  }
  bool wait_epilogue = false;  // the last item's epilogue holds the ring
  for (int item = first_item; item < end_item; ++item) {
    const WorkItem w = next;
    if (wait_epilogue) named_sync(kItemBarrier, kThreads + kProducerThreads);
    wait_epilogue = epilogue_holds_ring(w);
    const TileSpan span = item_span(w, group);
    const Index tile_ix = tile_index(w, num_heads, num_kv_heads, sm_scale, params);
    const KvT* const k_row = k_cache + w.kv_head * kHeadDim + tx * VEC;
    const KvT* const v_row = v_cache + w.kv_head * kHeadDimVO + tx * VEC_VO;
    // (kFp8Rows) this thread's piece of the item's KV head in cache token 0 (load_rows_fp8)
    const char* const k_raw_row = reinterpret_cast<const char*>(k_cache + w.kv_head * kHeadDim) +
                                  16 * (ptid % kRawLanes);
    const char* const v_raw_row = reinterpret_cast<const char*>(v_cache + w.kv_head * kHeadDimVO) +
                                  16 * (ptid % kRawLanes);
    const float2 kv_scale = kv_scales(params, w.kv_head);  // (kProducerConverts) the KV head's
    TileCursor cursor{-32, 0u, 0u};
    for (int t = next_tile(cursor, span, lane, params, tile_ix); t >= 0;
         t = next_tile(cursor, span, lane, params, tile_ix)) {
      const int start = w.kv_start + (t >> 2) * kTileKeys;
      // (kTma) A whole tile from a multiple of kTmaBoxRows: every box lies inside one page.
      if (kTma && start + kTileKeys <= w.kv_end && start % kTmaBoxRows == 0) {
        // The tile's box rows (kTmaBoxRows keys each: a page, or part of one) go round the
        // producer's four warps, row r to warp r % 4, whose lane i looks up the page of its
        // i-th row here, before the waits. Lane 0 of each warp then issues its rows' boxes, K's
        // and V's column blocks (a TMA takes its operands from uniform registers, so one
        // thread issues them; one thread issuing all 32 boxes of a 16-token-page tile ran
        // slower than cp.async, four in parallel 16-25% faster: benchmarks/NOTES.md), after
        // adding their bytes to the expected ones of the barrier they land on (`full`, or
        // `landed` where the producer converts).
        constexpr int kRowsPerWarp = kTileKeys / kTmaBoxRows / 4;
        const int first_row = ptid >> 5;  // this warp's rows: first_row + 4 i
        const int token = lane < kRowsPerWarp
                              ? cache_token(kv_indices, w, start + (first_row + 4 * lane) * kTmaBoxRows,
                                            page_div)
                              : 0;
        if (k_laps > 0) mbar_wait(k_empty_bar + 8 * k_stage, (k_laps - 1) & 1);
        if (laps > 0) mbar_wait(v_empty_bar + 8 * stage, (laps - 1) & 1);
        const unsigned bar = copy_bar + 8 * stage;
        const unsigned k_dst = k_smem + k_stage * (kKStageElems * 2);
        const unsigned v_dst = v_smem + stage * (kVStageElems * 2);
        const unsigned char* const k_map = tma_maps + kTmaCtaMaps + 256 * blockIdx.x;
        if (lane == 0) mbar_expect(bar, kTmaTileBytes / 4);
#pragma unroll
        for (int i = 0; i < kRowsPerWarp; ++i) {
          const unsigned row = (first_row + 4 * i) * (kTmaBoxRows * 128);
          const int row_token = __shfl_sync(0xffffffffu, token, i);
          if (lane == 0) {
#pragma unroll
            for (int b = 0; b < kTmaBlocksK; ++b) {
              tma_load_3d(k_dst + b * (kTileKeys * 128) + row, k_map, kTmaBlockCols * b,
                          w.kv_head, row_token, bar);
            }
#pragma unroll
            for (int b = 0; b < kTmaBlocks - kTmaBlocksK; ++b) {
              tma_load_3d(v_dst + b * (kTileKeys * 128) + row, k_map + 128, kTmaBlockCols * b,
                          w.kv_head, row_token, bar);
            }
          }
        }
        mbar_arrive(bar);
      } else {
        const auto rows = warp_tile_rows<kFp8Rows ? kRawLanes : TX>(kv_indices, w, start,
                                                                   ptid >> 5, lane, page_div);
        if (k_laps > 0) mbar_wait(k_empty_bar + 8 * k_stage, (k_laps - 1) & 1);
        if (laps > 0) mbar_wait(v_empty_bar + 8 * stage, (laps - 1) & 1);
        const unsigned k_dst = k_smem + k_stage * (kKStageElems * 2);
        const unsigned v_dst = v_smem + stage * (kVStageElems * 2);
        if constexpr (kFp8Rows) {
          load_rows_fp8(k_dst, v_dst, k_raw_row, v_raw_row, rows, w.kv_end, start,
                        ptid / kRawLanes, ptid % kRawLanes, k_token_bytes, v_token_bytes);
        } else {
          load_tile<kProducerGroups>(k_dst, v_dst, k_row, v_row, rows, w.kv_end, start, group_id,
                                     tx, k_token_bytes, v_token_bytes);
        }
        mbar_arrive_on_copies(copy_bar + 8 * stage);
      }
      if constexpr (kTma && kProducerConverts) {
        // The tile's bytes have landed (every producer thread's arrival, the boxes' bytes; a
        // partial tile's cp.async): rewritten as T in place (kFp8Qk: the values; wgmma reads
        // the raw keys), then published to wgmma.
        mbar_wait(landed_bar + 8 * stage, laps & 1);
        dequantize_rows<kProducerThreads, kFp8Qk ? kConvertValues : kConvertKeys | kConvertValues,
                        true>(
            reinterpret_cast<T*>(__cvta_shared_to_generic(k_smem + k_stage * (kKStageElems * 2))),
            reinterpret_cast<T*>(__cvta_shared_to_generic(v_smem + stage * (kVStageElems * 2))),
            ptid, kv_scale);
        fence_async_shared();  // the converted tile, before wgmma reads it (async proxy)
        mbar_arrive(full_bar + 8 * stage);
      }
      if (++k_stage == kKStages) {
        k_stage = 0;
        ++k_laps;
      }
      if (++stage == kStages) {
        stage = 0;
        ++laps;
      }
    }
    if (item + 1 < end_item) {
      next = read_work_item(item + 1, work_request, work_kv_head, work_row_start, work_kv_start,
                            work_kv_end, work_partial, qo_indptr, kv_indptr, kv_last_page_len,
                            page_size, group, cascade);
    }
  }
}

// (kTmaTiles) Does the producer copy whole tiles by TMA? Where the host gave maps (pages of a
// multiple of kTmaBoxRows tokens) and the caches are 16-byte aligned; then warp 0 writes this
// CTA's maps (through K stage 0, before any copy lands there) and the producer's threads meet.
// Every producer thread calls it, then runs the loop built for the answer (produce_items: the
// cp.async-only one holds no TMA state).
__device__ __forceinline__ bool tma_tiles_used(const KvT* k_cache, const KvT* v_cache,
                                               const unsigned char* const tma_maps) {
  return kTmaTiles && tma_maps != nullptr &&
         ((reinterpret_cast<unsigned long long>(k_cache) |
           reinterpret_cast<unsigned long long>(v_cache)) & 15) == 0;
}

__device__ __forceinline__ bool producer_tensor_maps(const KvT* k_cache, const KvT* v_cache,
                                                     unsigned char* const tma_maps,
                                                     const unsigned k_smem, const int ptid) {
  if (!tma_tiles_used(k_cache, v_cache, tma_maps)) return false;
  if (ptid < 32) {
    unsigned char* const k_map = tma_maps + kTmaCtaMaps + 256 * blockIdx.x;
    tensor_map_for(k_map, tma_maps, k_cache, k_smem, ptid);
    tensor_map_for(k_map + 128, tma_maps + 128, v_cache, k_smem + 128, ptid);
    fence_async_shared();  // the scratch's reads before the copies that overwrite it
  }
  named_sync(kProducerBarrier, kProducerThreads);
  return true;
}
