"""Synthetic models (`synth:NAME[@SEED][?layers=N]`, tracelm/io/synth.py): the registry file's names, shapes and types
at its own size, the published dims at another, the same bytes for a seed, a model that loads and generates.

The files written here are SmolLM2-135M with 2 layers (36 MB); the other sizes are checked on their plan (the tensor
table and metadata the writer writes), which needs no writing."""

from __future__ import annotations

import hashlib
import re
from pathlib import Path

import gguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q

from tracelm import TracelmError
from tracelm.cli import main
from tracelm.io import registry, synth
from tracelm.io.gguf_file import GGUFFile, model_config

CONFIG = str(Path(__file__).resolve().parents[1] / "configs" / "smollm2.yaml")
SMALL = "synth:smollm2-135m?layers=2"
SMOLLM2_SHA256 = registry.MODELS["smollm2-135m-instruct"].sha256
# sha256 over the tensors' bytes of SMALL at seed 0, in plan order: the bytes every machine must write
SMALL_DATA_SHA256 = "3d78bf42a95fca4e18af7d16b9a7a0fc47df11c2ac64d8b5ec9527b669e2fff2"


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture
def synth_home(tmp_path, monkeypatch) -> Path:
    """The synthetic models' cache in a temporary folder (the registry models stay where the fixtures pulled them)."""
    monkeypatch.setattr(registry, "synth_home", lambda: tmp_path / "synth")
    return tmp_path / "synth"


@pytest.fixture(scope="module")
def small(tmp_path_factory, smollm2_path) -> Path:
    sn = synth.parse(SMALL)
    return synth.write(sn, smollm2_path, SMOLLM2_SHA256, tmp_path_factory.mktemp("synth") / sn.filename)


@pytest.mark.parametrize(("name", "fixture"), [("smollm2-135m", "smollm2_path"), ("gemma3-270m", "gemma3_path"),
                                               ("qwen2.5-0.5b", "qwen_coder_path")])
def test_own_size_has_the_registry_files_names_shapes_types_and_metadata(name, fixture, request):
    base = GGUFFile(request.getfixturevalue(fixture))
    sn = synth.parse(synth.PREFIX + name)
    planned = {t.name: (t.shape, t.qtype) for t in synth.plan(base, sn.shape)}
    assert planned == {t.name: (t.shape, t.qtype) for t in base.tensors.values()}
    meta = {k: (v, types) for k, v, types in synth.metadata(base, sn, "0" * 64)}
    for key, value in base.metadata.items():
        if key in ("general.architecture", "general.name", "general.size_label"):  # the writer adds the first
            continue
        got, types = meta[key]
        assert types == base.value_types[key], key
        assert np.array_equal(got, value) if isinstance(value, np.ndarray) else got == value, key
    assert meta["general.name"][0] == f"synth:{name}@0"
    assert meta["tracelm.synth.base"][0] == sn.size.base


def test_a_larger_size_has_the_published_dims_and_the_files_type_rules(qwen_coder_path):
    base = GGUFFile(qwen_coder_path)
    sn = synth.parse("synth:qwen2.5-7b")
    tensors = {t.name: t for t in synth.plan(base, sn.shape)}
    # Qwen/Qwen2.5-7B config.json: hidden 3584, intermediate 18944, 28 layers, 28 heads, 4 KV heads (head 128)
    assert {n.split(".")[1] for n in tensors if n.startswith("blk.")} == {str(i) for i in range(28)}
    shapes = {n.removeprefix("blk.0."): t.shape for n, t in tensors.items() if not n.startswith("blk.") or
              n.startswith("blk.0.")}
    assert shapes["attn_q.weight"] == (3584, 3584) and shapes["attn_k.weight"] == (512, 3584)
    assert shapes["attn_v.weight"] == (512, 3584) and shapes["attn_output.weight"] == (3584, 3584)
    assert shapes["ffn_gate.weight"] == shapes["ffn_up.weight"] == (18944, 3584)
    assert shapes["ffn_down.weight"] == (3584, 18944) and shapes["attn_k.bias"] == (512,)
    assert shapes["token_embd.weight"] == shapes["output.weight"] == (151936, 3584)  # the file's vocabulary
    meta = {k: v for k, v, _ in synth.metadata(base, sn, "0" * 64)}
    assert (meta["qwen2.block_count"], meta["qwen2.embedding_length"], meta["qwen2.feed_forward_length"],
            meta["qwen2.attention.head_count"], meta["qwen2.attention.head_count_kv"]) == (28, 3584, 18944, 28, 4)
    # 896-value rows forced the 0.5B file's Q5_0 / Q8_0 fall-backs; 3584 is whole super-blocks: Q4_K / Q6_K
    assert base.info("blk.0.attn_q.weight").qtype == Q.Q5_0 and tensors["blk.0.attn_q.weight"].qtype == Q.Q4_K
    assert base.info("output.weight").qtype == Q.Q8_0 and tensors["output.weight"].qtype == Q.Q6_K
    assert tensors["token_embd.weight"].qtype == Q.Q4_K
    # the file's attn_v / ffn_down mix follows use_more_bits over the layers' names (0, 1, 10, 11, ...): kept
    down = [tensors[f"blk.{i}.ffn_down.weight"].qtype for i in range(28)]
    by_name = sorted(range(28), key=str)
    assert all((down[layer] == Q.Q6_K) == synth._more_bits(rank, 28) for rank, layer in enumerate(by_name))
    assert down == [tensors[f"blk.{i}.attn_v.weight"].qtype for i in range(28)]
    file = synth.nbytes
    assert 4.5e9 < sum(file(t) for t in tensors.values()) < 4.8e9  # Qwen2.5-7B-Instruct Q4_K_M: 4.68 GB


def test_gemma_sizes_keep_fallbacks_where_rows_need_them(gemma3_path):
    base = GGUFFile(gemma3_path)
    one = {t.name: t for t in synth.plan(base, synth.parse("synth:gemma3-1b").shape)}
    assert one["blk.0.attn_q.weight"].shape == (1024, 1152) and one["blk.0.ffn_down.weight"].shape == (1152, 6912)
    assert one["blk.0.attn_q.weight"].qtype == Q.Q5_0  # 1152 is not whole super-blocks, as 640 was not
    assert one["blk.0.ffn_down.weight"].qtype == Q.Q6_K and one["token_embd.weight"].qtype == Q.Q8_0
    four = {t.name: t for t in synth.plan(base, synth.parse("synth:gemma3-4b").shape)}
    assert four["blk.33.attn_k.weight"].shape == (1024, 2560) and four["blk.0.attn_q_norm.weight"].shape == (256,)
    assert four["blk.0.attn_q.weight"].qtype == Q.Q4_K and four["token_embd.weight"].qtype == Q.Q6_K
    meta = {k: v for k, v, _ in synth.metadata(base, synth.parse("synth:gemma3-4b"), "")}
    assert meta["gemma3.attention.sliding_window"] == 1024 and meta["gemma3.attention.key_length"] == 256


def test_layer_types_keep_the_files_rule_at_another_count():
    six, four = Q.Q6_K, Q.Q4_K
    gemma18 = [six if c == "6" else four for c in "664464464464464666"]  # Gemma 3 270M's ffn_down, by number
    got = synth.layer_types(gemma18, 26)
    assert got == [six if synth._more_bits(i, 26) else four for i in range(26)]
    assert synth.layer_types(gemma18, 18) == gemma18
    assert synth.layer_types([four] * 3, 5) == [four] * 5
    odd = [six, four, four, four]  # neither order's rule: spread in proportion
    assert synth.layer_types(odd, 8) == [six, six, four, four, four, four, four, four]


@pytest.mark.parametrize("qtype", [Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0, Q.Q4_K, Q.Q5_K, Q.Q6_K, Q.F32, Q.F16])
def test_blocks_give_unit_outputs_for_unit_inputs(qtype):
    t = synth.Planned("blk.0.ffn_down.weight", (64, 4864), qtype)
    data = synth.tensor_data(t, 0)
    w = data.astype(np.float32) if qtype in synth.FLOAT_TYPES else gguf.quants.dequantize(data, qtype)
    assert w.shape == (64, 4864) and np.isfinite(w).all()
    y = np.random.default_rng(0).standard_normal((16, 4864)) @ w.T.astype(np.float64)
    assert 0.85 < y.std() < 1.15
    assert abs(w.mean()) * np.sqrt(4864) < 0.15  # near zero-mean


def test_norms_and_biases_are_near_one_and_zero():
    norm = synth.tensor_data(synth.Planned("blk.0.attn_norm.weight", (576,), Q.F32), 0)
    bias = synth.tensor_data(synth.Planned("blk.0.attn_q.bias", (576,), Q.F32), 0)
    assert 0.9 <= norm.min() and norm.max() <= 1.1 and abs(bias).max() <= 0.1 and bias.std() > 0.02


def test_same_seed_same_bytes_another_seed_others(small, smollm2_path, tmp_path):
    again = synth.write(synth.parse(SMALL), smollm2_path, SMOLLM2_SHA256, tmp_path / "again.gguf")
    assert _sha(again) == _sha(small)
    other = synth.write(synth.parse("synth:smollm2-135m@1?layers=2"), smollm2_path, SMOLLM2_SHA256,
                        tmp_path / "other.gguf")
    assert _sha(other) != _sha(small)
    a, b = GGUFFile(small), GGUFFile(other)
    assert a.tensors.keys() == b.tensors.keys()
    assert all(a.raw(n).tobytes() != b.raw(n).tobytes() for n in a.tensors)


def test_the_bytes_are_pinned(small):
    """The tensors' bytes of SMALL at seed 0 are these on every machine (PCG64's raw words, IEEE f16 rounding):
    a change to the generator shows here and must bump synth.GENERATOR."""
    gf = GGUFFile(small)
    h = hashlib.sha256()
    for t in synth.plan(GGUFFile(registry.resolve("smollm2-135m-instruct")), synth.parse(SMALL).shape):
        h.update(gf.raw(t.name).tobytes())
    assert h.hexdigest() == SMALL_DATA_SHA256


def test_written_file_is_the_plan_and_loads_and_generates(small, smollm2_path):
    gf = GGUFFile(small)
    planned = synth.plan(GGUFFile(smollm2_path), synth.parse(SMALL).shape)
    assert [(t.name, t.shape, t.qtype) for t in gf.tensors.values()] == [(t.name, t.shape, t.qtype) for t in planned]
    cfg = model_config(gf)
    assert (cfg.n_layer, cfg.n_embd, cfg.n_head, cfg.n_head_kv, cfg.n_vocab) == (2, 576, 9, 3, 49152)
    assert gf.metadata["tracelm.synth.generator"] == synth.GENERATOR
    assert gf.metadata["tracelm.synth.base_sha256"] == SMOLLM2_SHA256
    assert gf.metadata["tokenizer.ggml.tokens"] == GGUFFile(smollm2_path).metadata["tokenizer.ggml.tokens"]
    from tracelm import Session

    with Session(str(small)) as s:
        logits = s.logits("Once upon a time")
        assert np.isfinite(logits).all() and 0.1 < logits.std() < 100
        assert len(s.encode(s.generate("Once upon a time", max_tokens=4, temperature=0))) >= 1


def test_resolve_writes_once_then_reuses(synth_home):
    path = registry.resolve(SMALL)
    assert path == synth_home / "smollm2-135m-layers2-0.gguf" and path.is_file()
    stamp = path.stat().st_mtime_ns
    assert registry.resolve(SMALL) == path and path.stat().st_mtime_ns == stamp
    assert registry.resolve("synth:smollm2-135m@0?layers=2") == path
    assert [p.name for p in synth_home.iterdir()] == [path.name]  # no temporary file left
    assert path.stat().st_mode & 0o777 == 0o644


def test_a_failed_write_leaves_nothing(synth_home, monkeypatch):
    calls = []

    def failing(t, seed):
        calls.append(t.name)
        if len(calls) == 5:
            raise OSError(28, "No space left on device")
        return original(t, seed)

    original = synth.tensor_data
    monkeypatch.setattr(synth, "tensor_data", failing)
    with pytest.raises(TracelmError, match="cannot write the synthetic model: No space left"):
        registry.resolve(SMALL)
    assert list(synth_home.iterdir()) == []


def test_cli_runs_a_synthetic_model(synth_home, capsys):
    assert main(["run", CONFIG, "--model", "synth:smollm2-135m@3?layers=2", "--prompt", "hi", "--max-tokens", "3",
                 "--temperature", "0"]) == 0
    assert (synth_home / "smollm2-135m-layers2-3.gguf").is_file()
    assert main(["models", "list"]) == 0
    assert "synth:qwen2.5-7b" in capsys.readouterr().out


@pytest.mark.parametrize(("name", "message"), [
    ("synth:qwen9", "unknown synthetic model 'synth:qwen9': known are synth:qwen2.5-0.5b, synth:qwen2.5-1.5b"),
    ("synth:", "unknown synthetic model"),
    ("synth:qwen2.5-7b@x", "the seed after @ must be an integer"),
    ("synth:qwen2.5-7b@-1", "the seed after @ must be an integer"),
    ("synth:qwen2.5-7b?layers=0", "unknown option 'layers=0'"),
    ("synth:qwen2.5-7b?depth=2", "unknown option 'depth=2'"),
])
def test_bad_names_say_what_is_wrong(name, message, synth_home, capsys):
    with pytest.raises(TracelmError, match=message):
        registry.resolve(name)
    assert main(["run", CONFIG, "--model", name, "--prompt", "hi"]) == 2  # one line, no traceback
    err = capsys.readouterr().err
    assert err.startswith("tracelm: error: ") and re.search(message, err) and err.count("\n") == 1


def test_names_parse():
    assert synth.parse("synth:qwen2.5-7b") == synth.SynthName("qwen2.5-7b", 0, None)
    assert synth.parse("synth:qwen2.5-7b@42?layers=3") == synth.SynthName("qwen2.5-7b", 42, 3)
    assert str(synth.parse("synth:gemma3-1b@7")) == "synth:gemma3-1b@7"
    assert synth.parse("synth:gemma3-1b@7").filename == "gemma3-1b-7.gguf"
    assert set(synth.SIZES) >= {"qwen2.5-0.5b", "qwen2.5-1.5b", "qwen2.5-3b", "qwen2.5-7b", "qwen2.5-14b",
                                "smollm2-135m", "smollm2-360m", "smollm2-1.7b", "gemma3-270m", "gemma3-1b", "gemma3-4b"}
    assert {s.base for s in synth.SIZES.values()} <= set(registry.MODELS)


def test_an_unwritable_folder_or_a_full_disk_says_so(tmp_path, smollm2_path, monkeypatch):
    blocked = tmp_path / "file"
    blocked.write_text("")
    sn = synth.parse(SMALL)
    with pytest.raises(TracelmError, match="cannot write the synthetic model there"):
        synth.write(sn, smollm2_path, SMOLLM2_SHA256, blocked / "synth" / sn.filename)
    monkeypatch.setattr(synth.shutil, "disk_usage", lambda p: type("U", (), {"free": 1 << 20})())
    with pytest.raises(TracelmError, match=r"not enough disk space in .* for synth:smollm2-135m@0\?layers=2"):
        synth.write(sn, smollm2_path, SMOLLM2_SHA256, tmp_path / "synth" / sn.filename)
    assert list((tmp_path / "synth").iterdir()) == []
