"""Random variants (tests/random_variants.py) through BatchAttention on the GPU, against the
NumPy reference: programs nobody wrote by hand, each on a batch of decode steps and chunked
prompts together, so every kernel a plan reaches runs them.

Each seed picks its variant and its configuration: q dtype, head dim (MLA's 192 / 128 for a
quarter of the fp8 and cascade seeds), page size, GQA group, KV splitting, and the cache: the
q dtype's (decode, prefill and merge kernels), fp8 (the tensor-core decode kernel where the
variant allows it, the prefill kernel's fp8 paths) or a shared-prefix cascade (the cascade
kernel and every level merged). A failure prints the program, so it can be saved as a .attn
file and rerun. ATTNLANG_RANDOM_VARIANTS=N runs seeds 0..N-1 (default 48).

Tolerance: the output dtype's (LANGUAGE.md section 7), as the other GPU tests.
"""

from __future__ import annotations

import os

import numpy as np
import pytest

import attnlang
from tests.random_variants import random_variant
from tests.runtime.test_gpu_attention import AXES, Case, check_case, lengths_for
from tests.runtime.test_gpu_cascade import _shape, run_cascade
from tests.runtime.test_gpu_fp8 import run_fp8

pytestmark = pytest.mark.gpu

CACHES = ("native", "fp8", "native", "cascade")  # by seed
SEEDS = range(int(os.environ.get("ATTNLANG_RANDOM_VARIANTS", "48")))


def _config(seed: int) -> dict:
    rng = np.random.default_rng(90_000 + seed)
    cfg = dict(dtype=str(rng.choice(AXES["dtype"])), head_dim=int(rng.choice(AXES["head_dim"])),
               page_size=int(rng.choice(AXES["page_size"])), group=int(rng.choice(AXES["group"])),
               split=str(rng.choice(AXES["split"])), cache=CACHES[seed % len(CACHES)],
               head_dim_vo=None)
    if cfg["cache"] != "native" and rng.random() < 0.25:  # MLA's head dims (LANGUAGE.md 10)
        cfg.update(head_dim=192, head_dim_vo=128)
    return cfg


@pytest.mark.parametrize("seed", SEEDS, ids=[f"seed{s}-{_config(s)['cache']}" for s in SEEDS])
def test_random_variant_matches_reference(cp, error_log, seed):
    cfg = _config(seed)
    text = random_variant(seed, cascade=cfg["cache"] == "cascade")
    variant = attnlang.parse(text, f"random_{seed}.attn")
    dims = f"{cfg['head_dim']}/{cfg['head_dim_vo']}" if cfg["head_dim_vo"] else cfg["head_dim"]
    where = (f"random seed {seed} {cfg['cache']} {cfg['dtype']} d{dims} "
             f"p{cfg['page_size']} g{cfg['group']} {cfg['split']}")
    num_kv_heads = 2
    try:
        if cfg["cache"] == "native":
            case = Case(f"random{seed}", cfg["dtype"], cfg["head_dim"], cfg["page_size"],
                        cfg["group"], "mixed", cfg["split"], seed=seed)
            check_case(cp, case, error_log, variant=variant)
        elif cfg["cache"] == "fp8":
            qo, kv = lengths_for(np.random.default_rng(seed), "mixed")
            run_fp8(cp, variant, qo, kv, num_qo_heads=num_kv_heads * cfg["group"],
                    num_kv_heads=num_kv_heads, head_dim=cfg["head_dim"], dtype=cfg["dtype"],
                    page_size=cfg["page_size"], seed=seed, error_log=error_log, where=where,
                    kv_chunk_size=100 if cfg["split"] == "forced" else None,
                    head_dim_vo=cfg["head_dim_vo"])
        else:
            qo, kv, shared = _shape("mixed" if seed % 8 == 3 else "decode", cfg["page_size"])
            run_cascade(cp, variant, qo, kv, shared, num_qo_heads=num_kv_heads * cfg["group"],
                        num_kv_heads=num_kv_heads, head_dim=cfg["head_dim"],
                        dtype=cfg["dtype"], page_size=cfg["page_size"], seed=seed,
                        error_log=error_log, where=where, head_dim_vo=cfg["head_dim_vo"])
    except AssertionError as e:
        raise AssertionError(f"{where}: {e}\n--- the variant ---\n{text}") from e
