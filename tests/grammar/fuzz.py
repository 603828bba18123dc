"""A seeded fuzzer of the attnlang front end: no input may crash the compiler.

Three families of inputs, in equal shares:

- ``random``: grammar-aware random programs (declarations, stages, expressions over every
  builtin name, function and operator, with edge-case numbers);
- ``mutant``: token and byte mutations of the example files (deletions, duplications, swaps,
  insertions, replaced bytes among them 0xff, tabs, form feeds and U+2028);
- ``numeric``: the examples with a number replaced by an edge case (int32 and float32
  limits, overflowing and subnormal values, very long literals).

The property (`check_source`): every input is either accepted, and then renders every kernel
kind and runs the NumPy reference on a tiny batch, or rejected with an AttnError whose every
position lies inside the file and whose shown line is that line. Anything else is a failure,
reported with the input shrunk to a minimal reproducer.

    python -m tests.grammar.fuzz --count 10000 [--seed 0]
"""

from __future__ import annotations

import argparse
import random
import sys
import traceback
from collections.abc import Iterator
from pathlib import Path

import numpy as np

import attnlang
from attnlang import reference
from attnlang.codegen.lower import lower
from attnlang.codegen.render import render
from attnlang.errors import AttnError
from attnlang.pipeline import decode_source

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = sorted((ROOT / "examples").glob("*.attn")) + sorted(
    (ROOT / "tests" / "variants").glob("*.attn"))

NAMES = ["logits", "q_pos", "kv_pos", "head", "kv_head", "batch", "qo_len", "kv_len", "dim",
         "sm_scale", "head_dim", "num_heads", "num_kv_heads", "causal", "q", "k", "v", "o",
         "cap", "w", "slopes", "undefined_name", "true", "false", "q_row", "dist", "table", "i"]
FUNCS = ["exp", "exp2", "log", "log2", "sqrt", "rsqrt", "tanh", "sigmoid", "abs", "min", "max",
         "pow", "floor", "ceil", "clamp", "softplus", "where", "sum", "mean", "rope", "erf",
         "sin", "cos", "mod", "int", "float"]
OPS = ["+", "-", "*", "/", "//", "%", "**", "<", "<=", ">", ">=", "==", "!=", "and", "or",
       "&", "|", "^", "<<", ">>"]
EDGE_NUMBERS = ["0", "1", "2", "0.5", "1e-45", "1e-50", "2147483647", "2147483648",
                "4294967296", "3.4028235e38", "3.5e38", "1e39", "1e400", "-2147483648",
                "9223372036854775808", "0.0", "1e308", "9" * 80, "1." + "0" * 70]
STAGES = ["query", "key", "value", "logits", "mask", "output", "softmax", "bogus"]
ODD_TEXT = ["\xff", "\t", "\x0c", "\x0b", "\u2028", "\r", "#", "(", ")", "[", "]", ",", "=",
            ":", "&&", "||", "!", "w[0]", "\x00", "é"]


# Names each stage can see (a wrong one now and then still tests the scope errors).
SCOPE = {"query": ["q", "dim", "q_pos", "head", "q_row"],
         "key": ["k", "dim", "kv_pos", "kv_head"],
         "value": ["v", "dim", "kv_pos", "kv_head"], "output": ["o", "dim", "q_pos", "head"],
         "logits": ["logits", "q_pos", "kv_pos", "head", "kv_len", "qo_len", "q_row", "dist"],
         "mask": ["q_pos", "kv_pos", "causal", "kv_len", "head", "q_row", "dist"], None: []}


def _expr(rng: random.Random, depth: int, stage: str | None = None) -> str:
    if depth <= 0 or rng.random() < 0.3:
        if rng.random() < 0.75 and SCOPE.get(stage):
            return rng.choice(SCOPE[stage] + ["sm_scale", "head_dim", "1.0", "2", "0.5"])
        return rng.choice(NAMES + EDGE_NUMBERS[:8]) if rng.random() < 0.8 else rng.choice(
            EDGE_NUMBERS)
    pick = rng.random()
    if pick < 0.45:
        return f"{_expr(rng, depth - 1, stage)} {rng.choice(OPS)} {_expr(rng, depth - 1, stage)}"
    if pick < 0.6:
        return rng.choice(["-", "not ", "-(", "(", "~"]) + _expr(rng, depth - 1, stage) + (
            ")" if rng.random() < 0.5 else "")
    if pick < 0.9:
        fn = rng.choice(FUNCS)
        args = ", ".join(_expr(rng, depth - 1, stage) for _ in range(rng.randint(0, 3)))
        if fn == "rope" and rng.random() < 0.5:
            args += ", theta=" + rng.choice(EDGE_NUMBERS[:8])
        return f"{fn}({args})"
    if pick < 0.91:
        return f"slopes[{rng.choice(['head', 'kv_head', 'batch', 'dim', 'q_pos'])}]"
    if pick < 0.93:  # a per-pair mask, mostly read at (q_row, kv_pos)
        return rng.choice(["pm[q_row, kv_pos]", "pm[q_row, kv_pos]", "pm[q_pos, kv_pos]",
                           "pm[kv_pos]", "not pm[q_row, kv_pos]"])
    if pick < 0.97:
        op = rng.choice(["sum", "max", "min", "any", "all", "mean", "where"])
        bounds = rng.choice(["4", "1, 3", "0", "300", "c", "kv_len", "2, 1", "1, 2, 3"])
        var = rng.choice(["i", "j", "head", "i"])
        return f"{op}({_expr(rng, depth - 1, stage)} for {var} in range({bounds}))"
    indices = [rng.choice(["head", "batch", "q_pos - kv_pos", "kv_pos // 4", "-1", "40",
                           _expr(rng, depth - 1, stage)]) for _ in range(rng.randint(1, 3))]
    return f"table[{', '.join(indices)}]"


def random_program(rng: random.Random) -> str:
    lines = [f"variant {rng.choice(['v', 'fuzz', 'a1'])}"]
    if rng.random() < 0.2:  # a well-formed per-pair mask, so programs reading it pass
        lines.append("param pm: bool[q, kv]")
    for _ in range(rng.randint(0, 3)):
        kind = rng.random()
        if kind < 0.4:
            ty = rng.choice(["float", "int", "bool", "double"])
            extent = rng.choice(["", "", "[heads]", "[kv_heads]", "[batch]", "[dim]", "[rows]",
                                 "[heads, 8]", "[batch, 64]", "[8, batch]", "[0]", "[4, 4, 2]",
                                 "[2.5]", "[c]", "[q, kv]", "[q, kv]", "[kv, q]", "[q]"])
            default = rng.choice(["", f" = {rng.choice(EDGE_NUMBERS)}", " = -1.5", " = true"])
            lines.append(f"param {rng.choice(['cap', 'w', 'slopes', 'table', 'NULL', 'pm'])}: "
                         f"{ty}{extent}{default}")
        elif kind < 0.7:
            lines.append(f"let {rng.choice(['dist', 'c', 'q'])} = "
                         f"{_expr(rng, 2, rng.choice(['logits', 'mask', None]))}")
        else:
            ty = rng.choice(["float", "int", "bool"])
            lines.append(f"const {rng.choice(['c', 'w', 'cap'])}: {ty} = {_expr(rng, 2)}")
    for _ in range(rng.randint(1, 3)):
        stage = rng.choice(STAGES) if rng.random() < 0.2 else rng.choice(
            ["logits", "mask", "query", "key", "value", "output"])
        if stage == "softmax":
            lines.append(f"softmax = {rng.choice(['on', 'off', 'maybe'])}")
        else:
            lines.append(f"{stage} = {_expr(rng, rng.randint(1, 4), stage)}")
    return "\n".join(lines) + rng.choice(["\n", "", "\n\n"])


def _tokens(text: str) -> list[str]:
    import re

    return re.findall(r"\s+|[A-Za-z_][A-Za-z0-9_]*|\d+\.?\d*(?:[eE][+-]?\d+)?|\*\*|[<>=!]=|.",
                      text)


def mutant(rng: random.Random, text: str) -> str | bytes:
    if rng.random() < 0.25:  # a byte-level mutation
        data = bytearray(text.encode("utf-8"))
        for _ in range(rng.randint(1, 3)):
            i = rng.randrange(len(data) + 1)
            data[i:i + rng.randint(0, 1)] = rng.choice(ODD_TEXT).encode("utf-8", "surrogatepass") \
                if rng.random() < 0.7 else bytes([rng.randrange(256)])
        return bytes(data)
    toks = _tokens(text)
    for _ in range(rng.randint(1, 4)):
        i = rng.randrange(len(toks))
        op = rng.random()
        if op < 0.3:
            del toks[i]
        elif op < 0.5:
            toks.insert(i, toks[i])
        elif op < 0.7:
            j = rng.randrange(len(toks))
            toks[i], toks[j] = toks[j], toks[i]
        else:
            toks.insert(i, rng.choice(ODD_TEXT + OPS + NAMES + FUNCS + ["variant", "param"]))
        if not toks:
            toks = ["variant"]
    return "".join(toks)


def numeric(rng: random.Random, text: str) -> str:
    toks = _tokens(text)
    spots = [i for i, t in enumerate(toks) if t[:1].isdigit()]
    if not spots:
        return text + f"\nlogits = logits * {rng.choice(EDGE_NUMBERS)}\n"
    for i in rng.sample(spots, k=min(len(spots), rng.randint(1, 2))):
        toks[i] = rng.choice(EDGE_NUMBERS)
    return "".join(toks)


def programs(count: int, seed: int = 0) -> Iterator[tuple[str, str | bytes]]:
    """(family, source) pairs, `count` of them, deterministic in `seed`."""
    rng = random.Random(seed)
    texts = [p.read_text() for p in EXAMPLES]
    for n in range(count):
        family = ("random", "mutant", "numeric")[n % 3]
        if family == "random":
            yield family, random_program(rng)
        elif family == "mutant":
            yield family, mutant(rng, rng.choice(texts))
        else:
            yield family, numeric(rng, rng.choice(texts))


# ---------------------------------------------------------------------------- the property


class Failure(AssertionError):
    """An input that broke the property; its message holds the (shrunk) source."""


def _tiny_params(v) -> dict:
    sizes = {"heads": 2, "kv_heads": 1, "batch": 1, "dim": 64}
    rng = np.random.default_rng(0)
    params = {}
    for p in v.params:
        is_float = str(p.type) == "float"
        if p.is_pair:  # check_source's one request: 3 queries over 5 keys
            params[p.name] = [rng.random((3, 5)) < 0.5]
            continue
        if p.is_tensor and np.prod(p.shape(sizes), dtype=float) > 1 << 16:
            # A table as large as the checker allows (2^31 - 1 elements): one value seen
            # through zero strides, so the reference reads it without the memory.
            value = {"float": 0.5, "int": 1, "bool": True}[str(p.type)]
            dtype = {"float": np.float64, "int": np.int64, "bool": np.bool_}[str(p.type)]
            params[p.name] = np.broadcast_to(np.asarray(value, dtype), p.shape(sizes))
        elif p.is_tensor:
            shape = p.shape(sizes)
            params[p.name] = (rng.standard_normal(shape).astype(np.float32) if is_float
                              else rng.random(shape) < 0.5 if str(p.type) == "bool"
                              else rng.integers(0, 3, shape).astype(np.int32))
        elif p.default is None:
            params[p.name] = 1.5 if is_float else 2
    return params


def _check_error(e: AttnError, text: str) -> None:
    lines = text.split("\n")
    for err in e.errors:
        if err.span is None:
            continue  # a file-level error (no position to check)
        line, col = err.span.line, err.span.col
        assert 1 <= line <= len(lines), f"error line {line} outside the file ({len(lines)})"
        shown = lines[line - 1].rstrip("\r")
        assert 1 <= col <= len(shown) + 1, f"error column {col} outside line {line}"
        assert f"\n  {shown}\n" in str(err) + "\n", "the error shows another line"


def check_source(source: str | bytes) -> str:
    """Apply the property to one input; returns "accepted" or "rejected", raises otherwise."""
    try:
        text = decode_source(source, "fuzz.attn") if isinstance(source, bytes) else source
        v = attnlang.parse(text, "fuzz.attn")
    except AttnError as e:
        _check_error(e, source.decode("utf-8", "replace") if isinstance(source, bytes)
                     else source)
        return "rejected"
    hooks = lower(v)
    for kind in ("decode", "prefill", "merge"):
        render(hooks, kind, "bfloat16", 64, "sm_90a")
    rng = np.random.default_rng(1)
    q, k = rng.standard_normal((3, 2, 64)), rng.standard_normal((5, 1, 64))
    with np.errstate(all="ignore"):
        reference.attention(v, q, k, k, params=_tiny_params(v))
    return "accepted"


def shrink(source: str | bytes) -> str | bytes:
    """A smaller input that still fails (greedy: drop lines, then characters)."""
    def fails(s) -> bool:
        try:
            check_source(s)
        except Exception:
            return True
        return False

    unit = b"\n" if isinstance(source, bytes) else "\n"
    parts = source.split(unit)
    i = 0
    while i < len(parts) and len(parts) > 1:
        trial = parts[:i] + parts[i + 1:]
        if fails(unit.join(trial)):
            parts = trial
        else:
            i += 1
    cur = unit.join(parts)
    i = 0
    while i < len(cur):
        trial = cur[:i] + cur[i + 1:]
        if trial and fails(trial):
            cur = trial
        else:
            i += 1
    return cur


def run(count: int, seed: int = 0, stop_after: int = 5) -> tuple[dict, list[str]]:
    """Fuzz `count` inputs; (counts by outcome and family, failure reports)."""
    counts: dict[str, int] = {}
    failures = []
    for family, source in programs(count, seed):
        try:
            outcome = check_source(source)
        except Exception as e:
            small = shrink(source)
            failures.append(f"{family}: {type(e).__name__}: {e}\nshrunk source: {small!r}\n"
                            + "".join(traceback.format_exception_only(type(e), e)))
            if len(failures) >= stop_after:
                break
            outcome = "failed"
        counts[f"{family} {outcome}"] = counts.get(f"{family} {outcome}", 0) + 1
    return counts, failures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--count", type=int, default=10000)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    counts, failures = run(args.count, args.seed, stop_after=20)
    for key in sorted(counts):
        print(f"{key:24s} {counts[key]}")
    for f in failures:
        print("\n" + f)
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
