"""attnlang: a small language and compiler for LLM attention variants.

    import attnlang as al
    v = al.load("examples/softcap.attn")                 # parse + check -> ir.Variant
    o, lse = al.reference.attention(v, q, k, vv)         # NumPy oracle
    km = al.compile(v, head_dim=128, dtype="bfloat16", arch="sm_90a")   # no GPU needed
    attn = al.BatchAttention(v, num_qo_heads=32, num_kv_heads=8, head_dim=128)
    attn.plan(qo_indptr, kv_indptr, kv_indices, kv_last_page_len)
    out = attn.run(q, (k_cache, v_cache), params={"cap": 30.0})

The GPU parts (compile, BatchAttention, merge_states) import CuPy only when first used, so
the language front end and the reference work on any machine.
"""

from __future__ import annotations

import importlib

from attnlang.errors import (
    AttnDeclarationError,
    AttnError,
    AttnErrors,
    AttnNameError,
    AttnScopeError,
    AttnSyntaxError,
    AttnTypeError,
)
from attnlang.pipeline import load, parse

__version__ = "0.1.0"

__all__ = [
    "load", "parse", "reference", "compile", "load_compiled", "BatchAttention", "merge_states",
    "AttnError", "AttnErrors", "AttnSyntaxError", "AttnNameError", "AttnScopeError",
    "AttnTypeError", "AttnDeclarationError", "__version__",
]

# Public names that live in modules needing CuPy (or NumPy-heavy ones): imported on first use.
_LAZY = {
    "reference": ("attnlang.reference", None),
    "compile": ("attnlang.runtime.module", "compile_variant"),
    "load_compiled": ("attnlang.runtime.module", "load_compiled"),
    "KernelModule": ("attnlang.runtime.module", "KernelModule"),
    "BatchAttention": ("attnlang.runtime.attention", "BatchAttention"),
    "merge_states": ("attnlang.runtime.merge", "merge_states"),
}


def __getattr__(name: str):
    if name in _LAZY:
        module_name, attr = _LAZY[name]
        module = importlib.import_module(module_name)
        value = module if attr is None else getattr(module, attr)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'attnlang' has no attribute '{name}'")
