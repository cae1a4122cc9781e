"""Streamed weights: quantized in the mapped GGUF, one block dequantized at a time into one scratch buffer;
the same logits as resident weights, bit for bit, and peak RSS within file + one block f32 + KV + 150 MB."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest

from tests.conftest import write_tiny_gguf
from tracelm import TracelmError
from tracelm.io.loader import load_model
from tracelm.stages.linear import GEMV_ROWS, block_rows, linear, linear_rows
from tracelm.state.records import RowSource
from tracelm.tools.bench import STREAMED_SLACK, logits_path

Q = gguf.GGMLQuantizationType


def both(path: Path, compute: str = "reference") -> tuple:
    """Resident and streamed loads of one file (on the numpy reference: the mode that dequantizes a block at a
    time; on the kernels streamed is only a reading order)."""
    return (load_model(str(path), progress=False, compute=compute),
            load_model(str(path), progress=False, weights="streamed", compute=compute))


@pytest.mark.parametrize("compute", ["reference", "kernels"])
@pytest.mark.parametrize("qtype", [Q.F32, Q.Q8_0, Q.Q4_0])
@pytest.mark.parametrize("tied", [True, False])
def test_tiny_streamed_logits_equal_resident(tmp_path: Path, qtype: Q, tied: bool, compute: str) -> None:
    resident, streamed = both(write_tiny_gguf(tmp_path / "tiny.gguf", qtype=qtype, tied=tied, seed=3), compute)
    prompt = resident.tokenizer.encode("hello, hello world")
    ids, a = logits_path(resident, prompt, 4)
    ids_s, b = logits_path(streamed, prompt, 4)
    assert ids == ids_s and a.shape == (len(prompt) + 4, resident.cfg.n_vocab)
    assert np.array_equal(a, b), np.abs(a - b).max()


def test_streamed_layers_share_one_scratch_buffer(tiny_gguf: Path) -> None:
    resident, streamed = both(tiny_gguf)
    layers = streamed.weights.layers
    assert len(layers) == 2 and not isinstance(streamed.weights.token_embd, np.ndarray)
    first = layers[0]
    kept = np.array(first.w_gate_up)
    assert np.array_equal(kept, resident.weights.layers[0].w_gate_up)
    second = layers[1]  # overwrites the first block's numbers in place
    assert np.shares_memory(first.w_gate_up, second.w_gate_up)
    assert np.array_equal(first.w_gate_up, resident.weights.layers[1].w_gate_up)
    for field in ("attn_norm", "wqkv", "wo", "ffn_norm", "w_gate_up", "w_down"):
        assert np.array_equal(getattr(second, field), getattr(resident.weights.layers[1], field)), field
        assert not getattr(second, field).flags.writeable
    assert layers.layer_nbytes >= max(lw.nbytes for lw in resident.weights.layers)
    assert streamed.weights.nbytes == resident.weights.nbytes
    ids = np.array([5, 200, 5, 259])
    assert np.array_equal(streamed.weights.token_embd[ids], resident.weights.token_embd[ids])


@pytest.mark.parametrize("n, d, max_rows", [(6144, 576, 2500), (9496, 896, 3000), (9496, 896, 100), (700, 64, 10_000)])
def test_linear_rows_equals_linear(n: int, d: int, max_rows: int) -> None:
    """The head's streamed product gives linear's numbers at every row count, on any BLAS: it is made of whole
    blocks of linear's own partition, each meeting the same call (9496 = 8 x 1187: a tail block; 100 rows: a
    piece of one block, larger than the scratch buffer)."""
    rng = np.random.default_rng(1)
    w = rng.standard_normal((n, d), dtype=np.float32)
    scratch = np.empty(max_rows * d, np.float32)
    asked = []

    def rows(lo: int, hi: int) -> np.ndarray:
        asked.append(hi - lo)
        out = scratch[: (hi - lo) * d].reshape(hi - lo, d) if hi - lo <= max_rows else np.empty((hi - lo, d),
                                                                                               np.float32)
        out[...] = w[lo:hi]
        return out

    src = RowSource((n, d), max_rows, rows, lambda ids: w[ids])
    r = block_rows(n, d)
    for m in (1, 2, 3, GEMV_ROWS, GEMV_ROWS + 1, 33):
        asked.clear()
        x = rng.standard_normal((m, d), dtype=np.float32)
        assert np.array_equal(linear_rows(x, src), linear(x, w)), (m, asked)
        assert sum(asked) == n and all(k % r == 0 and (k <= max_rows or k == r) for k in asked[:-1]), asked


def test_streamed_needs_a_gguf(tmp_path: Path) -> None:
    from tests.test_formats_safetensors import tiny_folder

    folder, _ = tiny_folder(tmp_path / "hf")
    gguf_path = str(write_tiny_gguf(tmp_path / "t.gguf"))
    with pytest.raises(TracelmError, match="hf: streamed weights need a GGUF file .this is a Hugging Face folder"):
        load_model(str(folder), progress=False, tokenizer=gguf_path, weights="streamed")
    with pytest.raises(TracelmError, match="weights 'disk'"):
        load_model(gguf_path, progress=False, weights="disk")


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tracelm.cli", *args], capture_output=True, text=True, timeout=120)


def test_run_with_weights_streamed_writes_the_resident_text(tmp_path: Path) -> None:
    model = write_tiny_gguf(tmp_path / "tiny.gguf", seed=5)
    config = tmp_path / "run.yaml"
    config.write_text(f"model: {model}\nprompt: hello\nmax_tokens: 6\ncontext: 64\nsampling:\n  temperature: 0\n")
    resident = _cli("run", str(config))
    streamed = _cli("run", str(config), "--set", "weights=streamed")
    assert resident.returncode == 0 and streamed.returncode == 0, resident.stderr + streamed.stderr
    assert streamed.stdout == resident.stdout and len(resident.stdout.strip()) > 0
    bad = _cli("run", str(config), "--set", "weights=disk")
    assert bad.returncode == 2 and bad.stderr.strip().splitlines() == [
        "tracelm: error: config key weights: 'weights' must be in ('resident', 'streamed') (got 'disk')"]


@pytest.mark.parametrize("compute", ["reference", "kernels"])
def test_smollm2_streamed_logits_equal_resident(smollm2_path: Path, compute: str) -> None:
    resident, streamed = both(smollm2_path, compute)
    prompt = resident.tokenizer.encode("The quick brown fox jumps over the lazy dog, and then it runs far away.")
    assert len(prompt) > GEMV_ROWS  # all positions at once: the matrix-matrix head
    for ids, n_decode in ((prompt, 2), (prompt[:5], 0)):  # and 2..GEMV_ROWS rows, and one row per decode step
        fed, a = logits_path(resident, ids, n_decode)
        fed_s, b = logits_path(streamed, ids, n_decode)
        assert fed == fed_s
        assert np.array_equal(a, b), np.abs(a - b).max()


RSS_CHILD = """
import json, sys
import numpy as np
from tracelm.io.loader import load_model
from tracelm.pipeline.runner import Runner
model = load_model(sys.argv[1], progress=False, weights="streamed", compute="reference")
runner = Runner(model, int(sys.argv[2]))
token = int(np.argmax(runner.prefill(model.tokenizer.encode("def add(a, b):\\n    return a + b\\n" * 3)).values[-1]))
for _ in range(int(sys.argv[3])):
    token = int(np.argmax(runner.step(token).values[-1]))
# VmHWM, the peak RSS of this process image: ru_maxrss would keep the peak of the forked pytest process (Linux
# carries it over exec), which holds resident models
peak = next(int(line.split()[1]) * 1024 for line in open("/proc/self/status") if line.startswith("VmHWM:"))
print(json.dumps({"peak": peak, "kv": runner.cache.nbytes,
                  "layer": model.weights.layers.layer_nbytes, "file": model.path.stat().st_size}))
"""


def streamed_peak_rss(path: Path, n_ctx: int, n_decode: int) -> dict[str, int]:
    env = {**os.environ, "OPENBLAS_NUM_THREADS": "1"}  # one BLAS thread: quicker on a busy 2-core machine
    out = subprocess.run([sys.executable, "-c", RSS_CHILD, str(path), str(n_ctx), str(n_decode)],
                         capture_output=True, text=True, timeout=300, env=env)
    assert out.returncode == 0, out.stderr
    r = json.loads(out.stdout)
    r["bound"] = r["file"] + r["layer"] + r["kv"] + STREAMED_SLACK
    print(f"{path.name}: peak RSS {r['peak'] / 2**20:.1f} MiB, bound {r['bound'] / 2**20:.1f} MiB "
          f"(file {r['file'] / 2**20:.1f} + block {r['layer'] / 2**20:.1f} + KV {r['kv'] / 2**20:.1f} + 150)")
    return r


def test_smollm2_streamed_peak_rss_within_bound(smollm2_path: Path) -> None:
    r = streamed_peak_rss(smollm2_path, 512, 2)
    assert r["peak"] <= r["bound"]
    assert r["layer"] < 20 * 2**20  # one block of SmolLM2 in f32 (~13.5 MiB), not the 513 MiB of all weights


def test_qwen_coder_streamed_peak_rss_within_bound(qwen_coder_path: Path) -> None:
    """The issue's target: Qwen2.5-Coder-0.5B (Q4_K_M, a 151936 x 896 head) streamed within the bound."""
    r = streamed_peak_rss(qwen_coder_path, 512, 1)
    assert r["peak"] <= r["bound"]


def test_a_streamed_trace_replays_bit_for_bit_on_resident_weights(tmp_path: Path) -> None:
    """A digest trace of a streamed run (sampled) is reproduced stage by stage by `replay`, which loads the
    weights resident: the audit trail does not depend on the weight mode."""
    from tests.test_trace import record
    from tracelm.audit.replay import REPRODUCED, replay

    model = write_tiny_gguf(tmp_path / "tiny.gguf", qtype=Q.Q8_0, seed=7)
    trace = tmp_path / "run.jsonl"
    lines = record(model, trace, "--set", "weights=streamed")
    assert json.loads(lines[0])["config"]["weights"] == "streamed"
    report = replay(trace)
    assert report.status == REPRODUCED and report.divergence is None and report.first_bit_difference is None
    assert report.compared > 50


@pytest.mark.parametrize("qtype", [Q.Q4_1, Q.Q5_0, Q.Q4_K, Q.Q6_K])
def test_own_dequantization_kernels_equal_gguf(qtype: Q) -> None:
    """Q4_1, Q5_0, Q4_K and Q6_K (SmolLM2's, Qwen2.5's and Gemma 3's main types) are dequantized by tracelm's
    own kernels: every value must be gguf.quants' own, for quantized data and for arbitrary bytes."""
    from tracelm.io.dequant import KERNEL_VALUES, dequantize

    rng = np.random.default_rng(2)
    block, type_size = gguf.GGML_QUANT_SIZES[qtype]
    n = KERNEL_VALUES // block + 3  # blocks: more than one kernel call
    noise = rng.integers(0, 256, (n, type_size), dtype=np.uint8)
    scale_bytes = {Q.Q4_1: (0, 2), Q.Q5_0: (0,), Q.Q4_K: (0, 2), Q.Q6_K: (208,)}[qtype]
    for at in scale_bytes:  # finite f16 scales (NaN != NaN); every other byte arbitrary
        noise[:, at : at + 2] = np.float16(rng.uniform(-3, 3, (n, 1))).view(np.uint8)
    cases = [(noise, (n, block))]
    if qtype in (Q.Q4_1, Q.Q5_0):  # gguf quantizes these (not the K-quants)
        w = rng.standard_normal((300, 256)) * rng.uniform(0.01, 10, (300, 1))
        cases.append((gguf.quants.quantize(w.astype(np.float32), qtype), w.shape))
    for data, shape in cases:
        ours = dequantize(data, qtype, shape)
        theirs = gguf.quants.dequantize(data, qtype).reshape(shape)
        assert ours.dtype == np.float32 and np.array_equal(ours, theirs)
