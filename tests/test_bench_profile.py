"""`tracelm bench profile`: a decode step's time by kind of work, the timers put back after."""

from __future__ import annotations

import json

import gguf
import numpy as np
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
    prefill = report["prefill"]  # the prompt's prefill, by the same kinds: nothing sampled
    assert prefill["tokens"] == 8 and prefill["tok_s_untimed"] == pytest.approx(8e3 / prefill["ms_untimed"], rel=0.01)
    assert set(prefill["kinds"]) == {*KINDS, "rest"} - {"sampling"}
    for kind in ("products", "head", "attention", "norms", "rope", "activation"):
        assert prefill["kinds"][kind]["ms_per_prefill"] > 0, kind
    assert sum(k["share"] for k in prefill["kinds"].values()) == pytest.approx(1.0, abs=0.01)
    assert sum(k["ms_per_prefill"] for k in prefill["kinds"].values()) == pytest.approx(prefill["ms"], rel=0.01,
                                                                                        abs=0.004)
    assert prefill["pool"] == {"jobs_per_prefill": 0.0}  # one thread: no pool
    assert report["cpu_steal_share"] is None or 0 <= report["cpu_steal_share"] <= 1  # the host's share meanwhile
    # the path's integer peak on this thread (none on the portable path)
    assert prefill["int8_dot_peak_g_s"] > 0 if kernels.path() != "portable" else prefill["int8_dot_peak_g_s"] is None


def test_cli(tiny_q8, capsys):
    assert cli.main(["bench", "profile", "--model", str(tiny_q8), "--streams", "2", "--prompt-tokens", "8",
                     "--decode-tokens", "2", "--threads", "1", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert list(k for k in report if k.startswith("streams_")) == ["streams_2"] and report["steps"] == 2


def test_thread_counts_profile_each_and_say_what_scales(tiny_q8):
    before = kernels.threads()
    report = bench_profile(str(tiny_q8), streams=(1, 2), n_prompt=8, n_decode=3, thread_counts=(1, 2))
    assert kernels.threads() == before  # put back
    assert report["threads"] == [1, 2]
    for t in (1, 2):
        for n in (1, 2):
            assert set(report[f"threads_{t}"][f"streams_{n}"]["kinds"]) == {*KINDS, "rest"}
    for n in (1, 2):
        two = report["scaling"][f"streams_{n}"]["threads_2"]
        base, here = report["threads_1"][f"streams_{n}"], report["threads_2"][f"streams_{n}"]
        assert two["step"] == round(base["ms_per_step_untimed"] / here["ms_per_step_untimed"], 2)
        assert two["products"] == round(base["kinds"]["products"]["ms_per_step"] /
                                        here["kinds"]["products"]["ms_per_step"], 2)
        assert set(two) == {"step", *KINDS, "rest"}
    two = report["scaling"]["prefill"]["threads_2"]
    base, here = report["threads_1"]["prefill"], report["threads_2"]["prefill"]
    assert two["prefill"] == round(base["ms_untimed"] / here["ms_untimed"], 2)
    assert two["products"] == round(base["kinds"]["products"]["ms_per_prefill"] /
                                    here["kinds"]["products"]["ms_per_prefill"], 2)
    if kernels.path() != "portable":
        assert two["int8_dot_peak"] == round(here["int8_dot_peak_g_s"] / base["int8_dot_peak_g_s"], 2)
    assert set(two) == {"prefill", *KINDS, "rest", "int8_dot_peak"} - {"sampling"}
    assert here["pool"]["jobs_per_prefill"] >= 1  # two threads: the products ran on the pool


def test_the_pools_time_in_its_jobs(tiny_q8, kernels_restored):
    """`pool`: the kernels' pool over the timed steps -- none of it on one thread; on two, its jobs a step, their
    wall, the share spent inside tasks and the rest as ms a step, consistent with each other."""
    report = bench_profile(str(tiny_q8), streams=(1,), n_prompt=8, n_decode=3, thread_counts=(1, 2))
    assert report["threads_1"]["streams_1"]["pool"] == {"jobs_per_step": 0.0}
    pool = report["threads_2"]["streams_1"]["pool"]
    assert pool["jobs_per_step"] >= 1 and 0 < pool["busy_share"] <= 1
    assert 0 < pool["ms_per_step"] <= report["threads_2"]["streams_1"]["ms_per_step"]
    assert pool["waiting_ms_per_step"] == pytest.approx(pool["ms_per_step"] * (1 - pool["busy_share"]), abs=0.002)
    kinds = report["threads_2"]["streams_1"]["kinds"]
    assert kinds["products"]["pool"]["jobs_per_step"] >= 1 and "pool" not in kinds["rest"]
    assert "pool" not in report["threads_1"]["streams_1"]["kinds"]["products"]  # one thread: no pool
    # each kind's jobs are the step's, counted while its calls ran (at most the step's, rounded to a tenth)
    assert sum(k["pool"]["jobs_per_step"] for k in kinds.values() if "pool" in k) <= pool["jobs_per_step"] + 0.5
    counts = kernels.pool_counts()  # counting stopped with the timed steps
    kernels.set_threads(2)
    x, w = np.ones((16, 512), np.float32), np.ones((512, 512), np.float32)
    kernels.matmul(x, w, 0)
    assert kernels.pool_counts() == counts
    kernels.pool_counting(True)  # and that product is the pool's when counted
    kernels.matmul(x, w, 0)
    kernels.pool_counting(False)
    assert kernels.pool_counts()[0] >= 1


def test_cli_thread_counts(tiny_q8, capsys):
    assert cli.main(["bench", "profile", "--model", str(tiny_q8), "--streams", "1", "--prompt-tokens", "8",
                     "--decode-tokens", "2", "--thread-counts", "2,1", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["threads"] == [2, 1] and "threads_1" in report["scaling"]["streams_1"]
    assert cli.main(["bench", "profile", "--model", str(tiny_q8), "--thread-counts", "1,1"]) == 2
    assert "--thread-counts '1,1'" in capsys.readouterr().err
    assert cli.main(["bench", "server", "--model", str(tiny_q8), "--thread-counts", "1,2"]) == 2
    assert "--thread-counts applies to bench profile only" in capsys.readouterr().err


def test_temperature_samples_with_the_defaults(tiny_q8, capsys, monkeypatch):
    """--temperature T: the streams sample at T with the sampler's defaults (top-k 40 ...), every token still asked
    for decoded (the end tokens biased away); the report says T."""
    seen = []
    step = Generation.step

    def spy(self, *args):
        seen.append((self.sampling.temperature, self.sampling.top_k, self.sampling.logit_bias))
        return step(self, *args)

    monkeypatch.setattr(Generation, "step", spy)
    assert cli.main(["bench", "profile", "--model", str(tiny_q8), "--streams", "2", "--prompt-tokens", "8",
                     "--decode-tokens", "3", "--threads", "1", "--temperature", "0.8", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["temperature"] == 0.8 and report["streams_2"]["kinds"]["sampling"]["ms_per_step"] > 0
    assert seen and all(t == 0.8 and k == 40 and bias for t, k, bias in seen)
    assert cli.main(["bench", "profile", "--model", str(tiny_q8), "--temperature", "-1"]) == 2
    assert "--temperature must be finite and >= 0" in capsys.readouterr().err
    assert cli.main(["bench", "server", "--model", str(tiny_q8), "--temperature", "inf"]) == 2
    assert "--temperature must be finite" in capsys.readouterr().err
    assert cli.main(["bench", "paths", "--model", str(tiny_q8), "--temperature", "0.5"]) == 2
    assert "--temperature applies to bench profile and bench server only" in capsys.readouterr().err


def test_filters_replace_the_defaults(tiny_q8, capsys, monkeypatch):
    """--top-k, --top-p, --min-p: the sampled streams' filters in the defaults' place, in the report; refused, naming
    the flag, when out of range or without --temperature."""
    seen = []
    step = Generation.step

    def spy(self, *args):
        seen.append((self.sampling.top_k, self.sampling.top_p, self.sampling.min_p))
        return step(self, *args)

    monkeypatch.setattr(Generation, "step", spy)
    assert cli.main(["bench", "profile", "--model", str(tiny_q8), "--streams", "1", "--prompt-tokens", "8",
                     "--decode-tokens", "3", "--threads", "1", "--temperature", "0.8", "--top-k", "0", "--min-p", "0",
                     "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["filters"] == {"top_k": 0, "min_p": 0.0}
    assert seen and set(seen) == {(0, 0.95, 0.0)}
    assert cli.main(["bench", "server", "--model", str(tiny_q8), "--temperature", "1", "--top-p", "1.5"]) == 2
    assert "bench: --top-p 1.5: 'top_p' must be <= 1.0" in capsys.readouterr().err
    assert cli.main(["bench", "profile", "--model", str(tiny_q8), "--top-k", "5"]) == 2
    assert "--top-k, --top-p and --min-p apply to bench profile and bench server with --temperature > 0" in \
        capsys.readouterr().err
