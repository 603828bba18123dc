"""Compiled kernels of one variant: compile, save, load from disk, load onto a GPU.

A `KernelModule` holds the cubins of one variant at one (dtype, head_dim, arch), one per
kernel kind ("decode", "prefill", "merge"; each a compiler `Cubin` with its ptxas report),
with what the runtime needs to call them: the variant's name, its run-time params
(ParamSpec, declaration order = kernel argument order) and its softmax flag. It is
produced by `compile_variant` (render + NVRTC; no GPU needed) or by `load_compiled` (a
directory written by `KernelModule.save`; needs neither NVRTC nor the .attn source).
`KernelModule.function` loads a cubin onto a device on first use.

Directory format (``manifest.json`` + one ``<kind>.cubin`` per kind)::

    {"format": 1, "attnlang_version": "0.1.0", "nvrtc_version": "12.9",
     "variant": {"name": "softcap", "softmax": true,
                 "params": [{"name": "cap", "type": "float", "extents": [], "default": 30.0}]},
     "dtype": "bfloat16", "head_dim": 128, "arch": "sm_90a",
     "kinds": ["decode", "prefill", "merge"],
     "cubins": {"decode": {"file": "decode.cubin", "entry": "decode", "sha256": "...",
                           "bytes": 123456, "functions": [{"name": "decode", "registers":
                           96, ...}], "compile_seconds": 1.2}, ...}}
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import threading
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from attnlang import ir
from attnlang.codegen import config
from attnlang.codegen.config import HEAD_DIM_PAIRS, HEAD_DIMS, KV_FP8, check_head_dims
from attnlang.runtime.arrays import normalize_dtype, normalize_kv_dtype
from attnlang.runtime.compiler import Cubin, FunctionInfo

__all__ = [
    "KINDS", "ALL_KINDS", "KERNEL_KINDS", "HEAD_DIMS", "MANIFEST_FORMAT", "KernelModule",
    "ModuleLoadError", "compile_variant", "load_compiled", "arch_runs_on", "device_arch",
    "check_head_dim", "check_module_fits", "module_for",
]

# The kernels a module holds by default; ALL_KINDS adds the cascade kernel (shared-prefix
# levels), compiled where a BatchAttention plans cascades (or `attnlang compile --cascade`).
KINDS = ("decode", "prefill", "merge")
ALL_KINDS = config.KINDS
KERNEL_KINDS = ALL_KINDS  # the name the CLI uses
MANIFEST_FORMAT = 1
_SHORT_DTYPE = {"float16": "fp16", "bfloat16": "bf16"}
# Dynamic shared memory above this needs an explicit opt-in per function.
_DEFAULT_DYNAMIC_SMEM = 48 * 1024


class ModuleLoadError(ValueError):
    """A compiled-module directory that cannot be used (missing, corrupt, incompatible)."""


@dataclass(frozen=True, eq=False)
class KernelModule:
    """The compiled kernels of one variant at one (dtype, head_dim, arch).

    Attributes: name (the variant's), params (its ParamSpecs, declaration order), softmax,
    dtype ("float16" | "bfloat16"), head_dim, head_dim_vo (of values and outputs: head_dim
    but for MLA's 192/128), arch ("sm_90a"), cubins (kind -> compiler
    `Cubin`: data, functions (ptxas report), compile_seconds, cache ("memory" | "disk" |
    "miss", or "loaded" for a module read by load_compiled), path), entries (kind -> extern
    "C" entry name), variant (the ir.Variant, None for a loaded module), param_dims (tensor
    param name -> the length of its `dim` axis: head_dim, or head_dim_vo for a table the value
    and output stages read), kv_dtype (the K/V cache's element type: dtype, or
    "float8_e4m3fn", whose kernels take the scales k_scale and v_scale as the last params),
    decode_mma (its decode kernel is the tensor-core one, `config.decode_mma`: launches
    differ).

    Example::

        km = compile_variant(al.load("examples/softcap.attn"), head_dim=128,
                             dtype="bfloat16", arch="sm_90a")     # no GPU needed
        km.save("out/softcap")
        km = load_compiled("out/softcap")                         # no NVRTC needed
        fn = km.function("decode")                                # loads onto the GPU
    """

    name: str
    params: tuple[ir.ParamSpec, ...]
    softmax: bool
    dtype: str
    head_dim: int
    arch: str
    cubins: Mapping[str, Cubin] = field(repr=False)
    entries: Mapping[str, str]
    variant: ir.Variant | None = field(default=None, repr=False)
    nvrtc_version: str = "unknown"
    head_dim_vo: int = 0  # 0: head_dim (set in __post_init__)
    param_dims: Mapping[str, int] = field(default_factory=dict, repr=False)
    kv_dtype: str = ""  # "": dtype (set in __post_init__)
    decode_mma: bool = False
    # device ordinal -> kind -> (cupy.cuda.Module, Function, dynamic smem opted into)
    _loaded: dict = field(default_factory=dict, init=False, repr=False)
    _lock: Any = field(default_factory=threading.Lock, init=False, repr=False)

    def __post_init__(self):
        if not self.head_dim_vo:
            object.__setattr__(self, "head_dim_vo", self.head_dim)
        if not self.kv_dtype:
            object.__setattr__(self, "kv_dtype", self.dtype)

    @property
    def kinds(self) -> tuple[str, ...]:
        return tuple(self.cubins)

    def label(self, kind: str) -> str:
        """Human name of one kernel, e.g. "softcap/decode bf16 d128 sm_90a" (with "fp8 KV"
        after the dtype for an fp8 cache)."""
        return (f"{self.name}/{kind} {_dtype_label(self.dtype, self.kv_dtype)} "
                f"{_dims_label(self.head_dim, self.head_dim_vo)} {self.arch}")

    def save(self, directory: str | os.PathLike) -> Path:
        """Write one ``<kind>.cubin`` per kind plus ``manifest.json`` into `directory`
        (created if needed; files replaced atomically). Returns the directory."""
        out = Path(directory)
        out.mkdir(parents=True, exist_ok=True)
        cubins = {}
        for kind, cubin in self.cubins.items():
            _atomic_write(out / f"{kind}.cubin", cubin.data)
            cubins[kind] = {
                "file": f"{kind}.cubin", "entry": self.entries[kind],
                "sha256": hashlib.sha256(cubin.data).hexdigest(), "bytes": len(cubin.data),
                "functions": [asdict(f) for f in cubin.functions],
                "compile_seconds": cubin.compile_seconds,
            }
        manifest = {
            "format": MANIFEST_FORMAT,
            "attnlang_version": _attnlang_version(),
            "nvrtc_version": self.nvrtc_version,
            "variant": {
                "name": self.name,
                "softmax": self.softmax,
                "params": [_param_to_json(p) for p in self.params],
            },
            "dtype": self.dtype,
            "kv_dtype": self.kv_dtype,
            "decode_mma": self.decode_mma,
            "head_dim": self.head_dim,
            "head_dim_vo": self.head_dim_vo,
            "param_dims": dict(self.param_dims),
            "arch": self.arch,
            "kinds": list(self.cubins),
            "cubins": cubins,
        }
        _atomic_write(out / "manifest.json",
                      (json.dumps(manifest, indent=2, sort_keys=True) + "\n").encode())
        return out

    def function(self, kind: str, device: int | None = None, *, dynamic_smem: int = 0):
        """The `kind` kernel loaded on `device` (default: CuPy's current device), as a
        cupy.cuda.Function. Loads the cubin once per device; opts the function into
        `dynamic_smem` bytes of dynamic shared memory when that exceeds 48 KB.

        Raises ValueError when the cubin's arch cannot run on the device.
        """
        import cupy
        from cupy_backends.cuda.api import driver

        if kind not in self.cubins:
            raise KeyError(f"{self.name} has no {kind!r} kernel; it has {', '.join(self.kinds)}")
        dev = cupy.cuda.Device(device).id if device is None else int(device)
        with self._lock:
            per_device = self._loaded.setdefault(dev, {})
            if kind not in per_device:
                cc = device_arch(dev)
                if not arch_runs_on(self.arch, cc):
                    raise ValueError(
                        f"{self.label(kind)} was compiled for {self.arch}, which cannot run on "
                        f"device {dev} (compute capability {cc[3:]}); compile it with "
                        f"arch='{'sm_90a' if cc == 'sm_90' else cc}'"
                    )
                with cupy.cuda.Device(dev):
                    cupy.cuda.runtime.free(0)  # make the device's context current for the driver
                    module = cupy.cuda.Module()
                    module.load(bytes(self.cubins[kind].data))
                    fn = module.get_function(self.entries[kind])
                per_device[kind] = [module, fn, _DEFAULT_DYNAMIC_SMEM]
            entry = per_device[kind]
            if dynamic_smem > entry[2]:
                with cupy.cuda.Device(dev):
                    driver.funcSetAttribute(
                        entry[1].ptr, driver.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                        int(dynamic_smem))
                entry[2] = int(dynamic_smem)
            return entry[1]


# In-process cache of compiled modules, so BatchAttentions of one variant share the loaded
# CUDA modules (the compiler caches the cubins themselves, in memory and on disk).
_MODULES: dict[tuple, KernelModule] = {}
_MODULES_LOCK = threading.Lock()


def compile_variant(variant: ir.Variant, *, head_dim: int, dtype: Any = "bfloat16",
                    arch: str | None = None, kinds: tuple[str, ...] = KINDS,
                    head_dim_vo: int | None = None, kv_dtype: Any = None) -> KernelModule:
    """Render and compile `variant`'s kernels (one per kind) for (dtype, head_dim, arch).

    Needs NVRTC and the CUDA headers, not a GPU. arch None: ``ATTNLANG_ARCH``, else the
    current GPU's. Cached in memory (per process) and on disk (by the compiler).
    head_dim_vo: the values' and outputs' head dim, None for head_dim (MLA: head_dim=192,
    head_dim_vo=128; `config.HEAD_DIM_PAIRS`). kv_dtype: the K/V cache's element type, None
    for dtype, or "float8_e4m3fn" (alias "fp8"): the module's params then end with the
    cache's scales k_scale and v_scale, float[kv_heads] (`ir.with_kv_scales`).

    Example: ``compile_variant(v, head_dim=128, dtype="bf16", arch="sm_90a").kinds``
    -> ``("decode", "prefill", "merge")``.
    """
    from attnlang.pipeline import generate_source
    from attnlang.runtime.compiler import compile_source, resolve_arch, toolchain

    if not isinstance(variant, ir.Variant):
        raise TypeError(f"variant must be an attnlang Variant (attnlang.load(...)), got "
                        f"{type(variant).__name__}")
    head_dim, head_dim_vo = check_head_dims(head_dim, head_dim_vo)
    # The dim axes' lengths; raises for a table both head dims would read.
    param_dims = {name: sizes["dim"] for name, sizes in
                  ir.extent_sizes(variant, 1, 1, 1, head_dim, head_dim_vo).items()}
    dtype = normalize_dtype(dtype)
    kv_dtype = normalize_kv_dtype(kv_dtype, dtype)
    if kv_dtype == KV_FP8:
        variant = ir.with_kv_scales(variant)
    kinds = tuple(kinds)
    unknown = [k for k in kinds if k not in ALL_KINDS]
    if unknown or not kinds:
        raise ValueError(f"kinds must be a non-empty subset of {ALL_KINDS}, got {kinds}")
    arch = resolve_arch(arch)
    key = (variant, head_dim, head_dim_vo, dtype, kv_dtype, arch, kinds)
    with _MODULES_LOCK:
        hit = _MODULES.get(key)
    if hit is not None:
        return hit
    short = _dtype_label(dtype, kv_dtype)
    dims = _dims_label(head_dim, head_dim_vo)
    labels = {kind: f"{variant.name}/{kind} {short} {dims}" for kind in kinds}
    sources = {kind: generate_source(variant, kind, dtype, head_dim, arch, head_dim_vo,
                                     kv_dtype) for kind in kinds}
    # The kinds compile concurrently: NVRTC runs without the GIL, and separate programs may
    # compile at once, so a cold compile takes about as long as its slowest kernel.
    with ThreadPoolExecutor(max_workers=len(kinds)) as pool:
        futures = {kind: pool.submit(compile_source, sources[kind], arch,
                                     name=f"{variant.name}_{kind}.cu", label=labels[kind])
                   for kind in kinds}
        cubins = {kind: futures[kind].result() for kind in kinds}
    for kind in ("prefill", "cascade"):
        if kind in cubins:
            cubins[kind] = without_spilling_tma_tiles(
                cubins[kind], sources[kind], kind, head_dim=head_dim, head_dim_vo=head_dim_vo,
                dtype=dtype, arch=arch, name=f"{variant.name}_{kind}.cu", label=labels[kind])
    entries = {kind: _entry_name(kind, [f.name for f in cubins[kind].functions], labels[kind])
               for kind in kinds}
    major, minor = toolchain().nvrtc  # no CuPy import when every kernel was cached
    from attnlang.codegen.lower import lower
    from attnlang.codegen.render import decode_mma

    module = KernelModule(
        name=variant.name, params=tuple(variant.params), softmax=bool(variant.softmax),
        dtype=dtype, head_dim=head_dim, arch=arch, cubins=cubins, entries=entries,
        variant=variant, nvrtc_version=f"{major}.{minor}", head_dim_vo=head_dim_vo,
        param_dims=param_dims, kv_dtype=kv_dtype,
        decode_mma=decode_mma(lower(variant), head_dim, head_dim_vo, kv_dtype),  # as rendered
    )
    with _MODULES_LOCK:
        return _MODULES.setdefault(key, module)


# The prefill kernel's producer warpgroup holds 56 registers (40 where the logits have per-tile
# terms). Where its loop with TMA tiles (prefill_shape.cuh's kTmaTiles) spills more than this,
# the kernel is compiled again without them: every tile by cp.async, whose loop then has the
# registers alone.
PRODUCER_SPILL_BYTES = 64
NO_TMA_TILES = "#define ATTNLANG_NO_TMA_TILES 1\n"


def without_spilling_tma_tiles(cubin: Cubin, source: str, kind: str, *, head_dim: int,
                               head_dim_vo: int, dtype: str, arch: str, name: str,
                               label: str) -> Cubin:
    """`cubin`, the prefill (or cascade) kernel compiled from `source`; or, where that kernel
    has a producer warpgroup and spills past PRODUCER_SPILL_BYTES, `source` compiled again
    without TMA tiles."""
    from attnlang.runtime.compiler import compile_source

    if not config.template_shape(kind, head_dim, dtype, arch, head_dim_vo).producer_threads:
        return cubin
    info = next((f for f in cubin.functions if f.name == kind), None)
    if info is None or max(info.spill_stores, info.spill_loads) <= PRODUCER_SPILL_BYTES:
        return cubin
    return compile_source(NO_TMA_TILES + source, arch, name=name, label=f"{label} (cp.async tiles)")


def load_compiled(directory: str | os.PathLike, *, check_version: bool = True) -> KernelModule:
    """Load a directory written by `KernelModule.save`. Verifies the manifest and every
    cubin's sha256; needs no NVRTC and no .attn source (nor a GPU until `function`).

    check_version: refuse modules written by another attnlang version (the kernel argument
    order and launch shapes may differ between versions). Raises ModuleLoadError.
    """
    root = Path(directory)
    path = root / "manifest.json"
    try:
        manifest = json.loads(path.read_text())
    except FileNotFoundError:
        raise ModuleLoadError(
            f"{root} is not a compiled attnlang module: {path} is missing (write one with "
            "`attnlang compile FILE -o DIR` or KernelModule.save(DIR))"
        ) from None
    except (OSError, ValueError) as e:
        raise ModuleLoadError(f"cannot read {path}: {e}") from None
    try:
        if manifest.get("format") != MANIFEST_FORMAT:
            raise ModuleLoadError(
                f"{path} has manifest format {manifest.get('format')!r}; this attnlang reads "
                f"format {MANIFEST_FORMAT}: recompile the variant"
            )
        written_by = manifest["attnlang_version"]
        if check_version and written_by != _attnlang_version():
            raise ModuleLoadError(
                f"{root} was compiled by attnlang {written_by}, this is attnlang "
                f"{_attnlang_version()}: kernel arguments may differ between versions, so "
                "recompile it (or pass check_version=False at your own risk)"
            )
        cubins, entries = {}, {}
        for kind in manifest["kinds"]:
            meta = manifest["cubins"][kind]
            if kind not in ALL_KINDS or Path(meta["file"]).name != meta["file"]:
                raise ModuleLoadError(f"{path}: bad cubin entry {kind!r}: {meta!r}")
            file = root / meta["file"]
            try:
                data = file.read_bytes()
            except OSError as e:
                raise ModuleLoadError(f"{root}: cannot read the {kind} cubin: {e}") from None
            digest = hashlib.sha256(data).hexdigest()
            if digest != meta["sha256"]:
                raise ModuleLoadError(
                    f"{file} is corrupt: its sha256 is {digest}, the manifest says "
                    f"{meta['sha256']}; recompile the variant"
                )
            cubins[kind] = Cubin(
                data=data, arch=str(manifest["arch"]), key=digest, log="",
                functions=tuple(FunctionInfo(**f) for f in meta.get("functions", ())),
                compile_seconds=float(meta.get("compile_seconds", 0.0)), cache="loaded",
                path=file)
            entries[kind] = str(meta["entry"])
        variant = manifest["variant"]
        return KernelModule(
            name=str(variant["name"]),
            params=tuple(_param_from_json(p) for p in variant["params"]),
            softmax=bool(variant["softmax"]),
            dtype=normalize_dtype(manifest["dtype"]),
            head_dim=check_head_dim(manifest["head_dim"]),
            arch=str(manifest["arch"]),
            cubins=cubins, entries=entries,
            nvrtc_version=str(manifest.get("nvrtc_version", "unknown")),
            head_dim_vo=check_head_dims(manifest["head_dim"],
                                        manifest.get("head_dim_vo", manifest["head_dim"]))[1],
            param_dims={str(k): int(v) for k, v in manifest.get("param_dims", {}).items()},
            kv_dtype=normalize_kv_dtype(manifest.get("kv_dtype"),
                                        normalize_dtype(manifest["dtype"])),
            decode_mma=bool(manifest.get("decode_mma", False)),
        )
    except ModuleLoadError:
        raise
    except (KeyError, TypeError, ValueError) as e:
        raise ModuleLoadError(f"{path} is malformed ({type(e).__name__}: {e}); recompile the "
                              "variant") from None


def check_head_dim(head_dim: Any) -> int:
    """head_dim as an int if some kernel pair has it (64, 128, 192, 256), else ValueError."""
    dims = sorted({q for q, _ in HEAD_DIM_PAIRS})
    if isinstance(head_dim, bool) or not isinstance(head_dim, int) or head_dim not in dims:
        raise ValueError(f"head_dim must be one of {', '.join(map(str, dims))}, "
                         f"got {head_dim!r}")
    return int(head_dim)


def _dtype_label(dtype: str, kv_dtype: str) -> str:
    """"bf16", or "bf16 fp8 KV" for an fp8 cache."""
    return _SHORT_DTYPE[dtype] + (" fp8 KV" if kv_dtype == KV_FP8 else "")


def _dims_label(head_dim: int, head_dim_vo: int) -> str:
    """"d128", or "d192/128" when the values' head dim differs."""
    return f"d{head_dim}" if head_dim == head_dim_vo else f"d{head_dim}/{head_dim_vo}"


_ARCH_RE = re.compile(r"sm_(\d+)(\d)([af]?)")


def arch_runs_on(arch: str, device: str) -> bool:
    """Can a cubin for `arch` ("sm_80", "sm_90a") run on a device of arch `device` ("sm_89")?

    Plain cubins run on the same major version with an equal or newer minor; arch-specific
    ('a') ones only on exactly their compute capability; family ('f') ones on their major.
    """
    a, d = _ARCH_RE.fullmatch(arch), _ARCH_RE.fullmatch(device)
    if a is None or d is None:
        return False
    major, minor, suffix = int(a.group(1)), int(a.group(2)), a.group(3)
    dmajor, dminor = int(d.group(1)), int(d.group(2))
    if suffix == "a":
        return (major, minor) == (dmajor, dminor)
    return major == dmajor and minor <= dminor


def check_module_fits(variant_or_module: Any, shape: Any, cascade: bool) -> None:
    """What a BatchAttention of `shape` (validate.AttentionShape) can check without a GPU of
    the variant or compiled module it is given: its type, and a module's head dims, dtypes
    and kernels (the cascade kernel where cascade)."""
    if not isinstance(variant_or_module, (ir.Variant, KernelModule)):
        raise TypeError(
            "variant_or_module must be an attnlang Variant (attnlang.load(...)) or a "
            f"compiled KernelModule (attnlang.load_compiled(...)), got "
            f"{type(variant_or_module).__name__}"
        )
    if isinstance(variant_or_module, ir.Variant):
        return
    module = variant_or_module
    have = (module.head_dim, module.head_dim_vo, module.dtype, module.kv_dtype)
    if have != (shape.head_dim, shape.head_dim_vo, shape.dtype, shape.kv_dtype):
        raise ValueError(
            f"the compiled module {module.name} is {module.dtype} head_dim {module.head_dim}"
            f"/{module.head_dim_vo} (query-key/value), cache {module.kv_dtype}, but this "
            f"BatchAttention asks for {shape.dtype} head_dim {shape.head_dim}/"
            f"{shape.head_dim_vo}, cache {shape.kv_dtype}: compile the variant for those "
            "(attnlang.compile) or pass the Variant itself"
        )
    needed = ALL_KINDS if cascade else KINDS
    missing = [k for k in needed if k not in module.cubins]
    if missing:
        how = ("`attnlang compile FILE --cascade`, or kinds=ALL_KINDS" if "cascade" in missing
               else "the default kinds")
        raise ValueError(f"the compiled module {module.name} lacks the {', '.join(missing)} "
                         f"kernel(s) BatchAttention needs; compile it with {how}")


def module_for(variant_or_module: ir.Variant | KernelModule, shape: Any, *, arch: str | None,
               device: int, cascade: bool) -> KernelModule:
    """The module a BatchAttention of `shape` runs on `device`: a compiled one as given
    (`check_module_fits` first), else the variant compiled (or found in the cache) for arch;
    None: the device's, where Hopper gets its arch-specific sm_90a, unless ATTNLANG_ARCH
    names another. The cascade kernel is compiled too where cascade."""
    if isinstance(variant_or_module, KernelModule):
        return variant_or_module
    if arch is None:
        from attnlang import env

        native = device_arch(device)
        arch = env.arch() or ("sm_90a" if native == "sm_90" else native)
    return compile_variant(variant_or_module, head_dim=shape.head_dim, dtype=shape.dtype,
                           arch=arch, head_dim_vo=shape.head_dim_vo, kv_dtype=shape.kv_dtype,
                           kinds=ALL_KINDS if cascade else KINDS)


def device_arch(device: int) -> str:
    """"sm_<cc>" of a CUDA device, e.g. "sm_90"."""
    import cupy

    return f"sm_{cupy.cuda.Device(device).compute_capability}"


_TEMPLATE_MODULES: dict[tuple[str, int], Any] = {}  # (file, device) -> cupy Module
_TEMPLATE_LOCK = threading.Lock()


def template_module(filename: str, device: int):
    """A self-contained kernel file of kernels_templates/ (merge_states.cu, kv_scales.cu),
    compiled through the attnlang compiler (cached) for `device`'s plain sm_XY (they need
    nothing arch-specific) and loaded there as a cupy Module, once per process."""
    with _TEMPLATE_LOCK:
        module = _TEMPLATE_MODULES.get((filename, device))
        if module is None:
            import cupy

            from attnlang.paths import templates_dir
            from attnlang.runtime.compiler import compile_source

            arch = device_arch(device)
            cubin = compile_source((templates_dir() / filename).read_text(), arch,
                                   name=filename, label=f"{filename.removesuffix('.cu')} {arch}")
            with cupy.cuda.Device(device):
                cupy.cuda.runtime.free(0)  # make the device's context current for the driver
                module = cupy.cuda.Module()
                module.load(cubin.data)
            _TEMPLATE_MODULES[(filename, device)] = module
    return module


def _entry_name(kind: str, names: list[str], label: str) -> str:
    """The extern "C" entry of a kind's cubin: named after the kind (docs/INTERNALS.md)."""
    if kind in names or not names:
        return kind
    if len(names) == 1:
        return names[0]
    raise ValueError(f"{label}: the cubin has entries {names}, none named {kind!r}")


def _param_to_json(p: ir.ParamSpec) -> dict[str, Any]:
    return {"name": p.name, "type": p.type.value, "extents": list(p.extents),
            "default": p.default}


def _param_from_json(d: Mapping[str, Any]) -> ir.ParamSpec:
    t = ir.Type(d["type"])
    # Manifests before tables had one optional named "extent".
    extents = d["extents"] if "extents" in d else [d["extent"]] if d.get("extent") else []
    if not isinstance(extents, list) or any(
            not (e in ir.EXTENT_INDEX or (type(e) is int and e >= 1)) for e in extents):
        raise ValueError(f"bad param {d!r}")
    if t not in (ir.INT, ir.FLOAT) and not (t is ir.BOOL and extents):
        raise ValueError(f"bad param {d!r}")
    default = d.get("default")
    if default is not None:
        default = int(default) if t is ir.INT else float(default)
    return ir.ParamSpec(name=str(d["name"]), type=t, extents=tuple(extents), default=default)


def _attnlang_version() -> str:
    import attnlang

    return str(getattr(attnlang, "__version__", "unknown"))


def _atomic_write(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)
