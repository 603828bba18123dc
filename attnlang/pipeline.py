"""The passes of attnlang, in order. Each is one module with one pure entry function:

    parse   attnlang.grammar.parser.parse_ast   text        -> ast.Module
    check   attnlang.codegen.check.check        ast.Module  -> ir.Variant
    lower   attnlang.codegen.lower.lower        ir.Variant  -> Hooks (C++ text)
    render  attnlang.codegen.render.render      Hooks       -> .cu source per kernel kind
    compile attnlang.runtime.compiler.compile_source  .cu   -> Cubin (disk-cached)

`attnlang.reference` evaluates the same ir.Variant in NumPy; the runtime
(`attnlang.runtime`) loads cubins and launches them over a plan.
"""

from __future__ import annotations

import os

from attnlang import ir
from attnlang.codegen.check import check
from attnlang.errors import AttnSyntaxError, Span
from attnlang.grammar.parser import parse_ast

__all__ = ["parse", "load", "decode_source", "generate_source"]


def parse(text: str, filename: str = "<string>") -> ir.Variant:
    """Parse and check variant source text. Raises AttnError (AttnErrors for several).

    >>> parse("variant causal\\nmask = causal").name
    'causal'
    """
    return check(parse_ast(text, filename), text, filename)


def load(path: str | os.PathLike) -> ir.Variant:
    """Read, parse and check an .attn file."""
    path = os.fspath(path)
    with open(path, "rb") as f:
        data = f.read()
    return parse(decode_source(data, path), filename=path)


def decode_source(data: bytes, filename: str) -> str:
    """The UTF-8 text of an .attn file; AttnSyntaxError at the first byte that is not UTF-8.

    >>> decode_source(b"variant a", "a.attn")
    'variant a'
    """
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        before = data[:e.start].decode("utf-8", errors="replace")
        line = before.count("\n") + 1
        col = len(before) - (before.rfind("\n") + 1) + 1
        shown = data.decode("utf-8", errors="replace")
        raise AttnSyntaxError(
            f"the file is not UTF-8 text (byte 0x{data[e.start]:02x})",
            Span(filename, line, col, line, col + 1),
            "save it as UTF-8; .attn files are plain text", shown) from None


def generate_source(variant: ir.Variant, kind: str, dtype: str, head_dim: int,
                    arch: str | None = None, head_dim_vo: int | None = None,
                    kv_dtype: str | None = None) -> str:
    """lower + render: the full CUDA source of one kernel kind for this variant (arch: the
    compile target, which picks the prefill path; head_dim_vo: the values' head dim, None for
    head_dim; kv_dtype: the cache's element type, None for dtype, "float8_e4m3fn" adds the
    scale params (`ir.with_kv_scales`); see `attnlang.codegen.render.render`)."""
    from attnlang.codegen.config import KV_FP8
    from attnlang.codegen.lower import lower
    from attnlang.codegen.render import render

    if kv_dtype == KV_FP8:
        variant = ir.with_kv_scales(variant)
    return render(lower(variant), kind, dtype, head_dim, arch, head_dim_vo, kv_dtype)
