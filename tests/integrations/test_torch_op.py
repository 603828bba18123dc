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

    def __init__(self, variant, head_dim, kv_dtype="bfloat16", num_kv_heads=2):
        if kv_dtype == "float8_e4m3fn":
            variant = attnlang.ir.with_kv_scales(variant)  # as compile_variant makes the module
        self.params = variant.params
        self.shape = type("Shape", (), {"head_dim": head_dim, "kv_dtype": kv_dtype,
                                        "num_kv_heads": num_kv_heads})()
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


def _traced_call(op, fn, *inputs):
    """The operator's node in the graph torch.compile traces of fn(*inputs)."""
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm

    torch.compile(fn, fullgraph=True, backend=backend)(*inputs)
    ops = (torch.ops.attnlang.attention, torch.ops.attnlang.attention.default)
    (call,) = [n for n in graphs[0].graph.nodes if n.target in ops]
    return call


def test_fp8_scales_follow_the_params():
    # Tensor scales are graph inputs after the tensor params; float scales graph constants
    # after the scalar params; a float beside a tensor becomes a tensor.
    op = AttentionOp(_Geometry(SOFTCAP, 64, "float8_e4m3fn"))
    assert op.tensor_names == () and op.scalar_names == ("cap",)
    q, k, _ = _meta_inputs()
    k8 = torch.empty(k.shape, dtype=torch.float8_e4m3fn, device="meta")
    ks, vs = torch.empty(2, device="meta"), torch.empty(2, device="meta")
    call = _traced_call(op, lambda q, k, v, ks, vs: op(q, k, v, k_scale=ks, v_scale=vs),
                        q, k8, k8, ks, vs)
    assert len(call.args[4]) == 2 and list(call.args[5]) == [30.0]
    call = _traced_call(op, lambda q, k, v: op(q, k, v, {"cap": 5.0}, k_scale=0.5, v_scale=2),
                        q, k8, k8)
    assert list(call.args[4]) == [] and list(call.args[5]) == [5.0, 0.5, 2.0]
    call = _traced_call(op, lambda q, k, v, ks: op(q, k, v, k_scale=ks, v_scale=0.25),
                        q, k8, k8, ks)
    assert len(call.args[4]) == 2 and list(call.args[5]) == [30.0]


def test_the_operator_hands_run_its_scales():
    # What the operator's implementation passes run(): the params by name, the scales as
    # k_scale= / v_scale= (tensors or floats, as the caller gave them), None without them.
    from attnlang.integrations import torch as bridge

    calls = []

    class Recorder(_Geometry):
        def run(self, q, kv, params, **kwargs):
            calls.append((params, kwargs))
            return q

    variant = attnlang.parse("variant t\nparam slopes: float[heads]\nparam cap: float\n"
                             "logits = cap * tanh(logits / cap) + slopes[head]\nmask = causal")
    fp8 = Recorder(variant, 64, "float8_e4m3fn")
    op = AttentionOp(fp8)
    q, k, v = _meta_inputs()
    slopes, ks, vs = (torch.empty(8, device="meta"), torch.empty(2, device="meta"),
                      torch.empty(2, device="meta"))
    bridge._call(op.handle, q, k, v, [slopes, ks, vs], [3.0], 0.125, False)
    bridge._call(op.handle, q, k, v, [slopes], [3.0, 0.5, 0.25], 0.125, False)
    (p1, kw1), (p2, kw2) = calls
    assert p1 == p2 == {"slopes": slopes, "cap": 3.0}
    assert kw1["k_scale"] is ks and kw1["v_scale"] is vs
    assert (kw2["k_scale"], kw2["v_scale"]) == (0.5, 0.25)
    bf16 = Recorder(variant, 64)
    AttentionOp(bf16)
    bridge._call(bf16._torch_op.handle, q, k, v, [slopes], [3.0], 0.125, True)
    assert calls[-1][1] == {"sm_scale": 0.125, "return_lse": True, "k_scale": None,
                            "v_scale": None}


def test_fp8_scales_are_checked():
    q, k, v = _meta_inputs()
    fp8 = AttentionOp(_Geometry(SOFTCAP, 64, "float8_e4m3fn"))
    with pytest.raises(TypeError, match="missing v_scale"):
        fp8(q, k, v, k_scale=1.0)
    with pytest.raises(TypeError, match="pass k_scale as the operator's k_scale= argument"):
        fp8(q, k, v, {"k_scale": torch.empty(2, device="meta")}, v_scale=1.0)
    with pytest.raises(TypeError, match="v_scale must be a float or a float32 CUDA tensor, got "
                                        "bool"):
        fp8(q, k, v, k_scale=1.0, v_scale=True)
    bf16 = AttentionOp(_Geometry(SOFTCAP, 64))
    with pytest.raises(TypeError, match="for an fp8 KV cache"):
        bf16(q, k, v, k_scale=1.0, v_scale=1.0)


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


@pytest.mark.gpu
def test_fp8_cache_through_the_operator():
    # Compiled, with tensor and with float scales: equal to run(); within bf16's tolerance
    # of attention over the dequantised cache; a CUDA graph replays new scale values.
    rng = np.random.default_rng(2)
    layout, q, k, v = _batch(rng)
    attn = attnlang.BatchAttention(SOFTCAP, 8, 2, 128, "bfloat16", 16, kv_dtype="fp8")
    attn.plan(*layout)
    op = AttentionOp(attn)
    ks = torch.tensor([0.02, 0.03], device="cuda")
    vs = torch.tensor([0.02, 0.05], device="cuda")  # randn / scale within e4m3's 448
    k8 = (k / ks[None, None, :, None]).to(torch.float8_e4m3fn)
    v8 = (v / vs[None, None, :, None]).to(torch.float8_e4m3fn)
    want = attn.run(q, (k8, v8), {"cap": 20.0}, k_scale=ks, v_scale=vs)
    compiled = torch.compile(lambda q, k, v, ks, vs: op(q, k, v, {"cap": 20.0}, k_scale=ks,
                                                         v_scale=vs), fullgraph=True)
    assert torch.equal(compiled(q, k8, v8, ks, vs), want)
    floats = torch.compile(lambda q, k, v: op(q, k, v, {"cap": 20.0}, k_scale=0.02,
                                              v_scale=0.05), fullgraph=True)
    assert torch.equal(floats(q, k8, v8),
                       attn.run(q, (k8, v8), {"cap": 20.0}, k_scale=0.02, v_scale=0.05))

    # Against the reference over the dequantised cache.
    from attnlang.reference import attention_paged

    seen = [(x.float() * scale[None, None, :, None]).cpu().numpy()
            for x, scale in ((k8, ks), (v8, vs))]
    ref, _ = attention_paged(SOFTCAP, q.float().cpu().numpy(), *seen, *layout,
                             params={"cap": 20.0})
    got = want.float().cpu().numpy()
    err = float(np.linalg.norm(got - ref) / np.linalg.norm(ref))
    assert err < 1e-2, f"relative L2 error {err:.2e}"

    # Captured with the scale tensors; new values written into them reach the replay.
    graph = torch.cuda.CUDAGraph()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        op(q, k8, v8, {"cap": 20.0}, k_scale=ks, v_scale=vs)  # warm-up outside the capture
        with torch.cuda.graph(graph, stream=side):
            static_out = op(q, k8, v8, {"cap": 20.0}, k_scale=ks, v_scale=vs)
    torch.cuda.current_stream().wait_stream(side)
    ks.mul_(2.0)
    vs.mul_(0.5)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(static_out, attn.run(q, (k8, v8), {"cap": 20.0}, k_scale=ks,
                                            v_scale=vs))
    assert not torch.equal(static_out, want)
