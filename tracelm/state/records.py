"""Frozen records that stages take and return.

Arrays inside records are made read-only on construction, so a stage cannot mutate what another
stage (or the trace) already saw.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import attrs
import numpy as np


def frozen_array(a: np.ndarray) -> np.ndarray:
    """Mark an array read-only (a view if it is not already read-only) and return it."""
    if a.flags.writeable:
        a = a.view()
        a.flags.writeable = False
    return a


def _ro(a: np.ndarray | None) -> np.ndarray | None:
    return None if a is None else frozen_array(a)


@attrs.frozen(slots=True, eq=False)
class QMatrix:
    """A [rows, cols] weight matrix as the model file stores it, for the compiled kernels (`compute: kernels`).

    `parts` stack row after row, each (blocks, qtype): `blocks` a read-only uint8 [rows, bytes per row] of
    GGUF blocks of GGML type `qtype` (F32, F16 and BF16 are blocks of one value). A fused q/k/v or gate/up
    has one part per run of tensors of one type (Q4_K_M files hold some v and down projections in Q6_K): each
    part is one kernel call. `halves`: how the activations meet quantized blocks (the run config's
    `activations`): 1, one int8 block per weight block (llama.cpp's q8 precision); 2, a hi and a lo int8 block
    (~15 bits, twice the work).
    `packed`: the parts of a quantized type in whole groups of 8 rows hold their bytes reordered for the kernels
    (`kernels.pack`: the same numbers, fewer loads per block); `kernels.unpack_rows` gives the file's rows back."""

    shape: tuple[int, int]
    parts: tuple[tuple[np.ndarray, int], ...] = attrs.field(
        converter=lambda parts: tuple((frozen_array(b), int(t)) for b, t in parts))
    halves: int = attrs.field(default=2, validator=attrs.validators.in_((1, 2)))
    packed: bool = False

    def __attrs_post_init__(self) -> None:
        rows = sum(b.shape[0] for b, _t in self.parts)
        if rows != self.shape[0] or any(b.dtype != np.uint8 or b.ndim != 2 for b, _t in self.parts):
            raise ValueError(f"QMatrix parts: {rows} uint8 rows given for shape {list(self.shape)}")

    @property
    def nbytes(self) -> int:
        """Bytes of the blocks (what the matrix holds in memory)."""
        return sum(b.nbytes for b, _t in self.parts)

    @property
    def qtypes(self) -> tuple[int, ...]:
        return tuple(t for _b, t in self.parts)


def _matrix(a: np.ndarray | RowSource | QMatrix) -> np.ndarray | RowSource | QMatrix:
    return a if isinstance(a, RowSource | QMatrix) else frozen_array(a)


@attrs.frozen(slots=True)
class Hidden:
    """Activations of T consecutive positions starting at `start`: x is [T, width]."""

    x: np.ndarray = attrs.field(converter=frozen_array)
    start: int


@attrs.frozen(slots=True)
class Heads:
    """Per-head projections of T positions: q [T, n_head, hd], k and v [T, n_head_kv, hd]."""

    q: np.ndarray = attrs.field(converter=frozen_array)
    k: np.ndarray = attrs.field(converter=frozen_array)
    v: np.ndarray = attrs.field(converter=frozen_array)
    start: int


@attrs.frozen(slots=True)
class Logits:
    """Unnormalised next-token scores: values [T, vocab] for positions start..start+T-1."""

    values: np.ndarray = attrs.field(converter=frozen_array)
    start: int


@attrs.frozen(slots=True)
class LayerWeights:
    """One transformer block: matrices [out, in] row-major as GGUF stores them, in f32 (`compute: reference`)
    or as the file's blocks (QMatrix, `compute: kernels`); vectors in f32.

    q, k and v are fused into one matrix (rows: q, then k, then v) and gate/up into another
    (rows: gate, then up), so a decode step reads each block's weights in four matrix products.
    """

    attn_norm: np.ndarray = attrs.field(converter=frozen_array)
    wqkv: np.ndarray | QMatrix = attrs.field(converter=_matrix)
    wo: np.ndarray | QMatrix = attrs.field(converter=_matrix)
    ffn_norm: np.ndarray = attrs.field(converter=frozen_array)
    w_gate_up: np.ndarray | QMatrix = attrs.field(converter=_matrix)
    w_down: np.ndarray | QMatrix = attrs.field(converter=_matrix)
    bqkv: np.ndarray | None = attrs.field(default=None, converter=_ro)
    q_norm: np.ndarray | None = attrs.field(default=None, converter=_ro)  # [head_dim], shared by the heads
    k_norm: np.ndarray | None = attrs.field(default=None, converter=_ro)
    post_attn_norm: np.ndarray | None = attrs.field(default=None, converter=_ro)  # [d]
    post_ffn_norm: np.ndarray | None = attrs.field(default=None, converter=_ro)

    @property
    def nbytes(self) -> int:
        arrays = (self.attn_norm, self.wqkv, self.wo, self.ffn_norm, self.w_gate_up, self.w_down, self.bqkv,
                  self.q_norm, self.k_norm, self.post_attn_norm, self.post_ffn_norm)
        return sum(a.nbytes for a in arrays if a is not None)


@attrs.frozen(slots=True)
class RowSource:
    """A [rows, cols] f32 weight matrix that is not held in memory (streamed weights: it stays quantized in
    the model file). `rows(lo, hi)` makes rows lo..hi-1, at most `max_rows` at a time, into a buffer the
    next call overwrites; `take(ids)` makes the rows of `ids` as a new array, so `source[ids]` works as it
    does on an array (the embedding lookup)."""

    shape: tuple[int, int]
    max_rows: int
    rows: Callable[[int, int], np.ndarray]
    take: Callable[[np.ndarray], np.ndarray]

    def __getitem__(self, ids: np.ndarray) -> np.ndarray:
        return self.take(np.asarray(ids))

    @property
    def nbytes(self) -> int:
        """Bytes the matrix would take in f32."""
        return 4 * self.shape[0] * self.shape[1]


@attrs.frozen(slots=True)
class ModelWeights:
    """All weights. Resident: f32 arrays. Streamed: `layers` makes block i's LayerWeights when item i is
    read (into one scratch buffer, valid until the next read) and the embedding and head are RowSources."""

    token_embd: np.ndarray | RowSource | QMatrix = attrs.field(converter=_matrix)  # [vocab, d]
    layers: Sequence[LayerWeights]
    output_norm: np.ndarray = attrs.field(converter=frozen_array)  # [d]
    output: np.ndarray | RowSource | QMatrix = attrs.field(converter=_matrix)  # [vocab, d]; token_embd when tied

    @property
    def nbytes(self) -> int:
        """Bytes of distinct weight arrays (f32 arrays, or the blocks of QMatrix ones; a tied head is counted
        once; streamed weights count as if they were resident)."""
        layers = self.layers.nbytes if hasattr(self.layers, "nbytes") else sum(lw.nbytes for lw in self.layers)
        total = self.token_embd.nbytes + self.output_norm.nbytes + layers
        if not isinstance(self.output, np.ndarray):
            tied = self.output is self.token_embd
        else:
            tied = isinstance(self.token_embd, np.ndarray) and np.shares_memory(self.output, self.token_embd)
        return total if tied else total + self.output.nbytes

    def with_halves(self, halves: int) -> ModelWeights:
        """The same weights (no copy) with every QMatrix meeting its activations in `halves` int8 blocks."""
        def each(m: object) -> object:
            return attrs.evolve(m, halves=halves) if isinstance(m, QMatrix) and m.halves != halves else m

        if not isinstance(self.output, QMatrix) or self.output.halves == halves:
            return self
        layers = tuple(attrs.evolve(lw, **{f: each(getattr(lw, f)) for f in ("wqkv", "wo", "w_gate_up", "w_down")})
                       for lw in self.layers)
        embd = each(self.token_embd)
        return attrs.evolve(self, token_embd=embd, layers=layers,
                            output=embd if self.output is self.token_embd else each(self.output))


_PENALTY_RANGE = [attrs.validators.ge(-2.0), attrs.validators.le(2.0)]
CONSTRAINT_KINDS = ("json_object", "json_schema", "regex", "lark")
LOGIT_BIAS_MAX = 100.0  # OpenAI's range: a bias in [-100, 100] per token


@attrs.frozen(slots=True)
class Constraint:
    """What the generated text must match; the grammar engine (llguidance) turns it into a mask of the tokens
    allowed next. `source`: json_schema, the schema as JSON text; regex, the pattern (the whole output
    matches it); lark, a Lark grammar (llguidance's dialect); json_object: unused (any JSON object)."""

    kind: str = attrs.field(validator=attrs.validators.in_(CONSTRAINT_KINDS))
    source: str = ""
    # json_schema: objects hold only the properties they name (no additionalProperties unless the schema allows
    # them) and a keyword the engine does not support is an error; False: the schema as JSON Schema reads, an
    # unsupported keyword ignored (best effort)
    strict: bool = True


def _constraint(value: Constraint | dict | None) -> Constraint | None:
    """A Constraint, or None; a mapping of its fields (as a trace or a config holds it) becomes one."""
    return Constraint(**value) if isinstance(value, dict) else value


def _logit_bias(value: object) -> tuple[tuple[int, float], ...]:
    """{token id: bias} (ids as ints or decimal strings) or (id, bias) pairs -> pairs sorted by id."""
    items = value.items() if isinstance(value, dict) else value
    try:
        pairs = sorted((int(i), float(b)) for i, b in items)  # type: ignore[union-attr]
    except (TypeError, ValueError):
        raise ValueError(f"logit_bias must map token ids to numbers, got {value!r}") from None
    ids = [i for i, _b in pairs]
    if len(set(ids)) != len(ids):
        raise ValueError(f"logit_bias names a token id twice: {ids}")
    for i, b in pairs:
        if i < 0 or not -LOGIT_BIAS_MAX <= b <= LOGIT_BIAS_MAX:
            raise ValueError(f"logit_bias {i}: {b:g}: ids are >= 0 and biases in [-100, 100]")
    return tuple(pairs)


@attrs.frozen(slots=True)
class SamplingParams:
    """How the next token is chosen from logits. temperature 0 means greedy (argmax).

    Order of application: logit bias and the constraint's mask (stages/constrain.py) -> repetition penalty ->
    frequency/presence penalties -> temperature -> top-k -> top-p -> min-p.
    A value that disables a filter: top_k 0, top_p 1.0, min_p 0.0, repeat_penalty 1.0.
    """

    temperature: float = attrs.field(default=0.8, validator=attrs.validators.ge(0.0))
    top_k: int = attrs.field(default=40, validator=attrs.validators.ge(0))
    top_p: float = attrs.field(default=0.95, validator=[attrs.validators.gt(0.0), attrs.validators.le(1.0)])
    min_p: float = attrs.field(default=0.05, validator=[attrs.validators.ge(0.0), attrs.validators.le(1.0)])
    repeat_penalty: float = attrs.field(default=1.0, validator=attrs.validators.gt(0.0))
    repeat_last_n: int = attrs.field(default=64, validator=attrs.validators.ge(0))
    seed: int = attrs.field(default=0, validator=attrs.validators.ge(0))
    # OpenAI's penalties, over the same window as repeat_penalty: logit -= f * count + p * (count > 0); 0 = off
    frequency_penalty: float = attrs.field(default=0.0, validator=_PENALTY_RANGE)
    presence_penalty: float = attrs.field(default=0.0, validator=_PENALTY_RANGE)
    # (token id, bias) pairs added to the logits before anything else (OpenAI's logit_bias); () = none
    logit_bias: tuple[tuple[int, float], ...] = attrs.field(default=(), converter=_logit_bias)
    # the grammar the output must match (a token mask before sampling); None = free text
    constraint: Constraint | None = attrs.field(default=None, converter=_constraint)


@attrs.frozen(slots=True)
class Choice:
    """A sampled token and the probability the final (filtered, tempered) distribution gave it."""

    token: int
    prob: float
