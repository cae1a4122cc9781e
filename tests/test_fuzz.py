"""Issue 18: `tracelm fuzz` -- every reader of untrusted input, fed mutated inputs, accepts them or refuses them with
tracelm's one-line error: no other exception, no hang. CI runs each target for a bounded count; every crash the
fuzzer found is a regression case below."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import gguf
import numpy as np
import pytest

from tests.test_hardening import VT, assert_one_line, cli, rewrite_gguf
from tracelm.io.gguf_file import GGUFFile
from tracelm.state.errors import ModelFormatError, TracelmError
from tracelm.tools import fuzz, fuzz_targets
from tracelm.tools.fuzz import FuzzOptions, run_fuzz

CONFIG = str(Path(__file__).resolve().parents[1] / "configs" / "smollm2.yaml")


def test_every_target_accepts_or_refuses_each_mutated_input(tmp_path) -> None:
    reports = run_fuzz(FuzzOptions("all", count=150, seed=0, timeout_s=30, crash_dir=tmp_path / "crashes"))
    assert [r.target for r in reports] == list(fuzz_targets.TARGETS)
    for r in reports:
        assert not r.failed, r.describe()
        assert r.inputs == 150 and r.accepted > 0 and sum(r.errors.values()) > 0, r.describe()  # both outcomes reached
    assert not (tmp_path / "crashes").exists()


def test_the_command_prints_counts_and_peak_rss(tmp_path, capsys) -> None:
    from tracelm.cli import main

    assert main(["fuzz", "llama2c", "--count", "40", "--seed", "7", "--crash-dir", str(tmp_path)]) == 0
    printed = capsys.readouterr().out
    assert "llama2c: 40 inputs:" in printed and "0 crashes, 0 hangs" in printed and "peak RSS" in printed
    assert_one_line(*cli(capsys, "fuzz", "gguf", "--count", "0"), "--count must be at least 1")


def test_the_inputs_depend_on_the_seed_alone() -> None:
    import random

    seeds = fuzz_targets.gguf_seeds()
    fields = {"model.gguf": fuzz.gguf_fields(seeds[0]["model.gguf"])}
    a = [fuzz.mutate(random.Random("1:gguf"), seeds[0], fields) for _ in range(5)]
    b = [fuzz.mutate(random.Random("1:gguf"), seeds[0], fields) for _ in range(5)]
    assert a == b and len(fields["model.gguf"]) > 20


def test_crashes_and_hangs_are_classified(tmp_path) -> None:
    def raises(exc: BaseException):
        def read(_folder: Path) -> None:
            raise exc
        return read
    assert fuzz._read_one(raises(ModelFormatError("x.gguf: bad")), tmp_path, {"a": b""})[:2] == ("error",
                                                                                                  "ModelFormatError")
    outcome, kind, message = fuzz._read_one(raises(KeyError("k")), tmp_path, {"a": b""})
    assert (outcome, kind) == ("crash", "KeyError") and "'k'" in message
    worker = fuzz.Worker(memory_mb=0)
    try:
        seed = fuzz_targets.llama2c_seeds()[0]
        assert worker.read("llama2c", seed, timeout_s=1e-6)[0] == "hang"  # no answer in time: killed, restarted
        assert worker.read("llama2c", seed, timeout_s=30) == ("accepted", "", "")
    finally:
        worker.stop()


# ---------------------------------------------------------------- the fuzzer's finds, as regression cases


@pytest.fixture
def scored_gguf(tmp_path) -> Path:
    """The fuzz seed with a SentencePiece vocabulary and a separate output matrix (every tensor f32)."""
    path = tmp_path / "seed.gguf"
    path.write_bytes(fuzz_targets.gguf_seeds()[1]["model.gguf"])
    return path


def test_an_output_matrix_of_the_wrong_shape_is_named(scored_gguf, tmp_path, capsys) -> None:
    """Found by `tracelm fuzz gguf`: a ValueError from QMatrix (the kernels' path never checked output.weight)."""
    out = np.array(next(t for t in gguf.GGUFReader(scored_gguf).tensors if t.name == "output.weight").data)
    bad = rewrite_gguf(scored_gguf, tmp_path / "short_head.gguf", tensors={"output.weight": out[:3]})
    code, err = cli(capsys, "run", CONFIG, "--model", str(bad), "--max-tokens", "2", "--context", "32")
    assert_one_line(code, err, "short_head.gguf: tensor output.weight has shape [3, 32], expected [18, 32]")


@pytest.mark.parametrize("key", ["unknown_token_id", "bos_token_id"])
def test_a_special_token_id_outside_the_vocabulary_is_named(scored_gguf, tmp_path, key) -> None:
    """Found by `tracelm fuzz gguf`: an IndexError building the SentencePiece vocabulary (unknown_token_id 32)."""
    from tracelm.io.tokenizer_formats import from_gguf_metadata

    bad = rewrite_gguf(scored_gguf, tmp_path / "ids.gguf", {f"tokenizer.ggml.{key}": (32, VT.UINT32)})
    with pytest.raises(ModelFormatError, match=f"tokenizer.ggml.{key}: 32 is above the maximum 17"):
        from_gguf_metadata(GGUFFile(bad).metadata, source="ids.gguf")


@pytest.mark.parametrize("head_dim", [1 << 30, 1 << 62])
def test_a_huge_head_dim_is_refused_before_the_rope_tables(tmp_path, head_dim) -> None:
    """Found by `tracelm fuzz safetensors`: a MemoryError (4 GiB) or numpy ValueError computing llama3 RoPE factors
    over a corrupt head_dim, before any tensor was compared with it."""
    from tracelm.io.safetensors_file import HFFolder

    sample = fuzz_targets.safetensors_seeds()[0]
    for name, data in sample.items():
        (tmp_path / name).write_bytes(data)
    (tmp_path / "config.json").write_text(json.dumps({**fuzz_targets.HF_CONFIG, "head_dim": head_dim}))
    with pytest.raises(ModelFormatError, match=f"head_dim: {head_dim} is above the maximum 65536"):
        HFFolder(tmp_path)


@pytest.mark.parametrize("edit", [
    lambda ev: ev[-1].update(decode_seconds={"a": 1}, n_generated="x", prefill_seconds=[1]),
    lambda ev: ev[0].update(config=[1], blas=[1, None], packages="x", prompt_ids=7, rng=None),
    lambda ev: next(e for e in ev if e["event"] == "stage").update(dur_us={"a": 1}),
])
def test_a_trace_summary_shows_edited_fields_without_failing(tmp_path, edit) -> None:
    """Found by `tracelm fuzz trace`: `trace show` of a re-chained trace whose footer's decode_seconds was an
    object ended in a TypeError."""
    from tests.test_hardening import edit_trace
    from tracelm.audit.verify import read_trace, summary

    src = tmp_path / "seed.jsonl"
    src.write_bytes(fuzz_targets.trace_bytes(signed=False))
    edited = edit_trace(src, tmp_path / "edited.jsonl", edit)
    assert "trace " in summary(read_trace(edited))


def test_a_truncated_safetensors_header_count_is_a_clean_error(tmp_path) -> None:
    """A header length field set to 2^63 (a field-aware mutation): refused by its size, nothing allocated."""
    from tracelm.io.safetensors_file import read_header

    data = fuzz_targets.safetensors_seeds()[0]["model.safetensors"]
    (tmp_path / "model.safetensors").write_bytes(struct.pack("<Q", 1 << 63) + data[8:])
    with pytest.raises(TracelmError, match="header of 9223372036854775808 bytes"):
        read_header(tmp_path / "model.safetensors")
