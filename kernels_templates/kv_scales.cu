// kv_scales.cu: an fp8 cache's one-element device scales copied to every KV head, for
// attnlang.runtime.kv_scales (run()'s k_scale= / v_scale= given as a device scalar).
//
// The kernels read each scale as float[num_kv_heads]. A scale kept on the device as one
// value (a serving engine's per-tensor scale, updated in place) is copied into the
// BatchAttention's buffer out [2 * n] (k_scale's n values, then v_scale's) on the call's
// stream before the attention kernels, so they see its value when they run and a CUDA graph
// replays the copy. A null source leaves its half (that scale was given per head).
// One CTA of at least n threads. Self-contained.

extern "C" __global__ void broadcast_kv_scales(const float* __restrict__ k_scale,
                                               const float* __restrict__ v_scale,
                                               float* __restrict__ out, const int n) {
  const int head = threadIdx.x;
  if (head >= n) return;
  if (k_scale != nullptr) out[head] = k_scale[0];
  if (v_scale != nullptr) out[n + head] = v_scale[0];
}
