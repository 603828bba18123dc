"""The command line: check, show, compile (table, cache, -o), cache dir/list/clear."""

import json
import os
import subprocess
import sys

import pytest
from click.testing import CliRunner

from attnlang.cli import main
from tests.variant_files import ROOT

SOFTCAP = str(ROOT / "examples" / "softcap.attn")
BROKEN = str(ROOT / "tests" / "grammar" / "errors" / "names.attn")


@pytest.fixture
def cli(tmp_path, monkeypatch):
    monkeypatch.setenv("ATTNLANG_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("ATTNLANG_QUIET", "1")
    from attnlang.runtime.compiler import clear_memory_cache

    clear_memory_cache()
    runner = CliRunner()
    return lambda *args: runner.invoke(main, list(args))


def test_check_ok(cli):
    r = cli("check", SOFTCAP)
    assert r.exit_code == 0, r.output
    assert "ok: variant softcap" in r.output and "cap: float = 30.0" in r.output


def test_check_broken_exits_2_with_positions(cli):
    r = cli("check", BROKEN)
    assert r.exit_code == 2
    assert "names.attn:5:30: error: unknown name 'cpa'" in r.output
    assert "hint: did you mean 'cap'?" in r.output and "Traceback" not in r.output


def test_check_missing_file(cli):
    r = cli("check", "no/such/file.attn")
    assert r.exit_code != 0 and "no/such/file.attn" in r.output


def test_show_prints_the_kernel(cli):
    r = cli("show", SOFTCAP, "--kernel", "decode", "--dtype", "fp16", "--head-dim", "64")
    assert r.exit_code == 0, r.output
    assert 'extern "C" __global__' in r.output and "softcap" in r.output
    assert cli("show", SOFTCAP, "--kernel", "nope").exit_code == 2


def test_show_an_fp8_cache_kernel(cli):
    r = cli("show", SOFTCAP, "--kernel", "prefill", "--kv-dtype", "fp8", "--arch", "sm_90a")
    assert r.exit_code == 0, r.output
    assert "const unsigned char* __restrict__ k_cache" in r.output
    assert "const float* param_k_scale" in r.output and "const float* param_v_scale" in r.output
    assert cli("show", SOFTCAP, "--kv-dtype", "int4").exit_code == 2


def test_compile_an_fp8_cache_module(cli, tmp_path):
    pytest.importorskip("cupy")
    r = _run_cli("compile", SOFTCAP, "--arch", "sm_90a", "--kv-dtype", "fp8", "-o",
                 str(tmp_path / "m"), cache=tmp_path / "cache")
    assert r.returncode == 0, r.stderr
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith(("decode", "prefill", "merge"))]
    assert len(lines) == 3 and all("bfloat16, fp8 KV" in ln for ln in lines)
    manifest = json.loads((tmp_path / "m" / "manifest.json").read_text())
    assert manifest["kv_dtype"] == "float8_e4m3fn"
    assert [p["name"] for p in manifest["variant"]["params"]] == ["cap", "k_scale", "v_scale"]


def test_compile_a_cascade_module(cli, tmp_path):
    pytest.importorskip("cupy")
    r = _run_cli("compile", SOFTCAP, "--arch", "sm_90a", "--cascade", "-o", str(tmp_path / "m"),
                 cache=tmp_path / "cache")
    assert r.returncode == 0, r.stderr
    kinds = [ln.split()[0] for ln in r.stdout.splitlines()
             if ln.startswith(("decode", "prefill", "merge", "cascade"))]
    assert kinds == ["decode", "prefill", "merge", "cascade"]
    manifest = json.loads((tmp_path / "m" / "manifest.json").read_text())
    assert manifest["kinds"] == ["decode", "prefill", "merge", "cascade"]
    from attnlang import load_compiled

    assert "cascade" in load_compiled(tmp_path / "m").kinds


def _run_cli(*args, cache):
    """The CLI in a fresh process, as a user runs it (each run has its own memory cache)."""
    env = dict(os.environ, ATTNLANG_CACHE_DIR=str(cache), ATTNLANG_QUIET="1")
    return subprocess.run([sys.executable, "-m", "attnlang.cli", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)


def test_compile_table_then_cache_hit_and_module(cli, tmp_path):
    pytest.importorskip("cupy")
    cache = tmp_path / "cache"
    first = _run_cli("compile", SOFTCAP, "--arch", "sm_90a", cache=cache)
    assert first.returncode == 0, first.stderr
    kinds = ("decode", "prefill", "merge")
    lines = [ln for ln in first.stdout.splitlines() if ln.startswith(kinds)]
    assert len(lines) == 3 and all(" miss " in ln for ln in lines)
    assert all(" 0/0 " in ln for ln in lines)  # no spills
    out = tmp_path / "module"
    second = _run_cli("compile", SOFTCAP, "--arch", "sm_90a", "-o", str(out), cache=cache)
    assert second.returncode == 0, second.stderr
    lines = [ln for ln in second.stdout.splitlines() if ln.startswith(kinds)]
    assert len(lines) == 3 and all(" disk " in ln for ln in lines)  # served from the cache
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["variant"]["name"] == "softcap"
    assert {p.name for p in out.glob("*.cubin")} == {"decode.cubin", "prefill.cubin", "merge.cubin"}
    listing = cli("cache", "list")
    assert "softcap/decode" in listing.output
    assert cli("cache", "dir").output.strip().endswith("cache")
    assert "removed" in cli("cache", "clear").output
    assert "(cache is empty)" in cli("cache", "list").output


def test_compile_reports_variant_errors_with_status_2(cli):
    assert cli("compile", BROKEN, "--arch", "sm_90a").exit_code == 2
