// prefill_shape.cuh: what the prefill kernel derives from its shape's literals (which
// prefill_common.cu.j2 splices just before): the rows deciding together, the register split with a
// producer, the named barriers, the fp8 and split-key choices, every static check of the
// shape, and the tile swizzle. Spliced verbatim by prefill_common.cu.j2 inside namespace
// attnlang::prefill_kernel: not a header of its own.

// Rows that take one decision per tile (skip it, drop its mask): a warp, or on the wgmma
// path a warpgroup (its four warps issue each wgmma together).
constexpr int kRefineRows = kWgmma ? 64 : kWarpRows;
// Registers per thread after the producer hands its own to the computing warpgroups
// (setmaxnreg), out of the 64,512 a 384-thread CTA is launched with: 2 x 128 x 224 + 128 x 56,
// or 232 + 40 for variants with per-tile logits terms (tables, tile-uniform terms: T5 ran 7%
// faster at S16384 with 232, causal 1-4% slower). 240 / 24, FA3's split, spilled the
// producer's loop (benchmarks/NOTES.md).
constexpr int kComputeRegisters =
    (variant::kDistanceTerm || variant::kUniformTerms > 0) ? 232 : 224;
constexpr int kCtaRegisters =  // (kProducer) what the CTA starts with: 168 x 384 threads
    kProducer ? 65536 / (kThreads + kProducerThreads) / 8 * 8 * (kThreads + kProducerThreads) : 0;
constexpr int kProducerRegisters =
    kProducer ? (kCtaRegisters - kThreads * kComputeRegisters) / kProducerThreads : 0;
// Named barriers (0 is __syncthreads): the computing threads alone; the end of an item's
// epilogue, which the producer waits for before it refills the ring where the epilogue used
// the ring's memory (epilogue_holds_ring).
constexpr unsigned kComputeBarrier = 1;
constexpr unsigned kItemBarrier = 2;
// An fp8 cache without key or value hooks (which must see dequantised values): the scales
// leave the per-element conversion, K's into q (scores q' k = q k' exactly as the softmax
// sees them) and V's into the output (o is linear in v), so a chunk is converted, not also
// multiplied: e4m3 values are exact in T. Not where the logits have per-tile terms either:
// their kernels sit at the register limit, and T5's spilled 136 bytes with the fold.
constexpr bool kFoldScales = kKvFp8 && !variant::kHasKey && !variant::kHasValue &&
                             !variant::kDistanceTerm && variant::kUniformTerms == 0;
// An fp8 cache beside a producer: its tiles copied as whole rows of bytes, 16 per lane
// (load_rows_fp8), kRawLanes lanes to a row; the computing threads make them T
// (dequantize_rows).
constexpr bool kFp8Rows = kKvFp8 && kProducer;
// (kFp8Rows) A tile's values converted under its S matmul rather than before its barrier
// (DeferredValues), where no key or value hook must see the whole converted tile first.
constexpr bool kDeferValues = kFp8Rows && !variant::kHasKey && !variant::kHasValue;
constexpr int kRawLanes = kHeadDim / 16;
// (kFoldScales beside a producer, bf16 q, whole 128-byte rows) The scores on e4m3 tensor
// cores: the keys stay the raw bytes their copy put in the K stage (128-byte swizzled, as
// wgmma reads them), and each query row enters as two e4m3 rows, hi + lo, times a power of two
// of its own (split_query_row): 4 + 4 significant bits, a bf16's 8 exactly. S = (Q_hi + Q_lo)
// K^T is two e4m3 matmuls at twice bf16's rate, and the producer converts the values alone.
// (f16 q carries 11 bits: its keys are still converted.) The raw keys fill half their stage.
constexpr bool kFp8Qk = kFoldScales && kProducer && IsBf16<T>::value && kHeadDim % 128 == 0 &&
                        kHeadDimVO == kHeadDim;
// (kFp8Qk) kQLoBytes: Q_lo's place after Q_hi in the Q tile, which the two fill; the rows'
// factors 2^-e k_scale (raw scores times them are the scores) are a float per row in the
// distance table's place (a kFp8Qk variant has no distance term).
constexpr int kQLoBytes = kRows * kHeadDim;
constexpr int kQkSteps8 = kHeadDim / 32;    // (kFp8Qk) k-steps of 32 e4m3 values
static_assert(!kFp8Qk || kDistanceFloats >= kRows, "a factor per row in the distance table");
// Split keys (kProducer): an item whose rows fit the first warpgroup (a decode step's GQA
// group, a short chunk) would leave the second idle while the first's per-tile chain (wait,
// convert, S, softmax, P V) sets the pace. Instead the warpgroups take alternate tiles of it,
// both on the first warpgroup's rows, each with its own softmax state, merged in shared
// memory before the epilogue (split_merge). Not where the computing warpgroups meet per tile
// anyway: key/value hooks, distance tables.
constexpr bool kSplitKeys =
    kProducer && !variant::kHasKey && !variant::kHasValue && !variant::kDistanceTerm;
constexpr unsigned kGroupBarrier = 3;  // + warpgroup (3, 4): one warpgroup's 128 threads
// TMA tiles (kProducer, pages of a multiple of kTmaBoxRows tokens): a tile whose keys all lie
// inside its item is copied by the copy engine in boxes of 64 columns by kTmaBoxRows keys,
// 128-byte swizzled on arrival exactly as wgmma reads them (an fp8 cache: 128 bytes by
// kTmaBoxRows keys, the raw rows, converted in shared memory: kProducerConverts below); the
// other tiles (an item's partial last tile, whose keys past kv_end must land as zeros; an
// item starting off a box row) stay cp.async. Four threads issue a tile's boxes where the
// producer warpgroup's 128 threads each did 32 cp.async and their addresses (without those
// copies the kernel ran 31-52% faster: benchmarks/NOTES.md). The maps come from the host
// (runtime/tensor_maps.py): [0, 128) K's template, [128, 256) V's, and from byte kTmaCtaMaps
// this call's K and V maps of each CTA, which its producer writes at the start. Not where the
// module compiler found the producer's registers (56; 40 where the logits have per-tile terms)
// spilling more than 64 bytes (a mask whose tile classes take many registers, which the
// producer computes in both its loops): it then compiles the source again with
// ATTNLANG_NO_TMA_TILES defined (runtime/module.py).
#ifdef ATTNLANG_NO_TMA_TILES
constexpr bool kTmaAllowed = false;
#else
constexpr bool kTmaAllowed = true;
#endif
constexpr bool kTmaTiles = kTmaAllowed && kProducer;
constexpr int kTmaBoxRows = 16;  // tensor_maps.BOX_ROWS
// A box row's 128 bytes: 64 elements of T, swizzled; or (an fp8 cache) 128 e4m3 bytes of a
// key, unswizzled, where load_rows_fp8 puts them for dequantize_rows.
constexpr int kTmaBlockCols = kKvFp8 ? 128 : 64;
constexpr int kTmaBlocksK = kHeadDim / kTmaBlockCols;
constexpr int kTmaBlocks = kTmaBlocksK + kHeadDimVO / kTmaBlockCols;
constexpr unsigned kTmaTileBytes = kTmaBlocks * kTileKeys * 128;  // a tile's K and V
constexpr int kTmaCtaMaps = 256;  // tensor_maps.CTA_MAPS
constexpr unsigned kProducerBarrier = 5;  // the producer warpgroup's 128 threads
// Ping-pong (kProducer): the two computing warpgroups take turns issuing a tile's matmuls,
// so one's softmax runs while the other's run on the tensor cores (FA3's warp scheduler
// barriers). Warpgroup g waits at kTurnBarrier + g (its 128 threads and the other's arrival),
// issues, then arrives at the other's; warpgroup 1 arrives at warpgroup 0's once at the
// start, and every tile, attended or skipped, takes one turn in each, so the turns stay in
// step over the CTA's items. Not with key or value hooks: their warpgroups meet at a barrier
// every tile anyway (transform_tile), and the kitchen-sink variant then spilled 88 bytes.
constexpr bool kPingPong = kProducer && !variant::kHasKey && !variant::kHasValue;
constexpr unsigned kTurnBarrier = 6;  // and 7
// (kFp8Rows) Where the producer copies by TMA, its threads are free while the copy engine
// works: they convert each tile in place once its bytes have landed (a `landed` mbarrier per
// stage, the boxes' bytes), then arrive on `full`, so the computing warps read T as from a
// T cache, without a conversion pass or a barrier of theirs per tile (those cost an fp8
// cache's prefill a third of its speed: benchmarks/NOTES.md). The computing threads
// convert where the producer copies without TMA (pages of 8 or 1 token): it would then wait
// on every cp.async of its own, which ran prefill at 0.47x of bf16. And where the producer has
// 40 registers (per-tile logits terms): its conversion spilled 68 bytes with the loads ahead,
// and without them ran T5 3% slower at S16384 than the computing warps' conversion.
constexpr bool kProducerConverts = kFp8Rows && kTmaTiles && kProducerRegisters >= 56;
// (kProducer, no output hook) The epilogue stages o as T with stmatrix, not as fp32: half the
// bytes and an eighth of the shared-memory stores (an output hook sees o in fp32).
constexpr bool kOutputAsT = kProducer && !variant::kHasOutput;
// ... and in the Q tile, which the item no longer reads, rather than in the ring, where the
// producer converts the tiles it copies (an fp8 cache): it then copies and converts the next
// item's first tiles during the epilogue instead of after it (S4096 5% faster). A bf16 cache
// ran up to 1.7% slower so (causal S16384; no conversion to hide), and split keys' merge
// (split_merge) passes through the drained ring in any case: epilogue_holds_ring.
constexpr bool kOutputInQTile = kOutputAsT && kProducerConverts && kHeadDimVO <= kHeadDim;
// With a producer, an item's end reads the next item's fields (prefill_item_start.cuh); not at
// head dim 256, whose epilogue holds twice the output's registers (spec_tree's fp8 kernel then
// spilled 128 bytes).
constexpr bool kFieldsAhead = kProducer && kHeadDimVO <= 128;

static_assert(VEC * TX == kHeadDim && VEC_VO * TX == kHeadDimVO && VEC % 8 == 0 &&
              VEC_VO % 8 == 0 && sizeof(T) == 2, "whole 16-byte row chunks per lane");
static_assert(kChunks >= 8 && kChunksVO >= 8, "the swizzle permutes chunks within groups of 8");
static_assert(!kFp8Rows || (kHeadDimVO == kHeadDim && 32 % kRawLanes == 0 &&
                            kTileKeys % (kThreads / kRawLanes) == 0 &&
                            kTileKeys % (kProducerThreads / kRawLanes) == 0),
              "fp8 rows: whole rows per warp, whole passes for the producer and the converters");
static_assert(kThreads % 32 == 0 && kThreads % TX == 0, "whole warps, whole row groups");
static_assert(!kTmaTiles || (kTileKeys % (4 * kTmaBoxRows) == 0 && kTileKeys / kTmaBoxRows / 4 <= 32),
              "TMA tiles: whole box rows for each of the producer's four warps");
static_assert(kTileKeys % 16 == 0 && kTileKeys % kGroups == 0, "whole k-steps; rows per group");
static_assert(kTileKeys % kSubKeys == 0 && kSubKeys % 16 == 0, "whole sub-tiles of whole k-steps");
static_assert(kRows % kGroups == 0, "every group loads the same number of Q rows");
static_assert(!kProducer || (kWgmma && kProducerThreads == 128 && kThreads == 256 &&
                             kTileKeys % kProducerGroups == 0 &&
                             8 * (3 * kStages + kKStages) <= kBarrierBytes),
              "a producer warpgroup beside two computing warpgroups, whole rows per group");
static_assert(!kProducer || (kProducerRegisters % 8 == 0 && kProducerRegisters >= 24),
              "setmaxnreg takes multiples of 8 from 24 up");
static_assert(kStages >= 2 + kLag, "the pipeline needs a stage in flight while one is read");
static_assert(kKStages >= kStages - kLag && kKStages <= kStages, "K is read kLag tiles less than V");
static_assert(!kWgmma || (kRowBlocks == 1 && kWarps % 4 == 0 && kTileKeys % 64 == 0 &&
                          kTileKeys <= 256 && kHeadDim <= 256),
              "wgmma: warpgroups of 16-row warps; 128-byte swizzle atoms of 64 columns");
static_assert(!kSplitKeys || (kRowBlocks == 1 && kThreads == 256 &&
                               (kDimTiles * 4 + 2 * kFragRows) * 128 * 4 <=
                                   (kKStages * kKStageElems + kStages * kVStageElems) * 2),
              "split keys: warpgroup 1's fragments fit in the drained ring");
static_assert(kRows * kHeadDimVO * 4 <= (kKStages * kKStageElems + kStages * kVStageElems + kRows * kHeadDim) * static_cast<int>(sizeof(T)),
              "the fp32 output staging fits in the K/V stages and the Q tile");

// Element offset of chunk `chunk` (8 elements) of row `row` in a [kTileRows][kRowElems] T
// tile (Q and K: kHeadDim, V: kHeadDimVO). mma.sync: rows of kRowElems elements. wgmma:
// column blocks of 64 elements, each [kTileRows][64] (wgmma.cuh: the 128-byte swizzle the
// hardware applies to descriptor reads). The chunk permutation is the same: low 3 bits of the
// chunk XOR the row's.
template <int kTileRows, int kRowElems = kHeadDim>
__device__ __forceinline__ int swizzle(const int row, const int chunk) {
  if constexpr (kWgmma) {
    return (chunk >> 3) * (kTileRows * 64) + row * 64 + (((chunk & 7) ^ (row & 7)) << 3);
  } else {
    return row * kRowElems + ((chunk ^ (row & 7)) << 3);
  }
}

// (kOutputAsT) Element offset of 16-byte chunk `chunk` (8 elements of T) of row `row` in the
// output's staging, [kRows][kHeadDimVO] T, same permutation: eight rows'
// chunks at one column fall in eight different bank groups (stmatrix writes such columns).
__device__ __forceinline__ int swizzle_out(const int row, const int chunk) {
  return row * kHeadDimVO + ((chunk ^ (row & 7)) << 3);
}

// Float offset of 16-byte chunk `chunk` (4 floats) of row `row` in a [rows][kHeadDimVO] float
// tile (the output staging), same permutation.
__device__ __forceinline__ int swizzle_f32(const int row, const int chunk) {
  return row * kHeadDimVO + ((chunk ^ (row & 7)) << 2);
}
