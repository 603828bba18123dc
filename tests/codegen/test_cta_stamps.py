"""benchmarks/cta_stamps.py patches a copy of the kernel templates with per-CTA timestamps:
its anchors must still be in the templates, and the stamped kernels must compile."""

import importlib.util
import sys
from pathlib import Path

import pytest

from attnlang import ir, paths
from attnlang.codegen import render as render_mod
from attnlang.codegen.lower import lower
from attnlang.codegen.render import render
from attnlang.runtime.compiler import compile_source
from tests.codegen.test_render import _toolchain_problem, by_id, load

_BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
_PROBLEM = _toolchain_problem()


@pytest.fixture(scope="module")
def cta_stamps():
    sys.path.insert(0, str(_BENCHMARKS))  # the script imports its sibling `common`
    try:
        spec = importlib.util.spec_from_file_location("cta_stamps", _BENCHMARKS / "cta_stamps.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        yield module
    finally:
        sys.path.remove(str(_BENCHMARKS))


@pytest.fixture
def stamped_templates(cta_stamps, tmp_path, monkeypatch):
    dst = tmp_path / "kernels_templates"
    cta_stamps.patch_templates(paths.templates_dir(), dst)
    monkeypatch.setattr(paths, "templates_dir", lambda: dst)
    render_mod.environment.cache_clear()
    yield dst
    render_mod.environment.cache_clear()  # after monkeypatch restores the real directory


def test_every_patched_template_changed(cta_stamps, stamped_templates, monkeypatch):
    monkeypatch.undo()  # the real directory again
    for name in cta_stamps.PATCHES:
        assert (stamped_templates / name).read_text() != (paths.templates_dir() / name).read_text()


def test_a_missing_anchor_is_named(cta_stamps, tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    for name in cta_stamps.PATCHES:
        (src / name).write_text("// no anchors here\n")
    with pytest.raises(ValueError, match="decode_mma.cu.j2 holds 0 copies"):
        cta_stamps.patch_templates(src, tmp_path / "dst")


@pytest.mark.skipif(_PROBLEM is not None, reason=f"needs NVRTC: {(_PROBLEM or '')[:200]}")
@pytest.mark.parametrize("kind, kv_dtype", [("decode", "float8_e4m3fn"), ("prefill", None)])
def test_stamped_kernels_compile(cta_stamps, stamped_templates, kind, kv_dtype):
    variant = load(by_id("causal"))
    hooks = lower(ir.with_kv_scales(variant) if kv_dtype else variant)
    src = render(hooks, kind, "bfloat16", 128, "sm_90a", kv_dtype=kv_dtype)
    assert f"{cta_stamps.STAMPS}[blockIdx.x][1]" in src
    cubin = compile_source(src, "sm_90a", name=f"stamped_{kind}.cu")
    assert any(f.name == kind for f in cubin.functions)
