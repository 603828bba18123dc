"""NumPy reference of LANGUAGE.md section 6: the oracle every kernel is tested against.

It evaluates the same typed IR (`attnlang.ir`) that the CUDA lowering renders, so the two
cannot drift apart (STYLE.md habit 10), with the interpreter of `attnlang.interpret`.

Every stage is evaluated vectorised over one request at a time (query rows in chunks when the
request is long), on a grid whose axes are the indices the stage can see (arrays of the index
variables broadcast against each other):

=========================  =====================  ==========================================
stage                      grid                   index variables
=========================  =====================  ==========================================
query, output              [qo_len, Hq, D]        q_pos (axis 0), head/kv_head (1), dim (2)
key, value                 [kv_len, Hkv, D]       kv_pos (axis 0), kv_head (1), dim (2)
logits, mask               [Hq, qo_len, kv_len]   head/kv_head (0), q_pos (1), kv_pos (2)
=========================  =====================  ==========================================

Vector stages end with the `dim` axis, so a reduction over dim is a NumPy reduction over
axis -1 with keepdims (it broadcasts back like a scalar), and rope rotates along axis -1.

Numerics: IEEE throughout, as on the GPU. Division by zero, overflow and invalid operations
give inf/nan silently (no RuntimeWarning leaks); integer `/` and `%` by zero give 0 (C leaves
them undefined; a `where` must be able to evaluate a branch it then discards).
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import numpy as np

from attnlang import ir
from attnlang.errors import did_you_mean
from attnlang.interpret import Scope, stage_value
from attnlang.runtime import pairmask

__all__ = ["attention", "attention_paged", "PRECISIONS"]

# precision= name -> the float dtype every float op of the evaluation runs in.
PRECISIONS: dict[str, type[np.floating]] = {"float64": np.float64, "float32": np.float32}
# Largest [Hq, rows, kv_len] grid evaluated at once; longer requests go in row chunks.
_GRID_ELEMENTS = 1 << 22


# ----------------------------------------------------------------------------------------
# Run-time input validation (LANGUAGE.md section 8: name the argument, before any work).
# ----------------------------------------------------------------------------------------


def _real_array(x, name: str, ndim: int, fdtype) -> np.ndarray:
    arr = np.asarray(x)
    if arr.dtype.kind not in "fiu":
        raise TypeError(f"{name}: expected an array of real numbers, got dtype {arr.dtype}")
    if arr.ndim != ndim:
        raise ValueError(f"{name}: expected {ndim} dimensions, got shape {arr.shape}")
    return arr.astype(fdtype, copy=False)


def _int_array(x, name: str) -> np.ndarray:
    arr = np.asarray(x)
    if arr.dtype.kind not in "iu" and arr.size:  # an empty list is float64: let it pass
        raise TypeError(f"{name}: expected an integer array, got dtype {arr.dtype}")
    if arr.ndim != 1:
        raise ValueError(f"{name}: expected a 1-D array, got shape {arr.shape}")
    return arr.astype(np.int64)


def _indptr(x, name: str, total: int, total_name: str) -> np.ndarray:
    """A CSR row pointer: 1-D ints, starts at 0, non-decreasing, ends at `total`."""
    arr = _int_array(x, name)
    if arr.size == 0:
        raise ValueError(f"{name}: must have batch + 1 >= 1 entries, got an empty array")
    if arr[0] != 0:
        raise ValueError(f"{name}: must start at 0, got {arr[0]}")
    if np.any(np.diff(arr) < 0):
        b = int(np.argmax(np.diff(arr) < 0))
        raise ValueError(
            f"{name}: must be non-decreasing, but {name}[{b}] = {arr[b]} > "
            f"{name}[{b + 1}] = {arr[b + 1]}"
        )
    if arr[-1] != total:
        raise ValueError(f"{name}: ends at {arr[-1]} but {total_name} has {total} rows")
    return arr


def _scalar(x, name: str) -> float:
    arr = np.asarray(x)
    if arr.ndim != 0 or arr.dtype.kind not in "fiu":
        raise TypeError(f"{name}: expected a real number, got {x!r}")
    return float(arr)


def _describe(p: ir.ParamSpec) -> str:
    return f"param {p.name}: {p.declared}"


def _check_params(v: ir.Variant, params, sizes: dict[str, dict[str, int]]) -> dict[str, np.ndarray]:
    """Validated params: every declared name, scalars 0-d, tensors of their exact extent
    (sizes: each param's named extents, `ir.extent_sizes`).

    Values stay int64 / float64 here; each scope casts them to its precision on read.
    """
    if params is None:
        params = {}
    if not isinstance(params, Mapping):
        raise TypeError(f"params: expected a mapping of param names to values, got {params!r}")
    declared = {p.name: p for p in v.params}
    for name in params:
        if name not in declared:
            hint = did_you_mean(str(name), declared)
            known = ", ".join(declared) or "none"
            raise ValueError(
                f"params: variant '{v.name}' has no param {name!r}"
                + (f"; {hint}" if hint else "")
                + f" (declared params: {known})"
            )
    out: dict[str, np.ndarray] = {}
    for p in v.params:
        if p.is_pair:  # per request: attention() splits it (pairmask.normalize)
            continue
        wanted = {ir.INT: "integer", ir.FLOAT: "real", ir.BOOL: "bool"}[p.type]
        kinds = {ir.INT: "iu", ir.FLOAT: "fiu", ir.BOOL: "b"}[p.type]
        dtype = {ir.INT: np.int64, ir.FLOAT: np.float64, ir.BOOL: np.bool_}[p.type]
        if p.name not in params:
            if p.is_tensor or p.default is None:
                raise ValueError(
                    f"params: missing {p.name!r} ({_describe(p)} has no default; "
                    f"pass params={{'{p.name}': ...}})"
                )
            out[p.name] = np.asarray(p.default, dtype)
            continue
        arr = np.asarray(params[p.name])
        if arr.dtype.kind not in kinds:
            raise TypeError(
                f"params[{p.name!r}]: {_describe(p)} takes {wanted} values, "
                f"got dtype {arr.dtype}"
            )
        if p.is_tensor:
            extents = sizes[p.name]
            shape = p.shape(extents)
            if arr.shape != shape:
                named = ", ".join(f"{e} = {extents[e]}" for e in p.extents if isinstance(e, str))
                raise ValueError(
                    f"params[{p.name!r}]: {_describe(p)} must have shape {shape}"
                    + (f" ({named})" if named else "") + f", got shape {arr.shape}"
                )
        elif arr.ndim != 0:
            raise ValueError(
                f"params[{p.name!r}]: {_describe(p)} is a scalar, got shape {arr.shape}"
            )
        out[p.name] = arr.astype(dtype, copy=False)
    return out


def _pair_params(v: ir.Variant, params, qo_lens, kv_lens) -> dict[str, list[np.ndarray]]:
    """Each per-pair mask (bool[q, kv]) as one [qo_len, kv_len] matrix per request."""
    out = {}
    for p in v.params:
        if p.is_pair:
            if params is None or p.name not in params:
                raise ValueError(f"params: missing {p.name!r} (bool[q, kv]: one [qo_len, "
                                 f"kv_len] bool matrix per request)")
            out[p.name] = pairmask.normalize(params[p.name], qo_lens, kv_lens, p.name)
    return out


def _uses_rope(v: ir.Variant) -> bool:
    return any(
        isinstance(n, ir.Rope)
        for stage in ir.STAGES
        if v.stage(stage) is not None
        for n in ir.walk(v.stage(stage))
    )


# ----------------------------------------------------------------------------------------
# Public API.
# ----------------------------------------------------------------------------------------


def attention(
    v: ir.Variant,
    q,
    k,
    vv,
    qo_indptr=None,
    kv_indptr=None,
    params: Mapping[str, object] | None = None,
    sm_scale: float | None = None,
    *,
    precision: str = "float64",
) -> tuple[np.ndarray, np.ndarray | None]:
    """Attention of variant `v` over a ragged batch, exactly as LANGUAGE.md section 6.

    Shapes (Hq query heads, Hkv key/value heads, Hq % Hkv == 0, D head dim, Dv the values'
    head dim, D unless they differ as in MLA):
      q          [total_q, Hq, D]   request b owns rows qo_indptr[b]:qo_indptr[b+1]
      k, vv      [total_kv, Hkv, D], [total_kv, Hkv, Dv]: request b owns rows
                 kv_indptr[b]:kv_indptr[b+1]
      qo_indptr, kv_indptr  [batch + 1] ints; None means one request holding every row
      params     {name: value}: scalars as numbers, tensor params as 1-D arrays of their
                 declared extent (heads = Hq, kv_heads = Hkv, batch, dim = D, or Dv
                 for a table read in the value and output stages)
      sm_scale   float, default 1 / sqrt(D)
    Returns (o, lse): o [total_q, Hq, Dv]; lse [total_q, Hq] natural-log sum of exp of the
    unmasked logits (-inf on a fully masked row, whose o is 0), or None with softmax off.
    Both in float64, or float32 with precision="float32" (every op in float32, as kernels).

    Inputs may have any real dtype. Raises TypeError / ValueError naming the argument on
    bad input (shapes, indptrs, head ratio, missing / unknown / mis-shaped params).

    Example::

        >>> import numpy as np, attnlang
        >>> v = attnlang.load("examples/softcap.attn")
        >>> rng = np.random.default_rng(0)
        >>> q = rng.standard_normal((5, 8, 64)); k = rng.standard_normal((12, 2, 64))
        >>> o, lse = attention(v, q, k, k, qo_indptr=[0, 2, 5], kv_indptr=[0, 4, 12],
        ...                    params={"cap": 20.0})
        >>> o.shape, lse.shape
        ((5, 8, 64), (5, 8))
    """
    if not isinstance(v, ir.Variant):
        raise TypeError(f"v: expected an attnlang.ir.Variant, got {type(v).__name__}")
    if precision not in PRECISIONS:
        raise ValueError(
            f"precision: expected one of {', '.join(PRECISIONS)}, got {precision!r}"
        )
    fdtype = PRECISIONS[precision]
    q = _real_array(q, "q", 3, fdtype)
    k = _real_array(k, "k", 3, fdtype)
    vv = _real_array(vv, "vv", 3, fdtype)
    total_q, hq, d = q.shape
    total_kv, hkv, _ = k.shape
    if k.shape[2] != d:
        raise ValueError(f"k: head dim {k.shape[2]} differs from q's {d}")
    if vv.shape[:2] != k.shape[:2]:
        raise ValueError(f"vv: shape {vv.shape} differs from k's {k.shape} in tokens or heads")
    if vv.shape[2] == 0:
        raise ValueError(f"vv: needs head dim >= 1, got shape {vv.shape}")
    if d == 0 or hkv == 0:
        raise ValueError(f"k: needs at least one head and head dim >= 1, got shape {k.shape}")
    if hq % hkv != 0:
        raise ValueError(
            f"q: num_heads ({hq}) must be a multiple of num_kv_heads ({hkv}, from k)"
        )
    if d % 2 and _uses_rope(v):
        raise ValueError(f"q: rope needs an even head dim, got {d}")
    qo_indptr, kv_indptr = _request_indptrs(qo_indptr, kv_indptr, total_q, total_kv)
    batch = len(qo_indptr) - 1
    p = _check_params(v, params, ir.extent_sizes(v, hq, hkv, batch, d, vv.shape[2]))
    pairs = _pair_params(v, params, np.diff(qo_indptr), np.diff(kv_indptr))
    scale = 1.0 / math.sqrt(d) if sm_scale is None else _scalar(sm_scale, "sm_scale")

    o = np.zeros((total_q, hq, vv.shape[2]), fdtype)
    lse = np.full((total_q, hq), -np.inf, fdtype) if v.softmax else None
    with np.errstate(all="ignore"):
        for b in range(batch):
            qs, qe = int(qo_indptr[b]), int(qo_indptr[b + 1])
            ks, ke = int(kv_indptr[b]), int(kv_indptr[b + 1])
            p_b = {**p, **{name: masks[b] for name, masks in pairs.items()}}
            o_b, lse_b = _request(v, b, q[qs:qe], k[ks:ke], vv[ks:ke], p_b, scale, fdtype)
            o[qs:qe] = o_b
            if lse is not None:
                lse[qs:qe] = lse_b
    return o, lse


def _request_indptrs(qo_indptr, kv_indptr, total_q: int, total_kv: int):
    """Both indptrs, validated; a None one means 'a single request' and needs batch 1."""
    if qo_indptr is not None:
        qo_indptr = _indptr(qo_indptr, "qo_indptr", total_q, "q")
    if kv_indptr is not None:
        kv_indptr = _indptr(kv_indptr, "kv_indptr", total_kv, "k")
    for name, given, other in (("qo_indptr", qo_indptr, kv_indptr),
                               ("kv_indptr", kv_indptr, qo_indptr)):
        if given is None and other is not None and len(other) != 2:
            raise ValueError(
                f"{name}: None means a single request, but the other indptr describes "
                f"{len(other) - 1} requests; pass both"
            )
    qo_indptr = np.array([0, total_q]) if qo_indptr is None else qo_indptr
    kv_indptr = np.array([0, total_kv]) if kv_indptr is None else kv_indptr
    if len(qo_indptr) != len(kv_indptr):
        raise ValueError(
            f"qo_indptr and kv_indptr describe different batch sizes: "
            f"{len(qo_indptr) - 1} and {len(kv_indptr) - 1} requests"
        )
    return qo_indptr, kv_indptr


def _request(v: ir.Variant, b: int, q, k, vv, params, sm_scale: float, fdtype):
    """One request: q [qo_len, Hq, D], k [kv_len, Hkv, D], vv [kv_len, Hkv, Dv] ->
    o [qo_len, Hq, Dv], lse [qo_len, Hq] (None with softmax off)."""
    qo_len, hq, d = q.shape
    kv_len, hkv, _ = k.shape
    dv = vv.shape[2]
    group = hq // hkv
    common = {
        "batch": np.int64(b), "qo_len": np.int64(qo_len), "kv_len": np.int64(kv_len),
        "head_dim": np.int64(d), "num_heads": np.int64(hq), "num_kv_heads": np.int64(hkv),
        "sm_scale": fdtype(sm_scale),
    }
    q_pos = kv_len - qo_len + np.arange(qo_len, dtype=np.int64)
    kv_pos = np.arange(kv_len, dtype=np.int64)
    heads = np.arange(hq, dtype=np.int64)
    kv_heads = np.arange(hkv, dtype=np.int64)
    dim = np.arange(d, dtype=np.int64).reshape(1, 1, d)
    dim_vo = np.arange(dv, dtype=np.int64).reshape(1, 1, dv)

    def scope(stage: str, shape: tuple[int, ...], **names) -> Scope:
        return Scope(stage, shape, {**common, **names}, params, fdtype)

    # Key and value stages on [kv_len, Hkv, D] grids, once per request.
    row_kv = dict(kv_head=kv_heads.reshape(1, hkv, 1), kv_pos=kv_pos.reshape(kv_len, 1, 1))
    kp = stage_value(v, "key", scope("key", k.shape, k=k, dim=dim, **row_kv), k)
    vp = stage_value(v, "value", scope("value", vv.shape, v=vv, dim=dim_vo, **row_kv), vv)
    k_by_head = kp.transpose(1, 2, 0)  # [Hkv, D, kv_len]
    v_by_head = vp.transpose(1, 0, 2)  # [Hkv, kv_len, D]

    def rows(i0: int, i1: int):
        """Query rows i0:i1 (every stage is row-independent, so chunking changes nothing)."""
        n = i1 - i0
        pos = q_pos[i0:i1]
        row_q = dict(head=heads.reshape(1, hq, 1), kv_head=(heads // group).reshape(1, hq, 1),
                     q_pos=pos.reshape(n, 1, 1))
        qp = stage_value(v, "query", scope("query", (n, hq, d), q=q[i0:i1], dim=dim, **row_q),
                         q[i0:i1])

        # s[h, i, j] = sm_scale * dot(q'[i, h], k'[j, h // group]), one matmul per kv head:
        # query head h = kv_head * group + g.
        q_grouped = qp.reshape(n, hkv, group, d).transpose(1, 2, 0, 3).reshape(hkv, -1, d)
        s = fdtype(sm_scale) * (q_grouped @ k_by_head).reshape(hq, n, kv_len)

        # Scalar stages on the [Hq, rows, kv_len] grid.
        pair = dict(head=heads.reshape(hq, 1, 1), kv_head=(heads // group).reshape(hq, 1, 1),
                    q_pos=pos.reshape(1, n, 1), kv_pos=kv_pos.reshape(1, 1, kv_len))
        pair["causal"] = pair["kv_pos"] <= pair["q_pos"]  # the checker expands it
        grid = (hq, n, kv_len)
        s = stage_value(v, "logits", scope("logits", grid, logits=s, **pair), s)
        keep = stage_value(v, "mask", scope("mask", grid, **pair), np.ones(grid, bool))

        def weighted_sum(w: np.ndarray) -> np.ndarray:  # [Hq, n, kv] x v' -> [Hq, n, Dv]
            return (w.reshape(hkv, group * n, kv_len) @ v_by_head).reshape(hq, n, dv)

        if v.softmax:
            s = np.where(keep, s, -np.inf)
            m = np.max(s, axis=-1, keepdims=True, initial=-np.inf)
            m = np.where(np.isneginf(m), 0, m).astype(fdtype)  # fully masked: no -inf - -inf
            p = np.exp(s - m)
            denom = np.sum(p, axis=-1, keepdims=True)
            empty = denom == 0
            o = np.where(empty, 0, weighted_sum(p) / np.where(empty, 1, denom)).astype(fdtype)
            lse = np.where(empty, -np.inf, m + np.log(np.where(empty, 1, denom)))
            lse = lse[..., 0].T.astype(fdtype)
        else:
            o = weighted_sum(np.where(keep, s, 0).astype(fdtype))
            lse = None

        o = o.transpose(1, 0, 2)  # [rows, Hq, Dv]
        out = stage_value(v, "output", scope("output", o.shape, o=o, dim=dim_vo, **row_q), o)
        return out, lse

    # Bound the [Hq, rows, kv_len] temporaries (a 32k-token prefill over 32 heads is 275 GB).
    step = max(1, _GRID_ELEMENTS // max(1, hq * kv_len))
    chunks = [rows(i0, min(i0 + step, qo_len)) for i0 in range(0, qo_len, step)]
    if not chunks:
        return np.zeros((0, hq, dv), fdtype), (np.zeros((0, hq), fdtype) if v.softmax else None)
    out = np.concatenate([c[0] for c in chunks])
    lse = np.concatenate([c[1] for c in chunks]) if v.softmax else None
    return out, lse


def attention_paged(
    v: ir.Variant,
    q,
    k_cache,
    v_cache,
    qo_indptr,
    kv_indptr,
    kv_indices,
    kv_last_page_len,
    params: Mapping[str, object] | None = None,
    sm_scale: float | None = None,
    *,
    precision: str = "float64",
) -> tuple[np.ndarray, np.ndarray | None]:
    """`attention` over a paged KV cache (the layout the kernels read).

    Shapes (P pages of page_size tokens):
      q                 [total_q, Hq, D], ragged by qo_indptr [batch + 1] (None: one request)
      k_cache, v_cache  [P, page_size, Hkv, D], [P, page_size, Hkv, Dv]
      kv_indptr         [batch + 1]: request b owns pages kv_indices[kv_indptr[b]:kv_indptr[b+1]],
                        in logical order (kv_pos runs through them in list order)
      kv_indices        [kv_indptr[-1]] page numbers in [0, P)
      kv_last_page_len  [batch]: valid tokens of b's last page, in [1, page_size]
                        (ignored, but must lie in [0, page_size], for a request with no pages)
    Returns (o [total_q, Hq, Dv], lse [total_q, Hq] or None), as `attention`.

    Example::

        >>> import numpy as np, attnlang
        >>> v = attnlang.load("examples/causal.attn")
        >>> rng = np.random.default_rng(0)
        >>> q = rng.standard_normal((5, 8, 64))
        >>> kc = rng.standard_normal((6, 4, 2, 64)); vc = rng.standard_normal((6, 4, 2, 64))
        >>> # request 0: pages 5, 1 (4 + 2 tokens); request 1: page 3 (3 tokens)
        >>> o, lse = attention_paged(v, q, kc, vc, [0, 2, 5], [0, 2, 3], [5, 1, 3], [2, 3])
        >>> o.shape, lse.shape
        ((5, 8, 64), (5, 8))
    """
    if precision not in PRECISIONS:
        raise ValueError(
            f"precision: expected one of {', '.join(PRECISIONS)}, got {precision!r}"
        )
    fdtype = PRECISIONS[precision]
    k_cache = _real_array(k_cache, "k_cache", 4, fdtype)
    v_cache = _real_array(v_cache, "v_cache", 4, fdtype)
    if v_cache.shape[:3] != k_cache.shape[:3]:
        raise ValueError(f"v_cache: shape {v_cache.shape} differs from k_cache's "
                         f"{k_cache.shape} in pages, page size or heads")
    num_pages, page_size, hkv, d = k_cache.shape
    dv = v_cache.shape[3]
    if page_size == 0:
        raise ValueError(f"k_cache: page size must be >= 1, got shape {k_cache.shape}")
    kv_indices = _int_array(kv_indices, "kv_indices")
    page_indptr = _indptr(kv_indptr, "kv_indptr", len(kv_indices), "kv_indices")
    batch = len(page_indptr) - 1
    last = _int_array(kv_last_page_len, "kv_last_page_len")
    if last.shape != (batch,):
        raise ValueError(
            f"kv_last_page_len: expected shape ({batch},) (one per request), got {last.shape}"
        )
    bad = (kv_indices < 0) | (kv_indices >= num_pages)
    if np.any(bad):
        i = int(np.argmax(bad))
        raise ValueError(
            f"kv_indices: page index {kv_indices[i]} at position {i} is out of range "
            f"[0, {num_pages}) (k_cache has {num_pages} pages)"
        )
    n_pages = np.diff(page_indptr)
    low = np.where(n_pages > 0, 1, 0)
    bad = (last < low) | (last > page_size)
    if np.any(bad):
        b = int(np.argmax(bad))
        raise ValueError(
            f"kv_last_page_len: request {b} has {last[b]} tokens in its last page; expected "
            f"{low[b]}..{page_size} (page_size = {page_size})"
        )

    kv_lens = np.where(n_pages > 0, (n_pages - 1) * page_size + last, 0)
    tokens = [
        k_cache[kv_indices[page_indptr[b]:page_indptr[b + 1]]]
        .reshape(-1, hkv, d)[: kv_lens[b]]
        for b in range(batch)
    ]
    values = [
        v_cache[kv_indices[page_indptr[b]:page_indptr[b + 1]]]
        .reshape(-1, hkv, dv)[: kv_lens[b]]
        for b in range(batch)
    ]
    k = np.concatenate(tokens) if tokens else np.zeros((0, hkv, d), fdtype)
    vv = np.concatenate(values) if values else np.zeros((0, hkv, dv), fdtype)
    token_indptr = np.concatenate([[0], np.cumsum(kv_lens)]).astype(np.int64)
    return attention(v, q, k, vv, qo_indptr, token_indptr, params, sm_scale,
                     precision=precision)
