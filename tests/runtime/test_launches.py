"""run()'s launches without a GPU (attnlang/runtime/launches.py): which one is a programmatic
dependent launch, and what the Python path hands cuLaunchKernelEx for it."""

import ctypes
from types import SimpleNamespace

import pytest

from attnlang.codegen.config import launch_config
from attnlang.runtime import launches as L
from attnlang.runtime.validate import AttentionShape
from attnlang.runtime.workspace import _SECTIONS


@pytest.mark.parametrize("arch, expected", [("sm_90a", True), ("sm_90", True),
                                            ("sm_100a", True), ("sm_120", True),
                                            ("sm_89", False), ("sm_80", False)])
def test_dependent_launch_where_griddepcontrol_is_compiled_in(arch, expected, monkeypatch):
    # machine.cuh compiles griddepcontrol.wait into the merge kernel from sm_90 on: a merge
    # kernel without it must never start before the partial states are written
    monkeypatch.delenv("ATTNLANG_DEPENDENT_LAUNCH", raising=False)
    assert L.dependent_launch(arch) is expected
    monkeypatch.setenv("ATTNLANG_DEPENDENT_LAUNCH", "off")
    assert L.dependent_launch(arch) is False


def _kernels(arch):
    configs = {kind: launch_config(kind, 128, 4, "bfloat16", arch)
               for kind in ("decode", "prefill", "merge")}
    functions = {kind: SimpleNamespace(ptr=0x100 * (i + 1)) for i, kind in enumerate(configs)}
    return L.Kernels(0, arch, configs, functions, num_ctas=264, num_prefill_ctas=132,
                     prefill_min_rows=3)


@pytest.mark.parametrize("arch", ["sm_90a", "sm_80"])
def test_every_launch_is_dependent_where_the_kernels_wait(arch, monkeypatch):
    monkeypatch.delenv("ATTNLANG_DEPENDENT_LAUNCH", raising=False)
    ws = {name: 10_000 + i for i, name in enumerate([*_SECTIONS, "partial_o", "partial_lse"])}
    shape = AttentionShape(32, 8, 128, "bfloat16", 16)
    got = L.pack_launches(_kernels(arch), ws, shape, num_params=0, merge_ctas=40)
    assert list(got) == ["decode", "prefill", "merge"]  # launch order: merge last
    assert {kind: one.dependent for kind, one in got.items()} == {
        "decode": arch == "sm_90a", "prefill": arch == "sm_90a", "merge": arch == "sm_90a"}
    assert got["merge"].grid == (40, 1, 1) and got["decode"].grid == (264, 1, 1)
    assert got["merge"].fn == 0x300
    config = got["merge"].ex_config  # cuLaunchKernelEx's, where dependent
    assert (config is not None) == (arch == "sm_90a")
    if config is not None:
        assert (config.grid_x, config.block_x, config.block_z, config.num_attrs) == (40, 16, 4, 1)
        assert (config.attrs[0].id, config.attrs[0].value.flag) == (6, 1)


def test_a_dependent_launch_hands_the_driver_one_attribute(monkeypatch):
    seen = {}

    def launch_ex(config, fn, params, extra):
        c = ctypes.cast(config, ctypes.POINTER(L._LaunchConfig))[0]
        seen.update(grid=(c.grid_x, c.grid_y, c.grid_z), block=(c.block_x, c.block_y, c.block_z),
                    smem=c.smem, stream=c.stream, fn=fn, params=params,
                    attributes=[(c.attrs[i].id, c.attrs[i].value.flag)
                                for i in range(c.num_attrs)])
        return 0

    monkeypatch.setattr(L, "_launch_kernel_ex", lambda: launch_ex)
    plain = []
    driver = SimpleNamespace(launchKernel=lambda *args: plain.append(args))
    args = SimpleNamespace(kernel_params=0xBEEF0)
    dependent = L.Launch(0x300, (40, 1, 1), (16, 8, 4), 6144, args, True,
                         L._dependent_config((40, 1, 1), (16, 8, 4), 6144))
    L.launch(driver, dependent, 0x77)
    assert plain == []
    assert seen == dict(grid=(40, 1, 1), block=(16, 8, 4), smem=6144, stream=0x77, fn=0x300,
                        params=0xBEEF0, attributes=[(6, 1)])
    assert dependent.ex_config.stream is None  # each launch sets the stream on a copy
    L.launch(driver, L.Launch(0x100, (264, 1, 1), (128, 1, 1), 0, args), 0x77)
    assert plain == [(0x100, 264, 1, 1, 128, 1, 1, 0, 0x77, 0xBEEF0, 0)]


@pytest.mark.parametrize("group, min_rows, max_qo_len, cascade, expected", [
    (4, 8, 1, False, {"decode", "merge"}),                # fp8 decode steps: no prefill launch
    (4, 8, 2, False, {"decode", "merge"}),                # 8 rows still decode on tensor cores
    (4, 8, 3, False, {"decode", "prefill", "merge"}),     # 12 rows may reach prefill
    (4, 3, 1, False, {"prefill", "merge"}),               # bf16 GQA steps run in prefill
    (1, 3, 1, True, {"cascade", "decode", "merge"}),      # MHA decode steps
    (1, 3, 8192, False, {"decode", "prefill", "merge"}),  # the default: max_total_q
])
def test_a_graph_holds_the_kernels_a_plan_can_reach(group, min_rows, max_qo_len, cascade,
                                                    expected):
    kinds = L.graph_kernels(group, min_rows, max_qo_len, cascade=cascade)
    assert {kind for kind, held in kinds.items() if held} == expected
