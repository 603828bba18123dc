"""The one list of variants that drives the parser, codegen, reference and GPU tests:
every example of the zoo plus the test-only variants that cover the rest of the language."""

from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
VARIANT_FILES = sorted(ROOT.glob("examples/*.attn")) + sorted(ROOT.glob("tests/variants/*.attn"))
VARIANT_IDS = [p.stem for p in VARIANT_FILES]

# Examples that port published variants with tables, lets and the integer operators, and MLA
# (causal at its own head dims). The reference and GPU tests run each of them; the slow CPU
# checks (the emulated kernels, the spill checks of every kernel) run their constructs once,
# through tests/variants/tables.attn and the head-dim cases, to keep the suite within its
# minutes.
PORT_IDS = ("flamingo_xattn", "gelu_attention", "longformer", "mla", "natten_tiled", "sandwich",
            "swin_bias", "t5_bias")
CPU_HEAVY_FILES = [p for p in VARIANT_FILES if p.stem not in PORT_IDS]
CPU_HEAVY_IDS = [p.stem for p in CPU_HEAVY_FILES]

# A test-only variant kept out of the zoo (its emulated and GPU cases are enough): query and
# output hooks with row reductions (shuffles over a row's TX lanes), per-head params, logits
# and a mask, and no key or value hook, so a decode step of an fp8 cache takes the tensor-core
# kernel (decode_mma.cu.j2) through its q and output stages.
ROW_HOOKS = """variant row_hooks
param gate: float[heads]
query  = q * rsqrt(mean(q * q) + 1e-6) * (1.0 + 0.1 * (q_pos % 3))
output = o * sigmoid(gate[head]) + where(dim % 2 == 0, 0.0, 0.01 * max(o))
logits = 20.0 * tanh(logits / 20.0)
mask   = causal and (q_pos - kv_pos) % 5 != 2
"""
