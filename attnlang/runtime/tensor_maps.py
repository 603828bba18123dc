"""TMA tensor maps of the paged K/V cache, for the prefill kernel's producer (sm_90a).

Where the prefill kernel has a producer warpgroup (the wgmma path at head dims 128 and 256)
and the cache's pages are a multiple of BOX_ROWS tokens (a contiguous cache is one page per
request; a ragged layout's requests are runs of consecutive rows), the producer copies each
tile whose keys all lie inside its work item by TMA: boxes of BOX_ROWS keys x 64 columns
(128 bytes, swizzled on arrival as wgmma reads them; an fp8 cache's: 128 e4m3 bytes, the raw
rows, keys swizzled and values not, converted in shared memory where the kernel does not read
them raw: prefill_shape.cuh's kFp8Qk), one per box row
and column block, issued by one thread of each of its four warps. A map holds the cache's
address, which may change from one call to the next, and run() must stay cheap (CUDA graphs
replay its kernels' arguments as captured); so the host encodes one template per cache,
once, here, and the kernel's producer writes its CTA's own copy with the call's address at
its start (`tensor_map_for` in wgmma.cuh). The buffer (prefill_shape.cuh's kTma* constants):

    [0, 128)      K's template      dims (head_dim, num_kv_heads, 2^31 - 1 tokens)
    [128, 256)    V's template      (head_dim_vo, ...), strides of a contiguous NHD cache
    256 + 256 c   CTA c's K map, then its V map (written by the kernel)

The token extent is the largest a map takes: the kernel only ever asks for tokens of pages
in the page table, so the cache's true size (which the kernel never learns) need not be in
it. ``ATTNLANG_PREFILL_TMA=0`` leaves every copy to cp.async (`env.prefill_tma`).
"""

from __future__ import annotations

import ctypes

from attnlang import env
from attnlang.codegen.config import KV_FP8, template_shape

__all__ = ["box_rows", "uses_tma", "buffer_bytes", "map_templates", "BOX_ROWS"]

MAP_BYTES = 128
CTA_MAPS = 2 * MAP_BYTES  # where the CTAs' maps start
# Keys per box (prefill_shape.cuh's kTmaBoxRows): a page of the usual 16 tokens, and a
# divisor of every wgmma tile (64 and 128 keys), so a box never straddles two tiles.
BOX_ROWS = 16
_TOKEN_EXTENT = (1 << 31) - 1

# cuda.h's enums (cuTensorMapEncodeTiled).
_UINT8 = 0             # CU_TENSOR_MAP_DATA_TYPE_UINT8: e4m3 bytes, copied as bits
_UINT16 = 1            # CU_TENSOR_MAP_DATA_TYPE_UINT16: any 2-byte element, copied as bits
_INTERLEAVE_NONE = 0
_SWIZZLE_NONE = 0
_SWIZZLE_128B = 3
_L2_PROMOTION_256B = 3
_OOB_FILL_NONE = 0


def box_rows(page_size: int, ragged: bool = False) -> int | None:
    """Keys per TMA box for pages of page_size, or None where the kernel copies with
    cp.async: a box lies inside one page, so page_size must be a multiple of BOX_ROWS. A
    ragged layout (BatchAttention's kv_layout="ragged": pages of one token, each request's
    consecutive rows of k and v) has boxes anywhere: its page table is the identity.

    ``box_rows(16)`` -> 16, ``box_rows(4096)`` -> 16, ``box_rows(8)`` -> None,
    ``box_rows(1, ragged=True)`` -> 16.
    """
    return BOX_ROWS if ragged or page_size % BOX_ROWS == 0 else None


def uses_tma(head_dim: int, head_dim_vo: int, dtype: str, kv_dtype: str, page_size: int,
             arch: str, ragged: bool = False) -> bool:
    """Does the prefill kernel of this shape get tensor maps? Where it has a producer
    warpgroup, box_rows(page_size, ragged) exists and ATTNLANG_PREFILL_TMA is not off. (A
    kernel the module compiler rebuilt without TMA tiles ignores them:
    module.PRODUCER_SPILL_BYTES.)"""
    if box_rows(page_size, ragged) is None or not env.prefill_tma():
        return False
    shape = template_shape("prefill", head_dim, dtype, arch, head_dim_vo)
    return shape.wgmma and shape.producer_threads > 0


def buffer_bytes(num_ctas: int) -> int:
    """Bytes of the map buffer for a kernel of num_ctas CTAs."""
    return CTA_MAPS + 2 * MAP_BYTES * num_ctas


def map_templates(head_dim: int, head_dim_vo: int, num_kv_heads: int, kv_dtype: str,
                  address: int) -> bytes:
    """The buffer's first CTA_MAPS bytes: K's and V's templates, encoded at `address` (any
    16-byte-aligned device address: the kernel replaces it). Needs the CUDA driver; raises
    RuntimeError if it refuses a map."""
    fp8 = kv_dtype == KV_FP8
    return (_encode(head_dim, num_kv_heads, fp8, address, swizzle=True) +
            _encode(head_dim_vo, num_kv_heads, fp8, address, swizzle=not fp8))


def _encode(head_dim: int, num_kv_heads: int, fp8: bool, address: int, swizzle: bool) -> bytes:
    """A tiled map of a contiguous [tokens, num_kv_heads, head_dim] cache: boxes of 64
    2-byte elements x 1 head x BOX_ROWS tokens, 128-byte swizzle (wgmma's layout); an fp8
    cache's of 128 bytes, the raw rows: its keys swizzled (where wgmma reads them raw, or the
    conversion finds them), its values not (converted in shared memory)."""
    from attnlang.runtime import hostpath

    fn = hostpath.libcuda().cuTensorMapEncodeTiled
    fn.restype = ctypes.c_int
    u64x3, u32x3 = ctypes.c_uint64 * 3, ctypes.c_uint32 * 3
    size, kind, cols = (1, _UINT8, 128) if fp8 else (2, _UINT16, 64)
    space = (ctypes.c_uint8 * (MAP_BYTES + 64))()  # the map must be 64-byte aligned
    at = -ctypes.addressof(space) % 64
    status = fn(ctypes.c_void_p(ctypes.addressof(space) + at), kind, 3,
                ctypes.c_void_p(address), u64x3(head_dim, num_kv_heads, _TOKEN_EXTENT),
                (ctypes.c_uint64 * 2)(size * head_dim, size * head_dim * num_kv_heads),
                u32x3(cols, 1, BOX_ROWS), u32x3(1, 1, 1), _INTERLEAVE_NONE,
                _SWIZZLE_128B if swizzle else _SWIZZLE_NONE,
                _L2_PROMOTION_256B, _OOB_FILL_NONE)
    if status != 0:
        raise RuntimeError(f"cuTensorMapEncodeTiled refused the cache's map (CUresult {status})")
    return bytes(space)[at:at + MAP_BYTES]
