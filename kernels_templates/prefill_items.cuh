// prefill_items.cuh: a work item of the prefill kernel, its query rows and their Index (one
// request's rows, or a cascade group's: several requests', each row its own), and how the
// rows deciding together class a tile. Spliced verbatim by prefill_common.cu.j2 inside namespace
// attnlang::prefill_kernel, after its constants: not a header of its own.

// A shared-prefix level's work list (kCascade, the `cascade` kernel): an item's rows are the
// fused rows of a group of consecutive requests whose page lists begin with the same pages,
// and its KV range lies in those pages. The group is numbered from its first request (the
// item's `batch`: its q_begin and pages); each row's own request, lengths and q_pos come
// from token_request and the batch's arrays, so every hook sees true positions.
struct Cascade {
  const int* item;           // [items][3]: one past the group's last token; the lowest and
                             // highest q_pos of the item's rows (what its tiles are classed by)
  const int* token_request;  // [total_q]: the request of each query token
  const int* qo_indptr;      // the batch's arrays (as the kernel's own)
  const int* kv_indptr;
  const int* kv_last_page_len;
  int page_size;
};

// One work item plus the lengths of its request.
struct WorkItem {
  int batch;       // request index (kCascade: the group's first request)
  int kv_head;     // KV head; its query heads are kv_head * group .. + group - 1
  int row_start;   // first fused row
  int rows;        // fused rows of the item: min(kRows, qo_len * group - row_start)
  int kv_start;    // first KV position
  int kv_end;      // one past the last KV position
  int partial;     // -1: write out/lse; else first partial row of the item
  int q_begin;     // token index of the request's first query in q / out
  int qo_len;      // the request's number of queries (kCascade: the group's)
  int kv_len;      // the request's KV length
  int page_begin;  // the request's first entry in kv_indices
  int q_lo, q_hi;  // (kCascade) the lowest and highest q_pos of the item's rows
};

__device__ __forceinline__ WorkItem read_work_item(
    const int item, const int* work_request, const int* work_kv_head, const int* work_row_start,
    const int* work_kv_start, const int* work_kv_end, const int* work_partial,
    const int* qo_indptr, const int* kv_indptr, const int* kv_last_page_len, const int page_size,
    const int group, const Cascade& cascade) {
  WorkItem w;
  w.batch = work_request[item];
  w.kv_head = work_kv_head[item];
  w.row_start = work_row_start[item];
  w.kv_start = work_kv_start[item];
  w.kv_end = work_kv_end[item];
  w.partial = work_partial[item];
  w.q_begin = qo_indptr[w.batch];
  w.qo_len = qo_indptr[w.batch + 1] - w.q_begin;
  w.kv_len = request_kv_len(kv_indptr, kv_last_page_len, w.batch, page_size);
  w.page_begin = kv_indptr[w.batch];
  if constexpr (kCascade) {
    w.qo_len = cascade.item[3 * item] - w.q_begin;
    w.q_lo = cascade.item[3 * item + 1];
    w.q_hi = cascade.item[3 * item + 2];
  }
  w.rows = imin(kRows, w.qo_len * group - w.row_start);
  return w;
}

// Split keys (kSplitKeys): an item whose rows fit the first warpgroup, attended by both
// warpgroups on alternate tiles. Uniform over the CTA and known to the producer too.
__device__ __forceinline__ bool split_keys(const int rows) { return kSplitKeys && rows <= 64; }

// (kProducer) Does the item's epilogue use the ring's memory (o's staging there, or
// split_merge), so that the producer must wait for its end before the next item's tiles?
__device__ __forceinline__ bool epilogue_holds_ring(const WorkItem& w) {
  return !kOutputInQTile || split_keys(w.rows);
}

// The query row behind tile row r: its token (row of q / out), head, q_pos, and its request
// with the request's lengths (what its Index holds).
struct QueryRow {
  int token, head, q_pos, batch, qo_len, kv_len;
};

// query_row_at: the same from the fused row's query qi (kCascade: within the group) and its
// member of the group (fused = qi group + member; PassRows steps them).
__device__ __forceinline__ QueryRow query_row_at(const WorkItem& w, const int qi, const int member,
                                                 const int group, const Cascade& cascade) {
  const int token = w.q_begin + qi;
  const int head = w.kv_head * group + member;
  if constexpr (kCascade) {
    // Rows past the item's last (padding) read the last token's request.
    const int b = cascade.token_request[imin(token, w.q_begin + w.qo_len - 1)];
    const int q_begin = cascade.qo_indptr[b];
    const int qo_len = cascade.qo_indptr[b + 1] - q_begin;
    const int kv_len = request_kv_len(cascade.kv_indptr, cascade.kv_last_page_len, b,
                                      cascade.page_size);
    return {token, head, kv_len - qo_len + (token - q_begin), b, qo_len, kv_len};
  } else {
    return {token, head, w.kv_len - w.qo_len + qi, w.batch, w.qo_len, w.kv_len};
  }
}

__device__ __forceinline__ QueryRow query_row(const WorkItem& w, const int r, const int group,
                                              const Cascade& cascade) {
  const int fused = w.row_start + r;
  const int qi = fused / group;
  return query_row_at(w, qi, fused - qi * group, group, cascade);
}

// The fused rows of a thread's passes over an item's rows (r0, r0 + kStep, ...) as query and
// member, each from the one before. (The epilogue's stores: a division in each pass, behind
// the pass's branch, made them a chain of ~250 cycles a pass; benchmarks/NOTES.md.)
template <int kStep>
struct PassRows {
  int qi, member;      // the current pass's row
  int step_q, step_m;  // kStep = step_q group + step_m
  int group;

  __device__ __forceinline__ PassRows(const WorkItem& w, const int r0, const int group_size)
      : group(group_size) {
    const int fused = w.row_start + r0;
    qi = fused / group;
    member = fused - qi * group;
    step_q = kStep / group;
    step_m = kStep - step_q * group;
  }
  __device__ __forceinline__ QueryRow row(const WorkItem& w, const Cascade& cascade) const {
    return query_row_at(w, qi, member, group, cascade);
  }
  __device__ __forceinline__ void next() {
    qi += step_q;
    member += step_m;
    if (member >= group) {
      member -= group;
      ++qi;
    }
  }
};

// The Index of a query row (no key position).
__device__ __forceinline__ Index row_index(const QueryRow& qr, const int kv_head,
                                           const int num_heads, const int num_kv_heads,
                                           const float sm_scale) {
  return Index{qr.batch, qr.head, kv_head, qr.qo_len, qr.kv_len, qr.q_pos, /*kv_pos=*/-1,
               num_heads, num_kv_heads, sm_scale};
}

// variant::mask_tile for the rows deciding together. A cascade item's rows are several
// requests': its tiles are classed over the q_pos range of them all, which is sound unless
// the mask reads the request (its batch, lengths, rows, per-pair bits): then every tile is
// partial and the per-element mask, which sees each row's own Index, decides.
__device__ __forceinline__ int tile_mask(const int q_lo, const int q_hi, const int kv_lo,
                                         const int kv_hi, const variant::Params& params,
                                         const Index& tile_ix) {
  if constexpr (kCascade && variant::kMaskReadsRequest) {
    return 1;
  } else {
    return variant::mask_tile(q_lo, q_hi, kv_lo, kv_hi, params, tile_ix);
  }
}

// Whether tiles may take the logits' per-tile terms (uniform values, distance tables), which
// are bounded over the same q_pos range: not in a cascade item where the logits read the
// request (the term is then evaluated per score, with each row's Index).
constexpr bool kTileTerms = !(kCascade && variant::kLogitsReadsRequest);
