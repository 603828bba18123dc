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

`handle` names a BatchAttention (AttentionOp registers it; weakly held); the params go in the
variant's declaration order, tensor params and scalar params in two lists, so torch.compile
sees every input of the kernel. Their fake (meta) implementations give the output shapes
without a GPU. plan() stays outside the compiled region: it is host work that rewrites the
BatchAttention's device workspace in place, and the operators read that workspace, so one
compiled graph (or CUDA graph) serves every later plan.
"""

from __future__ import annotations

import itertools
import math
import weakref
from collections.abc import Mapping
from typing import Any

import torch

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
    params = dict(zip(op.tensor_names, tensor_params, strict=True))
    for name, is_int, value in zip(op.scalar_names, op.scalar_is_int, scalar_params,
                                   strict=True):
        params[name] = int(value) if is_int else value
    return attn.run(q, (k_cache, v_cache), params, sm_scale=sm_scale, return_lse=return_lse)


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

    ``op(q, k_cache, v_cache, params=None, *, sm_scale=None, return_lse=False)`` takes what
    BatchAttention.run takes (torch tensors; params by name, scalars as Python numbers,
    tensor params as CUDA tensors) and returns out, or (out, lse) with return_lse=True (lse
    None for softmax-off variants). Under torch.compile the scalar params and sm_scale are
    graph constants (a new value recompiles); tensor params are graph inputs.

    Example::

        op = AttentionOp(attn)
        out = torch.compile(lambda q, k, v: op(q, k, v, {"cap": 30.0}), fullgraph=True)(q, k, v)
    """

    def __init__(self, attn: Any):
        specs = attn.params
        self.handle = next(_HANDLES)
        self.head_dim = attn.shape.head_dim
        self.softmax = bool(attn.module.softmax)
        # Per-pair masks (bool[q, kv]) went to plan(): the operator passes the rest.
        self.tensor_names = tuple(p.name for p in specs if p.is_tensor and not p.is_pair)
        scalars = [p for p in specs if not p.is_tensor]
        self.scalar_names = tuple(p.name for p in scalars)
        self.scalar_is_int = tuple(str(p.type) == "int" for p in scalars)
        self.scalar_defaults = tuple(p.default for p in scalars)
        self._attn = attn
        attn._torch_op = self
        _ATTENTIONS[self.handle] = attn

    def __call__(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 params: Mapping[str, Any] | None = None, *, sm_scale: float | None = None,
                 return_lse: bool = False):
        params = {} if params is None else params
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
        scale = 1.0 / math.sqrt(self.head_dim) if sm_scale is None else float(sm_scale)
        if return_lse:
            out, lse = torch.ops.attnlang.attention_lse(self.handle, q, k_cache, v_cache,
                                                        tensors, scalars, scale)
            return out, (lse if self.softmax else None)
        return torch.ops.attnlang.attention(self.handle, q, k_cache, v_cache, tensors,
                                            scalars, scale)
