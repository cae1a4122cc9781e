"""`tracelm quantize` and quantize-on-load (issue 30 item 3): the legacy types byte for byte as gguf-py's quantizer,
the K-quants' error against f32, the written GGUF read back with its vocabulary and chat template, the same
logits from the file and from quantizing on load, and peak memory while quantizing on load."""

from __future__ import annotations

import json
import subprocess
import sys

import gguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType as QType

from tests.conftest import child_env, peak_rss_run
from tests.hf_synth import TEMPLATE, hf_model_folder


def tracelm(*args: str, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tracelm.cli", *args], capture_output=True, text=True, timeout=600,
                          env=child_env(), **kw)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return hf_model_folder(tmp_path_factory.mktemp("hf") / "tiny-hf")


def rel_rms(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.sqrt(np.mean((a - b) ** 2) / np.mean(b**2)))


def test_type_names_agree() -> None:
    from tracelm.io.quantize import QUANT_TYPES
    from tracelm.state.run_config import QUANT_NAMES

    assert tuple(QUANT_TYPES) == QUANT_NAMES


@pytest.mark.parametrize("qtype", [QType.Q8_0, QType.Q4_0, QType.Q4_1, QType.Q5_0, QType.Q5_1])
def test_legacy_types_are_gguf_quants_bytes(qtype) -> None:
    from tracelm.io.quantize import quantize_rows

    rng = np.random.default_rng(1)
    x = rng.standard_normal((37, 4096)).astype(np.float32) * 0.02  # more rows than one chunk holds
    x[3] = 0  # an all-zero row
    x[5, :32] = 7.5  # a block of one value
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr("tracelm.io.quantize.ROWS_PER_CHUNK_VALUES", 4096 * 5)  # chunks of 5 rows
        ours = quantize_rows(x, qtype)
    assert ours.tobytes() == gguf.quants.quantize(x, qtype).tobytes()


@pytest.mark.parametrize(("name", "bounds", "legacy"), [("q4_k", (0.075, 0.095), QType.Q4_0),
                                                         ("q5_k", (0.038, 0.05), QType.Q5_0),
                                                         ("q6_k", (0.019, 0.03), QType.Q8_0)])
def test_k_quants_error_against_f32(name, bounds, legacy) -> None:
    """RMS error relative to the signal, on Gaussian rows and on heavy-tailed rows with outliers: within the
    bounds (Gaussian, heavy-tailed), below the legacy type of as many bits (q6_k: within 4x of q8_0), and the
    same values whichever dequantizer (gguf-py's, tracelm's, the kernels') reads the blocks."""
    import tracelm.kernels as kernels
    from tracelm.io.dequant import dequantize
    from tracelm.io.quantize import quant_type, quantize_rows

    qtype = quant_type(name)
    rng = np.random.default_rng(2)
    gauss = rng.standard_normal((64, 1024)).astype(np.float32)
    heavy = rng.standard_t(3, (64, 1024)).astype(np.float32)
    heavy[::7, ::97] *= 20
    for x, bound in ((gauss, bounds[0]), (heavy, bounds[1]), (gauss * 1e-3 + 0.5, bounds[0])):
        blocks = quantize_rows(x, qtype)
        back = gguf.quants.dequantize(blocks, qtype)
        np.testing.assert_array_equal(dequantize(blocks, qtype, x.shape), back)
        np.testing.assert_array_equal(kernels.dequantize(blocks, int(qtype)), back)
        err = rel_rms(back, x)
        ref = rel_rms(gguf.quants.dequantize(gguf.quants.quantize(x, legacy), legacy), x)
        assert err <= bound, (name, err)
        assert err < (4 * ref if legacy == QType.Q8_0 else ref), (name, err, ref)
    zeros = quantize_rows(np.zeros((2, 256), np.float32), qtype)
    assert not gguf.quants.dequantize(zeros, qtype).any()


def test_tensor_types_follow_llama_quantize() -> None:
    from tracelm.io.quantize import tensor_type

    assert tensor_type("blk.0.attn_norm.weight", (256,), QType.Q4_K, True) == QType.F32
    assert tensor_type("token_embd.weight", (300, 256), QType.Q4_K, True) == QType.Q6_K  # tied: the head
    assert tensor_type("token_embd.weight", (300, 256), QType.Q4_K, False) == QType.Q4_K
    assert tensor_type("output.weight", (300, 256), QType.Q4_0, False) == QType.Q6_K
    assert tensor_type("output.weight", (300, 256), QType.Q8_0, False) == QType.Q8_0
    assert tensor_type("output.weight", (300, 64), QType.Q4_K, False) == QType.Q8_0
    assert tensor_type("blk.0.ffn_down.weight", (64, 96), QType.Q4_K, True) == QType.Q5_0  # rows not 256s
    assert tensor_type("blk.0.ffn_down.weight", (64, 48), QType.Q4_0, True) == QType.F16  # nor 32s


@pytest.mark.parametrize("name", ["q8_0", "q4_0"])
def test_quantized_file_holds_gguf_quants_bytes(folder, tmp_path, name) -> None:
    """Every matrix of the written file is gguf.quants.quantize of the folder's values (q and k rows reordered
    for GGUF llama's adjacent RoPE pairs, as convert_hf_to_gguf does)."""
    from tracelm.io.export import neox_to_adjacent
    from tracelm.io.gguf_file import GGUFFile
    from tracelm.io.safetensors_file import HFFolder

    out = tmp_path / f"m-{name}.gguf"
    proc = tracelm("quantize", str(folder), str(out), "--type", name)
    assert proc.returncode == 0, proc.stderr
    gf, hf = GGUFFile(out), HFFolder(folder)
    qtype = QType.Q8_0 if name == "q8_0" else QType.Q4_0
    assert gf.metadata["general.file_type"] == (7 if name == "q8_0" else 2)
    checked = 0
    for tname, t in gf.tensors.items():
        x = hf.tensor_f32(tname)
        if tname.endswith(("attn_q.weight", "attn_k.weight")):
            x = neox_to_adjacent(x, 4 if "attn_q" in tname else 2)
        if len(t.shape) == 1:
            assert t.qtype == QType.F32 and np.array_equal(gf.tensor_f32(tname), x)
            continue
        want = qtype if tname != "token_embd.weight" or name == "q8_0" else QType.Q6_K  # tied head
        assert t.qtype == want, tname
        if want == qtype:
            assert gf.raw(tname).tobytes() == gguf.quants.quantize(x, qtype).tobytes(), tname
            checked += 1
    assert checked >= 14


def test_quantized_file_carries_vocabulary_and_template(folder, tmp_path) -> None:
    """The old export wrote no vocabulary (tracelm then refused the file): now the GGUF loads alone, encodes as
    the folder's tokenizer.json does, carries its chat template, and gives the folder's logits."""
    from tracelm.io.loader import load_model
    from tracelm.pipeline.runner import Runner

    out = tmp_path / "m-q4_k.gguf"
    proc = tracelm("quantize", str(folder), str(out), "--type", "q4_k")
    assert proc.returncode == 0, proc.stderr
    assert "264 tokens" in proc.stderr
    ours, ref = load_model(str(out), progress=False), load_model(str(folder), progress=False)
    assert ours.chat_template == TEMPLATE and ours.tokenizer.chat_template == TEMPLATE
    assert ours.tokenizer.kind == "gguf-gpt2/gpt-2"
    for text in ["hello there, the hell", "  spaces\tand\nlines 1234 ünïcödé", "<|im_start|>user"]:
        assert ours.tokenizer.encode(text) == ref.tokenizer.encode(text)
        assert ours.tokenizer.encode(text, parse_special=True) == ref.tokenizer.encode(text, parse_special=True)
    assert ours.tokenizer.eos_id == ref.tokenizer.eos_id and ours.tokenizer.bos_id == ref.tokenizer.bos_id
    ids = ref.tokenizer.encode("hello there, the hell")
    a, b = Runner(ours, 32, kv_dtype="f32").logits(ids), Runner(ref, 32, kv_dtype="f32").logits(ids)
    assert rel_rms(a, b) < 0.3, rel_rms(a, b)  # q4_k on a random 2-layer model (q8_0: 0.02)

    export = tmp_path / "m-f32.gguf"
    proc = tracelm("export", "--model", str(folder), "--out", str(export))
    assert proc.returncode == 0, proc.stderr
    f32 = load_model(str(export), progress=False)  # loads without --tokenizer
    assert np.abs(Runner(f32, 32, kv_dtype="f32").logits(ids) - b).max() < 1e-3


def test_quantize_bad_input_is_one_line(folder, tmp_path) -> None:
    proc = tracelm("quantize", str(folder), str(tmp_path / "x.gguf"), "--type", "q3_k")
    assert proc.returncode == 2 and "invalid choice: 'q3_k'" in proc.stderr
    proc = tracelm("quantize", str(tmp_path / "nope"), str(tmp_path / "x.gguf"), "--type", "q4_0")
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert "nope" in proc.stderr
    bad = tmp_path / "bad"
    bad.mkdir()
    for f in folder.iterdir():
        (bad / f.name).write_bytes(f.read_bytes())
    spec = json.loads((bad / "tokenizer.json").read_text())
    spec["pre_tokenizer"] = {"type": "Whitespace"}
    spec["decoder"] = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True}
    (bad / "tokenizer.json").write_text(json.dumps(spec))
    proc = tracelm("quantize", str(bad), str(tmp_path / "x.gguf"), "--type", "q4_0")
    assert proc.returncode == 2 and "pre_tokenizer 'Whitespace'" in proc.stderr, proc.stderr
    assert not (tmp_path / "x.gguf").exists()


def test_quantize_on_load_gives_the_file_s_blocks_and_logits(folder, tmp_path) -> None:
    """`Session(folder, quantize=...)`: every float matrix becomes the blocks `tracelm quantize` writes (q8_0: the
    bytes of gguf.quants.quantize), and the logits are the quantized file's."""
    import tracelm.kernels as kernels
    from tracelm import Session
    from tracelm.io.loader import load_model
    from tracelm.io.safetensors_file import HFFolder
    from tracelm.pipeline.runner import Runner

    s = Session(str(folder), quantize="q8_0", settings=["context=64"])
    wo = s.model.weights.layers[1].wo
    assert wo.qtypes == (int(QType.Q8_0),) and wo.packed
    rows = kernels.unpack_rows(wo.parts[0][0], QType.Q8_0, np.arange(wo.shape[0]))
    want = gguf.quants.quantize(HFFolder(folder).tensor_f32("blk.1.attn_output.weight"), QType.Q8_0)
    assert rows.tobytes() == want.tobytes()
    assert s.model.weights.token_embd.qtypes == (int(QType.Q8_0),)
    s.close()

    out = tmp_path / "m-q4_k.gguf"
    assert tracelm("quantize", str(folder), str(out), "--type", "q4_k").returncode == 0
    s = Session(str(folder), quantize="q4_k", settings=["context=64"])
    assert s.model.weights.layers[0].w_down.qtypes == (int(QType.Q4_K),)
    assert s.model.weights.token_embd.qtypes == (int(QType.Q6_K),)
    ids = s.encode("hello there, the hell")
    a = Runner(s.model, 32).logits(ids)
    b = Runner(load_model(str(out), progress=False), 32).logits(ids)  # the file's q/k rows reordered: same math
    assert np.abs(a - b).max() < 1e-3
    assert s.generate("hello", max_tokens=4, temperature=0) == Session(str(out), settings=["context=64"]).generate(
        "hello", max_tokens=4, temperature=0)
    s.close()


def test_quantize_on_load_of_a_float_gguf(tiny_gguf) -> None:
    """A float GGUF quantizes too; rows of 64 values are no whole Q4_K super-block: Q5_0, as llama.cpp falls back."""
    from tracelm import Session

    ref = Session(str(tiny_gguf), settings=["context=64"])
    s = Session(str(tiny_gguf), quantize="q4_k", settings=["context=64"])
    assert s.model.weights.layers[0].wqkv.qtypes == (int(QType.Q5_0),)
    assert s.model.weights.token_embd.qtypes == (int(QType.Q8_0),)  # the tied head: Q8_0 when not 256s
    a, b = s.logits([1, 2, 3, 4]), ref.logits([1, 2, 3, 4])
    assert 0 < rel_rms(a, b) < 0.2
    assert "quantize-q4_k" in __import__("tracelm.session", fromlist=["numerics"]).numerics(s.cfg)


def test_quantize_on_load_bad_input(folder, tiny_gguf) -> None:
    from tracelm import Session, TracelmError

    with pytest.raises(TracelmError, match="quantize"):
        Session(str(folder), quantize="q3_k")
    s = Session(str(tiny_gguf), quantize="q8_0", settings=["weights=streamed"])
    with pytest.raises(TracelmError, match="resident weights on the kernels"):
        s.generate("hi", max_tokens=1)
    proc = tracelm("run", "--model", str(folder), "--quantize", "q9", "--prompt", "hi")
    assert proc.returncode == 2 and "invalid choice: 'q9'" in proc.stderr


PEAK = """
import json, math, sys
from tracelm import Session
from tracelm.session import held_bytes
s = Session(sys.argv[1], quantize="q8_0", settings=["context=64", "threads=1"])
text = s.generate("hello", max_tokens=4, temperature=0)
print(json.dumps({"quantized": s.source.weights_bytes(quantize="q8_0"), "kv": held_bytes(s.runner),
                  "f32": 4 * sum(math.prod(t.shape) for t in s.source.hf.tensors.values())}))
"""


def test_quantize_on_load_peak_memory(tmp_path) -> None:
    """Quantizing a folder on load holds its blocks, never all its matrices in f32: peak RSS (a fresh process,
    getrusage) under the quantized size + the KV cache + 200 MB, for a model whose f32 matrices alone exceed that."""
    folder = hf_model_folder(tmp_path / "big", hidden=1024, ff=2816, layers=6, heads=8, kv_heads=8, dtype="F16")
    proc, peak = peak_rss_run([sys.executable, "-c", PEAK, str(folder)], child_env())
    assert proc.returncode == 0, proc.stderr
    r = json.loads(proc.stdout)
    bound = r["quantized"] + r["kv"] + 200 * 2**20
    assert r["f32"] > bound, r  # the test's size: f32 matrices all at once could not pass
    assert peak < bound, {"peak": peak / 2**20, **{k: v / 2**20 for k, v in r.items()}}



def test_sentencepiece_folder_vocabulary_is_carried(tmp_path) -> None:
    """A folder whose tokenizer is a SentencePiece tokenizer.model (llama 2's): the GGUF holds it as GGUF `llama`
    (pieces, scores, types, space prefix) and encodes as sentencepiece does; the template comes along."""
    import shutil

    from tests.conftest import FIXTURES
    from tracelm.io.gguf_file import GGUFFile
    from tracelm.io.loader import load_tokenizer

    spm = FIXTURES / "llama2c" / "tokenizer.model"
    folder = hf_model_folder(tmp_path / "spm", hidden=64, ff=96, layers=1, n_vocab=32000, dtype="F32")
    (folder / "tokenizer.json").unlink()
    shutil.copy(spm, folder / "tokenizer.model")
    (folder / "tokenizer_config.json").write_text(json.dumps({"add_bos_token": True, "chat_template": TEMPLATE}))
    out = tmp_path / "spm.gguf"
    proc = tracelm("quantize", str(folder), str(out), "--type", "q8_0")
    assert proc.returncode == 0, proc.stderr
    meta = GGUFFile(out).metadata
    assert meta["tokenizer.ggml.model"] == "llama" and meta["tokenizer.chat_template"] == TEMPLATE
    ours, ref = load_tokenizer(str(out)), load_tokenizer(str(spm))
    for text in ["Hello world", " leading space and  two", "ünïcödé 123\n\tend", "<s> is text here"]:
        assert ours.encode(text) == ref.encode(text), text
        assert ours.decode(ours.encode(text), skip_special=True) == text


@pytest.mark.reference
def test_transformers_reads_the_quantized_file_as_tracelm_does(folder, tmp_path) -> None:
    """Another reader of GGUF: transformers (its GGUF loader follows llama.cpp's conventions, q/k rows included)
    loads the q4_k file and its tokenizer, and computes tracelm's logits on it."""
    from tests.conftest import require_reference

    require_reference()
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tracelm.io.loader import load_model
    from tracelm.pipeline.runner import Runner

    out = tmp_path / "m-q4_k.gguf"
    assert tracelm("quantize", str(folder), str(out), "--type", "q4_k").returncode == 0
    model = AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file=out.name, dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(str(tmp_path), gguf_file=out.name)
    ours = load_model(str(out), progress=False)
    text = "hello there, the hell"
    ids = ours.tokenizer.encode(text)
    assert tok(text)["input_ids"] == ids
    with torch.no_grad():
        theirs = model(torch.tensor([ids])).logits[0].numpy()
    assert np.abs(theirs - Runner(ours, 32, kv_dtype="f32").logits(ids)).max() < 1e-3


def test_a_quantized_on_load_run_replays_bit_for_bit(folder, tmp_path) -> None:
    """The trace header's config names the quantize type: replay quantizes the same way and reproduces every stage."""
    trace = tmp_path / "q.jsonl"
    proc = tracelm("run", "--model", str(folder), "--quantize", "q4_k", "--prompt", "hello", "--max-tokens", "4",
                   "--temperature", "0", "--context", "64", "--trace", str(trace))
    assert proc.returncode == 0, proc.stderr
    assert json.loads(trace.read_text().splitlines()[0])["config"]["quantize"] == "q4_k"
    proc = tracelm("replay", str(trace))
    assert "every stage output bit-identical" in proc.stdout, proc.stdout + proc.stderr


def test_quantize_a_float_gguf(tiny_gguf, tmp_path) -> None:
    """A GGUF in, a quantized GGUF out: its tensors quantized as they are (no reordering), its metadata kept."""
    from tracelm.io.gguf_file import GGUFFile

    out = tmp_path / "tiny-q4_0.gguf"
    proc = tracelm("quantize", str(tiny_gguf), str(out), "--type", "q4_0")
    assert proc.returncode == 0, proc.stderr
    src, gf = GGUFFile(tiny_gguf), GGUFFile(out)
    assert gf.metadata["tokenizer.ggml.tokens"] == src.metadata["tokenizer.ggml.tokens"]
    assert gf.metadata["tokenizer.ggml.merges"] == src.metadata["tokenizer.ggml.merges"]
    for name in ("blk.0.attn_q.weight", "blk.1.ffn_down.weight"):
        assert gf.tensors[name].qtype == QType.Q4_0
        assert gf.raw(name).tobytes() == gguf.quants.quantize(src.tensor_f32(name), QType.Q4_0).tobytes()
    proc = tracelm("run", "--model", str(out), "--prompt", "hello", "--max-tokens", "3", "--context", "64")
    assert proc.returncode == 0, proc.stderr
