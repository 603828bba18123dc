"""attnlang's torch operators: traced by torch.compile in one graph (CPU, meta tensors), and
on the GPU equal to run(), compiled or not, and replayed from a CUDA graph after a replan."""

import numpy as np
import pytest

import attnlang

torch = pytest.importorskip("torch")

from attnlang.integrations.torch import AttentionOp  # noqa: E402

SOFTCAP = attnlang.parse("variant softcap\nparam cap: float = 30.0\n"
                         "logits = cap * tanh(logits / cap)\nmask = causal")


class _Geometry:
    """What AttentionOp reads of a BatchAttention, for tracing on meta tensors (no GPU)."""

    def __init__(self, variant, head_dim):
        self.params = variant.params
        self.shape = type("Shape", (), {"head_dim": head_dim})()
        self.module = type("Module", (), {"softmax": variant.softmax})()


def _meta_inputs(total_q=5, heads=8, kv_heads=2, head_dim=64, pages=3, page_size=16):
    q = torch.empty(total_q, heads, head_dim, dtype=torch.bfloat16, device="meta")
    k = torch.empty(pages, page_size, kv_heads, head_dim, dtype=torch.bfloat16, device="meta")
    return q, k, torch.empty_like(k)


def test_compiles_in_one_graph_without_a_break():
    op = AttentionOp(_Geometry(SOFTCAP, 64))

    def layer(q, k, v):
        out, lse = op(q, k, v, {"cap": 20.0}, return_lse=True)
        return out * 2, lse

    q, k, v = _meta_inputs()
    explained = torch._dynamo.explain(layer)(q, k, v)
    assert explained.graph_count == 1 and explained.graph_break_count == 0
    out, lse = torch.compile(layer, fullgraph=True, backend="aot_eager")(q, k, v)
    assert out.shape == q.shape and out.dtype == q.dtype
    assert lse.shape == (5, 8) and lse.dtype == torch.float32


def test_traced_output_takes_the_value_head_dim():
    # MLA: q and k of 192, v of 128: out is [total_q, heads, 128] in the traced graph too.
    op = AttentionOp(_Geometry(SOFTCAP, 192))
    q, k, _ = _meta_inputs(head_dim=192)
    v = torch.empty(3, 16, 2, 128, dtype=torch.bfloat16, device="meta")
    out, lse = torch.compile(lambda q, k, v: op(q, k, v, return_lse=True), fullgraph=True,
                             backend="aot_eager")(q, k, v)
    assert out.shape == (5, 8, 128) and lse.shape == (5, 8)


def test_params_reach_the_operator_in_declaration_order():
    variant = attnlang.parse("variant t\nparam slopes: float[heads]\nparam w: int = 7\n"
                             "param cap: float\nlogits = cap * tanh(logits / cap) - "
                             "slopes[head] * (q_pos - kv_pos)\nmask = q_pos - kv_pos < w")
    op = AttentionOp(_Geometry(variant, 64))
    assert op.tensor_names == ("slopes",) and op.scalar_names == ("w", "cap")
    q, k, v = _meta_inputs()
    slopes = torch.empty(8, device="meta")
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm

    torch.compile(lambda q, k, v, s: op(q, k, v, {"slopes": s, "cap": 3.0}), fullgraph=True,
                  backend=backend)(q, k, v, slopes)
    ops = (torch.ops.attnlang.attention, torch.ops.attnlang.attention.default)
    (call,) = [n for n in graphs[0].graph.nodes if n.target in ops]
    assert call.args[0] == op.handle and list(call.args[5]) == [7.0, 3.0]
    assert call.args[6] == pytest.approx(1 / 8)


def test_bad_params_are_rejected_by_name():
    op = AttentionOp(_Geometry(SOFTCAP, 64))
    q, k, v = _meta_inputs()
    with pytest.raises(ValueError, match="unknown param 'cpa'.*cap"):
        op(q, k, v, {"cpa": 1.0})
    with pytest.raises(TypeError, match="'cap' must be a number, got bool"):
        op(q, k, v, {"cap": True})


# ---------------------------------------------------------------------------- GPU


def _batch(rng, page_size=16, heads=8, kv_heads=2, head_dim=128):
    qo, kv = [1, 7, 1, 40], [300, 64, 1000, 40]
    pages = [-(-n // page_size) for n in kv]
    kv_indptr = np.concatenate([[0], np.cumsum(pages)])
    kv_indices = rng.permutation(int(kv_indptr[-1]) + 5)[:kv_indptr[-1]]
    last = [n - (p - 1) * page_size for n, p in zip(kv, pages, strict=True)]
    qo_indptr = np.concatenate([[0], np.cumsum(qo)])
    num_pages = int(kv_indptr[-1]) + 5
    dev = dict(device="cuda", dtype=torch.bfloat16)
    q = torch.randn(int(qo_indptr[-1]), heads, head_dim, **dev)
    k = torch.randn(num_pages, page_size, kv_heads, head_dim, **dev)
    return (qo_indptr, kv_indptr, kv_indices, last), q, k, torch.randn_like(k)


@pytest.mark.gpu
def test_compiled_equals_eager_and_graph_replays_after_replan():
    rng = np.random.default_rng(0)
    layout, q, k, v = _batch(rng)
    attn = attnlang.BatchAttention(SOFTCAP, 8, 2, 128, "bfloat16", 16)
    attn.plan(*layout)
    op = AttentionOp(attn)
    want = attn.run(q, (k, v), {"cap": 20.0})

    compiled = torch.compile(lambda q, k, v: op(q, k, v, {"cap": 20.0}), fullgraph=True)
    assert torch.equal(compiled(q, k, v), want)
    out, lse = op(q, k, v, {"cap": 20.0}, return_lse=True)
    assert torch.equal(out, want) and lse.shape == (q.shape[0], 8)

    # Captured once, replayed after a new plan of the same total_q: the new batch's result.
    static_q = q.clone()
    graph = torch.cuda.CUDAGraph()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        op(static_q, k, v, {"cap": 20.0})  # warm-up outside the capture
        with torch.cuda.graph(graph, stream=side):
            static_out = op(static_q, k, v, {"cap": 20.0})
    torch.cuda.current_stream().wait_stream(side)
    layout2, q2, _, _ = _batch(np.random.default_rng(1))
    qo2 = np.array([0, 20, 49, 49, 49])  # same total_q (49), other lengths
    layout2 = (qo2, *layout2[1:])
    attn.plan(*layout2)
    torch.cuda.synchronize()
    static_q.copy_(q2)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(static_out, attn.run(q2, (k, v), {"cap": 20.0}))
