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
