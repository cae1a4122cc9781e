"""`tracelm bench profile`: a decode step's time by kind of work, the timers put back after."""

from __future__ import annotations

import json

import gguf
import pytest

import tracelm.pipeline.graph as graph
from tests.conftest import write_tiny_gguf
from tracelm import cli, kernels
from tracelm.pipeline.runner import Generation
from tracelm.tools.bench_profile import KINDS, bench_profile


@pytest.fixture(scope="module")
def tiny_q8(tmp_path_factory):
    return write_tiny_gguf(tmp_path_factory.mktemp("profile") / "tiny-q8.gguf", qtype=gguf.GGMLQuantizationType.Q8_0)


def test_every_kind_timed_and_the_shares_add_up(tiny_q8):
    before = (graph.linear_into, graph.head, kernels.attend_parts, kernels.rms_norm, kernels.rope, Generation.step,
              dict(graph.compiled.ACTIVATIONS))
    report = bench_profile(str(tiny_q8), streams=(1, 3), n_prompt=8, n_decode=4, threads=1)
    after = (graph.linear_into, graph.head, kernels.attend_parts, kernels.rms_norm, kernels.rope, Generation.step,
             dict(graph.compiled.ACTIVATIONS))
    assert after == before  # the timers are gone
    for n in (1, 3):
        entry = report[f"streams_{n}"]
        kinds = entry["kinds"]
        assert set(kinds) == {*KINDS, "rest"}
        # the tiny model's pass runs products, attention, norms, RoPE, its activation and the head every step
        for kind in ("products", "head", "attention", "norms", "rope", "activation", "sampling"):
            assert kinds[kind]["ms_per_step"] > 0, kind
        assert sum(k["share"] for k in kinds.values()) == pytest.approx(1.0, abs=0.01)  # shares: 3 decimals
        # each figure is rounded to a microsecond, so the sum may be off by half a microsecond per kind
        assert sum(k["ms_per_step"] for k in kinds.values()) == pytest.approx(
            entry["ms_per_step"], rel=0.01, abs=0.0005 * (len(kinds) + 1))
        assert entry["ms_per_step_untimed"] > 0


def test_cli(tiny_q8, capsys):
    assert cli.main(["bench", "profile", "--model", str(tiny_q8), "--streams", "2", "--prompt-tokens", "8",
                     "--decode-tokens", "2", "--threads", "1", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert list(k for k in report if k.startswith("streams_")) == ["streams_2"] and report["steps"] == 2
