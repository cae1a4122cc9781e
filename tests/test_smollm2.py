"""End to end on the real default model, SmolLM2-135M-Instruct (GGUF, Q4_1/Q8_0). Its logits against Hugging Face
transformers, beside the other registry models': tests/test_families.py."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tracelm.pipeline.runner import Runner

CONFIG = str(Path(__file__).resolve().parents[1] / "configs" / "smollm2.yaml")

pytestmark = pytest.mark.model


def tracelm(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tracelm.cli", *args], capture_output=True, text=True,
                          input=stdin, timeout=300)


def test_run_answers_paris(smollm2_path) -> None:
    proc = tracelm("run", CONFIG, "--prompt", "The capital of France is", "--temperature", "0", "--max-tokens", "8")
    assert proc.returncode == 0, proc.stderr
    assert "Paris" in proc.stdout


def test_chat_answers_paris(smollm2_path) -> None:
    proc = tracelm("chat", CONFIG, "--temperature", "0", "--max-tokens", "40",
                   stdin="What is the capital of France?\n")
    assert proc.returncode == 0, proc.stderr
    assert "Paris" in proc.stdout


def test_chat_second_turn_reuses_the_cache(smollm2_path) -> None:
    proc = tracelm("chat", CONFIG, "--temperature", "0", "--max-tokens", "24",
                   "--message", "What is the capital of France?", "--message", "And of Italy?")
    assert proc.returncode == 0, proc.stderr
    reuse = [line for line in proc.stderr.splitlines() if line.startswith("[reused")]
    assert len(reuse) == 2 and reuse[0].startswith("[reused 0 of")
    n_reused, n_prompt = (int(w) for w in reuse[1].split()[1:4:2])
    assert 0 < n_reused < n_prompt  # only the new turn was prefilled


def test_trace_file_has_header_stages_and_tokens(smollm2_path, tmp_path) -> None:
    trace = tmp_path / "run.jsonl"
    proc = tracelm("run", CONFIG, "--temperature", "0", "--max-tokens", "3", "--trace", str(trace))
    assert proc.returncode == 0, proc.stderr
    events = [json.loads(line) for line in trace.read_text().splitlines()]
    header = events[0]
    assert header["event"] == "header" and header["level"] == "digest"
    assert header["model_sha256"] == "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
    assert header["prompt_ids"] and header["seed"] == 0 and header["packages"]["numpy"]
    assert header["config"]["sampling"]["temperature"] == 0.0
    assert events[-1]["event"] == "footer" and events[-1]["n_generated"] == 3
    assert sum(e["event"] == "stage" for e in events) == 3 * (1 + 7 * 30 + 2)


def test_logits_command_writes_every_position(smollm2, tmp_path) -> None:
    out = tmp_path / "logits.npy"
    proc = tracelm("logits", "--model", str(smollm2.path), "--prompt", "Hello world", "--out", str(out))
    assert proc.returncode == 0, proc.stderr
    logits = np.load(out)
    ids = smollm2.tokenizer.encode("Hello world")
    assert logits.dtype == np.float32 and logits.shape == (len(ids), smollm2.cfg.n_vocab)
    np.testing.assert_allclose(logits, Runner(smollm2, 16).logits(ids), atol=1e-4)


def test_int8_products_per_token_counts_each_quantized_weight_times_the_halves(smollm2) -> None:
    """The integer bound's work per prompt token, from the weights, against the dims: the block's four products
    at every position and the head at the last, each weight met by the activations' halves."""
    from tracelm.tools.bench import int8_products_per_token

    c, w = smollm2.cfg, smollm2.weights
    block = c.n_layer * (c.n_embd * (c.q_dim + 2 * c.kv_dim) + c.q_dim * c.n_embd + 3 * c.n_embd * c.n_ff)
    for halves in (2, 1):
        per_token = int8_products_per_token(w.with_halves(halves), 64)
        assert per_token == pytest.approx(halves * (block + c.n_vocab * c.n_embd / 64), rel=1e-12)


def test_bench_reports_rates_and_ratios(smollm2_path) -> None:
    proc = tracelm("bench", "--model", str(smollm2_path), "--prompt-tokens", "32", "--decode-tokens", "4", "--threads",
                   "1", "--json")
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    for key in ("load_seconds", "prefill_tok_s", "decode_tok_s", "peak_rss_mb", "bandwidth_gb_s", "sgemm_gflop_s",
                "decode_vs_roofline", "prefill_vs_sgemm_bound"):
        assert report[key] > 0, key
    # each decode step and each products-alone pass timed: the mean rate within the steps' spread, the best pass
    # the passes' min
    step = report["decode_step_ms"]
    assert 0 < step["min"] <= step["median"] <= step["max"]
    assert step["min"] * 0.99 <= 1e3 / report["decode_tok_s"] <= step["max"] * 1.01
    passes = report["decode_products_ms"]
    assert 0 < passes["min"] <= passes["median"] <= passes["max"]
    assert 1e3 / report["decode_products_tok_s"] == pytest.approx(passes["min"], rel=0.02)
    # the roofline's bandwidth: the better of the two reads, the pool's at the bench's own thread count
    reads = report["bandwidth_reads"]
    assert reads["threads"] == 1 and min(reads["sgemv_gb_s"], reads["kernels_read_gb_s"]) > 0
    assert report["bandwidth_gb_s"] == max(reads["sgemv_gb_s"], reads["kernels_read_gb_s"])
    # the prompt's integer bound: the path's dot at its peak on the bench's threads over the quantized weights'
    # int8 products per token; a product's integer work cannot pass it (the amx tiles' can: it times vpdpbusd)
    if report["kernels_path"] == "portable":
        assert "int8_dot_peak" not in report
    else:
        peak = report["int8_dot_peak"]
        assert peak["path"] == report["kernels_path"] and peak["threads"] == 1
        assert report["prefill_int8_bound_tok_s"] > 0
        if report["kernels_path"] != "amx":
            assert 0 < report["prefill_products_vs_int8_bound"] < 1 and 0 < report["prefill_vs_int8_bound"] < 1
    # how much of the process sits on huge pages (Linux says; the weights' arena is advised for them)
    assert report["huge_pages_mb"] is None or 0 <= report["huge_pages_mb"] <= report["peak_rss_mb"]
    # the share of the run's CPU time the host kept (Linux says)
    assert report["cpu_steal_share"] is None or 0 <= report["cpu_steal_share"] <= 1
    # the path measured, and why it was trusted: its self-test against the portable path passed
    assert report["kernels_path"] in report["selftest"]
    assert report["selftest"][report["kernels_path"]].startswith("passed")
