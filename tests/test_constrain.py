"""Constrained decoding (issue 15): the constrain stage on synthetic masks, llguidance fed each vocabulary kind
(byte-level BPE, SentencePiece), grammar errors, logit bias, JSON schemas and regexes on SmolLM2 sampled over
several seeds, speculation under a constraint, the trace fields and replay of a constrained run."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest

from tests.conftest import FIXTURES
from tests.test_trace import rechain
from tracelm import kernels
from tracelm.audit.replay import DIVERGED, REPRODUCED, replay
from tracelm.cli import main
from tracelm.io.grammar import Matcher, check_constraint, closed, constraint_digest, mask_digest, vocabulary
from tracelm.io.loader import load_tokenizer
from tracelm.io.run_config import load_run_config, record_from_dict
from tracelm.stages.constrain import allowed_tokens, constrain
from tracelm.stages.sample import sample
from tracelm.state.errors import TracelmError
from tracelm.state.records import Constraint, SamplingParams
from tracelm.tools.bench_grammar import PROMPT as PERSON
from tracelm.tools.bench_grammar import SCHEMA  # required string, integer and enum fields, a nested array


def schema_validator():
    return pytest.importorskip("jsonschema", reason="jsonschema is in the test extra")


def packed(allowed: np.ndarray) -> np.ndarray:
    """A boolean [vocab] mask packed as llguidance writes it: int32 words, bit j of word i = token 32 i + j."""
    bits = np.zeros(-(-allowed.size // 32) * 32, np.uint8)
    bits[: allowed.size] = allowed
    return np.packbits(bits, bitorder="little").view(np.int32)


def mask_ids(matcher: Matcher) -> set[int]:
    return set(np.flatnonzero(allowed_tokens(matcher.mask(), matcher.n_vocab)).tolist())


# ---------------------------------------------------------------- the stage, synthetic


def test_a_packed_mask_unpacks_to_its_tokens() -> None:
    rng = np.random.default_rng(0)
    for vocab in (1, 31, 32, 33, 1000):
        allowed = rng.random(vocab) < 0.3
        assert np.array_equal(allowed_tokens(packed(allowed), vocab), allowed)
    with pytest.raises(ValueError, match="needs 2 int32 words"):
        allowed_tokens(np.zeros(1, np.int32), 33)


def test_constrain_masks_and_biases_and_leaves_its_input() -> None:
    rng = np.random.default_rng(1)
    logits = rng.standard_normal(70).astype(np.float32)
    before = logits.copy()
    allowed = rng.random(70) < 0.5
    out = constrain(logits, packed(allowed), [(3, 2.5), (int(np.flatnonzero(allowed)[0]), -1.0)])
    assert np.array_equal(logits, before) and out.dtype == np.float32
    assert np.all(np.isneginf(out[~allowed]))
    expect = logits.copy()
    expect[3] += 2.5
    expect[np.flatnonzero(allowed)[0]] -= 1.0
    assert np.array_equal(out[allowed], expect[allowed])
    with pytest.raises(ValueError, match="outside the vocabulary"):
        constrain(logits, None, [(70, 1.0)])
    with pytest.raises(ValueError, match="allows no token"):
        constrain(logits, packed(np.zeros(70, bool)))


def test_the_masks_kernel_is_the_numpy_statement() -> None:
    """constrain's mask through the kernels (float32 / float64 rows) gives numpy's -inf wherever the bit is clear and
    nothing else changed, at every length around the kernel's 64-token runs, sparse and dense masks, whole words of
    ones and of zeros; other dtypes go through numpy."""
    rng = np.random.default_rng(5)
    for vocab in (1, 7, 63, 64, 65, 128, 200, 151936):
        for density in (0.0005, 0.5, 0.999, 1.0):
            allowed = rng.random(vocab) < density
            allowed[rng.integers(vocab)] = True
            allowed[: min(vocab, 130)] = allowed[: min(vocab, 130)] & (np.arange(min(vocab, 130)) >= 64)  # 64 off
            if not allowed.any():
                allowed[-1] = True
            for dtype in (np.float32, np.float64, np.float16):
                logits = rng.standard_normal(vocab).astype(dtype)
                out = constrain(logits, packed(allowed))
                want = np.where(allowed, logits, -np.inf).astype(dtype)
                assert out.dtype == dtype and np.array_equal(out, want), (vocab, density, dtype)
    x = np.zeros(100, np.float32)
    assert kernels.mask_logits(x, packed(np.arange(100) % 3 == 0).view(np.uint8)) == 34
    with pytest.raises(ValueError, match="mask_logits: a mask for 100 tokens needs 13 bytes, got 12"):
        kernels.mask_logits(x, np.zeros(12, np.uint8))
    with pytest.raises(ValueError, match="mask_logits: logits must be float32 or float64"):
        kernels.mask_logits(x.astype(np.float16), np.zeros(13, np.uint8))


def test_sampling_never_draws_a_masked_token() -> None:
    rng = np.random.default_rng(2)
    logits = rng.standard_normal(500).astype(np.float32) * 3
    allowed = np.zeros(500, bool)
    allowed[[7, 99, 250, 499]] = True
    masked = constrain(logits, packed(allowed))
    params = SamplingParams(temperature=1.5, top_k=0, top_p=1.0, min_p=0.0)
    draws = {sample(masked, params, np.random.default_rng(s), np.array([], np.int64)).token for s in range(300)}
    assert draws == {7, 99, 250, 499}
    greedy = sample(masked, SamplingParams(temperature=0.0), rng, np.array([], np.int64)).token
    assert greedy == max(np.flatnonzero(allowed), key=lambda i: logits[i])
    assert sample(logits, params, np.random.default_rng(0), np.array([], np.int64)).token not in draws  # unmasked


def test_constraint_and_logit_bias_records_check_their_values() -> None:
    p = SamplingParams(logit_bias={"15": -100, 3: 2}, constraint={"kind": "regex", "source": "a+"})
    assert p.logit_bias == ((3, 2.0), (15, -100.0)) and p.constraint == Constraint("regex", "a+")
    for bad in ({"logit_bias": {1: 101}}, {"logit_bias": [(1, 1), (1, 2)]}, {"logit_bias": {"x": 1}},
                {"constraint": {"kind": "gbnf", "source": "x"}}):
        with pytest.raises((ValueError, TypeError)):
            SamplingParams(**bad)
    cfg = load_run_config(None, ["sampling.logit_bias={5: 1.5}",
                                 'sampling.constraint={kind: lark, source: "start: x"}'])
    assert cfg.sampling.logit_bias == ((5, 1.5),) and cfg.sampling.constraint.kind == "lark"
    assert record_from_dict(SamplingParams, json.loads(json.dumps(cfg.sampling, default=_plain))) == cfg.sampling
    with pytest.raises(TracelmError, match="sampling.constraint.kind"):
        load_run_config(None, ["sampling.constraint={kind: yaml}"])


def _plain(x):
    import attrs

    return attrs.asdict(x)


def test_strict_schemas_are_closed() -> None:
    s = closed({"type": "object", "properties": {"a": {"type": "object", "properties": {}}},
                "enum": [{"properties": 1}], "additionalProperties": True})
    assert s["additionalProperties"] is True and s["properties"]["a"]["additionalProperties"] is False
    assert s["enum"] == [{"properties": 1}]  # data, not a schema


# ---------------------------------------------------------------- llguidance on each vocabulary kind


@pytest.fixture(scope="module")
def tiny_tok(tiny_gguf: Path):
    return load_tokenizer(str(tiny_gguf))


def test_masks_on_a_synthetic_byte_level_vocabulary(tiny_tok) -> None:
    tok = tiny_tok
    ids = {tok.token_bytes(i): i for i in range(tok.n_vocab)}
    end = tok.eos_id
    m = Matcher(Constraint("regex", "hello|help"), tok)
    assert mask_ids(m) == {ids[b"h"], ids[b"he"], ids[b"hell"]}
    # bytes the grammar forces come as the tokenizer would spell them (llguidance keeps tokenizations canonical)
    assert mask_ids(Matcher(Constraint("regex", "hello"), tok)) == {ids[b"hell"]}
    m.consume(ids[b"hell"], mask_digest(m.mask()))
    assert mask_ids(m) == {ids[b"o"]} and not m.stopped
    m.consume(ids[b"o"], mask_digest(m.mask()))
    assert m.stopped and mask_ids(m) == {end}
    with pytest.raises(TracelmError, match="refused"):
        Matcher(Constraint("regex", "hello"), tok).consume(ids[b"x"], "0" * 32)
    # the end-of-text control token is never spelled by text the grammar allows
    spelled = Matcher(Constraint("regex", re.escape("<|endoftext|>")), tok)
    assert end not in mask_ids(spelled) and ids[b"<"] in mask_ids(spelled)
    assert vocabulary(tok)[end] == b"\xff<|endoftext|>"


def _digit_tokens(tok) -> set[int]:
    """Ids whose bytes are one or more ASCII digits, found by brute force over the vocabulary (text tokens only)."""
    special = {i for i, b in enumerate(vocabulary(tok)) if b[:1] == b"\xff"}
    return {i for i in range(tok.n_vocab) if i not in special and re.fullmatch(rb"[0-9]+", tok.token_bytes(i))}


def test_masks_on_a_sentencepiece_vocabulary() -> None:
    tok = load_tokenizer(str(FIXTURES / "llama2c" / "tok512.bin"))
    want = _digit_tokens(tok)
    assert len(want) >= 10  # the byte tokens <0x30>..<0x39> at least
    m = Matcher(Constraint("regex", "[0-9]+"), tok)
    assert mask_ids(m) == want
    m.consume(min(want), mask_digest(m.mask()))
    assert mask_ids(m) == want | {tok.eos_id}  # accepting: the end is allowed too


@pytest.mark.model
def test_masks_on_smollm2s_byte_level_vocabulary(smollm2) -> None:
    tok = smollm2.tokenizer
    assert mask_ids(Matcher(Constraint("regex", "[0-9]+"), tok)) == _digit_tokens(tok)
    first = mask_ids(Matcher(Constraint("json_object"), tok))
    assert first and all(tok.token_bytes(i).startswith(b"{") for i in first)


def test_grammar_problems_are_named(tiny_tok) -> None:
    cases = [(Constraint("json_schema", "{"), "not valid JSON"), (Constraint("json_schema", '{"type": "foo"}'), "foo"),
             (Constraint("json_schema", "[]"), "is an object"), (Constraint("regex", "[a-"), "unclosed"),
             (Constraint("lark", "start: foo"), 'unknown name: "foo"'), (Constraint("regex", " "), "empty"),
             (Constraint("json_schema", '{"type": "string", "format": "bogus"}'), "bogus")]
    for c, message in cases:
        with pytest.raises(TracelmError, match=re.escape(message)):
            check_constraint(c, tiny_tok)
    check_constraint(Constraint("json_schema", '{"type": "string", "format": "bogus"}', strict=False), tiny_tok)


# ---------------------------------------------------------------- generation on the tiny model: replay


def test_a_constrained_traced_run_replays_and_a_changed_constraint_diverges(tiny_gguf: Path, tmp_path: Path,
                                                                             capsys) -> None:
    trace = tmp_path / "run.jsonl"
    code = main(["run", "--model", str(tiny_gguf), "--prompt", "hello", "--max-tokens", "12", "--temperature", "0.9",
                 "--seed", "2", "--regex", "[a-h]{3,6}-[0-9]+", "--trace", str(trace)])
    text = capsys.readouterr().out.strip()
    assert code == 0 and re.fullmatch("[a-h]{3,6}-[0-9]+", text)
    lines = trace.read_text().splitlines(keepends=True)
    tokens = [json.loads(x) for x in lines if '"event":"token"' in x]
    recorded = Constraint(**json.loads(lines[0])["config"]["sampling"]["constraint"])
    assert recorded == Constraint("regex", "[a-h]{3,6}-[0-9]+")
    assert {t["constraint"] for t in tokens} == {constraint_digest(recorded)}
    assert len({t["state"] for t in tokens}) == len(tokens)  # the state moves with every token
    report = replay(trace)
    assert report.status == REPRODUCED and report.first_bit_difference is None
    assert main(["trace", "show", str(trace)]) == 0
    assert f"constraint regex (17 characters, digest {tokens[0]['constraint']})" in capsys.readouterr().out
    forged = tmp_path / "forged.jsonl"
    forged.write_text("".join(rechain([x.replace("{3,6}", "{3,7}") for x in lines])))
    changed = replay(forged)
    assert changed.status == DIVERGED and changed.divergence.kind == "token"
    assert "constraint" in changed.divergence.reason


def test_bad_constraint_flags_fail_before_the_model_loads(tmp_path: Path, capsys) -> None:
    schema = tmp_path / "bad.json"
    schema.write_text('{"type": "object", "properties": {"a": {"type": "strin"}}}')
    assert main(["run", "--model", str(tmp_path / "missing.gguf"), "--schema", str(schema)]) == 2
    assert main(["run", "--schema", str(tmp_path / "absent.json")]) == 2
    err = capsys.readouterr().err
    assert "--schema" in err and "cannot read" in err
    gbnf = tmp_path / "bad.gbnf"
    gbnf.write_text('root ::= ("a"')
    for flag in ("--grammar", "--grammar-file"):
        assert main(["run", "--model", str(tmp_path / "missing.gguf"), flag, str(gbnf)]) == 2
        assert f"{flag} {gbnf}: not a GBNF grammar: Expected ')'" in capsys.readouterr().err


def test_a_gbnf_grammar_runs_as_its_lark_and_the_trace_holds_that(tiny_gguf: Path, tmp_path: Path, capsys) -> None:
    """--grammar-file (llama.cpp's GBNF) and --grammar FILE.gbnf: converted to Lark as read; the output is in the
    language, and the trace's constraint is the Lark grammar applied (what its replay compiles)."""
    gbnf = tmp_path / "words.gbnf"
    gbnf.write_text('root ::= word ("-" word)+\nword ::= [a-h] [a-h] [a-h]\n')
    texts = []
    for flag in ("--grammar-file", "--grammar"):
        trace = tmp_path / f"{flag}.jsonl"
        code = main(["run", "--model", str(tiny_gguf), "--prompt", "hello", "--max-tokens", "40", "--temperature",
                     "0.9", "--seed", "4", flag, str(gbnf), "--trace", str(trace)])
        texts.append(capsys.readouterr().out.strip())
        assert code == 0 and re.fullmatch(r"[a-h]{3}(-[a-h]{3})+", texts[-1]), texts[-1]
        recorded = Constraint(**json.loads(trace.read_text().splitlines()[0])["config"]["sampling"]["constraint"])
        assert recorded.kind == "lark" and "start:" in recorded.source and "::=" not in recorded.source
        assert replay(trace).status == REPRODUCED
    assert texts[0] == texts[1]


# ---------------------------------------------------------------- SmolLM2: schemas, regexes, bias, speculation


@pytest.fixture(scope="module")
def session(smollm2):
    from tracelm.session import Session

    s = Session(smollm2, settings=["context=1024"])
    yield s
    s.close()


def _person(session, seed: int, constraint: Constraint | None) -> str:
    session.reset()
    return session.chat(PERSON, temperature=0.8, seed=seed, max_tokens=200, constraint=constraint)


@pytest.mark.model
def test_json_schema_output_validates_over_seeds(session) -> None:
    jsonschema = schema_validator()
    c = Constraint("json_schema", json.dumps(SCHEMA))
    for seed in range(1, 6):
        out = _person(session, seed, c)
        assert session.stats.finish_reason == "stop", out
        jsonschema.validate(json.loads(out), SCHEMA)
    failures = 0
    for seed in range(1, 4):  # the same seeds unconstrained: the schema is not met by luck
        try:
            jsonschema.validate(json.loads(_person(session, seed, None)), SCHEMA)
        except (ValueError, jsonschema.ValidationError):
            failures += 1
    assert failures > 0


@pytest.mark.model
def test_regex_output_fullmatches_and_a_complete_grammar_stops(session) -> None:
    pattern = r"[A-Z][a-z]+ is [1-9][0-9]? years old\."
    for seed in (1, 2, 3):
        out = session.generate("Tell me about Anna.", temperature=0.8, seed=seed, max_tokens=24,
                               constraint=Constraint("regex", pattern))
        assert re.fullmatch(pattern, out) and session.stats.finish_reason == "stop", out
    free = session.generate("Tell me about Anna.", temperature=0.8, seed=1, max_tokens=24)
    assert not re.fullmatch(pattern, free)
    assert session.generate("Is Paris in France?", temperature=0, constraint=Constraint("regex", "yes|no")) in (
        "yes", "no")
    assert session.stats.n_generated <= 2 and session.stats.finish_reason == "stop"


@pytest.mark.model
def test_logit_bias_bans_and_forces(session) -> None:
    prompt = "The capital of France is"
    greedy = dict(temperature=0, max_tokens=1)
    top = session.tokenizer.encode(session.generate(prompt, **greedy))[0]
    banned = session.generate(prompt, **greedy, logit_bias={top: -100})
    assert session.tokenizer.encode(banned)[0] != top
    rare = session.tokenizer.encode(" zebra")[0]
    assert session.generate(prompt, temperature=0.8, seed=5, max_tokens=1, logit_bias={rare: 100}) == " zebra"
    assert session.generate(prompt, **greedy) != " zebra"
    with pytest.raises(TracelmError, match="outside the vocabulary"):
        session.generate(prompt, **greedy, logit_bias={session.tokenizer.n_vocab: 1})


@pytest.mark.model
def test_speculation_under_a_constraint_gives_the_same_text(smollm2) -> None:
    from tracelm.session import Session

    jsonschema = schema_validator()
    c = Constraint("json_schema", json.dumps(SCHEMA))
    texts, drafted = [], []
    for draft in (0, 6):
        with Session(smollm2, settings=["context=1024", f"speculative.draft_tokens={draft}"]) as s:
            texts.append(s.chat(PERSON, temperature=0.8, seed=3, max_tokens=160, constraint=c))
            drafted.append(s.stats.n_drafted)
    assert texts[0] == texts[1] and drafted[0] == 0 and drafted[1] > 0
    jsonschema.validate(json.loads(texts[0]), SCHEMA)


def test_bench_grammar_reports_both_rates(tiny_gguf: Path, capsys) -> None:
    """`tracelm bench --grammar`: plain and constrained decode on the engine the other benches open (threads,
    activations), the grammar stage's cost per token."""
    assert main(["bench", "--grammar", "json", "--model", str(tiny_gguf), "--decode-tokens", "4", "--repeats", "2",
                 "--threads", "1", "--activations", "int8", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["grammar"] == "json" and report["repeats"] == 2
    assert report["decode_tok_s_plain"] > 0 and report["decode_tok_s_constrained"] > 0
    assert report["grammar_ms_per_token"] > 0
