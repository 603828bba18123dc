"""The one list of variants that drives the parser, codegen, reference and GPU tests:
every example of the zoo plus the test-only variants that cover the rest of the language."""

from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
VARIANT_FILES = sorted(ROOT.glob("examples/*.attn")) + sorted(ROOT.glob("tests/variants/*.attn"))
VARIANT_IDS = [p.stem for p in VARIANT_FILES]
