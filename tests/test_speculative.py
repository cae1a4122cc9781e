"""Prompt-lookup speculative decoding: drafts, and output identical to plain decoding."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.conftest import REPO
from tracelm.io.loader import load_model
from tracelm.pipeline.runner import Runner
from tracelm.pipeline.speculative import lookup_draft
from tracelm.state.records import SamplingParams


def test_lookup_draft_follows_the_latest_longest_match() -> None:
    h = [1, 2, 3, 9, 9, 1, 2, 3, 7, 8, 5, 2, 3]
    assert lookup_draft(h, 3) == [7, 8, 5]  # "2 3" last seen at 6..7 ("1 2 3" never ends the history)
    assert lookup_draft([4, 5, 6, 4, 5], 2, ngram=2) == [6, 4]
    assert lookup_draft([4, 5, 6, 4, 5], 9) == [6, 4, 5]
    assert lookup_draft([1, 2, 3], 4) == []  # nothing repeats
    assert lookup_draft([7], 4) == [] and lookup_draft([1, 1], 0) == []


def test_a_draft_is_as_long_as_its_match_earns() -> None:
    """A match of n tokens earns at most 2^n drafted tokens (and never more than k)."""
    h = list(range(1, 20))
    assert lookup_draft(h + [1], 16) == [2, 3]  # one-token match: 2
    assert lookup_draft(h + [1, 2], 16) == [3, 4, 5, 6]  # two tokens: 4
    assert lookup_draft(h + [1, 2, 3], 16) == list(range(4, 12))  # three: 8
    assert lookup_draft(h + [1, 2, 3, 4], 16) == list(range(5, 20)) + [1]  # four: 16 (reading on into the repeat)
    assert lookup_draft(h + [1, 2, 3, 4], 5) == [5, 6, 7, 8, 9]  # k caps it
    assert lookup_draft(h + [1, 2, 3], 16, ngram=1) == [4, 5]  # matches of one token at most: 2


@pytest.fixture(scope="module", params=["kernels", "reference"])
def tiny(tiny_gguf, request):
    """The tiny model on the kernels and on numpy's BLAS (whose row-invariance rests on the same calls)."""
    return load_model(str(tiny_gguf), progress=False, compute=request.param)


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=0.0, repeat_penalty=1.0),
    SamplingParams(temperature=0.0, repeat_penalty=1.3, repeat_last_n=8),
    SamplingParams(temperature=0.9, top_k=0, top_p=1.0, min_p=0.0, seed=11),
    SamplingParams(temperature=1.2, top_k=20, top_p=0.9, seed=5),
])
def test_speculation_gives_the_tokens_of_plain_decoding(tiny, params) -> None:
    prompt = tiny.tokenizer.encode("hello hello hello hell")
    plain = Runner(tiny, 96)
    text = "".join(plain.generate(prompt, 40, params))
    for k in (1, 4, 8):
        fast = Runner(tiny, 96, draft_tokens=k)
        assert "".join(fast.generate(prompt, 40, params)) == text
        s = fast.stats
        assert s.tokens == plain.stats.tokens and s.finish_reason == plain.stats.finish_reason
        assert s.n_passes <= plain.stats.n_generated
        assert fast.cache.tokens == (prompt + s.tokens)[: fast.cache.n_past]  # only chosen tokens stay cached


def test_speculation_saves_passes_on_repetitive_text(tiny) -> None:
    # a tiny random model falls into loops under greedy decoding: lookup guesses them
    greedy = SamplingParams(temperature=0.0, repeat_penalty=1.0)
    runner = Runner(tiny, 200, draft_tokens=6)
    list(runner.generate(tiny.tokenizer.encode("hello"), 120, greedy))
    s = runner.stats
    assert s.n_accepted > 0 and s.n_passes < s.n_generated
    assert s.n_accepted <= s.n_drafted


def test_a_speculative_traced_run_replays(tiny_gguf, tmp_path) -> None:
    trace = tmp_path / "spec.jsonl"
    cli = [sys.executable, "-m", "tracelm.cli"]
    run = subprocess.run([*cli, "run", str(REPO / "configs" / "smollm2.yaml"), "--model", str(tiny_gguf),
                          "--prompt", "hello hello hello", "--max-tokens", "30", "--temperature", "0.9",
                          "--set", "speculative.draft_tokens=4", "--trace", str(trace)],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    footer = json.loads(trace.read_text().splitlines()[-1])
    assert footer["draft_tokens"] > 0 and footer["decode_passes"] <= footer["n_generated"]
    replay = subprocess.run([*cli, "replay", str(trace), "--require", "intact"], capture_output=True, text=True,
                            timeout=120)  # an unsigned trace: the auditor accepts it explicitly (issue 31)
    assert replay.returncode == 0, replay.stdout + replay.stderr


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=0.0, repeat_penalty=1.0),
    SamplingParams(temperature=0.9, top_k=0, top_p=1.0, min_p=0.0, seed=11),
])
def test_a_draft_model_gives_the_tokens_of_plain_decoding(tiny, tmp_path, params) -> None:
    """Drafts from another model (same vocabulary, other weights) and from the model itself: the tokens
    of plain decoding either way; the model drafting for itself has every greedy guess accepted."""
    from tests.conftest import write_tiny_gguf

    other = load_model(str(write_tiny_gguf(tmp_path / "other.gguf", seed=7)), progress=False)
    prompt = tiny.tokenizer.encode("hello hello hello hell")
    plain = Runner(tiny, 96)
    text = "".join(plain.generate(prompt, 40, params))
    for draft in (other, tiny):
        fast = Runner(tiny, 96, draft_tokens=4, draft_model=draft)
        assert "".join(fast.generate(prompt, 40, params)) == text
        s = fast.stats
        assert s.tokens == plain.stats.tokens and s.n_drafted > 0
        assert fast.cache.tokens == (prompt + s.tokens)[: fast.cache.n_past]
        if draft is tiny and params.temperature == 0:
            assert s.n_accepted == s.n_drafted and s.n_passes < s.n_generated / 3


def test_a_draft_model_needs_the_same_vocabulary(tiny, smollm2) -> None:
    from tracelm import TracelmError

    with pytest.raises(TracelmError, match="another vocabulary"):
        Runner(tiny, 64, draft_tokens=4, draft_model=smollm2)
