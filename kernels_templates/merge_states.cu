// merge_states.cu: the exact merge of two attention states, for attnlang.merge_states.
//
// An attention state of one (token, head) row is (o, lse): o the softmax-weighted value sum
// over some set of keys, lse the natural-log log-sum-exp of those keys' logits. Two states
// over disjoint key sets merge exactly:
//     lse = log(exp(lse_a) + exp(lse_b))          computed as m + log(w_a + w_b),
//     o   = (w_a * o_a + w_b * o_b) / (w_a + w_b)  with m = max(lse_a, lse_b), w = exp(lse - m)
// A state over no keys has lse = -inf and contributes nothing (its o is never read); two of
// them merge to o = 0, lse = -inf, as LANGUAGE.md section 6 asks of fully masked rows.
//
// Symbols: rows = N * H rows of head_dim elements, row-major and contiguous:
//   o_a, o_b [rows, head_dim] (T), lse_a, lse_b [rows] (float) -> o [rows, head_dim], lse [rows]
// Layout: one warp per row (grid-stride over rows); lane `lane` handles elements
// lane, lane + 32, ... of its row, so each warp access is contiguous.
// Self-contained apart from cuda_fp16.h / cuda_bf16.h. Precise expf/logf: this is not a
// hot kernel and callers compare it against float64.

#include <cuda_bf16.h>
#include <cuda_fp16.h>

namespace {

template <typename T> __device__ __forceinline__ float load_float(const T* p);
template <> __device__ __forceinline__ float load_float<float>(const float* p) { return *p; }
template <> __device__ __forceinline__ float load_float<__half>(const __half* p) {
  return __half2float(*p);
}
template <> __device__ __forceinline__ float load_float<__nv_bfloat16>(const __nv_bfloat16* p) {
  return __bfloat162float(*p);
}

template <typename T> __device__ __forceinline__ void store_float(T* p, float x);
template <> __device__ __forceinline__ void store_float<float>(float* p, float x) { *p = x; }
template <> __device__ __forceinline__ void store_float<__half>(__half* p, float x) {
  *p = __float2half_rn(x);
}
template <> __device__ __forceinline__ void store_float<__nv_bfloat16>(__nv_bfloat16* p, float x) {
  *p = __float2bfloat16_rn(x);
}

constexpr int kWarp = 32;

// -inf without math.h (NVRTC has no INFINITY macro).
__device__ __forceinline__ float neg_inf() { return __int_as_float(0xff800000); }

template <typename T>
__device__ void merge_rows(const T* __restrict__ o_a, const float* __restrict__ lse_a,
                           const T* __restrict__ o_b, const float* __restrict__ lse_b,
                           T* __restrict__ o, float* __restrict__ lse, long long rows,
                           int head_dim) {
  const int lane = threadIdx.x % kWarp;
  const int warps_per_block = blockDim.x / kWarp;
  const long long first_row = (long long)blockIdx.x * warps_per_block + threadIdx.x / kWarp;
  const long long row_stride = (long long)gridDim.x * warps_per_block;
  for (long long row = first_row; row < rows; row += row_stride) {
    const float la = lse_a[row];
    const float lb = lse_b[row];
    const float m = fmaxf(la, lb);
    float wa = 0.f, wb = 0.f, merged_lse = neg_inf();
    if (m != neg_inf()) {  // at least one side saw a key
      wa = expf(la - m);   // exp(-inf) = 0 for an empty side
      wb = expf(lb - m);
      const float total = wa + wb;
      merged_lse = m + logf(total);
      wa /= total;
      wb /= total;
    }
    const long long base = row * head_dim;
    for (int d = lane; d < head_dim; d += kWarp) {
      // An empty side's o may be garbage: never read it (0 * NaN would be NaN).
      float x = 0.f;
      if (wa > 0.f) x += wa * load_float(o_a + base + d);
      if (wb > 0.f) x += wb * load_float(o_b + base + d);
      store_float(o + base + d, x);
    }
    if (lane == 0) lse[row] = merged_lse;
  }
}

}  // namespace

#define ATTNLANG_MERGE_STATES_ENTRY(NAME, T)                                                \
  extern "C" __global__ void NAME(const T* o_a, const float* lse_a, const T* o_b,         \
                                  const float* lse_b, T* o, float* lse, long long rows,   \
                                  int head_dim) {                                         \
    merge_rows<T>(o_a, lse_a, o_b, lse_b, o, lse, rows, head_dim);                        \
  }

ATTNLANG_MERGE_STATES_ENTRY(merge_states_float32, float)
ATTNLANG_MERGE_STATES_ENTRY(merge_states_float16, __half)
ATTNLANG_MERGE_STATES_ENTRY(merge_states_bfloat16, __nv_bfloat16)
