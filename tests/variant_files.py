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
