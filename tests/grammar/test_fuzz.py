"""The front end's no-crash property on 2,000 seeded inputs (tests/grammar/fuzz.py): every input
is accepted (and then renders every kernel and runs the reference) or rejected with an
AttnError positioned inside the file. `python -m tests.grammar.fuzz --count 10000` runs more."""

import pytest

from tests.grammar import fuzz


def test_two_thousand_inputs_never_crash():
    counts, failures = fuzz.run(2000, seed=20261123)
    assert not failures, "\n\n".join(failures)
    for family in ("random", "mutant", "numeric"):  # every family reaches both outcomes
        assert counts.get(f"{family} accepted", 0) > 0, counts
        assert counts.get(f"{family} rejected", 0) > 0, counts


def test_an_accepted_random_program_compiles_with_nvrtc(tmp_path, monkeypatch):
    pytest.importorskip("cupy")
    import random

    import attnlang
    from attnlang.runtime.module import compile_variant

    monkeypatch.setenv("ATTNLANG_CACHE_DIR", str(tmp_path))
    rng = random.Random(7)
    for _ in range(500):
        source = fuzz.random_program(rng)
        try:
            variant = attnlang.parse(source)
        except attnlang.AttnError:
            continue
        km = compile_variant(variant, head_dim=64, dtype="bfloat16", arch="sm_90a",
                             kinds=("decode",))
        assert "decode" in km.cubins, source
        return
    pytest.fail("no random program was accepted")


def test_random_variants_are_accepted_and_cover_the_language():
    # tests/random_variants.py feeds the differential tests (emulated kernels here, the GPU's
    # in tests/runtime/test_gpu_random_variants.py): its programs must all be accepted, and
    # between them reach every stage and every kind of piece it knows.
    from tests.random_variants import random_variant

    texts = [random_variant(seed, cascade=seed % 2 == 1) for seed in range(300)]
    for text in texts:
        assert fuzz.check_source(text) == "accepted", text
    joined = "\n".join(texts)
    for construct in ("query = ", "key = ", "value = ", "output = ", "logits = ", "mask = ",
                      "softmax = off", "rope(", "rope_interleaved(", "theta=", "rsqrt(mean(",
                      "max(", "sum(cos(", "any(", "erf(", "tanh(", "sigmoid(", "clamp(",
                      "where(", "slopes[head]", "bias[head, ", "w_query[dim]", "g_key[kv_head]",
                      "prefix[batch]", "keep[batch, ", "allowed[q_row, kv_pos]",
                      "offset[batch]", "let rel", "const window", "param window", "const temp",
                      "param cap", "not (", " and (", " or (", "kv_len % 7", "mod(q_pos",
                      ">> 3 & 3", "^ 5", "int(float(", "float(qo_len % 5)"):
        assert construct in joined, construct
    assert not any("kv_len % 7" in t for t in texts[1::2]), "a cascade variant's value reads kv_len"
