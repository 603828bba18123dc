"""The kernels one BatchAttention launches: their launch configs, the loaded functions, the
grids, and each launch as run() hands it to the driver (`Launch`, `launch`).

`load_kernels` runs once a BatchAttention has its compiled module; `pack_launches` once its
workspace exists. Both need a GPU (they load cubins and ask the driver for occupancy); what
they are built from (`config.launch_config`, `workspace.PackedArgs`) is tested without one.
"""

from __future__ import annotations

import ctypes
import functools
import math
import re
from dataclasses import dataclass
from typing import Any, NamedTuple

from attnlang import env
from attnlang.codegen.config import DECODE_MMA_ROWS, LaunchConfig, fine_tiles, launch_config
from attnlang.runtime import hostpath, planner
from attnlang.runtime.dequantize import Dequantizer
from attnlang.runtime.module import KernelModule
from attnlang.runtime.plan_mixed import Tiling
from attnlang.runtime.validate import AttentionShape
from attnlang.runtime.workspace import DEQUANTIZE, PREFILL_DEQUANTIZED, PackedArgs

__all__ = ["Kernels", "Launch", "launch", "load_kernels", "merge_grid", "pack_launches",
           "dependent_launch", "graph_kernels"]

# CTAs per SM when num_ctas is not given: the kernel's occupancy, capped. Beyond a few CTAs
# per SM, more CTAs only shrink the KV chunks (more partial states to merge) without adding
# memory parallelism the warps of each CTA do not already provide.
MAX_CTAS_PER_SM = 4
# The merge kernel loops over rows, so a grid of a few CTAs per SM covers any count.
_MERGE_CTAS_PER_SM = 8


class Launch(NamedTuple):
    """One kernel launch of run(): the function, grid, block, dynamic shared memory, the
    packed arguments (run() rewrites their pointers and params per call) and whether it is a
    programmatic dependent launch (`dependent_launch`; then `ex_config` is cuLaunchKernelEx's
    config for it but the stream, which each launch copies)."""

    fn: int
    grid: tuple[int, int, int]
    block: tuple[int, int, int]
    smem: int
    args: PackedArgs
    dependent: bool = False
    ex_config: _LaunchConfig | None = None


@dataclass(frozen=True)
class Kernels:
    """A module's kernels on one device: configs and functions by kind ("decode", "prefill",
    "merge", and "cascade" when built, which has the prefill kernel's config), the two
    attention grids, and the rows above which a request runs in the prefill kernel."""

    device: int
    arch: str
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
    return Kernels(device, module.arch, configs, functions, int(num_ctas),
                   int(num_prefill_ctas), int(prefill_min_rows))


def merge_grid(kernels: Kernels, max_merge_rows: int) -> int:
    """The merge kernel's fixed grid: enough CTAs for max_merge_rows, a few per SM at most."""
    ctas = -(-max_merge_rows // max(1, kernels.configs["merge"].rows_per_tile))
    return max(1, min(ctas, _MERGE_CTAS_PER_SM * num_sms(kernels.device)))


def graph_kernels(group_size: int, prefill_min_rows: int, max_qo_len: int, *,
                  cascade: bool, dequantize: bool = False) -> dict[str, bool]:
    """The kernels a CUDA graph of run() must hold, by kind: those some plan within the
    bounds can reach. A request of qo_len queries has qo_len * group_size fused rows (from
    group_size up to max_qo_len * group_size); more than prefill_min_rows go to the prefill
    kernel. (A captured launch whose kernel has no work still runs its grid: an empty prefill
    launch cost an fp8 decode step 2.5-7%.) dequantize: an fp8 cache's prefill may run
    through a converted copy (runtime/dequantize.py), whose two kernels then go where the
    prefill kernel goes.

    >>> graph_kernels(4, 8, 1, cascade=False)  # GQA 4 decode steps, an fp8 cache
    {'cascade': False, 'decode': True, 'prefill': False, 'merge': True, 'dequantize': False, \
'prefill_dequantized': False}
    """
    prefill = max_qo_len * group_size > prefill_min_rows
    return {"cascade": cascade,
            "decode": group_size <= prefill_min_rows,
            "prefill": prefill,
            "merge": True,
            DEQUANTIZE: prefill and dequantize,
            PREFILL_DEQUANTIZED: prefill and dequantize}


def dependent_launch(arch: str) -> bool:
    """Are the kernels of a module built for `arch` launched as programmatic dependents of the
    kernel before each in the stream? On sm_90+ (where their `griddepcontrol.wait` is
    compiled in: machine.cuh's dependent launch), unless ATTNLANG_DEPENDENT_LAUNCH is off.
    ``dependent_launch("sm_90a")`` -> True, ``dependent_launch("sm_80")`` -> False."""
    m = re.fullmatch(r"sm_(\d+)[af]?", arch)
    return m is not None and int(m.group(1)) >= 90 and env.dependent_launch()


def pack_launches(kernels: Kernels, workspace: dict[str, int], shape: AttentionShape,
                  num_params: int, merge_ctas: int,
                  dequantizer: Dequantizer | None = None) -> dict[str, Launch]:
    """Each kernel's `Launch`, its arguments packed once (run() rewrites pointers and
    params). In launch order: the cascade kernel first, the merge kernel last (it reads the
    others' partial states); with a `dequantizer` (an fp8 cache's converted copy), its
    conversion and the prefill kernel over the copy after the fp8 prefill kernel. Dependent
    launches where `dependent_launch` says so."""
    entries = [(kind, kernels.functions[kind].ptr,
                kernels.num_ctas if kind == "decode" else kernels.num_prefill_ctas,
                kernels.configs[kind])
               for kind in ("cascade", "decode", "prefill") if kind in kernels.functions]
    if dequantizer is not None:
        entries += [(DEQUANTIZE, dequantizer.convert.ptr, dequantizer.convert_ctas,
                     LaunchConfig((dequantizer.THREADS, 1, 1), 0, 0, 0)),
                    (PREFILL_DEQUANTIZED, dequantizer.prefill.ptr, kernels.num_prefill_ctas,
                     kernels.configs["prefill"])]
        workspace = {**workspace, **dequantizer.pointers}
    entries.append(("merge", kernels.functions["merge"].ptr, merge_ctas,
                    kernels.configs["merge"]))
    dependent = dependent_launch(kernels.arch)
    launches = {}
    for kind, fn, ctas, cfg in entries:
        packed = PackedArgs(kind, workspace, num_heads=shape.num_qo_heads,
                            num_kv_heads=shape.num_kv_heads, page_size=shape.page_size,
                            num_params=num_params)
        grid, block, smem = (int(ctas), 1, 1), _block3(cfg.block), int(cfg.smem_bytes)
        launches[kind] = Launch(fn, grid, block, smem, packed, dependent,
                                _dependent_config(grid, block, smem) if dependent else None)
    return launches


def launch(driver, one: Launch, stream: int) -> None:
    """Enqueue `one` on `stream` (cuLaunchKernel through CuPy's `driver`, or
    cuLaunchKernelEx with programmatic stream serialization for a dependent launch)."""
    if not one.dependent:
        driver.launchKernel(one.fn, *one.grid, *one.block, one.smem, stream,
                            one.args.kernel_params, 0)
        return
    # A copy per launch: the foreign call releases the GIL, so another thread's run() must
    # not rewrite the stream of a config the driver is reading.
    config = _LaunchConfig.from_buffer_copy(one.ex_config)
    config.stream = stream
    status = _launch_kernel_ex()(ctypes.byref(config), one.fn, one.args.kernel_params, None)
    if status != 0:
        name = ctypes.c_char_p()
        hostpath.libcuda().cuGetErrorName(status, ctypes.byref(name))
        raise RuntimeError(f"cuLaunchKernelEx failed: "
                           f"{(name.value or b'error').decode()} ({status})")


# cuLaunchKernelEx's config with one attribute, as cuda.h lays it out (hostpath.c's too).
_PROGRAMMATIC_STREAM_SERIALIZATION = 6  # CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION


class _AttributeValue(ctypes.Union):
    _fields_ = [("bytes", ctypes.c_char * 64), ("flag", ctypes.c_int), ("align", ctypes.c_void_p)]


class _LaunchAttribute(ctypes.Structure):
    _fields_ = [("id", ctypes.c_int), ("pad", ctypes.c_char * 4), ("value", _AttributeValue)]


class _LaunchConfig(ctypes.Structure):
    _fields_ = [("grid_x", ctypes.c_uint), ("grid_y", ctypes.c_uint), ("grid_z", ctypes.c_uint),
                ("block_x", ctypes.c_uint), ("block_y", ctypes.c_uint),
                ("block_z", ctypes.c_uint), ("smem", ctypes.c_uint),
                ("stream", ctypes.c_void_p), ("attrs", ctypes.POINTER(_LaunchAttribute)),
                ("num_attrs", ctypes.c_uint)]


def _dependent_config(grid, block, smem: int) -> _LaunchConfig:
    """cuLaunchKernelEx's config of a dependent launch, stream 0; its attribute is kept
    alive by the config (ctypes holds what a pointer field points to)."""
    attribute = _LaunchAttribute(_PROGRAMMATIC_STREAM_SERIALIZATION)
    attribute.value.flag = 1
    return _LaunchConfig(*grid, *block, smem, None, ctypes.pointer(attribute), 1)


@functools.cache
def _launch_kernel_ex():
    fn = hostpath.libcuda().cuLaunchKernelEx
    fn.restype = ctypes.c_int
    fn.argtypes = [ctypes.POINTER(_LaunchConfig), ctypes.c_void_p, ctypes.c_void_p,
                   ctypes.c_void_p]
    return fn


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
