"""Pass 4, render: `Hooks` -> the full, self-contained CUDA source of one kernel kind.

The templates (``kernels_templates/<kind>.cu.j2``) only splice: every value comes from here,
computed in Python (`attnlang.codegen.config` for the layout constants, `Hooks` for the
variant). Jinja2 runs with `StrictUndefined`, so a template naming a value this module does
not pass fails loudly instead of rendering an empty string. ``common.cuh`` is spliced in by
an include, so the only ``#include`` lines left are CUDA's own (cuda_fp16.h, cuda_bf16.h).
Included ``.cuh`` headers are C++, never Jinja: they are spliced verbatim (inline PTX such as
``{%0, %1}`` operand lists would otherwise read as template tags).

After rendering, each `lower.LINE_RESET` marker becomes ``#line <n> "<variant>_<kind>.cu"``
with n the marker's own position, so lines after a hook are numbered as the generated file
again (the hooks' ``#line`` directives point into the .attn file).
"""

from __future__ import annotations

import functools

import jinja2

from attnlang import paths
from attnlang.codegen import config
from attnlang.codegen.lower import LINE_RESET, Hooks

__all__ = ["render", "context", "environment", "generated_name"]


class _Loader(jinja2.FileSystemLoader):
    """Templates (``*.j2``) as Jinja; headers (``*.cuh``) as verbatim text."""

    def get_source(self, environment, template):
        source, filename, uptodate = super().get_source(environment, template)
        if template.endswith(".cuh"):
            if "{% endraw %}" in source:
                raise ValueError(f"{filename} contains '{{% endraw %}}'")
            source = "{% raw %}" + source + "{% endraw %}"
        return source, filename, uptodate


@functools.lru_cache(maxsize=1)
def environment() -> jinja2.Environment:
    """The Jinja2 environment of the kernel templates (StrictUndefined, no autoescape)."""
    return jinja2.Environment(
        loader=_Loader(str(paths.templates_dir())),
        undefined=jinja2.StrictUndefined,
        autoescape=False,
        keep_trailing_newline=True,
        trim_blocks=False,
        lstrip_blocks=False,
    )


def generated_name(hooks: Hooks, kind: str) -> str:
    """The file name the generated source calls itself in #line directives."""
    return f"{hooks.variant}_{kind}.cu"


def _header(name: str) -> str:
    return (paths.templates_dir() / name).read_text()




def context(hooks: Hooks, kind: str, dtype: str, head_dim: int) -> dict[str, object]:
    """Every value a template splices, by name. Raises ValueError for a bad kind, dtype or
    head_dim (`config.template_shape` validates them).

    ``hooks_source`` carries what the hooks need besides common.cuh: the interval helpers of
    ``variant::mask_tile`` (mask_tiles.cuh), spliced verbatim ahead of the hooks.
    """
    shape = config.template_shape(kind, head_dim, dtype)
    return {
        "variant_name": hooks.variant,
        "dtype": dtype,
        "ctype": shape.ctype,
        "head_dim": shape.head_dim,
        "vec": shape.vec,
        "tx": shape.tx,
        "kv_tile": shape.kv_tile,
        "stages": shape.stages,
        "chunk": shape.chunk,
        "max_threads": shape.max_threads,
        "min_blocks": shape.min_blocks,
        "row_blocks": shape.row_blocks,
        "hooks_source": _header("mask_tiles.cuh") + "\n" + hooks.source,
        "variant_params": hooks.kernel_params_decl,
        "params_init": hooks.params_init,
    }


def _resolve_line_resets(text: str, name: str) -> str:
    lines = text.split("\n")
    for i, line in enumerate(lines):
        if line.strip() == LINE_RESET:
            # `#line n` names the number of the line after the directive: 1-based i + 2.
            lines[i] = f'#line {i + 2} "{name}"'
    return "\n".join(lines)


def render(hooks: Hooks, kind: str, dtype: str, head_dim: int) -> str:
    """The complete CUDA source of kernel `kind` ("decode", "prefill" or "merge") for these
    hooks.

    dtype: "float16" or "bfloat16"; head_dim: 64, 128 or 256. The source's ``extern "C"``
    entry is named after the kind; its arguments are INTERNALS.md's followed by
    ``hooks.kernel_params``. Raises ValueError for an unsupported kind, dtype or head_dim.

    Example::

        src = render(lower(attnlang.load("examples/softcap.attn")), "decode", "bfloat16", 128)
        'extern "C" __global__' in src   # True
    """
    ctx = context(hooks, kind, dtype, head_dim)
    text = environment().get_template(f"{kind}.cu.j2").render(**ctx)
    return _resolve_line_resets(text, generated_name(hooks, kind))
