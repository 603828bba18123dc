"""BatchAttention.run() as a PyTorch operator: compiles under torch.compile(fullgraph=True)
without a graph break, and captures into CUDA graphs.

    import attnlang as al
    from attnlang.integrations.torch import AttentionOp

    attn = al.BatchAttention(al.load("examples/softcap.attn"), 32, 8, 128, "bfloat16", 16)
    attn.plan(qo_indptr, kv_indptr, kv_indices, kv_last_page_len)   # eager, once per step
    op = AttentionOp(attn)

    @torch.compile(fullgraph=True)
    def layer(q, k_cache, v_cache):
        return op(q, k_cache, v_cache, {"cap": 30.0})                # one graph, no break

Two operators are registered, `torch.ops.attnlang.attention` (-> out) and
`torch.ops.attnlang.attention_lse` (-> out, lse), with the signature

    (handle: int, q, k_cache, v_cache, tensor_params: list[Tensor],
     scalar_params: list[float], sm_scale: float)

`handle` names a BatchAttention (AttentionOp registers it; weakly held); the params go in
the variant's declaration order, tensor params and scalar params in two lists, so
torch.compile sees every input of the kernel. An fp8 cache's k_scale and v_scale follow the
variant's params: in the tensor list where they are tensors, in the scalar list where both
are floats. The operators' fake (meta) implementations give the output shapes without a GPU.
plan() stays outside the compiled region: it is host work that rewrites the BatchAttention's
device workspace in place, and the operators read that workspace, so one compiled graph (or
CUDA graph) serves every later plan.
"""

from __future__ import annotations

import itertools
import math
import weakref
from collections.abc import Mapping
from typing import Any

import torch

from attnlang.codegen.config import KV_FP8
from attnlang.ir import KV_SCALE_PARAMS

__all__ = ["AttentionOp"]

_ATTENTIONS: weakref.WeakValueDictionary[int, Any] = weakref.WeakValueDictionary()
_HANDLES = itertools.count(1)


def _attention(handle: int):
    attn = _ATTENTIONS.get(handle)
    if attn is None:
        raise RuntimeError(
            f"attnlang operator: BatchAttention handle {handle} is gone (the object was "
            "garbage-collected); keep the AttentionOp (and its BatchAttention) alive while "
            "a compiled function or CUDA graph uses it")
    return attn


def _call(handle, q, k_cache, v_cache, tensor_params, scalar_params, sm_scale, return_lse):
    attn = _attention(handle)
    op = attn._torch_op  # the AttentionOp that registered it: the params' names
    tensors, scalars = len(op.tensor_names), len(op.scalar_names)
    params = dict(zip(op.tensor_names, tensor_params[:tensors], strict=True))
    for name, is_int, value in zip(op.scalar_names, op.scalar_is_int, scalar_params[:scalars],
                                   strict=True):
        params[name] = int(value) if is_int else value
    # An fp8 cache's scales, after the params (AttentionOp.__call__): two tensors or two floats.
    scales = list(tensor_params[tensors:]) or list(scalar_params[scalars:]) or [None, None]
    k_scale, v_scale = scales
    return attn.run(q, (k_cache, v_cache), params, sm_scale=sm_scale, return_lse=return_lse,
                    k_scale=k_scale, v_scale=v_scale)


@torch.library.custom_op("attnlang::attention", mutates_args=(), device_types="cuda")
def _attention_op(handle: int, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                  tensor_params: list[torch.Tensor], scalar_params: list[float],
                  sm_scale: float) -> torch.Tensor:
    return _call(handle, q, k_cache, v_cache, tensor_params, scalar_params, sm_scale, False)


@torch.library.custom_op("attnlang::attention_lse", mutates_args=(), device_types="cuda")
def _attention_lse_op(handle: int, q: torch.Tensor, k_cache: torch.Tensor,
                      v_cache: torch.Tensor, tensor_params: list[torch.Tensor],
                      scalar_params: list[float],
                      sm_scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    out, lse = _call(handle, q, k_cache, v_cache, tensor_params, scalar_params, sm_scale,
                     True)
    if lse is None:  # softmax-off variants have no lse; the operator's schema has one
        lse = torch.full((q.shape[0], q.shape[1]), float("nan"), dtype=torch.float32,
                         device=q.device)
    return out, lse


def _fake_out(q: torch.Tensor, v_cache: torch.Tensor) -> torch.Tensor:
    """out as run() makes it: q's rows and heads, v_cache's head dim (MLA: 128 beside 192)."""
    return q.new_empty((q.shape[0], q.shape[1], v_cache.shape[-1]))


@_attention_op.register_fake
def _(handle, q, k_cache, v_cache, tensor_params, scalar_params, sm_scale):
    return _fake_out(q, v_cache)


@_attention_lse_op.register_fake
def _(handle, q, k_cache, v_cache, tensor_params, scalar_params, sm_scale):
    return _fake_out(q, v_cache), q.new_empty((q.shape[0], q.shape[1]), dtype=torch.float32)


class AttentionOp:
    """A BatchAttention called through the attnlang torch operators.

    ``op(q, k_cache, v_cache, params=None, *, sm_scale=None, return_lse=False, k_scale=None,
    v_scale=None)`` takes what BatchAttention.run takes (torch tensors; params by name,
    scalars as Python numbers, tensor params as CUDA tensors; an fp8 cache's k_scale and
    v_scale as floats or float32 CUDA tensors [num_kv_heads] or of one element) and returns
    out, or (out, lse) with return_lse=True (lse None for softmax-off variants). Under
    torch.compile the scalar params, float scales and sm_scale are graph constants (a new
    value recompiles); tensor params and tensor scales are graph inputs.

    Example::

        op = AttentionOp(attn)
        out = torch.compile(lambda q, k, v: op(q, k, v, {"cap": 30.0}), fullgraph=True)(q, k, v)
        # an fp8 cache (BatchAttention(..., kv_dtype="fp8")): k/v float8_e4m3fn, scales [kv_heads]
        out = op(q, k8, v8, {"cap": 30.0}, k_scale=k_scale, v_scale=v_scale)
    """

    def __init__(self, attn: Any):
        specs = attn.params
        self.handle = next(_HANDLES)
        self.head_dim = attn.shape.head_dim
        self.softmax = bool(attn.module.softmax)
        # Per-pair masks (bool[q, kv]) went to plan(): the operator passes the rest. An fp8
        # cache's scales are params of its kernels, and k_scale= / v_scale= arguments here.
        self.fp8 = attn.shape.kv_dtype == KV_FP8
        self.num_kv_heads = attn.shape.num_kv_heads
        self.tensor_names = tuple(p.name for p in specs if p.is_tensor and not p.is_pair
                                  and not (self.fp8 and p.name in KV_SCALE_PARAMS))
        scalars = [p for p in specs if not p.is_tensor]
        self.scalar_names = tuple(p.name for p in scalars)
        self.scalar_is_int = tuple(str(p.type) == "int" for p in scalars)
        self.scalar_defaults = tuple(p.default for p in scalars)
        self._attn = attn
        attn._torch_op = self
        _ATTENTIONS[self.handle] = attn

    def __call__(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 params: Mapping[str, Any] | None = None, *, sm_scale: float | None = None,
                 return_lse: bool = False, k_scale: Any = None, v_scale: Any = None):
        params = {} if params is None else params
        clash = [name for name in KV_SCALE_PARAMS if self.fp8 and name in params]
        if clash:
            raise TypeError(f"pass {clash[0]} as the operator's {clash[0]}= argument, not in "
                            "params")
        unknown = [name for name in params
                   if name not in self.tensor_names and name not in self.scalar_names]
        if unknown:
            known = ", ".join(self.tensor_names + self.scalar_names) or "none"
            raise ValueError(f"unknown param {unknown[0]!r} (this variant's params: {known})")
        tensors = [params[name] if name in params else None for name in self.tensor_names]
        if any(t is None for t in tensors):
            missing = self.tensor_names[tensors.index(None)]
            raise ValueError(f"missing tensor param {missing!r}: pass params={{{missing!r}: "
                             "a CUDA tensor}}")
        scalars = []
        for name, default in zip(self.scalar_names, self.scalar_defaults, strict=True):
            value = params.get(name, default)
            if value is None:
                raise ValueError(f"missing param {name!r}: it has no default")
            if isinstance(value, bool):
                raise TypeError(f"param {name!r} must be a number, got bool")
            scalars.append(float(value))
        scale_tensors, scale_floats = self._kv_scales(k_scale, v_scale, q)
        tensors += scale_tensors
        scalars += scale_floats
        scale = 1.0 / math.sqrt(self.head_dim) if sm_scale is None else float(sm_scale)
        if return_lse:
            out, lse = torch.ops.attnlang.attention_lse(self.handle, q, k_cache, v_cache,
                                                        tensors, scalars, scale)
            return out, (lse if self.softmax else None)
        return torch.ops.attnlang.attention(self.handle, q, k_cache, v_cache, tensors,
                                            scalars, scale)

    def _kv_scales(self, k_scale: Any, v_scale: Any, q: torch.Tensor) -> tuple[list, list]:
        """An fp8 cache's scales as the operator takes them: ([k, v], []) as tensors, or
        ([], [k, v]) where both are numbers (a number beside a tensor becomes a tensor)."""
        if not self.fp8:
            if k_scale is not None or v_scale is not None:
                raise TypeError("k_scale and v_scale are for an fp8 KV cache; this "
                                "BatchAttention's cache is not fp8 (build it with kv_dtype='fp8')")
            return [], []
        if k_scale is None or v_scale is None:
            missing = "k_scale" if k_scale is None else "v_scale"
            raise TypeError(f"an fp8 KV cache needs k_scale and v_scale (missing {missing}): a "
                            "float, or a float32 CUDA tensor [num_kv_heads]")
        pair = (k_scale, v_scale)
        for name, value in zip(KV_SCALE_PARAMS, pair, strict=True):
            if isinstance(value, bool) or not isinstance(value, (int, float, torch.Tensor)):
                raise TypeError(f"{name} must be a float or a float32 CUDA tensor, got "
                                f"{type(value).__name__}")
        if not any(isinstance(x, torch.Tensor) for x in pair):
            return [], [float(x) for x in pair]
        return [x if isinstance(x, torch.Tensor) else
                torch.full((self.num_kv_heads,), float(x), dtype=torch.float32, device=q.device)
                for x in pair], []
