// prefill_kernel_start.cuh: the start of both prefill kernels' bodies: the thread layout,
// shared memory's carve-up and the softmax's scale. Spliced verbatim, at function scope, by
// prefill_mma.cu.j2 and prefill_wgmma.cu.j2 after the entry's opening (prefill_entry.cu.j2).
  // Thread layout (see the symbols above).
  const int tid = threadIdx.x;
  const int lane = tid & 31;
  // wgmma: broadcast from lane 0, so ptxas knows the warp index (and all derived from it) is
  // uniform over the warp, which the warpgroup-wide issue needs to stay asynchronous.
  const int warp = kWgmma ? __shfl_sync(0xffffffffu, tid >> 5, 0) : tid >> 5;
  const int warp_row = kWarpRows * warp;  // first tile row of this warp
  const int lane_row = lane >> 2;         // fragment rows warp_row + 16 b + lane_row + {0, 8}
  const int lane_col = 2 * (lane & 3);    // fragment columns lane_col + {0, 1} of each n-tile
  const int ld_row = lane & 7;            // ldmatrix: the row this lane addresses ...
  const int ld_matrix = lane >> 3;        // ... of 8x8 matrix ld_matrix
  const int tx = tid % TX;                // vector stages: lane of the row group ...
  const int group_id = tid / TX;          // ... and the group
  const int dim0 = tx * VEC;              // first element of a Q or K row this lane holds
  const int dim0_vo = tx * VEC_VO;        // ... of a V or output row
  const int group = num_heads / num_kv_heads;  // query heads per KV head
  const FastDivmod page_div(page_size);
  const int k_token_bytes = num_kv_heads * kHeadDim * static_cast<int>(sizeof(KvT));  // per cache token
  const int v_token_bytes = num_kv_heads * kHeadDimVO * static_cast<int>(sizeof(KvT));
  const LaneOffsets off = lane_offsets(ld_matrix, ld_row);

  T* const k_smem = reinterpret_cast<T*>(smem);            // [kKStages][kTileKeys][kHeadDim]
  T* const v_smem = k_smem + kKStages * kKStageElems;      // [kStages][kTileKeys][kHeadDimVO]
  T* const q_smem = v_smem + kStages * kVStageElems;       // [kRows][kHeadDim]
  // After Q: with a producer, its pipeline barriers (full per stage, then empty per K stage
  // and per V stage, then (kProducerConverts) `landed` per stage), then the distance table
  // [kDistanceFloats].
  unsigned char* const tail = reinterpret_cast<unsigned char*>(q_smem + kRows * kHeadDim);
  const unsigned full_bar = smem_u32(tail);
  const unsigned k_empty_bar = full_bar + 8 * kStages;
  const unsigned v_empty_bar = k_empty_bar + 8 * kKStages;
  const unsigned landed_bar = v_empty_bar + 8 * kStages;
  float* const distance_smem = reinterpret_cast<float*>(tail + kBarrierBytes);
  float* const o_smem = reinterpret_cast<float*>(smem);    // [kRows][kHeadDimVO] fp32, after the loop
  const unsigned k_smem_u32 = smem_u32(k_smem);            // the same, as shared addresses
  const unsigned v_smem_u32 = smem_u32(v_smem);

  // Softmax on, no logits hook: scores are raw dot products of sign-folded q, and
  // score * score_scale is the logit in log2 units (the max clamp keeps sm_scale = 0 finite:
  // -inf * 0 would be NaN). With a logits hook scores are logits (natural units).
  const float score_scale = variant::kHasLogits ? kLog2e : fmaxf(fabsf(sm_scale) * kLog2e, kMinNormal);
  const float q_sign = (variant::kSoftmax && !variant::kHasLogits && sm_scale < 0.0f) ? -1.0f : 1.0f;

  // A work item's fields, read ahead (kFieldsAhead): at the end of the item before, so that
  // their two rounds of dependent loads land under its epilogue.
  WorkItem next_fields{};
  bool fields_read = false;
