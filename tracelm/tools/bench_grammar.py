"""`tracelm bench --grammar json|schema`: what constrained decoding costs against plain decoding.

The same chat prompt (asking for a person with pets, as JSON) is decoded `repeats` times with and without a
constraint, sampled (temperature 0.8, seed r for repeat r), the two runs of a repeat back to back in alternating
order so a change in machine load hits both alike. Reported: decode tok/s of each, their ratio, and the grammar
stage itself -- computing the mask, applying it, advancing the matcher (`GenerationStats.constrain_seconds`) --
in ms per token and as a share of constrained decode time (issue 15's target: <= 15 %). A constrained run may
end early (the JSON is complete); rates are tokens over seconds, so runs of different lengths compare.
"""

from __future__ import annotations

import json
from typing import Any

from tracelm.session import Runner, Session, chat_prompt
from tracelm.state.records import Constraint, SamplingParams
from tracelm.tools.bench import open_session

GRAMMARS = ("json", "schema")
PROMPT = "Describe a fictional person and their pets as JSON: name, age, favourite colour, pets (kind and legs)."
SCHEMA = {  # issue 15's: required string, integer and enum fields, a nested array (also `tracelm check`'s)
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer"},
        "colour": {"enum": ["red", "green", "blue"]},
        "pets": {"type": "array", "maxItems": 3,
                 "items": {"type": "object", "properties": {"kind": {"type": "string"}, "legs": {"type": "integer"}},
                           "required": ["kind", "legs"]}},
    },
    "required": ["name", "age", "colour", "pets"],
}


def bench_constraint(kind: str) -> Constraint:
    """`json`: any JSON object (response_format json_object); `schema`: the person schema above (strict)."""
    if kind == "json":
        return Constraint("json_object")
    return Constraint("json_schema", json.dumps(SCHEMA))


def grammar_overhead(model_name: str, kind: str = "json", n_decode: int = 128, repeats: int = 3,
                     **engine: Any) -> dict[str, Any]:
    """Decode tok/s plain and constrained by `kind` (see the module docstring); `engine`: the Session's run config
    fields (compute, threads, activations), as every bench takes them."""
    with open_session(model_name, **engine) as session:
        return _grammar_overhead(session, bench_constraint(kind), kind, n_decode, repeats)


def _decode(session: Session, ids: list[int], n_decode: int, sampling: SamplingParams) -> Runner:
    runner = session.new_runner(len(ids) + n_decode + 1)
    for _ in runner.generate(ids, n_decode, sampling):
        pass
    return runner


def _grammar_overhead(session: Session, constraint: Constraint, kind: str, n_decode: int, repeats: int
                      ) -> dict[str, Any]:
    ids = chat_prompt(session.model, [{"role": "user", "content": PROMPT}])
    tokens = {"plain": 0, "constrained": 0}
    seconds = {"plain": 0.0, "constrained": 0.0}
    grammar_seconds, finished = 0.0, 0
    _decode(session, ids, 4, SamplingParams(constraint=constraint))  # warm-up: the vocabulary's token trie
    for r in range(repeats):
        for name in ("plain", "constrained")[:: 1 if r % 2 == 0 else -1]:
            sampling = SamplingParams(temperature=0.8, seed=r, constraint=constraint if name == "constrained" else None)
            stats = _decode(session, ids, n_decode, sampling).stats
            tokens[name] += stats.n_generated
            seconds[name] += stats.decode_seconds
            if name == "constrained":
                grammar_seconds += stats.constrain_seconds
                finished += stats.finish_reason == "stop"
    rate = {k: tokens[k] / seconds[k] if seconds[k] else 0.0 for k in tokens}
    return {
        "model": str(session.model.path.name),
        "grammar": kind,
        "repeats": repeats,
        "decode_tokens_plain": tokens["plain"],
        "decode_tokens_constrained": tokens["constrained"],
        "constrained_runs_complete": f"{finished}/{repeats}",
        "decode_tok_s_plain": round(rate["plain"], 2),
        "decode_tok_s_constrained": round(rate["constrained"], 2),
        "constrained_vs_plain": round(rate["constrained"] / rate["plain"], 4) if rate["plain"] else None,
        "grammar_ms_per_token": round(1e3 * grammar_seconds / max(tokens["constrained"], 1), 3),
        "grammar_share_pct": round(100 * grammar_seconds / max(seconds["constrained"], 1e-9), 2),
        "target_share_pct": 15.0,
    }
