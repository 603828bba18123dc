"""The kernels one BatchAttention launches: their launch configs, the loaded functions, the
grids, and each launch as run() hands it to cuLaunchKernel.

`load_kernels` runs once a BatchAttention has its compiled module; `pack_launches` once its
workspace exists. Both need a GPU (they load cubins and ask the driver for occupancy); what
they are built from (`config.launch_config`, `workspace.PackedArgs`) is tested without one.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from attnlang.codegen.config import DECODE_MMA_ROWS, LaunchConfig, fine_tiles, launch_config
from attnlang.runtime import planner
from attnlang.runtime.module import KernelModule
from attnlang.runtime.plan_mixed import Tiling
from attnlang.runtime.validate import AttentionShape
from attnlang.runtime.workspace import PackedArgs

__all__ = ["Kernels", "load_kernels", "merge_grid", "pack_launches"]

# CTAs per SM when num_ctas is not given: the kernel's occupancy, capped. Beyond a few CTAs
# per SM, more CTAs only shrink the KV chunks (more partial states to merge) without adding
# memory parallelism the warps of each CTA do not already provide.
MAX_CTAS_PER_SM = 4
# The merge kernel loops over rows, so a grid of a few CTAs per SM covers any count.
_MERGE_CTAS_PER_SM = 8


@dataclass(frozen=True)
class Kernels:
    """A module's kernels on one device: configs and functions by kind ("decode", "prefill",
    "merge", and "cascade" when built, which has the prefill kernel's config), the two
    attention grids, and the rows above which a request runs in the prefill kernel."""

    device: int
    configs: dict[str, LaunchConfig]
    functions: dict[str, Any]
    num_ctas: int
    num_prefill_ctas: int
    prefill_min_rows: int

    @property
    def tilings(self) -> dict[str, Tiling]:
        """What the planner needs of the two attention kernels (plan_mixed's Tiling)."""
        return {kind: Tiling(self.configs[kind].rows_per_tile, ctas,
                             max(1, int(self.configs[kind].kv_tile or 1)))
                for kind, ctas in (("decode", self.num_ctas), ("prefill", self.num_prefill_ctas))}


def load_kernels(module: KernelModule, shape: AttentionShape, device: int, *,
                 num_ctas: int | None, num_prefill_ctas: int | None,
                 prefill_min_rows: int | None, cascade: bool) -> Kernels:
    """Load `module`'s kernels onto `device` with the launch configs its compiled templates
    imply (the arch picks the prefill path, the params its tiles, `decode_mma` the decode
    kernel). Grids: num_ctas for decode (default: SMs x occupancy, at most MAX_CTAS_PER_SM
    per SM) and num_prefill_ctas for prefill (default num_ctas if given, else the prefill
    kernel's own). prefill_min_rows None: 8 where the decode kernel runs on tensor cores
    (config.DECODE_MMA_ROWS, the rows of its items), else planner.PREFILL_MIN_ROWS."""
    s = shape
    mma = module.decode_mma
    configs = {kind: launch_config(kind, s.head_dim, s.group_size, s.dtype, module.arch,
                                   s.head_dim_vo, fine_tiles(module.params),
                                   mma and kind == "decode")
               for kind in ("decode", "prefill", "merge")}
    if cascade:  # the prefill kernel's shape (launch_config's prefill)
        configs["cascade"] = configs["prefill"]
    functions = {kind: module.function(kind, device, dynamic_smem=cfg.smem_bytes)
                 for kind, cfg in configs.items()}
    if num_ctas is None:
        num_ctas = _default_num_ctas(device, functions["decode"], configs["decode"])
        if num_prefill_ctas is None:
            num_prefill_ctas = _default_num_ctas(device, functions["prefill"], configs["prefill"])
    elif num_prefill_ctas is None:
        num_prefill_ctas = num_ctas
    if prefill_min_rows is None:
        prefill_min_rows = DECODE_MMA_ROWS if mma else planner.PREFILL_MIN_ROWS
    return Kernels(device, configs, functions, int(num_ctas), int(num_prefill_ctas),
                   int(prefill_min_rows))


def merge_grid(kernels: Kernels, max_merge_rows: int) -> int:
    """The merge kernel's fixed grid: enough CTAs for max_merge_rows, a few per SM at most."""
    ctas = -(-max_merge_rows // max(1, kernels.configs["merge"].rows_per_tile))
    return max(1, min(ctas, _MERGE_CTAS_PER_SM * num_sms(kernels.device)))


def pack_launches(kernels: Kernels, workspace: dict[str, int], shape: AttentionShape,
                  num_params: int, merge_ctas: int) -> dict[str, tuple]:
    """Each kernel's launch as run() hands it to cuLaunchKernel: function, grid, block, shared
    memory and its arguments, packed once (run() rewrites pointers and params). In launch
    order: the cascade kernel first, the merge kernel last (it reads the others' partial
    states)."""
    grids = {"cascade": kernels.num_prefill_ctas, "decode": kernels.num_ctas,
             "prefill": kernels.num_prefill_ctas, "merge": merge_ctas}
    launches = {}
    for kind in ("cascade", "decode", "prefill", "merge"):
        if kind not in kernels.functions:
            continue
        cfg = kernels.configs[kind]
        packed = PackedArgs(kind, workspace, num_heads=shape.num_qo_heads,
                            num_kv_heads=shape.num_kv_heads, page_size=shape.page_size,
                            num_params=num_params)
        launches[kind] = (kernels.functions[kind].ptr, int(grids[kind]), 1, 1,
                          *_block3(cfg.block), int(cfg.smem_bytes), packed)
    return launches


def num_sms(device: int) -> int:
    import cupy

    return int(cupy.cuda.runtime.getDeviceProperties(device)["multiProcessorCount"])


def _default_num_ctas(device: int, fn, cfg: LaunchConfig) -> int:
    import cupy
    from cupy_backends.cuda.api import driver

    with cupy.cuda.Device(device):
        per_sm = driver.occupancyMaxActiveBlocksPerMultiprocessor(
            fn.ptr, int(math.prod(_block3(cfg.block))), int(cfg.smem_bytes))
    return num_sms(device) * max(1, min(int(per_sm), MAX_CTAS_PER_SM))


def _block3(block) -> tuple[int, int, int]:
    b = tuple(int(x) for x in block) if isinstance(block, (tuple, list)) else (int(block),)
    return (b + (1, 1))[:3]
