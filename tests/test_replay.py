"""`tracelm replay`: exact reproduction (sampling included), the first divergence after a one-weight change
or a changed seed, refusal when the model differs or the trace is damaged."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import gguf
import numpy as np
import pytest

from tests.test_trace import rechain, record
from tracelm.audit.replay import DIVERGED, REPRODUCED, replay
from tracelm.cli import main


@pytest.fixture(scope="module")
def recorded(tiny_gguf, tmp_path_factory) -> tuple[Path, Path]:
    """A private copy of the tiny model (tests below write changed copies beside it) and a digest trace
    of a run sampling at temperature 0.9."""
    d = tmp_path_factory.mktemp("replay")
    model = d / "tiny.gguf"
    shutil.copy(tiny_gguf, model)
    trace = d / "run.jsonl"
    record(model, trace)
    return model, trace


def run_replay(capsys, *args: str) -> tuple[int, str]:
    code = main(["replay", *map(str, args)])
    cap = capsys.readouterr()
    return code, cap.out + cap.err


def test_sampled_run_replays_bit_for_bit(recorded, capsys) -> None:
    _, trace = recorded
    lines = trace.read_text().splitlines()
    assert json.loads(lines[0])["config"]["sampling"]["temperature"] == 0.9
    report = replay(trace)
    assert report.status == REPRODUCED and report.divergence is None and report.first_bit_difference is None
    assert report.compared == len(lines) - 2  # every event but the header and the footer
    assert report.bit_exact == sum('"event":"stage"' in x for x in lines)
    code, out = run_replay(capsys, trace)  # issue 29: reproduced, but unsigned: said, and exit 3 (was 0)
    assert code == 3 and "every stage output bit-identical" in out and "nothing was authenticated" in out, out
    assert run_replay(capsys, trace, "--require", "intact")[0] == 0


def test_summary_level_replays_by_statistics(recorded, tmp_path, capsys) -> None:
    model, _ = recorded
    trace = tmp_path / "summary.jsonl"
    record(model, trace, "--set", "trace.level=summary")
    report = replay(trace)
    assert report.status == REPRODUCED and report.bit_exact == 0 and report.compared > 50


def _change_one_weight(src: Path, dst: Path, tensor: str, index: int, value: float) -> float:
    """Copy the GGUF and overwrite one f32 element of one tensor; return the old value."""
    shutil.copy(src, dst)
    t = next(t for t in gguf.GGUFReader(str(src)).tensors if t.name == tensor)
    assert t.tensor_type == gguf.GGMLQuantizationType.F32
    offset = int(t.data_offset) + 4 * index
    with open(dst, "r+b") as f:
        f.seek(offset)
        old = float(np.frombuffer(f.read(4), np.float32)[0])
        f.seek(offset)
        f.write(np.float32(value).tobytes())
    return old


def test_one_changed_weight_is_found_at_its_layer_and_stage(recorded, tmp_path, capsys) -> None:
    model, trace = recorded
    changed = tmp_path / "changed.gguf"
    old = _change_one_weight(model, changed, "blk.1.ffn_up.weight", 7 * 64 + 5, 4.0)
    assert old != 4.0
    code, out = run_replay(capsys, trace, "--model", changed)  # a different file: said plainly, no replay
    assert code == 2 and "sha256 differs" in out and "--allow-model-change" in out
    report = replay(trace, str(changed), allow_model_change=True)
    assert report.status == DIVERGED
    d = report.divergence
    assert (d.kind, d.token, d.layer, d.stage) == ("stage", 0, 1, "ffn"), d.describe()
    first = report.first_bit_difference
    assert first is None or (first.layer, first.stage) == (1, "ffn")
    # every stage before it matched bit for bit
    assert report.bit_exact == 1 + 7 + 6 and report.within_tolerance == 0
    assert d.recorded["digest"] != d.replayed["digest"] and d.recorded["rms"] != d.replayed["rms"]
    code, out = run_replay(capsys, trace, "--model", changed, "--allow-model-change")
    assert code == 1 and "token 0, layer 1, stage ffn" in out and "sha256 differs" in out
    # the same weight changed in layer 0 is found in layer 0
    changed0 = tmp_path / "changed0.gguf"
    _change_one_weight(model, changed0, "blk.0.ffn_up.weight", 7 * 64 + 5, 4.0)
    d0 = replay(trace, str(changed0), allow_model_change=True).divergence
    assert (d0.layer, d0.stage) == (0, "ffn")


def test_a_different_seed_diverges_at_a_token(recorded, tmp_path) -> None:
    _, trace = recorded
    lines = trace.read_text().splitlines(keepends=True)
    assert '"seed":3' in lines[1]
    lines[1] = lines[1].replace('"seed":3', '"seed":4')  # the generate event's sampling seed and rng seed
    forged = tmp_path / "seed4.jsonl"
    forged.write_text("".join(rechain(lines)))
    report = replay(forged)
    assert report.status == DIVERGED and report.divergence.kind == "token"
    assert report.first_bit_difference is None  # every stage before the first differing token matched


def test_replay_refuses_a_damaged_trace(recorded, tmp_path, capsys) -> None:
    _, trace = recorded
    lines = trace.read_text().splitlines(keepends=True)
    damaged = tmp_path / "damaged.jsonl"
    damaged.write_text("".join(lines[:-1]))
    code, out = run_replay(capsys, damaged)
    assert code == 2 and "not intact" in out and "footer" in out


def test_bench_trace_overhead_reports_all_levels(tiny_gguf) -> None:
    from tracelm.tools.bench import trace_overhead

    report = trace_overhead(str(tiny_gguf), n_decode=3, repeats=1, n_prompt=4)
    for level in ("off", "summary", "digest"):
        assert report[f"decode_tok_s_{level}"] > 0 and report[f"cpu_ms_per_token_{level}"] > 0
    assert report["summary_vs_off"] == pytest.approx(report["decode_tok_s_summary"] / report["decode_tok_s_off"],
                                                     rel=0.01)


def test_multi_turn_trace_with_a_warm_cache_replays(recorded, tmp_path) -> None:
    """A trace of two generate calls on one Runner whose Cache already held a prefix before tracing began
    (as a server session does), with an annotation event the replay does not produce."""
    from tracelm.io.loader import load_model
    from tracelm.pipeline.runner import Runner
    from tracelm.pipeline.trace import Tracer, write_footer, write_header
    from tracelm.state.records import SamplingParams
    from tracelm.state.run_config import RunConfig

    model_path, _ = recorded
    model = load_model(str(model_path), progress=False)
    cfg = RunConfig(model=str(model_path), context=128)
    params = SamplingParams(temperature=0.8, seed=11)
    first = model.tokenizer.encode("hello there")
    runner = Runner(model, cfg.context)
    list(runner.generate(first, 3, params))  # untraced: the Cache now holds `first` and 2 generated tokens
    second = first + runner.stats.tokens + model.tokenizer.encode(" and more")
    path = tmp_path / "session.jsonl"
    with open(path, "w", encoding="utf-8") as f:
        tracer = Tracer(f, "digest")
        write_header(tracer, cfg, model, second)
        tracer.event("request", request_id="r1")
        list(runner.generate(second, 4, params, tracer=tracer))
        third = second + runner.stats.tokens + model.tokenizer.encode("!")
        list(runner.generate(third, 3, SamplingParams(temperature=0.0), tracer=tracer))
        write_footer(tracer, runner.stats)
    events = [json.loads(x) for x in path.read_text().splitlines()]
    gens = [e for e in events if e["event"] == "generate"]
    assert len(gens) == 2 and gens[0]["reused"] == len(first) + 2 and gens[1]["reused"] > len(second)
    report = replay(path)
    assert report.status == REPRODUCED, report.describe()
    assert report.first_bit_difference is None or report.within_tolerance > 0
    assert any("cached, untraced" in n for n in report.notes)
    assert report.compared == len(events) - 3  # all but the header, the request annotation and the footer
