"""Typed IR of an attention variant: the output of the checker, the input of every backend.

The checker (`attnlang.codegen.check`) resolves names, scopes them to stages, checks types,
inserts int->float promotions explicitly (`Cast`) and folds consts, so that the backends
(the NumPy reference and the CUDA lowering) only ever *evaluate* this tree: they never
re-derive a type or a scope rule.

Every node is a frozen dataclass. Source spans are kept for messages but excluded from
equality and hashing, so the same variant written at other lines is the same variant.

Example: ``logits = cap * tanh(logits / cap)`` with ``param cap: float = 50.0`` becomes::

    Binary("*", Param("cap", FLOAT), Call("tanh", (Binary("/", Var("logits", FLOAT),
           Param("cap", FLOAT), FLOAT),), FLOAT), FLOAT)
"""

from __future__ import annotations

import dataclasses
import enum
from dataclasses import dataclass, field

from attnlang.errors import Span

__all__ = [
    "Type", "BOOL", "INT", "FLOAT", "Expr", "Const", "Var", "Param", "ParamIndex", "Cast",
    "Unary", "Binary", "Call", "Reduce", "Rope", "LoopVar", "Loop", "ParamSpec", "Variant",
    "STAGES", "VECTOR_STAGES", "INDEX_VARS", "STAGE_VARS", "EXTENT_INDEX", "PAIR_EXTENTS",
    "SCALAR_FUNCS", "REDUCTIONS", "LOOP_REDUCTIONS", "MAX_LOOP_COUNT", "MAX_TENSOR_ELEMENTS",
    "walk", "varies_with_dim", "extent_sizes", "KV_SCALE_PARAMS", "with_kv_scales",
]


class Type(enum.Enum):
    BOOL = "bool"
    INT = "int"
    FLOAT = "float"

    def __str__(self) -> str:
        return self.value


BOOL, INT, FLOAT = Type.BOOL, Type.INT, Type.FLOAT

# The stages of LANGUAGE.md section 3, in evaluation order. `softmax` is a flag, not an expr.
STAGES = ("query", "key", "value", "logits", "mask", "output")
# Stages that describe one element of a head vector (they see `dim` and the reductions).
VECTOR_STAGES = ("query", "key", "value", "output")
# The element name each vector stage reads.
STAGE_INPUT = {"query": "q", "key": "k", "value": "v", "output": "o"}

# Built-in names with their type and the stages that may read them (LANGUAGE.md section 4).
_ALL = frozenset(STAGES)
INDEX_VARS: dict[str, tuple[Type, frozenset[str]]] = {
    "batch": (INT, _ALL),
    "head": (INT, frozenset({"query", "logits", "mask", "output"})),
    "kv_head": (INT, _ALL),
    "qo_len": (INT, _ALL),
    "kv_len": (INT, _ALL),
    "q_pos": (INT, frozenset({"query", "logits", "mask", "output"})),
    # The query's row in its request, 0..qo_len-1 (FlexAttention's q_idx); the checker
    # expands it to q_pos - (kv_len - qo_len).
    "q_row": (INT, frozenset({"query", "logits", "mask", "output"})),
    "kv_pos": (INT, frozenset({"key", "value", "logits", "mask"})),
    "causal": (BOOL, frozenset({"logits", "mask"})),
    "logits": (FLOAT, frozenset({"logits"})),
    "q": (FLOAT, frozenset({"query"})),
    "k": (FLOAT, frozenset({"key"})),
    "v": (FLOAT, frozenset({"value"})),
    "o": (FLOAT, frozenset({"output"})),
    "dim": (INT, frozenset(VECTOR_STAGES)),
    # Kernel-wide scalars, visible everywhere.
    "sm_scale": (FLOAT, _ALL),
    "head_dim": (INT, _ALL),
    "num_heads": (INT, _ALL),
    "num_kv_heads": (INT, _ALL),
}
STAGE_VARS = INDEX_VARS  # alias used by the checker's hints

# Named tensor-param extents (their size is known at run time) and the one index variable
# each may be indexed by. Other extents are fixed sizes (a literal or an int const).
EXTENT_INDEX = {"heads": "head", "kv_heads": "kv_head", "batch": "batch", "dim": "dim",
                "q": "q_row", "kv": "kv_pos"}
# A per-pair mask, `param allowed: bool[q, kv]`: each request's own [qo_len, kv_len] matrix,
# given to plan() (tiles are skipped by its bits) and stored as packed bits.
PAIR_EXTENTS = ("q", "kv")
# Largest number of elements of a tensor param's fixed extents.
MAX_TENSOR_ELEMENTS = 2**31 - 1

# Scalar functions: name -> number of arguments. `where` is typed specially by the checker.
SCALAR_FUNCS = {
    "exp": 1, "exp2": 1, "log": 1, "log2": 1, "sqrt": 1, "rsqrt": 1, "tanh": 1,
    "sigmoid": 1, "abs": 1, "floor": 1, "ceil": 1, "softplus": 1, "erf": 1, "sin": 1, "cos": 1,
    "int": 1, "float": 1,
    "min": 2, "max": 2, "pow": 2, "mod": 2, "clamp": 3, "where": 3,
}
# Reductions over `dim` (one argument). `min`/`max` with two arguments are the scalar forms.
REDUCTIONS = ("sum", "mean", "max", "min")
# Reductions over a bounded range, `sum(E for i in range(N))`; any/all take bools.
LOOP_REDUCTIONS = ("sum", "max", "min", "any", "all")
# Most iterations a bounded reduction may have (it is a loop per element in the kernels).
MAX_LOOP_COUNT = 256


def _span() -> Span | None:
    return field(default=None, compare=False, hash=False, repr=False)


@dataclass(frozen=True)
class Expr:
    """Base of all typed expressions. `type` is the value's type after the checker."""


@dataclass(frozen=True)
class Const(Expr):
    """A literal or a folded `const`. value is bool, int or float matching `type`."""

    value: bool | int | float
    type: Type
    span: Span | None = _span()


@dataclass(frozen=True)
class Var(Expr):
    """A built-in name of INDEX_VARS (`causal` never appears: the checker expands it)."""

    name: str
    type: Type
    span: Span | None = _span()


@dataclass(frozen=True)
class Param(Expr):
    """A scalar run-time param, read from the kernel's params struct."""

    name: str
    type: Type
    span: Span | None = _span()


@dataclass(frozen=True)
class ParamIndex(Expr):
    """Element of a tensor param, `name[i, j, ...]`: one int index per extent.

    An axis of a named extent (EXTENT_INDEX) is indexed by its own Var; an axis of a fixed
    extent by any int expression, and an index outside 0..extent-1 reads 0 (false for bool
    tensors): nothing is read out of bounds.
    """

    name: str
    indices: tuple[Expr, ...]
    extents: tuple[str | int, ...]
    type: Type
    span: Span | None = _span()


@dataclass(frozen=True)
class Cast(Expr):
    """Explicit int -> float promotion inserted by the checker."""

    x: Expr
    type: Type = FLOAT
    span: Span | None = _span()


@dataclass(frozen=True)
class Unary(Expr):
    """op: "-" (int or float), "~" (int: bitwise not) or "not" (bool)."""

    op: str
    x: Expr
    type: Type
    span: Span | None = _span()


@dataclass(frozen=True)
class Binary(Expr):
    """Arithmetic `+ - * / // % **`, comparisons `< <= > >= == !=`, logic `and or`, and
    on ints the bitwise `& | ^ << >>`.

    Operands already have matching types (the checker inserted Casts). `/` and `%` on two
    ints truncate toward zero (C semantics), `//` floors; `**` is always float. A shift count
    outside 0..31 shifts every bit out (`<<` gives 0, `>>` 0 or -1); `<<` wraps in int32.
    """

    op: str
    a: Expr
    b: Expr
    type: Type
    span: Span | None = _span()


@dataclass(frozen=True)
class Call(Expr):
    """A scalar function of SCALAR_FUNCS. Float functions get float args (Cast inserted);
    `min max abs clamp mod` keep ints when every argument is int; `where(c, a, b)`;
    `int(x)` truncates a float toward zero (saturating, NaN -> 0), `float(x)` converts."""

    fn: str
    args: tuple[Expr, ...]
    type: Type
    span: Span | None = _span()


@dataclass(frozen=True)
class Reduce(Expr):
    """sum/mean/max/min of a float expression over `dim` (vector stages only). A scalar."""

    op: str
    x: Expr
    type: Type = FLOAT
    span: Span | None = _span()


@dataclass(frozen=True)
class LoopVar(Expr):
    """The variable of the bounded reduction that binds it (an int)."""

    name: str
    type: Type = INT
    span: Span | None = _span()


@dataclass(frozen=True)
class Loop(Expr):
    """`op(body for var in range(start, stop))`: body evaluated at var = start .. stop - 1 and
    reduced by op (sum, max, min: numbers, the body's type; any, all: bools). The bounds are
    constants, 1 <= stop - start <= MAX_LOOP_COUNT."""

    op: str
    var: str
    start: int
    stop: int
    body: Expr
    type: Type
    span: Span | None = _span()


@dataclass(frozen=True)
class Rope(Expr):
    """Rotary embedding of vector expression x at integer position pos (vector stages only).

    interleaved=False: rotate-half, pairs (i, i + head_dim/2), frequency
    theta^(-2 (i mod head_dim/2) / head_dim). interleaved=True: GPT-J, pairs (2i, 2i+1),
    frequency theta^(-2i / head_dim) for both elements of pair i.
    """

    x: Expr
    pos: Expr  # INT, does not vary with dim
    theta: Expr  # FLOAT, does not vary with dim
    interleaved: bool
    type: Type = FLOAT
    span: Span | None = _span()


@dataclass(frozen=True)
class ParamSpec:
    """A declared run-time param. extents is () for scalars, else one entry per axis: a
    name of EXTENT_INDEX or a fixed size. Scalars are INT or FLOAT; tensors may be BOOL."""

    name: str
    type: Type
    extents: tuple[str | int, ...] = ()
    default: int | float | None = None
    span: Span | None = _span()

    @property
    def is_tensor(self) -> bool:
        return bool(self.extents)

    @property
    def is_pair(self) -> bool:
        """A per-pair mask (bool[q, kv]): one matrix per request, given to plan()."""
        return self.extents == PAIR_EXTENTS

    def shape(self, sizes: dict[str, int]) -> tuple[int, ...]:
        """The tensor's shape, given the sizes of the named extents it uses."""
        return tuple(sizes[e] if isinstance(e, str) else e for e in self.extents)

    @property
    def declared(self) -> str:
        """The declaration's type, e.g. "float[heads, 32]"."""
        if not self.extents:
            return str(self.type)
        return f"{self.type}[{', '.join(map(str, self.extents))}]"


@dataclass(frozen=True)
class Variant:
    """A checked variant. Omitted stages are None (identity; mask None = no mask).

    params keep declaration order; consts hold the folded values (already substituted into
    the stages, kept for introspection).
    """

    name: str
    params: tuple[ParamSpec, ...] = ()
    consts: tuple[tuple[str, bool | int | float], ...] = ()
    query: Expr | None = None
    key: Expr | None = None
    value: Expr | None = None
    logits: Expr | None = None
    mask: Expr | None = None
    output: Expr | None = None
    softmax: bool = True
    source: str = field(default="", compare=False, hash=False, repr=False)
    filename: str = field(default="<string>", compare=False, hash=False, repr=False)

    def stage(self, name: str) -> Expr | None:
        return getattr(self, name)

    def param(self, name: str) -> ParamSpec:
        for p in self.params:
            if p.name == name:
                return p
        raise KeyError(name)


def walk(e: Expr):
    """Yield e and every sub-expression, parents first."""
    yield e
    if isinstance(e, (Cast, Unary, Reduce)):
        yield from walk(e.x)
    elif isinstance(e, Binary):
        yield from walk(e.a)
        yield from walk(e.b)
    elif isinstance(e, Call):
        for a in e.args:
            yield from walk(a)
    elif isinstance(e, Rope):
        yield from walk(e.x)
        yield from walk(e.pos)
        yield from walk(e.theta)
    elif isinstance(e, ParamIndex):
        for i in e.indices:
            yield from walk(i)
    elif isinstance(e, Loop):
        yield from walk(e.body)


def varies_with_dim(e: Expr) -> bool:
    """True if e's value differs between elements of a head vector (it is 'vector-valued').

    Reductions are scalars even though their argument varies; a Rope varies.
    """
    if isinstance(e, Var):
        return e.name in ("q", "k", "v", "o", "dim")
    if isinstance(e, ParamIndex):
        return any(varies_with_dim(i) for i in e.indices)
    if isinstance(e, Loop):
        return varies_with_dim(e.body)
    if isinstance(e, Reduce):
        return False
    if isinstance(e, Rope):
        return True
    if isinstance(e, (Cast, Unary)):
        return varies_with_dim(e.x)
    if isinstance(e, Binary):
        return varies_with_dim(e.a) or varies_with_dim(e.b)
    if isinstance(e, Call):
        return any(varies_with_dim(a) for a in e.args)
    return False


# Vector stages by the head dim of their vector: queries and keys, values and outputs.
_QK_STAGES, _VO_STAGES = ("query", "key"), ("value", "output")


def extent_sizes(v: Variant, num_heads: int, num_kv_heads: int, batch: int, head_dim: int,
                 head_dim_vo: int | None = None) -> dict[str, dict[str, int]]:
    """The size of every named extent of each tensor param of v, by param name.

    A `dim` axis is as long as the vector of the stages that read it: head_dim in query and
    key, head_dim_vo (None: head_dim) in value and output. A table read in stages of both
    kinds needs the two to agree: ValueError otherwise, naming the param.
    """
    vo = head_dim if head_dim_vo is None else head_dim_vo
    common = {"heads": num_heads, "kv_heads": num_kv_heads, "batch": batch}
    readers: dict[str, set[str]] = {}
    for stage in VECTOR_STAGES:
        e = v.stage(stage)
        for node in walk(e) if e is not None else ():
            if isinstance(node, ParamIndex):
                readers.setdefault(node.name, set()).add(stage)
    sizes = {}
    for p in v.params:
        if p.is_pair:  # its size is each request's own (qo_len, kv_len)
            continue
        stages = readers.get(p.name, set())
        dim = vo if stages and stages <= set(_VO_STAGES) else head_dim
        both = stages & set(_QK_STAGES) and stages & set(_VO_STAGES)
        if "dim" in p.extents and head_dim != vo and both:
            raise ValueError(
                f"param {p.name!r} ({p.declared}) is read in the {', '.join(sorted(stages))} "
                f"stages, whose vectors are {head_dim} (query, key) and {vo} (value, output) "
                f"long: its dim axis cannot be both; declare one table per head dim")
        sizes[p.name] = {**common, "dim": dim}
    return sizes


# The run-time params an fp8 KV cache's kernels take besides the variant's own: the scales
# that dequantise K and V (value = e4m3 value * scale of its KV head).
KV_SCALE_PARAMS = ("k_scale", "v_scale")


def with_kv_scales(v: Variant) -> Variant:
    """v as the kernels of an fp8 KV cache see it: its params followed by k_scale and v_scale,
    float[kv_heads] (a per-tensor scale is one value repeated). Idempotent; raises ValueError
    when v declares either name otherwise (the names are the cache's).

    >>> with_kv_scales(Variant("plain")).params[1].declared
    'float[kv_heads]'
    """
    wanted = tuple(ParamSpec(name, FLOAT, ("kv_heads",)) for name in KV_SCALE_PARAMS)
    have = {p.name: p for p in v.params}
    if all(have.get(p.name) == p for p in wanted):
        return v
    clash = [name for name in KV_SCALE_PARAMS if name in have]
    if clash:
        raise ValueError(
            f"variant {v.name!r} declares param {clash[0]!r}, a name an fp8 KV cache gives its "
            f"dequantisation scales ({', '.join(KV_SCALE_PARAMS)}: float[kv_heads]); rename "
            "the variant's param")
    return dataclasses.replace(v, params=v.params + wanted)
