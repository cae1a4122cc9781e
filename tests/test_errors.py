"""Bad input gives one line naming the problem and exit status 2, never a traceback."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import gguf
import pytest

from tests.conftest import write_tiny_gguf
from tracelm.state.errors import TracelmError

CONFIG = Path(__file__).resolve().parents[1] / "configs" / "smollm2.yaml"


def tracelm(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tracelm.cli", *args], capture_output=True, text=True, timeout=120)


def assert_one_line_error(proc: subprocess.CompletedProcess, *needles: str) -> None:
    assert proc.returncode == 2, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("tracelm: error: "), proc.stderr
    assert "Traceback" not in proc.stderr
    for n in needles:
        assert n in lines[0], lines[0]


def run_model(path: Path, *extra: str) -> subprocess.CompletedProcess:
    return tracelm("run", str(CONFIG), "--model", str(path), "--max-tokens", "2", "--temperature", "0", *extra)


def test_not_a_gguf_file(tmp_path: Path) -> None:
    p = tmp_path / "notes.gguf"
    p.write_text("hello, I am not a model")
    assert_one_line_error(run_model(p), "notes.gguf", "not a GGUF file")


def test_empty_file(tmp_path: Path) -> None:
    p = tmp_path / "empty.gguf"
    p.write_bytes(b"")
    assert_one_line_error(run_model(p), "empty.gguf", "not a GGUF file")


@pytest.mark.parametrize("keep", [0.5, 0.01])
def test_truncated_gguf(tmp_path: Path, keep: float) -> None:
    full = write_tiny_gguf(tmp_path / "full.gguf").read_bytes()
    p = tmp_path / "cut.gguf"
    p.write_bytes(full[: int(len(full) * keep)])
    assert_one_line_error(run_model(p), "cut.gguf", "truncated")


def test_unknown_architecture(tmp_path: Path) -> None:
    p = write_tiny_gguf(tmp_path / "alien.gguf", arch="alienformer")
    assert_one_line_error(run_model(p), "alien.gguf", "unknown architecture 'alienformer'")


def test_unsupported_tensor_type(tmp_path: Path) -> None:
    p = write_tiny_gguf(tmp_path / "q.gguf")
    data = bytearray(p.read_bytes())
    # retype blk.0.attn_q.weight to an integer type that has no dequantization (I8 would not fit: use I32)
    name = b"blk.0.attn_q.weight"
    at = data.index(name) + len(name)
    n_dims = int.from_bytes(data[at : at + 4], "little")
    type_at = at + 4 + 8 * n_dims
    assert int.from_bytes(data[type_at : type_at + 4], "little") == gguf.GGMLQuantizationType.F32
    data[type_at : type_at + 4] = int(gguf.GGMLQuantizationType.I32).to_bytes(4, "little")
    p.write_bytes(bytes(data))
    assert_one_line_error(run_model(p), "q.gguf", "blk.0.attn_q.weight", "I32")


def test_missing_tensor(tmp_path: Path) -> None:
    p = write_tiny_gguf(tmp_path / "holey.gguf", drop="blk.1.ffn_down.weight")
    assert_one_line_error(run_model(p), "holey.gguf", "missing tensor blk.1.ffn_down.weight")


def test_missing_file(tmp_path: Path) -> None:
    assert_one_line_error(run_model(tmp_path / "nowhere.gguf"), "nowhere.gguf")


def test_prompt_longer_than_context(tmp_path: Path) -> None:
    p = write_tiny_gguf(tmp_path / "tiny.gguf")
    assert_one_line_error(run_model(p, "--context", "8", "--prompt", "a b c d e f g h i j"),
                          "exceeds the context of 8")


@pytest.mark.parametrize("override,needle", [
    ("sampling.temprature=0.5", "unknown config key sampling.temprature"),
    ("colour=blue", "unknown config key colour"),
    ("context=many", "config key context: expected int"),
    ("sampling.top_p=1.5", "config key sampling.top_p"),
    ("trace.level=loud", "config key trace.level"),
])
def test_bad_config_values(tmp_path: Path, override: str, needle: str) -> None:
    p = write_tiny_gguf(tmp_path / "tiny.gguf")
    assert_one_line_error(run_model(p, "--set", override), needle)


def test_unknown_key_in_a_config_file(tmp_path: Path) -> None:
    cfg = tmp_path / "bad.yaml"
    cfg.write_text("model: x.gguf\nsampling:\n  temperature: 0\n  nucleus: 0.9\n")
    assert_one_line_error(tracelm("run", str(cfg)), "unknown config key sampling.nucleus")


def test_unknown_model_name() -> None:
    assert_one_line_error(run_model(Path("no-such-model")), "unknown model 'no-such-model'")


def test_numbers_in_exponent_form_are_numbers(tmp_path: Path) -> None:
    """1e-2 (no dot) is text to YAML 1.1 and 1e-50 is how a float flag's value reaches the config: a float key
    takes both, from --set, a flag and a config file; a NaN is refused by the key's own range."""
    from tracelm.io.run_config import load_run_config

    cfg = load_run_config(None, ["sampling.min_p=1e-2", "sampling.top_p=9.5E-1", "sampling.temperature=1e-50"])
    assert (cfg.sampling.min_p, cfg.sampling.top_p, cfg.sampling.temperature) == (0.01, 0.95, 1e-50)
    path = tmp_path / "sci.yaml"
    path.write_text("sampling:\n  min_p: 5e-2\n")
    assert load_run_config(str(path), []).sampling.min_p == 0.05
    with pytest.raises(TracelmError, match="'temperature' must be >= 0.0: nan"):
        load_run_config(None, ["sampling.temperature=NaN"])
    with pytest.raises(TracelmError, match="config key sampling.min_p: expected float, got 'abc'"):
        load_run_config(None, ["sampling.min_p=abc"])
    p = write_tiny_gguf(tmp_path / "tiny.gguf")
    assert run_model(p, "--temperature", "1e-50", "--prompt", "hi").returncode == 0
