"""llama2.c checkpoints: stories260K.bin (shared fixture) read, run through the graph, checked against a
plain transcription of run.c's forward pass, exported to GGUF and read back."""

from __future__ import annotations

import hashlib
import json
import struct
import subprocess
import sys

import numpy as np
import pytest

from tests.conftest import FIXTURES, REPO

L2C = FIXTURES / "llama2c"
MODEL, TOK = L2C / "stories260K.bin", L2C / "tok512.bin"
CONFIG = str(REPO / "configs" / "stories260k.yaml")
FILES = ("--model", str(MODEL), "--set", f"tokenizer={TOK}")  # the config's files, from the shared fixtures

pytestmark = pytest.mark.skipif(not MODEL.is_file(), reason=f"fixture {MODEL} not present")


def tracelm(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tracelm.cli", *args], capture_output=True, text=True, timeout=120)


def runc_greedy(path, ids: list[int], n: int) -> list[int]:
    """run.c's forward, one position at a time, written from its source's description (no tracelm code)."""
    raw = open(path, "rb").read()
    dim, hidden, L, nh, nkv, vocab, seq = struct.unpack_from("<7i", raw)
    f = np.frombuffer(raw, "<f4", offset=28)
    hs, shared, vocab = dim // nh, vocab > 0, abs(vocab)
    kvd, pos = nkv * hs, 0

    def take(*shape):
        nonlocal pos
        n_ = int(np.prod(shape))
        a = f[pos : pos + n_].reshape(shape).astype(np.float64)
        pos += n_
        return a

    emb, rms_att, wq, wk, wv = take(vocab, dim), take(L, dim), take(L, dim, dim), take(L, kvd, dim), take(L, kvd, dim)
    wo, rms_ffn = take(L, dim, dim), take(L, dim)
    w1, w2, w3 = take(L, hidden, dim), take(L, dim, hidden), take(L, hidden, dim)
    rms_final = take(dim)
    take(seq, hs)
    wcls = emb if shared else take(vocab, dim)
    kc, vc = np.zeros((L, seq, kvd)), np.zeros((L, seq, kvd))
    rms = lambda x, w: w * x / np.sqrt(np.mean(x * x) + 1e-5)  # noqa: E731
    out, toks = [], list(ids)
    for p in range(len(ids) + n - 1):
        x = emb[toks[p]].copy()
        for layer in range(L):
            xb = rms(x, rms_att[layer])
            q, k, v = wq[layer] @ xb, wk[layer] @ xb, wv[layer] @ xb
            for i in range(0, dim, 2):  # adjacent pairs, frequency by position in the head
                fr = 1.0 / 10000.0 ** ((i % hs) / hs)
                c, s = np.cos(p * fr), np.sin(p * fr)
                for vec in (q, k) if i < kvd else (q,):
                    a, b = vec[i], vec[i + 1]
                    vec[i], vec[i + 1] = a * c - b * s, a * s + b * c
            kc[layer, p], vc[layer, p] = k, v
            att_out = np.zeros(dim)
            for h in range(nh):
                kh = h // (nh // nkv)
                sc = kc[layer, : p + 1, kh * hs : (kh + 1) * hs] @ q[h * hs : (h + 1) * hs] / np.sqrt(hs)
                sc = np.exp(sc - sc.max())
                att_out[h * hs : (h + 1) * hs] = (sc / sc.sum()) @ vc[layer, : p + 1, kh * hs : (kh + 1) * hs]
            x = x + wo[layer] @ att_out
            xb = rms(x, rms_ffn[layer])
            g = w1[layer] @ xb
            x = x + w2[layer] @ (g / (1 + np.exp(-g)) * (w3[layer] @ xb))
        if p >= len(ids) - 1:
            nxt = int(np.argmax(wcls @ rms(x, rms_final)))
            out.append(nxt)
            toks.append(nxt)
    return out


def test_stories260k_config_and_weights() -> None:
    from tracelm.io.loader import ModelFile

    src = ModelFile(str(MODEL), str(TOK))
    c = src.cfg
    shape = (c.n_embd, c.n_ff, c.n_layer, c.n_head, c.n_head_kv, c.n_vocab, c.n_ctx_train)
    assert shape == (64, 172, 5, 8, 4, 512, 512)
    assert c.tied_head and c.rope_mode == "adjacent"
    w = src.load(progress=False).weights
    assert w.layers[0].wqkv.shape == (64 + 2 * 32, 64) and w.layers[0].w_gate_up.shape == (2 * 172, 64)


def test_run_greedy_ids_follow_run_c() -> None:
    from tracelm.io.loader import load_model
    from tracelm.pipeline.runner import Runner
    from tracelm.state.records import SamplingParams

    model = load_model(str(MODEL), progress=False, tokenizer=str(TOK))
    ids = model.tokenizer.encode("Once upon a time")
    assert ids[0] == 1  # BOS first, as run.c's encode(..., bos=1)
    runner = Runner(model, 512)
    list(runner.generate(ids, 24, SamplingParams(temperature=0.0, repeat_penalty=1.0)))
    ours = runner.stats.tokens
    ref = runc_greedy(MODEL, ids, 24)
    assert ours == ref[: len(ours)] and len(ours) >= 1


def test_tracelm_run_with_config() -> None:
    proc = tracelm("run", CONFIG, *FILES, "--max-tokens", "16")
    assert proc.returncode == 0, proc.stderr
    assert "16 generated" in proc.stderr


def test_trace_of_a_llama2c_run_verifies_and_replays(tmp_path) -> None:
    """The header hashes the .bin and its separate tokenizer.bin (not GGUF metadata); replay reloads both."""
    trace = tmp_path / "s.jsonl"
    proc = tracelm("run", CONFIG, *FILES, "--max-tokens", "6", "--temperature", "0.8", "--trace", str(trace))
    assert proc.returncode == 0, proc.stderr
    header = json.loads(trace.read_text().splitlines()[0])
    assert header["tokenizer_sha256"] == hashlib.sha256((L2C / "tok512.bin").read_bytes()).hexdigest()
    assert header["model_sha256"] == hashlib.sha256((L2C / "stories260K.bin").read_bytes()).hexdigest()
    assert tracelm("trace", "verify", str(trace)).returncode == 3  # issue 31: unsigned, nothing authenticated
    assert tracelm("trace", "verify", str(trace), "--require", "intact").returncode == 0
    replayed = tracelm("replay", str(trace), "--require", "intact")
    assert replayed.returncode == 0, replayed.stdout + replayed.stderr


def test_export_to_gguf_gives_identical_logits(tmp_path) -> None:
    from tracelm.io.loader import load_model
    from tracelm.pipeline.runner import Runner

    out = tmp_path / "stories260K.gguf"
    proc = tracelm("export", "--model", str(MODEL), "--tokenizer", str(TOK), "--out", str(out))
    assert proc.returncode == 0, proc.stderr
    a = load_model(str(MODEL), progress=False, tokenizer=str(TOK))
    b = load_model(str(out), progress=False, tokenizer=str(TOK))
    assert b.cfg.arch == "llama" and b.cfg.n_layer == 5
    ids = a.tokenizer.encode("Once upon a time there was")
    np.testing.assert_array_equal(Runner(a, 64).logits(ids), Runner(b, 64).logits(ids))


def test_size_not_matching_header_is_a_clear_error(tmp_path) -> None:
    bad = tmp_path / "cut.bin"
    bad.write_bytes(MODEL.read_bytes()[:-4])
    proc = tracelm("run", CONFIG, "--model", str(bad), "--set", f"tokenizer={TOK}", "--max-tokens", "2")
    assert proc.returncode == 2
    err = proc.stderr.strip().splitlines()
    assert len(err) == 1 and "cut.bin" in err[0] and "1056536 bytes" in err[0] and "needs 1056540" in err[0]


def test_missing_tokenizer_is_a_clear_error() -> None:
    proc = tracelm("export", "--model", str(MODEL), "--out", "/nonexistent/x.gguf")
    assert proc.returncode == 2 and "no vocabulary" in proc.stderr and "Traceback" not in proc.stderr


def runc_encode(path, text: str) -> list[int]:
    """run.c's encode(): BOS, a dummy-prefix space, one token per UTF-8 character (bytes + 3 when absent),
    then repeatedly merge the adjacent pair whose concatenation has the highest score (leftmost on ties)."""
    raw = open(path, "rb").read()
    pos, vocab, scores = 4, [], []
    while pos < len(raw):
        score, n = struct.unpack_from("<fi", raw, pos)
        vocab.append(raw[pos + 8 : pos + 8 + n])
        scores.append(score)
        pos += 8 + n
    index: dict[bytes, int] = {}
    for i, v in enumerate(vocab):
        index.setdefault(v, i)
    ids = [1]
    if text:
        ids.append(index[b" "])
    for ch in text:
        b = ch.encode("utf-8")
        ids.extend([index[b]] if b in index else [x + 3 for x in b])
    while True:
        best, best_i, best_id = -1e10, -1, -1
        for i in range(len(ids) - 1):
            j = index.get(vocab[ids[i]] + vocab[ids[i + 1]], -1)
            if j != -1 and scores[j] > best:
                best, best_i, best_id = scores[j], i, j
        if best_i == -1:
            return ids
        ids[best_i : best_i + 2] = [best_id]


@pytest.mark.parametrize("text", ["Once upon a time", "e4 e5 Nf3 Nc6 Bb5", "hello, world!  two spaces"])
def test_prompt_ids_follow_run_c_encode(text) -> None:
    from tracelm.io.loader import load_tokenizer

    assert load_tokenizer(str(TOK)).encode(text) == runc_encode(TOK, text)
