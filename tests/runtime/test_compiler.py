"""The compile pass and its cache: NVRTC on the CPU, no GPU needed.

Every test gets its own cache directory and starts with an empty in-process cache. Tests
that run NVRTC skip cleanly when CuPy's NVRTC or the CUDA headers are missing.
"""

from __future__ import annotations

import hashlib
import multiprocessing
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from attnlang import env
from attnlang.runtime import cache, compiler
from attnlang.runtime import toolchain as tc
from attnlang.runtime.compiler import CompileError, Cubin, compile_source


def _toolchain_problem() -> str | None:
    try:
        compiler.nvrtc_version()
        compiler.cuda_include_dirs()
    except Exception as e:  # ToolchainError, or a broken cupy install
        return str(e)
    return None


_PROBLEM = _toolchain_problem()
needs_nvrtc = pytest.mark.skipif(
    _PROBLEM is not None,
    reason=f"needs NVRTC and CUDA headers: {(_PROBLEM or '').splitlines()[:1]}",
)

# Small, but exercises what generated kernels use: both half types, static shared memory.
KERNEL = r"""
#include <cuda_fp16.h>
#include <cuda_bf16.h>

extern "C" __global__ void widen(const __nv_bfloat16* x, __half* y, int n) {
  __shared__ float tile[128];
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  tile[threadIdx.x] = i < n ? __bfloat162float(x[i]) : 0.0f;
  __syncthreads();
  if (i < n) y[i] = __float2half(tile[blockDim.x - 1 - threadIdx.x]);
}
"""


def reset_compiler_state() -> None:
    """Forget everything this process compiled, so the next compile starts cold."""
    cache.clear_memory_cache()
    tc._TOOLCHAINS.clear()


@pytest.fixture(autouse=True)
def fresh_cache(tmp_path, monkeypatch) -> Path:
    directory = tmp_path / "cache"
    monkeypatch.setenv("ATTNLANG_CACHE_DIR", str(directory))
    monkeypatch.setenv("ATTNLANG_QUIET", "1")
    for name in ("ATTNLANG_ARCH", "ATTNLANG_DUMP_DIR"):
        monkeypatch.delenv(name, raising=False)
    reset_compiler_state()
    yield directory
    reset_compiler_state()


def _timed(fn, *args, **kwargs):
    start = time.perf_counter()
    result = fn(*args, **kwargs)
    return result, time.perf_counter() - start


# ---------------------------------------------------------------------------- caching


@needs_nvrtc
def test_miss_then_memory_then_disk_hit(fresh_cache):
    cold, _ = _timed(compile_source, KERNEL, "sm_90a", label="widen")
    assert cold.cache == "miss" and cold.arch == "sm_90a"
    assert cold.path == fresh_cache / f"{cold.key}.cubin" and cold.path.is_file()
    assert cold.data[:4] == b"\x7fELF"  # a cubin is an ELF image

    warm, memory_s = _timed(compile_source, KERNEL, "sm_90a", label="widen")
    assert warm.cache == "memory" and warm.data == cold.data
    assert memory_s < 0.05

    reset_compiler_state()  # as a new process would be
    disk, disk_s = _timed(compile_source, KERNEL, "sm_90a", label="widen")
    assert disk.cache == "disk"
    assert (disk.data, disk.functions, disk.log) == (cold.data, cold.functions, cold.log)
    assert disk.compile_seconds == pytest.approx(cold.compile_seconds)
    assert disk_s < 0.2
    assert compile_source(KERNEL, "sm_90a").cache == "memory"


def test_key_ignores_line_directives():
    tagged = '#line 3 "softcap.attn"\n' + KERNEL.replace(
        "  int i", '  # line 12 "other/place.attn"\n  int i'
    )
    assert cache.cache_key(tagged, "sm_90a", (), "tc") == cache.cache_key(KERNEL, "sm_90a",
                                                                            (), "tc")
    # Unless line info is requested: then the positions end up in the cubin.
    assert (cache.cache_key(tagged, "sm_90a", ("-lineinfo",), "tc")
            != cache.cache_key(KERNEL, "sm_90a", ("-lineinfo",), "tc"))


def test_key_depends_on_arch_options_and_toolchain():
    base = cache.cache_key(KERNEL, "sm_90a", ("-DA=1", "-DB=2"), "tc")
    assert base == cache.cache_key(KERNEL, "sm_90a", ("-DB=2", "-DA=1"), "tc")  # sorted
    others = {
        cache.cache_key(KERNEL, "sm_80", ("-DA=1", "-DB=2"), "tc"),
        cache.cache_key(KERNEL, "sm_90a", ("-DA=1",), "tc"),
        cache.cache_key(KERNEL, "sm_90a", ("-DA=1", "-DB=3"), "tc"),
        cache.cache_key(KERNEL, "sm_90a", ("-DA=1", "-DB=2"), "tc2"),
        cache.cache_key(KERNEL + " ", "sm_90a", ("-DA=1", "-DB=2"), "tc"),
        # Field boundaries matter: moving text between fields must change the key.
        cache.cache_key(KERNEL, "sm_90", ("a-DA=1", "-DB=2"), "tc"),
    }
    assert base not in others and len(others) == 6


@needs_nvrtc
def test_fingerprint_names_versions_not_paths():
    fingerprint = compiler.toolchain_fingerprint()
    major, minor = compiler.nvrtc_version()
    assert f"nvrtc {major}.{minor}" in fingerprint and "format" in fingerprint
    assert "/" not in fingerprint and os.sep not in fingerprint


@needs_nvrtc
def test_line_directives_hit_the_same_entry():
    plain = compile_source(KERNEL, "sm_90a")
    tagged = compile_source('#line 1 "a.attn"\n' + KERNEL, "sm_90a", name="other.cu")
    assert tagged.cache == "memory" and tagged.key == plain.key


def _flip_payload(path: Path) -> None:
    blob = bytearray(path.read_bytes())
    blob[len(blob) // 2] ^= 0xFF
    path.write_bytes(bytes(blob))


def _flip_magic(path: Path) -> None:
    path.write_bytes(b"X" + path.read_bytes()[1:])


def _truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[:-100])


def _truncate_header(path: Path) -> None:
    path.write_bytes(path.read_bytes()[:20])


def _append(path: Path) -> None:
    path.write_bytes(path.read_bytes() + b"\0")


@needs_nvrtc
@pytest.mark.parametrize("damage", [_flip_payload, _flip_magic, _truncate, _truncate_header,
                                    _append])
def test_damaged_entry_is_rebuilt(damage):
    good = compile_source(KERNEL, "sm_90a")
    damage(good.path)
    reset_compiler_state()
    rebuilt = compile_source(KERNEL, "sm_90a")
    assert rebuilt.cache == "miss" and rebuilt.data == good.data
    reset_compiler_state()
    assert compile_source(KERNEL, "sm_90a").cache == "disk"  # the rebuilt entry verifies


def _compile_in_child(source, arch, barrier, results) -> None:
    compiler.toolchain_fingerprint()  # warm up imports so the two compiles overlap
    barrier.wait()
    cubin = compile_source(source, arch)
    results.put((cubin.cache, hashlib.sha256(cubin.data).hexdigest(), str(cubin.path)))


@needs_nvrtc
def test_two_processes_compile_once(fresh_cache):
    source = KERNEL + "\n// only this test compiles this source\n"
    ctx = multiprocessing.get_context("spawn")
    barrier, results = ctx.Barrier(2), ctx.Queue()
    children = [ctx.Process(target=_compile_in_child, args=(source, "sm_90a", barrier, results))
                for _ in range(2)]
    for child in children:
        child.start()
    outcomes = [results.get(timeout=60) for _ in children]
    for child in children:
        child.join(timeout=60)
        assert child.exitcode == 0
    caches, digests, paths = zip(*outcomes, strict=True)
    # One compiled; the other waited on the lock (or came later) and read the entry.
    assert sorted(caches) == ["disk", "miss"]
    assert len(set(digests)) == 1 and len(set(paths)) == 1
    assert [p.name for p in fresh_cache.glob("*.cubin")] == [Path(paths[0]).name]
    assert not list(fresh_cache.glob(".*.tmp"))


@needs_nvrtc
def test_a_cache_hit_imports_no_cupy(fresh_cache, monkeypatch):
    # The first compile finds the toolchain (CuPy's NVRTC, the CUDA headers) and remembers it
    # in the cache directory; a later process serves its hit without importing CuPy.
    source = KERNEL + "\n// the cache-hit test\n"
    assert compile_source(source, "sm_90a").cache == "miss"
    memo = fresh_cache / "toolchain" / "memo.json"
    assert memo.is_file()
    code = ("import sys; from attnlang.runtime.compiler import compile_source; "
            f"c = compile_source({source!r}, 'sm_90a'); print(c.cache, 'cupy' in sys.modules)")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env=os.environ.copy(), timeout=120)
    assert run.returncode == 0, run.stderr
    assert run.stdout.split() == ["disk", "False"]
    # Another installation probe (here a CUDA variable) finds the toolchain again; a corrupt
    # memo is ignored; clear_cache forgets it.
    chain = compiler.toolchain()
    memo.write_text("{not json")
    tc._TOOLCHAINS.clear()
    assert compiler.toolchain() == chain
    probe = tc._installation_probe()
    assert tc._read_memo(memo, probe) == chain
    monkeypatch.setenv("CUDA_HOME", os.environ.get("CUDA_HOME", "") + "/elsewhere")
    assert tc._read_memo(memo, tc._installation_probe()) is None
    cache.clear_cache()
    assert not memo.exists()


# ---------------------------------------------------------------------------- compiling


@needs_nvrtc
@pytest.mark.parametrize("arch", ["sm_80", "sm_90a"])
def test_compiles_half_types_for(arch):
    cubin = compile_source(KERNEL, arch)
    assert isinstance(cubin, Cubin) and cubin.arch == arch
    assert f"for '{arch}'" in cubin.log


@needs_nvrtc
def test_archs_get_separate_entries():
    assert compile_source(KERNEL, "sm_80").key != compile_source(KERNEL, "sm_90a").key
    assert len(cache.list_entries()) == 2


@needs_nvrtc
def test_ptxas_report_is_parsed():
    (info,) = compile_source(KERNEL, "sm_90a").functions
    assert info.name == "widen"
    assert info.registers > 0
    assert (info.stack_bytes, info.spill_stores, info.spill_loads) == (0, 0, 0)
    assert info.shared_bytes == 128 * 4


def test_ptxas_report_parser():
    # Two entries, one calling a non-inlined device function that spills.
    log = "\n".join([
        "ptxas info    : 0 bytes gmem",
        "ptxas info    : Compiling entry function 'first' for 'sm_90a'",
        "ptxas info    : Function properties for first",
        "ptxas         .     16 bytes stack frame, 8 bytes spill stores, 4 bytes spill loads",
        "ptxas info    : Used 128 registers, used 1 barriers, 2048 bytes smem, 400 bytes cmem[0]",
        "ptxas info    : Function properties for _Z6helperv",
        "ptxas         .     32 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads",
        "ptxas info    : Compiling entry function 'second' for 'sm_90a'",
        "ptxas info    : Used 40 registers, used 0 barriers, 352 bytes cmem[0]",
    ])
    assert compiler.parse_ptxas_report(log) == (
        compiler.FunctionInfo("first", 128, 16, 8, 4, 2048),
        compiler.FunctionInfo("second", 40, 0, 0, 0, 0),
    )
    assert compiler.parse_ptxas_report("") == ()


@needs_nvrtc
def test_syntax_error_raises_compile_error(fresh_cache):
    broken = KERNEL.replace("__syncthreads();", "__syncthreads()")
    with pytest.raises(CompileError) as info:
        compile_source(broken, "sm_90a", label="broken widen")
    err = info.value
    message = str(err)
    assert "broken widen" in message and "sm_90a" in message
    assert "bug in attnlang" in message
    assert 'expected a ";"' in message and 'expected a ";"' in err.log
    assert err.source == broken
    assert err.dump_path == fresh_cache / "failed" / f"{err.key}.cu"
    assert str(err.dump_path) in message
    dumped = err.dump_path.read_text()
    assert "| extern \"C\" __global__ void widen(" in dumped  # numbered lines
    assert 'expected a ";"' in dumped
    assert not list(fresh_cache.glob("*.cubin"))


# ---------------------------------------------------------------------------- arch


@pytest.mark.parametrize("bad, hint", [("sm90a", "sm_90a"), ("9.0", "sm_90"), ("90a", "sm_90a"),
                                       ("compute_80", "sm_80"), ("hopper", None)])
def test_bad_arch_is_a_clear_value_error(bad, hint):
    with pytest.raises(ValueError, match="expected 'sm_'") as info:
        compile_source(KERNEL, bad)
    assert repr(bad) in str(info.value)
    if hint:
        assert f"did you mean {hint!r}" in str(info.value)


def test_arch_suffix_needs_a_new_enough_gpu():
    with pytest.raises(ValueError, match="use 'sm_80'"):
        compiler.resolve_arch("sm_80a")


def test_bad_arch_from_env_names_the_variable(monkeypatch):
    monkeypatch.setenv("ATTNLANG_ARCH", "sm-90")
    with pytest.raises(ValueError, match="ATTNLANG_ARCH 'sm-90'"):
        compiler.resolve_arch(None)


def test_arch_comes_from_env_then_gpu(monkeypatch):
    monkeypatch.setattr(compiler, "_detect_gpu_arch", lambda: "sm_90a")
    assert compiler.resolve_arch("sm_80") == "sm_80"
    assert compiler.resolve_arch(None) == "sm_90a"
    monkeypatch.setenv("ATTNLANG_ARCH", "sm_86")
    assert compiler.resolve_arch(None) == "sm_86"


def test_no_arch_and_no_gpu_is_a_clear_error(monkeypatch):
    detected = compiler._detect_gpu_arch()  # None here; a valid arch on a GPU machine
    assert detected is None or compiler.resolve_arch(detected) == detected
    monkeypatch.setattr(compiler, "_detect_gpu_arch", lambda: None)
    with pytest.raises(ValueError, match="no target architecture") as info:
        compile_source(KERNEL)
    assert "--arch sm_90a" in str(info.value) and "ATTNLANG_ARCH" in str(info.value)


def test_arch_option_is_refused():
    with pytest.raises(ValueError, match="arch="):
        compile_source(KERNEL, "sm_90a", options=["-arch=sm_80"])


@needs_nvrtc
def test_arch_below_ampere_is_refused():
    """attnlang's kernels need sm_80+ (bf16 mma, cp.async): older targets are refused up front,
    not with pages of ptxas errors."""
    for arch in ("sm_20", "sm_75"):
        with pytest.raises(ValueError, match="need compute capability 8.0 or newer"):
            compile_source(KERNEL, arch)


# ---------------------------------------------------------------------------- headers


def _fake_headers(directory: Path, version: int) -> str:
    directory.mkdir(parents=True)
    (directory / "cuda_fp16.h").write_text("")
    (directory / "cuda.h").write_text(f"#define CUDA_VERSION {version}\n")
    return str(directory)


@pytest.fixture
def discovery(monkeypatch):
    """Header discovery with the candidate list and NVRTC version under test control."""
    monkeypatch.setattr(tc, "nvrtc_version", lambda: (12, 9))
    tc._discover.cache_clear()
    yield
    tc._discover.cache_clear()


def test_headers_matching_nvrtc_are_preferred(tmp_path, monkeypatch, discovery):
    cu13 = _fake_headers(tmp_path / "cu13", 13000)
    cu12 = _fake_headers(tmp_path / "cu12", 12090)
    empty = tmp_path / "empty"
    empty.mkdir()
    monkeypatch.setattr(tc, "_candidate_dirs", lambda *_: [str(empty), cu13, cu12])
    assert compiler.cuda_include_dirs() == [cu12]


def test_env_include_dirs_come_first(tmp_path, monkeypatch, discovery):
    extra = _fake_headers(tmp_path / "mine", 13000)
    other = tmp_path / "other"
    other.mkdir()
    monkeypatch.setattr(tc, "_candidate_dirs", lambda *_: [str(tmp_path / "never")])
    monkeypatch.setenv("ATTNLANG_CUDA_INCLUDE", os.pathsep.join([str(other), extra]))
    assert env.cuda_include() == [str(other), extra]
    assert compiler.cuda_include_dirs() == [str(other), extra]


def test_missing_env_include_dir_is_an_error(tmp_path, monkeypatch, discovery):
    monkeypatch.setenv("ATTNLANG_CUDA_INCLUDE", str(tmp_path / "nope"))
    with pytest.raises(compiler.ToolchainError, match="ATTNLANG_CUDA_INCLUDE"):
        compiler.cuda_include_dirs()


def test_no_headers_is_a_clear_error(tmp_path, monkeypatch, discovery):
    monkeypatch.setattr(tc, "_candidate_dirs", lambda *_: [str(tmp_path / "a")])
    with pytest.raises(compiler.ToolchainError) as info:
        compiler.cuda_include_dirs()
    message = str(info.value)
    assert "cuda_fp16.h" in message and str(tmp_path / "a") in message
    assert "pip install 'attnlang[cuda12]'" in message


@needs_nvrtc
def test_real_discovery_finds_usable_headers():
    dirs = compiler.cuda_include_dirs()
    assert dirs and any(Path(d, "cuda_fp16.h").is_file() for d in dirs)


# ---------------------------------------------------------------------------- management


@needs_nvrtc
def test_list_and_clear(fresh_cache):
    assert cache.list_entries() == [] and compiler.clear_cache() == 0
    cubin = compile_source(KERNEL, "sm_90a", label="widen bf16")
    (row,) = compiler.list_entries()
    assert row["key"] == cubin.key and row["label"] == "widen bf16" and row["arch"] == "sm_90a"
    assert row["path"] == cubin.path and row["size"] == cubin.path.stat().st_size
    assert row["mtime"] > 0
    assert compiler.cache_dir() == fresh_cache
    assert compiler.clear_cache() == 1
    assert compiler.list_entries() == [] and not list(fresh_cache.glob("*.lock"))
    assert compile_source(KERNEL, "sm_90a").cache == "miss"  # memory was cleared too


@needs_nvrtc
def test_progress_lines(monkeypatch, capsys):
    monkeypatch.setenv("ATTNLANG_QUIET", "0")
    compile_source(KERNEL, "sm_90a", label="widen bf16")
    compile_source(KERNEL, "sm_90a", label="widen bf16")  # a hit prints nothing
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 2
    assert lines[0] == "attnlang: compiling widen bf16 for sm_90a ..."
    assert lines[1].startswith("attnlang: compiled widen bf16 in ") and lines[1].endswith(" s")


@needs_nvrtc
def test_quiet_silences_progress(capsys):
    compile_source(KERNEL, "sm_90a")
    assert capsys.readouterr().err == ""


@needs_nvrtc
def test_dump_dir_gets_source_and_cubin(tmp_path, monkeypatch):
    monkeypatch.setenv("ATTNLANG_DUMP_DIR", str(tmp_path / "dump"))
    cubin = compile_source(KERNEL, "sm_90a", label="widen bf16")
    stem = f"widen_bf16-{cubin.key[:12]}"
    assert (tmp_path / "dump" / f"{stem}.cu").read_text() == KERNEL
    assert (tmp_path / "dump" / f"{stem}.cubin").read_bytes() == cubin.data
    assert "Used" in (tmp_path / "dump" / f"{stem}.log").read_text()


@needs_nvrtc
def test_unusable_cache_dir_still_compiles(tmp_path, monkeypatch):
    not_a_dir = tmp_path / "file"
    not_a_dir.write_text("")
    monkeypatch.setenv("ATTNLANG_CACHE_DIR", str(not_a_dir))
    with pytest.warns(RuntimeWarning, match="ATTNLANG_CACHE_DIR"):
        cubin = compile_source(KERNEL, "sm_90a")
    assert cubin.cache == "miss" and cubin.path is None
    assert compile_source(KERNEL, "sm_90a").cache == "memory"


@needs_nvrtc
def test_cubin_is_whole(fresh_cache):
    """The cubin ends where its ELF headers say (CuPy's getCUBIN drops the last byte)."""
    import struct

    data = compile_source('extern "C" __global__ void k(float* x) { x[0] = 1.0f; }',
                          "sm_90a").data
    assert data[:4] == b"\x7fELF"
    ph_offset = struct.unpack_from("<Q", data, 0x20)[0]
    ph_size, ph_count = struct.unpack_from("<HH", data, 0x36)
    sh_offset = struct.unpack_from("<Q", data, 0x28)[0]
    sh_size, sh_count = struct.unpack_from("<HH", data, 0x3A)
    assert len(data) >= max(ph_offset + ph_size * ph_count, sh_offset + sh_size * sh_count)
