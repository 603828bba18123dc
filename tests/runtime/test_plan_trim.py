"""KV trimming in the planner (plan_batch / plan_mixed with the variant's mask): every
(row, key) pair the reference mask makes visible stays covered, exactly once, by the items
that write (or merge into) that row; masked tiles leave the spans and the costs. No GPU."""

import numpy as np
import pytest

import attnlang as al
from attnlang import interpret, ir
from attnlang.runtime import pairmask, plan_trim, planner
from attnlang.runtime.plan_mixed import Tiling, plan_mixed
from attnlang.runtime.planner import plan_batch
from tests.codegen.test_mask_tiles import VARIANTS, random_params

NUM_KV_HEADS, GROUP, HEAD_DIM = 2, 4, 64
NUM_HEADS = NUM_KV_HEADS * GROUP
DECODE, PREFILL = Tiling(4, 16, 32), Tiling(64, 8, 64)
MASKED = sorted(k for k, v in VARIANTS.items() if v.mask is not None)


def _params(v: ir.Variant, rng, batch_size: int) -> dict:
    return random_params(v, rng, {"heads": NUM_HEADS, "kv_heads": NUM_KV_HEADS,
                                  "batch": batch_size, "dim": HEAD_DIM}, int_high=300)


def _visible(v: ir.Variant, b: int, qo: int, kv: int, params: dict) -> np.ndarray:
    """[kv_head, fused row, key] visibility by the reference's per-element mask."""
    heads = np.arange(NUM_HEADS)[:, None, None]
    q_pos = (kv - qo + np.arange(qo))[None, :, None]
    kv_pos = np.arange(kv)[None, None, :]
    shape = (NUM_HEADS, qo, kv)
    names = {"q_pos": q_pos, "kv_pos": kv_pos, "head": heads, "batch": np.asarray(b),
             "kv_head": heads // GROUP, "qo_len": np.asarray(qo), "kv_len": np.asarray(kv),
             "num_heads": np.asarray(NUM_HEADS), "num_kv_heads": np.asarray(NUM_KV_HEADS),
             "head_dim": np.asarray(HEAD_DIM), "sm_scale": np.asarray(0.125),
             "causal": kv_pos <= q_pos}
    scope = interpret.Scope("mask", shape, names,
                             {k: np.asarray(x) for k, x in params.items()}, np.float32)
    vis = np.broadcast_to(interpret.evaluate(v.mask, scope), shape)
    # head = kv_head * group + g, fused row = i * group + g
    return vis.reshape(NUM_KV_HEADS, GROUP, qo, kv).transpose(0, 2, 1, 3).reshape(
        NUM_KV_HEADS, qo * GROUP, kv)


def check_trimmed(plan, qo, kv, visible):
    """Items of a row never overlap, cover every visible key; each row is written once:
    by one direct item, or by its partial items merged in KV order by one merge row."""
    direct, partial, spans = {}, {}, {}
    for sub in (plan.decode, plan.prefill):
        for w in range(sub.num_work_items):
            b, h, row0 = int(sub.work_request[w]), int(sub.work_kv_head[w]), int(
                sub.work_row_start[w])
            kv0, kv1 = int(sub.work_kv_start[w]), int(sub.work_kv_end[w])
            assert 0 <= kv0 <= kv1 <= kv[b]
            rows = min(sub.rows_per_tile, qo[b] * GROUP - row0)
            for r in range(row0, row0 + rows):
                spans.setdefault((b, h, r), []).append((kv0, kv1))
                if sub.work_partial[w] < 0:
                    direct[(b, h, r)] = direct.get((b, h, r), 0) + 1
                else:
                    partial[int(sub.work_partial[w]) + r - row0] = (b, h, r, kv0, kv1)
    for b in range(len(qo)):
        cov = np.zeros((NUM_KV_HEADS, qo[b] * GROUP, kv[b]), int)
        for h in range(NUM_KV_HEADS):
            for r in range(qo[b] * GROUP):
                for kv0, kv1 in spans.get((b, h, r), []):
                    cov[h, r, kv0:kv1] += 1
        assert cov.max(initial=0) <= 1, f"request {b}: a key is covered twice"
        missed = visible[b] & (cov == 0)
        assert not missed.any(), f"request {b}: visible pairs dropped at {np.argwhere(missed)[:3]}"
    merged = {}
    qo_start = np.concatenate(([0], np.cumsum(qo)))
    for m in range(plan.merge_count):
        b, t, head = (int(x) for x in (plan.merge_request[m], plan.merge_token[m],
                                       plan.merge_head[m]))
        key = (b, head // GROUP, (t - qo_start[b]) * GROUP + head % GROUP)
        assert key not in merged and key not in direct
        slots = plan.merge_slots[plan.merge_indptr[m]:plan.merge_indptr[m + 1]]
        pos = None
        for s in slots:
            sb, sh, sr, kv0, kv1 = partial.pop(int(s))
            assert (sb, sh, sr) == key
            assert pos is None or kv0 == pos, "merge slots not in KV order"
            pos = kv1
        merged[key] = True
    assert not partial, "partial rows that no merge row reads"
    for b in range(len(qo)):
        for h in range(NUM_KV_HEADS):
            for r in range(qo[b] * GROUP):
                writes = direct.get((b, h, r), 0) + merged.get((b, h, r), 0)
                assert writes == 1, f"row {(b, h, r)} written {writes} times"


def _batch(rng, n=6):
    qo = np.where(rng.random(n) < 0.5, rng.integers(1, 5, n), rng.integers(5, 200, n))
    kv = qo + rng.integers(0, 700, n)
    qo[rng.integers(n)] = 0
    return qo, kv


@pytest.mark.parametrize("name", MASKED)
@pytest.mark.parametrize("seed", range(2))
def test_trimmed_plans_cover_every_visible_pair(name, seed):
    v, rng = VARIANTS[name], np.random.default_rng(seed)
    qo, kv = _batch(rng)
    params = _params(v, rng, len(qo))
    visible = [_visible(v, b, int(qo[b]), int(kv[b]), params) for b in range(len(qo))]
    for chunk in (None, 100, 1 << 30):
        plan = plan_mixed(qo, kv, num_kv_heads=NUM_KV_HEADS, group_size=GROUP, decode=DECODE,
                          prefill=PREFILL, kv_chunk_size=chunk, mask=v.mask,
                          head_dim=HEAD_DIM)
        check_trimmed(plan, qo, kv, visible)
        again = plan_mixed(qo, kv, num_kv_heads=NUM_KV_HEADS, group_size=GROUP,
                           decode=DECODE, prefill=PREFILL, kv_chunk_size=chunk,
                           mask=v.mask, head_dim=HEAD_DIM)
        assert plan.same_as(again)


def _window(w: int) -> ir.Variant:
    return al.parse(f"variant win\nmask = causal and q_pos - kv_pos < {w}")


def test_sliding_window_decode_is_trimmed_to_the_window():
    kv = np.full(32, 8192)
    plan = plan_batch(np.ones(32, int), kv, num_kv_heads=8, group_size=4, rows_per_tile=4,
                      num_ctas=528, kv_align=32, mask=_window(4096).mask, head_dim=128)
    spans = plan.work_kv_end.astype(int) - plan.work_kv_start
    per_unit = np.bincount(plan.work_request * 8 + plan.work_kv_head, weights=spans)
    assert (per_unit >= 4096).all() and (per_unit <= 4096 + plan_trim.TRIM_TILE).all()
    assert plan.work_kv_end.max() == 8192 and plan.work_kv_start.min() >= 8192 - 4096 - 128
    full = plan_batch(np.ones(32, int), kv, num_kv_heads=8, group_size=4, rows_per_tile=4,
                      num_ctas=528, kv_align=32, mask=None)
    assert plan.cta_costs().sum() < 0.6 * full.cta_costs().sum()


def test_causal_prefill_spans_and_cost_halve():
    causal = al.parse("variant c\nmask = causal").mask
    qo = kv = np.array([4096])
    kw = dict(num_kv_heads=8, group_size=4, rows_per_tile=64, num_ctas=8, kv_align=64,
              kv_chunk_size=1 << 30)
    trimmed = plan_batch(qo, kv, mask=causal, head_dim=128, **kw)
    whole = plan_batch(qo, kv, **kw)
    span = (trimmed.work_kv_end.astype(int) - trimmed.work_kv_start).sum()
    assert abs(span / (whole.work_kv_end.astype(int) - whole.work_kv_start).sum() - 0.5) < 0.02
    # the automatic bound is computed from the trimmed spans, so the plan splits less
    auto_t = plan_batch(qo, kv, mask=causal, head_dim=128, **{**kw, "kv_chunk_size": None})
    auto_w = plan_batch(qo, kv, **{**kw, "kv_chunk_size": None})
    assert auto_t.cta_costs().sum() <= auto_w.cta_costs().sum()


def test_fully_masked_unit_keeps_one_empty_item():
    # kv_pos < 0 is never true: every unit has no visible tile, yet its rows are written.
    mask = al.parse("variant none\nmask = kv_pos < 0").mask
    qo, kv = np.array([1, 100]), np.array([500, 300])
    plan = plan_mixed(qo, kv, num_kv_heads=NUM_KV_HEADS, group_size=GROUP, decode=DECODE,
                      prefill=PREFILL, mask=mask, head_dim=HEAD_DIM)
    for sub in (plan.decode, plan.prefill):
        assert (sub.work_kv_start == sub.work_kv_end).all()
        assert (sub.work_partial == -1).all()
    assert plan.merge_count == 0
    visible = [np.zeros((NUM_KV_HEADS, q * GROUP, k), bool) for q, k in zip(qo, kv, strict=True)]
    check_trimmed(plan, qo, kv, visible)


def test_no_mask_plans_are_unchanged():
    rng = np.random.default_rng(3)
    qo, kv = _batch(rng, 9)
    a = plan_mixed(qo, kv, num_kv_heads=NUM_KV_HEADS, group_size=GROUP, decode=DECODE,
                   prefill=PREFILL)
    b = plan_mixed(qo, kv, num_kv_heads=NUM_KV_HEADS, group_size=GROUP, decode=DECODE,
                   prefill=PREFILL, mask=VARIANTS["full"].mask if "full" in VARIANTS else None,
                   head_dim=HEAD_DIM)
    assert a.same_as(b)
    # without head_dim a mask cannot be analysed
    with pytest.raises(planner.PlanError, match="head_dim"):
        plan_batch(qo, kv, num_kv_heads=2, group_size=4, rows_per_tile=4, num_ctas=4,
                   mask=_window(10).mask)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_per_pair_masks_trim_by_their_blocks(seed):
    """A per-pair mask's block summary (pairmask.PairBlocks) trims each unit's KV range and
    drops units with nothing visible, never a visible pair; a mask combined with causal too."""
    rng = np.random.default_rng(seed)
    qo, kv = _batch(rng)
    masks = []
    for q, k in zip(qo, kv, strict=True):  # block-sparse 32 x 64 layouts, some rows empty
        layout = rng.random((-(-q // 32) or 1, -(-k // 64) or 1)) < 0.4
        masks.append(np.repeat(np.repeat(layout, 32, 0), 64, 1)[:q, :k])
    pairs = {"allowed": pairmask.PairBlocks(masks)}
    for src in ("mask = allowed[q_row, kv_pos]", "mask = allowed[q_row, kv_pos] and causal"):
        v = al.parse(f"variant t\nparam allowed: bool[q, kv]\n{src}")
        visible = []
        for b, m in enumerate(masks):
            rows = np.repeat(m, GROUP, axis=0)  # fused row = query * group + member
            if "causal" in src:
                q_pos = kv[b] - qo[b] + np.arange(qo[b])
                rows = rows & np.repeat(np.arange(kv[b])[None, :] <= q_pos[:, None], GROUP, 0)
            visible.append(np.broadcast_to(rows, (NUM_KV_HEADS, *rows.shape)))
        plans = {}
        for chunk in (None, 100):
            plans[chunk] = plan_mixed(qo, kv, num_kv_heads=NUM_KV_HEADS, group_size=GROUP,
                                      decode=DECODE, prefill=PREFILL, kv_chunk_size=chunk,
                                      mask=v.mask, head_dim=HEAD_DIM, pairs=pairs)
            check_trimmed(plans[chunk], qo, kv, visible)
        untrimmed = plan_mixed(qo, kv, num_kv_heads=NUM_KV_HEADS, group_size=GROUP,
                               decode=DECODE, prefill=PREFILL, mask=v.mask, head_dim=HEAD_DIM)

        def span(plan):
            return sum(int((p.work_kv_end - p.work_kv_start).sum())
                       for p in (plan.decode, plan.prefill))

        assert span(plans[None]) < span(untrimmed)  # the blocks trimmed something
