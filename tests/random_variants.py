"""Seeded random attention variants that the checker accepts and whose numbers stay in range,
for the differential tests: each one run by the kernels and by the NumPy reference must agree
within the tolerance of LANGUAGE.md section 7.

Where the front-end fuzzer (tests/grammar/fuzz.py) throws anything at the compiler and asks
only that it never crash, these programs are meant to be accepted and to compute something:
every stage is built from pieces of the kinds real variants use (tables indexed by heads,
requests, dims and buckets; rope; norms over the head vector; soft-caps; position biases;
bounded reductions; ints of a signed distance: floor division, C's %, shifts, truncating
casts; windows, prefixes, blocks, per-pair masks and bool tables combined with and / or /
not; softmax off over sigmoid weights), nested at random, with lets and consts.
The pieces keep values bounded (gates, tanh, rsqrt-normalised vectors, small coefficients), so
a disagreement means a kernel, lowering or reference bug, not float32 against float64 on a
badly conditioned input. The names of tables follow tests/runtime/test_gpu_attention's
make_params (`slopes` geometric, other float tables near 1, `int[batch]` a position).

    text = random_variant(seed)   # a .attn source; deterministic in seed
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field


@dataclass
class _Program:
    """The declarations a program's pieces asked for, in order, without repeats."""
    decls: list[str] = field(default_factory=list)

    def need(self, line: str) -> None:
        if line not in self.decls:
            self.decls.append(line)


def _num(rng: random.Random, lo: float, hi: float) -> str:
    """A float literal in [lo, hi), four significant digits."""
    text = f"{rng.uniform(lo, hi):.4g}"
    return text if any(c in text for c in ".e") else text + ".0"


# ------------------------------------------------------------------ vector stages

# The element name, the position and the head each vector stage sees.
_VECTOR = {"query": ("q", "q_pos", "head"), "key": ("k", "kv_pos", "kv_head"),
           "value": ("v", "kv_pos", "kv_head"), "output": ("o", "q_pos", "head")}


def _vector_stage(rng: random.Random, prog: _Program, stage: str) -> str:
    x, pos, head = _VECTOR[stage]
    heads = "heads" if head == "head" else "kv_heads"
    # Innermost: the element itself, or its vector normalised (QK-norm), or centred.
    pick = rng.random()
    if pick < 0.25:
        expr = f"{x} * rsqrt(mean({x} * {x}) + 1e-6)"
    elif pick < 0.35:
        expr = f"{x} - {_num(rng, 0.05, 0.3)} * mean({x})"
    elif pick < 0.45:
        expr = f"{x} + {_num(rng, 0.01, 0.05)} * (max({x}) + min({x}))"
    else:
        expr = x
    for _ in range(rng.randint(1, 2)):
        pick = rng.random()
        if pick < 0.2:
            prog.need(f"param w_{stage}: float[dim]")
            expr = f"({expr}) * w_{stage}[dim]"
        elif pick < 0.35:
            prog.need(f"param g_{stage}: float[{heads}]")
            expr = f"({expr}) * g_{stage}[{head}]"
        elif pick < 0.5:
            expr = f"({expr}) * (1.0 + {_num(rng, 0.02, 0.1)} * cos(float({pos} % 11)))"
        elif pick < 0.6:
            every = rng.choice([2, 3, 8])
            expr = f"where(dim % {every} == 0, ({expr}) * {_num(rng, 0.5, 1.5)}, {expr})"
        elif pick < 0.7:
            freq = _num(rng, 0.1, 1.0)
            expr = f"({expr}) + {_num(rng, 0.02, 0.2)} * sin(float(dim) * {freq})"
        elif pick < 0.8:
            expr = f"({expr}) * sigmoid({x} + {_num(rng, 0.5, 2.0)})"
        elif pick < 0.84:
            expr = f"{_num(rng, 1.5, 3.0)} * tanh(({expr}) / {_num(rng, 1.5, 3.0)})"
        elif pick < 0.88 and stage in ("query", "output"):
            term = rng.choice(["qo_len % 5", "q_row % 3", "batch", "kv_len - q_pos"])
            expr = f"({expr}) * (1.0 + {_num(rng, 0.005, 0.02)} * float({term}))"
        else:
            expr = f"clamp({expr}, -{_num(rng, 2.0, 4.0)}, {_num(rng, 2.0, 4.0)})"
    if stage in ("query", "key") and rng.random() < 0.35:
        theta = rng.choice(["", ", theta=500.0", ", theta=1000000.0"])
        fn = rng.choice(["rope", "rope_interleaved"])
        expr = f"{fn}({expr}, {pos}{theta})"
    return expr


# ------------------------------------------------------------------ logits

def _logits(rng: random.Random, prog: _Program, softmax: bool, rel: str) -> str:
    expr = "logits"
    for _ in range(rng.randint(1, 3)):
        pick = rng.random()
        if pick < 0.12:
            if rng.random() < 0.5:
                prog.need("param cap: float = 20.0")
                cap = "cap"
            else:
                cap = _num(rng, 5.0, 30.0)
            expr = f"{cap} * tanh(({expr}) / {cap})"
        elif pick < 0.24:
            prog.need("param slopes: float[heads]")
            expr = f"({expr}) - slopes[head] * float(abs({rel}))"
        elif pick < 0.34:
            prog.need("param bias: float[heads, 8]")
            expr = f"({expr}) + bias[head, clamp(({rel}) // {rng.choice([16, 64, 200])}, 0, 7)]"
        elif pick < 0.42:
            expr = f"({expr}) * {_num(rng, 0.5, 1.5)}"
        elif pick < 0.5:
            freq = _num(rng, 0.1, 1.0)
            expr = f"({expr}) + {_num(rng, 0.1, 0.5)} * sin(float(kv_pos) * {freq})"
        elif pick < 0.58:
            expr = f"where(head % 2 == 0, {expr}, ({expr}) * {_num(rng, 0.3, 0.9)})"
        elif pick < 0.64:
            expr = f"clamp({expr}, -{_num(rng, 4.0, 10.0)}, {_num(rng, 4.0, 10.0)})"
        elif pick < 0.72:
            n = rng.randint(2, 12)
            expr = (f"({expr}) + {_num(rng, 0.01, 0.1)} * sum(cos(float({rel}) * "
                    f"{_num(rng, 0.001, 0.05)} * float(i)) for i in range(1, {n}))")
        elif pick < 0.78:
            expr = f"({expr}) + {_num(rng, 0.05, 0.2)} * erf({expr})"
        elif pick < 0.84:
            expr = f"({expr}) - {_num(rng, 1e-4, 2e-3)} * float(kv_len - kv_pos + q_row)"
        elif pick < 0.9:
            prog.need("param offset: int[batch]")
            expr = f"({expr}) + {_num(rng, 0.05, 0.3)} * float(offset[batch] % 3)"
        elif pick < 0.93:
            expr = f"({expr}) + where(causal, 0.0, -{_num(rng, 0.5, 3.0)})"
        elif pick < 0.96:  # ints of a signed distance: floor division, C's %, xor, max
            term = rng.choice([f"(({rel}) // {rng.randint(2, 9)}) % 3",
                               f"mod({rel}, {rng.randint(2, 9)}) - 2",
                               "max(q_row - kv_pos, -3) ^ 5", f"({rel}) >> 3 & 3"])
            expr = f"({expr}) + {_num(rng, 0.02, 0.2)} * float({term})"
        else:
            prog.need("const temp: float = 2 ** 0.5")
            expr = f"({expr}) / temp"
    if not softmax:  # FlashSigmoid-style weights: bounded, and the output a weighted sum
        expr = f"sigmoid(({expr}) - {_num(rng, 3.0, 8.0)})"
    return expr


# ------------------------------------------------------------------ mask

def _mask_atom(rng: random.Random, prog: _Program, rel: str) -> str:
    pick = rng.random()
    if pick < 0.2:
        return rng.choice(["causal", "kv_pos <= q_pos", f"{rel} >= 0"])
    if pick < 0.32:
        if not any(line.split(":")[0].endswith(" window") for line in prog.decls):
            prog.need(f"const window: int = {rng.choice([7, 64, 300, 1000])}"
                      if rng.random() < 0.5 else "param window: int = 500")
        return f"{rel} < window"
    if pick < 0.42:
        prog.need("param prefix: int[batch]")
        return "kv_pos < prefix[batch]"
    if pick < 0.5:
        m = rng.choice([2, 3, 5])
        return f"kv_pos % {m} != {rng.randrange(m)}"
    if pick < 0.58:
        return f"kv_pos < {rng.choice([1, 4, 16])}"  # attention sinks
    if pick < 0.66:
        prog.need("param allowed: bool[q, kv]")
        return "allowed[q_row, kv_pos]"
    if pick < 0.73:
        prog.need("param keep: bool[batch, 64]")
        return "keep[batch, kv_pos % 64]"
    if pick < 0.8:
        b = rng.choice([16, 32, 128])
        return f"kv_pos // {b} <= q_pos // {b}"
    if pick < 0.83:
        return f"head % {rng.choice([2, 4])} == 0"
    if pick < 0.89:  # ints of a signed distance (negative past the diagonal)
        m = rng.randint(2, 7)
        return rng.choice([f"mod({rel}, {m}) != {rng.randrange(m)}",
                           f"({rel}) % {m} != {rng.randint(1 - m, m - 1)}",
                           f"(({rel}) >> {rng.randint(1, 4)}) != -1",
                           f"int(float({rel}) / {_num(rng, 2.0, 40.0)}) != {rng.randint(-2, 2)}"])
    if pick < 0.94:
        return f"any(kv_pos == q_pos - {rng.choice([1, 3, 17])} * i for i in range(4))"
    return f"(kv_pos & {rng.choice([1, 3, 7])}) != 1"


def _mask(rng: random.Random, prog: _Program, rel: str) -> str:
    expr = _mask_atom(rng, prog, rel)
    for _ in range(rng.randint(0, 2)):
        atom = _mask_atom(rng, prog, rel)
        if rng.random() < 0.2:
            atom = f"not ({atom})"
        expr = f"({expr}) {rng.choice(['and', 'or', 'or'])} ({atom})"
    return expr


# ------------------------------------------------------------------ the program

def random_variant(seed: int, *, cascade: bool = False) -> str:
    """A random .attn source the checker accepts. cascade: no key or value stage reads the
    request (`batch`, `qo_len`, `kv_len`), so the variant has a cascade kernel."""
    rng = random.Random(seed)
    prog = _Program()
    stages: dict[str, str] = {}
    rel = "q_pos - kv_pos"
    if rng.random() < 0.3:
        prog.need("let rel = q_pos - kv_pos")
        rel = "rel"
    softmax = rng.random() >= 0.12
    for stage in ("query", "key", "value", "output"):
        if rng.random() < 0.3:
            stages[stage] = _vector_stage(rng, prog, stage)
    if not cascade and "value" in stages and rng.random() < 0.3:
        stages["value"] = f"({stages['value']}) * (1.0 + 0.001 * float(kv_len % 7))"
    if rng.random() < 0.7 or not softmax:
        stages["logits"] = _logits(rng, prog, softmax, rel)
    if rng.random() < 0.75:
        stages["mask"] = _mask(rng, prog, rel)
    lines = [f"variant random_{seed}", *prog.decls]
    lines += [f"{stage} = {expr}" for stage, expr in stages.items()]
    if not softmax:
        lines.append("softmax = off")
    return "\n".join(lines) + "\n"
