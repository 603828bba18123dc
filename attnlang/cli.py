"""The `attnlang` command line: check, show, compile, cache.

Errors in a variant print as `file:line:col: error: ...` with the source line and a caret,
and exit with status 2; anything else that fails exits with status 1.
"""

from __future__ import annotations

import sys
from pathlib import Path

import click

from attnlang.errors import AttnError

DTYPES = {"bf16": "bfloat16", "bfloat16": "bfloat16", "fp16": "float16", "float16": "float16"}
# "192/128": queries and keys of 192, values of 128 (MLA; config.HEAD_DIM_PAIRS).
HEAD_DIMS = ("64", "128", "256", "192/128")
# --kv-dtype: a cache type other than the dtype (float8 e4m3)
KV_DTYPES = ("fp8", "float8_e4m3fn")


def _head_dims(text: str) -> tuple[int, int]:
    """"128" -> (128, 128); "192/128" -> (192, 128)."""
    qk, _, vo = text.partition("/")
    return int(qk), int(vo or qk)


def _load(path: str):
    from attnlang.pipeline import load

    try:
        return load(path)
    except AttnError as e:
        click.echo(str(e), err=True)
        sys.exit(2)
    except OSError as e:
        raise click.FileError(path, hint=e.strerror) from None


def _kinds() -> tuple[str, ...]:
    from attnlang.runtime.module import KERNEL_KINDS

    return KERNEL_KINDS


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="attnlang")
def main():
    """attnlang: compile attention variants to paged CUDA kernels."""


@main.command()
@click.argument("file", type=click.Path(dir_okay=False))
def check(file):
    """Parse and check FILE; print a summary, or the errors (exit status 2)."""
    v = _load(file)
    stages = [s for s in ("query", "key", "value", "logits", "mask", "output") if v.stage(s)]
    params = ", ".join(
        f"{p.name}: {p.declared}"
        + (f" = {p.default}" if p.default is not None else "") for p in v.params)
    click.echo(f"{file}: ok: variant {v.name}")
    click.echo(f"  stages:  {', '.join(stages) or '(none: plain attention)'}; "
               f"softmax {'on' if v.softmax else 'off'}")
    click.echo(f"  params:  {params or '(none)'}")
    if v.consts:
        click.echo("  consts:  " + ", ".join(f"{n} = {val}" for n, val in v.consts))


@main.command()
@click.argument("file", type=click.Path(dir_okay=False))
@click.option("--kernel", "kind", default="decode", show_default=True,
              help="Kernel kind to show (decode, merge, ...).")
@click.option("--dtype", type=click.Choice(sorted(DTYPES)), default="bf16", show_default=True)
@click.option("--head-dim", type=click.Choice(HEAD_DIMS), default="128", show_default=True)
@click.option("--arch", default=None,
              help="Target, e.g. sm_90a (its prefill kernel takes the wgmma path); default: the "
                   "path every sm_80+ target runs.")
@click.option("--kv-dtype", type=click.Choice(KV_DTYPES), default=None,
              help="The KV cache's element type [default: the dtype]; fp8: float8 e4m3, "
                   "dequantised with the run-time params k_scale and v_scale.")
def show(file, kind, dtype, head_dim, arch, kv_dtype):
    """Print the generated CUDA source of one kernel of FILE."""
    from attnlang.pipeline import generate_source

    v = _load(file)
    if kind not in _kinds():
        raise click.BadParameter(f"unknown kernel '{kind}'; kernels are: {', '.join(_kinds())}",
                                 param_hint="--kernel")
    if arch is not None:
        from attnlang.runtime.compiler import resolve_arch

        try:
            arch = resolve_arch(arch)
        except ValueError as e:
            raise click.BadParameter(str(e), param_hint="--arch") from None
    qk, vo = _head_dims(head_dim)
    click.echo(generate_source(v, kind, DTYPES[dtype], qk, arch, vo, _kv_dtype(kv_dtype, dtype)))


@main.command()
@click.argument("file", type=click.Path(dir_okay=False))
@click.option("--head-dim", "head_dims", type=click.Choice(HEAD_DIMS), multiple=True,
              help="Head dimension(s) [default: 128]; 192/128: queries and keys of 192, "
                   "values of 128 (MLA).")
@click.option("--dtype", "dtypes", type=click.Choice(sorted(DTYPES)), multiple=True,
              help="Input dtype(s) [default: bf16].")
@click.option("--arch", default=None,
              help="Target, e.g. sm_90a or sm_80 [default: the GPU's, else $ATTNLANG_ARCH].")
@click.option("--kv-dtype", type=click.Choice(KV_DTYPES), default=None,
              help="The KV cache's element type [default: the dtype]; fp8: float8 e4m3, "
                   "dequantised with the run-time params k_scale and v_scale.")
@click.option("--cascade", is_flag=True,
              help="Also compile the cascade kernel (shared-prefix levels, "
                   "BatchAttention(..., cascade=True)).")
@click.option("-o", "--output", "out_dir", type=click.Path(file_okay=False), default=None,
              help="Also write a self-contained compiled module (cubins + manifest.json) here; "
                   "one subdirectory per dtype/head-dim when several are asked for.")
def compile(file, head_dims, dtypes, arch, kv_dtype, cascade, out_dir):  # noqa: A001 - the command's name
    """Compile every kernel of FILE with NVRTC (no GPU needed); print a table per kernel."""
    from attnlang.codegen.config import fine_tiles, launch_config
    from attnlang.runtime.compiler import CompileError
    from attnlang.runtime.module import ALL_KINDS, KINDS, compile_variant

    v = _load(file)
    combos = [(DTYPES[d], h) for d in (dtypes or ("bf16",)) for h in (head_dims or ("128",))]
    combos = list(dict.fromkeys(combos))
    rows = []
    for dtype, dims in combos:
        head_dim, head_dim_vo = _head_dims(dims)
        try:
            km = compile_variant(v, head_dim=head_dim, dtype=dtype, arch=arch,
                                 head_dim_vo=head_dim_vo, kv_dtype=_kv_dtype(kv_dtype, dtype),
                                 kinds=ALL_KINDS if cascade else KINDS)
        except (CompileError, ValueError, RuntimeError) as e:
            click.echo(f"attnlang: error: {e}", err=True)
            sys.exit(1)
        for kind, cubin in km.cubins.items():
            # ptxas reports static shared memory only; the kernels size theirs at launch.
            dynamic = launch_config(kind, head_dim, 1, dtype, cubin.arch, head_dim_vo,
                                    fine_tiles(km.params), km.decode_mma).smem_bytes
            for fn in cubin.functions:
                shown = dtype if km.kv_dtype == dtype else f"{dtype}, fp8 KV"
                rows.append((kind, shown, dims, cubin.arch, str(fn.registers),
                             f"{(fn.shared_bytes + dynamic) // 1024} KiB",
                             f"{fn.spill_stores}/{fn.spill_loads}",
                             # a cache hit compiled nothing now: no time to show
                             f"{cubin.compile_seconds:.2f}s" if cubin.cache == "miss" else "-",
                             cubin.cache,
                             str(cubin.path) if cubin.path else "-"))
        if out_dir is not None:
            target = Path(out_dir)
            if len(combos) > 1:
                target = target / f"{dtype}-d{dims.replace('/', '-')}"
            km.save(target)
            click.echo(f"wrote {target}/ (load it with attnlang.load_compiled)")
    header = ("kernel", "dtype", "head_dim", "arch", "regs", "smem", "spill st/ld", "compile",
              "cache", "cubin")
    click.echo(f"variant {v.name} ({file})")
    click.echo(_table(header, rows))


def _kv_dtype(choice: str | None, dtype: str) -> str | None:
    """--kv-dtype's choice as compile_variant's kv_dtype (None: the dtype's own)."""
    return None if choice is None else "float8_e4m3fn"


def _table(header, rows) -> str:
    widths = [max(len(str(c)) for c in col) for col in zip(header, *rows, strict=True)]
    fmt = "  ".join(f"{{:<{w}}}" for w in widths)
    lines = [fmt.format(*header), fmt.format(*("-" * w for w in widths))]
    lines += [fmt.format(*r) for r in rows]
    return "\n".join(line.rstrip() for line in lines)


@main.group()
def cache():
    """Inspect or clear the on-disk kernel cache."""


@cache.command("dir")
def cache_dir_cmd():
    """Print the cache directory ($ATTNLANG_CACHE_DIR or the user cache dir)."""
    from attnlang.runtime.compiler import cache_dir

    click.echo(str(cache_dir()))


@cache.command("list")
def cache_list():
    """List cached kernels."""
    from attnlang.runtime.compiler import list_entries

    entries = list_entries()
    if not entries:
        click.echo("(cache is empty)")
        return
    rows = [(e["key"][:16], e.get("label") or "-", e.get("arch") or "-", f"{e['size']:,}")
            for e in entries]
    click.echo(_table(("key", "kernel", "arch", "bytes"), rows))


@cache.command("clear")
def cache_clear():
    """Remove every cached kernel."""
    from attnlang.runtime.compiler import clear_cache

    click.echo(f"removed {clear_cache()} cached kernel(s)")


if __name__ == "__main__":  # pragma: no cover
    main()
