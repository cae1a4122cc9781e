"""The graph, Cache and runner on a tiny synthetic GGUF model."""

from __future__ import annotations

import json

import gguf
import numpy as np
import pytest

from tests.conftest import write_tiny_gguf
from tracelm import TracelmError
from tracelm.io.loader import load_model
from tracelm.pipeline.graph import forward, new_cache
from tracelm.pipeline.runner import Runner, stop_split
from tracelm.pipeline.trace import Tracer
from tracelm.state.records import SamplingParams

GREEDY = SamplingParams(temperature=0.0)


@pytest.fixture(scope="module")
def tiny(tiny_gguf):
    return load_model(str(tiny_gguf), progress=False)


def test_config_from_metadata(tiny) -> None:
    c = tiny.cfg
    assert (c.n_embd, c.n_layer, c.n_head, c.n_head_kv, c.head_dim, c.n_ff) == (64, 2, 4, 2, 16, 96)
    assert c.tied_head and c.rope_mode == "adjacent" and c.n_vocab == 260
    assert tiny.weights.output is tiny.weights.token_embd


def test_decode_step_by_step_equals_batched_prefill(tiny) -> None:
    ids = [104, 101, 108, 108, 111, 32, 119, 111, 114, 108, 100, 33]
    batched = forward(tiny.cfg, tiny.weights, new_cache(tiny.cfg, 32), ids, all_logits=True).values
    cache = new_cache(tiny.cfg, 32)
    stepped = np.concatenate([forward(tiny.cfg, tiny.weights, cache, [i]).values for i in ids])
    assert batched.shape == (len(ids), tiny.cfg.n_vocab)
    np.testing.assert_allclose(stepped, batched, atol=1e-4, rtol=0)
    # a prefill split in two chunks gives the same logits as well
    cache = new_cache(tiny.cfg, 32)
    first = forward(tiny.cfg, tiny.weights, cache, ids[:5], all_logits=True).values
    second = forward(tiny.cfg, tiny.weights, cache, ids[5:], all_logits=True).values
    np.testing.assert_allclose(np.concatenate([first, second]), batched, atol=1e-4, rtol=0)


def test_cache_reset_nbytes_and_masks(tiny) -> None:
    cache = new_cache(tiny.cfg, 16)
    c = tiny.cfg
    assert cache.nbytes >= 2 * c.n_layer * c.n_head_kv * 16 * c.head_dim * 2  # f16 keys and values
    assert new_cache(c, 16, kv_dtype="f32").kv_nbytes == 2 * cache.kv_nbytes
    forward(c, tiny.weights, cache, [1, 2, 3])
    assert cache.tokens == [1, 2, 3]
    lo, mask = cache.window_mask(3, 2, 0)  # window 0: causal only
    assert lo == 0 and mask.shape == (2, 5) and np.isneginf(mask[0, 4]) and mask[0, 3] == 0 and mask[1, 4] == 0
    cache.reset()
    assert cache.n_past == 0


def test_generate_is_seeded_and_reuses_the_prefix(tiny) -> None:
    params = SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=7)
    runner = Runner(tiny, 64)
    prompt = tiny.tokenizer.encode("hello")
    a = "".join(runner.generate(prompt, 10, params))
    ids_a = list(runner.stats.tokens)
    b = "".join(runner.generate(prompt, 10, params))
    assert runner.stats.n_reused == len(prompt) - 1  # the prompt was cached by the first call
    assert (a, ids_a) == (b, runner.stats.tokens)
    c = "".join(Runner(tiny, 64).generate(prompt, 10, SamplingParams(temperature=1.0, top_k=0, seed=8)))
    assert runner.stats.tokens != [] and (c != a or ids_a != runner.stats.tokens)


def test_generation_output_equals_decode_of_ids(tiny) -> None:
    runner = Runner(tiny, 64)
    text = "".join(runner.generate(tiny.tokenizer.encode("hell"), 20, SamplingParams(temperature=1.5, seed=3)))
    assert text == tiny.tokenizer.decode(runner.stats.tokens)
    assert runner.stats.finish_reason in ("length", "stop")


def test_context_overflow_is_an_error_before_any_work(tiny) -> None:
    runner = Runner(tiny, 8)
    with pytest.raises(TracelmError, match="exceeds the context of 8"):
        next(runner.generate(list(range(6)), 3, GREEDY))
    assert runner.cache.n_past == 0


def test_stop_split_holds_back_possible_prefixes() -> None:
    assert stop_split("abc</", ["</s>"]) == ("abc", "</", False)
    assert stop_split("abc</s>def", ["</s>"]) == ("abc", "", True)
    assert stop_split("abc", []) == ("abc", "", False)
    assert stop_split("xEND", ["STOP", "END"]) == ("x", "", True)


def test_stop_strings_end_generation(tiny) -> None:
    runner = Runner(tiny, 64)
    full = "".join(runner.generate([104], 30, GREEDY))
    assert len(full) > 4
    stop = full[2:4]
    cut = "".join(Runner(tiny, 64).generate([104], 30, GREEDY, stop=[stop]))
    assert cut == full[: full.find(stop)]


def test_trace_events_cover_every_stage(tiny, tmp_path) -> None:
    path = tmp_path / "t.jsonl"
    with open(path, "w") as f:
        list(Runner(tiny, 32).generate([104, 101], 2, GREEDY, tracer=Tracer(f, "digest")))
    events = [json.loads(line) for line in path.read_text().splitlines()]
    stages = [e for e in events if e["event"] == "stage"]
    per_pass = 1 + 7 * tiny.cfg.n_layer + 2
    assert len(stages) == 2 * per_pass  # prefill + one decode step (the last token is not fed back)
    assert [e["seq"] for e in events] == list(range(len(events)))
    first = stages[0]
    assert first["stage"] == "embed" and first["shape"] == [[2, 64]] and len(first["digest"]) == 32
    assert {e["stage"] for e in stages} == {"embed", "attn_norm", "qkv", "rope", "attend", "out_proj", "ffn_norm",
                                            "ffn", "output_norm", "head"}
    assert sum(e["event"] == "token" for e in events) == 2


def test_product_pass_times_every_weight_product_of_a_pass(tiny_gguf, monkeypatch) -> None:
    """`tracelm bench`'s products-alone figure runs exactly a pass's weight products: four per block, in graph
    order, with the pass's rows, and the head for the last row."""
    from tracelm.io.loader import load_model
    from tracelm.stages import linear as linear_module
    from tracelm.tools.bench import product_pass_seconds

    model = load_model(str(tiny_gguf), progress=False)
    calls, real = [], linear_module.linear

    def spy(x, w):
        calls.append((x.shape, w.shape))
        return real(x, w)

    monkeypatch.setattr(linear_module, "linear", spy)
    assert product_pass_seconds(model.weights, model.cfg, 3, 1) > 0
    head = ((1, model.cfg.n_embd), model.weights.output.shape)
    one_pass = [((3, w.shape[1]), w.shape) for lw in model.weights.layers
                for w in (lw.wqkv, lw.wo, lw.w_gate_up, lw.w_down)] + [head]
    assert calls == one_pass * 2  # a warm-up pass, then the timed one


def test_bench_kernels_reports_every_type_and_shape(tiny_gguf) -> None:
    from tracelm.tools.bench import bench_kernels

    report = bench_kernels(str(tiny_gguf), rows=(1, 4))
    assert report["dequant_F32_gb_s"] > 0
    for kind in ("qkv", "attn_output", "ffn_gate_up", "ffn_down", "head"):
        for m in (1, 4):
            row = report[f"{kind}_M{m}"]
            assert row["ms"] > 0 and row["gb_s"] > 0 and row["gflop_s"] > 0
            assert "quantize_ms" not in row  # f32 weights: x is not quantized


def test_bench_kernels_reports_the_quantizers_share(tmp_path) -> None:
    """On quantized blocks each product's row says how long quantizing x took of it (a kernel call per part)."""
    from tracelm.tools.bench import bench_kernels

    path = write_tiny_gguf(tmp_path / "q8.gguf", qtype=gguf.GGMLQuantizationType.Q8_0)
    report = bench_kernels(str(path), rows=(1, 8))
    for kind in ("qkv", "attn_output", "ffn_gate_up", "ffn_down", "head"):
        for m in (1, 8):
            row = report[f"{kind}_M{m}"]
            assert row["quantize_ms"] > 0 and row["ms"] > 0, (kind, m, row)


@pytest.mark.parametrize("kv", ["f16", "f32"])
def test_kv_cache_dtype_holds_rounded_keys_and_steps_equal_a_pass(tiny, kv) -> None:
    """kv_cache f16 stores each key and value rounded to nearest f16 (what the Cache holds is k.astype(f16)), a
    pass reads its own keys as later steps do, and the logits stay close to the f32 Cache's."""
    ids = [1, 5, 9, 3, 7, 2]
    whole = Runner(tiny, 32, kv_dtype=kv)
    logits = whole.logits(ids)
    steps = Runner(tiny, 32, kv_dtype=kv)
    rows = [steps.logits(ids[: i + 1])[-1] for i in range(len(ids))]
    np.testing.assert_array_equal(np.stack(rows), logits)
    assert whole.cache.k[0].dtype == np.dtype(np.float16 if kv == "f16" else np.float32)
    exact = Runner(tiny, 32, kv_dtype="f32").logits(ids)
    np.testing.assert_allclose(logits, exact, rtol=0, atol=2e-2 * np.abs(exact).max())


def test_a_snapshot_resumes_only_in_a_cache_of_its_dtype(tiny) -> None:
    r16 = Runner(tiny, 32, kv_dtype="f16")
    r16.logits([1, 2, 3])
    r32 = Runner(tiny, 32, kv_dtype="f32")
    with pytest.raises(TracelmError, match="float16, this Cache in float32"):
        r32.cache.restore(r16.cache.snapshot())
    assert r32.cache.n_past == 0
