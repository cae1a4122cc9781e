"""Issue 18: crafted and fuzzed inputs give one named error (exit 2), never a traceback; non-finite values are
located; resources are bounded before allocation; interrupted runs leave verifiable traces; replay checks every
recomputed value; the CLI's run config takes what the server takes."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import struct
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.conftest import finish_gguf, write_tiny_gguf
from tests.test_formats_safetensors import tiny_folder, write_safetensors
from tracelm.cli import main
from tracelm.io.loader import ModelFile
from tracelm.state.errors import ModelFormatError, NonFiniteError, ResourceError, TracelmError

CONFIG = str(Path(__file__).resolve().parents[1] / "configs" / "smollm2.yaml")
VT = gguf.GGUFValueType
DEEP = "[" * 100_000 + "]" * 100_000  # JSON nested past the parser's recursion limit


# ---------------------------------------------------------------- helpers


def cli(capsys, *args: str) -> tuple[int, str]:
    code = main(list(args))
    return code, capsys.readouterr().err


def assert_one_line(code: int, err: str, *needles: str) -> None:
    lines = [x for x in err.splitlines() if x.strip()]
    assert code == 2, err
    assert len(lines) == 1 and lines[0].startswith("tracelm: error: "), err
    assert "Traceback" not in err
    for n in needles:
        assert n in lines[0], lines[0]


def run(capsys, model: Path, *extra: str) -> tuple[int, str]:
    return cli(capsys, "run", CONFIG, "--model", str(model), "--max-tokens", "2", "--temperature", "0", *extra)


def rewrite_gguf(src: Path, dst: Path, changes: dict[str, Any] | None = None,
                 tensors: dict[str, np.ndarray] | None = None) -> Path:
    """A copy of the GGUF `src` with metadata keys set to (value, type[, array element type]) or dropped (None),
    and tensors replaced by the arrays in `tensors`."""
    r = gguf.GGUFReader(src)
    changes, tensors = changes or {}, tensors or {}
    w = gguf.GGUFWriter(str(dst), str(r.fields["general.architecture"].contents()))
    for name, field in r.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture" or name in changes:
            continue
        w.add_key_value(name, field.contents(), field.types[0], field.types[-1] if len(field.types) > 1 else None)
    for name, change in changes.items():
        if change is not None:
            w.add_key_value(name, *change)
    for t in r.tensors:
        w.add_tensor(t.name, tensors.get(t.name, np.array(t.data)))
    return finish_gguf(w, dst)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return write_tiny_gguf(tmp_path_factory.mktemp("hardening") / "tiny.gguf")


def rechain(lines: list[str]) -> list[str]:
    """Lines with every hash recomputed, as someone who edits an unsigned trace would."""
    prev, out = "0" * 64, []
    for line in lines:
        obj = json.loads(line)
        obj.pop("hash"), obj.pop("mac", None)
        obj["prev"] = prev
        body = json.dumps(obj, ensure_ascii=False, separators=(",", ":"))[:-1]
        prev = hashlib.sha256(body.encode()).hexdigest()
        out.append(f'{body},"hash":"{prev}"}}')
    return out


def edit_trace(src: Path, dst: Path, edit) -> Path:
    """`edit(events)` changes the parsed events in place; the result is re-chained."""
    events = [json.loads(x) for x in src.read_text().splitlines()]
    edit(events)
    dst.write_text("\n".join(rechain([json.dumps(e, separators=(",", ":")) for e in events])) + "\n")
    return dst


# ---------------------------------------------------------------- 1/2: GGUF metadata, by type and range

U32, I32 = VT.UINT32, VT.INT32
GGUF_CASES = [
    ("general.alignment", (0, U32), "general.alignment: 0 is below the minimum 8"),
    ("general.alignment", ("32", VT.STRING), "general.alignment: expected an integer, got a string"),
    ("general.alignment", (12, U32), "general.alignment: 12 is not a power of two"),
    ("general.alignment", (4, U32), "general.alignment: 4 is below the minimum 8"),
    ("llama.attention.head_count", (0, U32), "llama.attention.head_count: 0 is below the minimum 1"),
    ("llama.attention.head_count_kv", (0, U32), "llama.attention.head_count_kv: 0 is below the minimum 1"),
    ("llama.attention.head_count_kv", (3, U32), "head_count 4 is not a multiple of llama.attention.head_count_kv 3"),
    ("llama.embedding_length", ("64", VT.STRING), "llama.embedding_length: expected an integer, got a string"),
    ("llama.embedding_length", ([64, 64], VT.ARRAY, U32), "llama.embedding_length: expected an integer, got an array"),
    ("llama.attention.scale", ("0.1", VT.STRING), "llama.attention.scale: expected a number, got a string"),
    ("llama.attention.sliding_window", (-1, I32), "llama.attention.sliding_window: -1 is below the minimum 0"),
    ("llama.block_count", (0, U32), "llama.block_count: 0 is below the minimum 1"),
    ("llama.block_count", (-2, I32), "llama.block_count: -2 is below the minimum 1"),
    ("llama.context_length", (0, U32), "llama.context_length: 0 is below the minimum 1"),
    ("llama.rope.freq_base", (float("nan"), VT.FLOAT32), "llama.rope.freq_base: expected a finite number"),
    ("tokenizer.ggml.bos_token_id", ("1", VT.STRING), "tokenizer.ggml.bos_token_id: expected an integer"),
    ("tokenizer.ggml.tokens", (list(range(260)), VT.ARRAY, I32), "tokenizer.ggml.tokens: expected an array of str"),
    ("tokenizer.ggml.merges", ([1, 2, 3], VT.ARRAY, I32), "tokenizer.ggml.merges: expected an array of strings"),
    ("tokenizer.ggml.add_bos_token", ("no", VT.STRING), "tokenizer.ggml.add_bos_token: expected a boolean"),
]


@pytest.mark.parametrize("key,change,message", GGUF_CASES, ids=[f"{c[0]}={c[1][0]!r}"[:60] for c in GGUF_CASES])
def test_gguf_metadata_of_the_wrong_type_or_value_is_named(tiny, tmp_path, capsys, key, change, message) -> None:
    bad = rewrite_gguf(tiny, tmp_path / "bad.gguf", {key: change})
    assert_one_line(*run(capsys, bad), "bad.gguf", message)


def test_gguf_scores_that_are_strings_are_named(tiny, tmp_path, capsys) -> None:
    n = len(gguf.GGUFReader(tiny).fields["tokenizer.ggml.tokens"].contents())
    bad = rewrite_gguf(tiny, tmp_path / "scores.gguf", {"tokenizer.ggml.model": ("llama", VT.STRING),
                                                       "tokenizer.ggml.scores": (["x"] * n, VT.ARRAY, VT.STRING)})
    assert_one_line(*run(capsys, bad), "scores.gguf", "tokenizer.ggml.scores: expected an array of numbers")


def patch_tensor_table(path: Path, name: bytes, new_name: bytes | None = None, offset_delta: int = 0) -> None:
    data = bytearray(path.read_bytes())
    at = data.index(name)
    if new_name is not None:
        data[at : at + len(name)] = new_name
    n_dims = int.from_bytes(data[at + len(name) : at + len(name) + 4], "little")
    off_at = at + len(name) + 4 + 8 * n_dims + 4
    offset = int.from_bytes(data[off_at : off_at + 8], "little")
    data[off_at : off_at + 8] = (offset + offset_delta).to_bytes(8, "little")
    path.write_bytes(bytes(data))


def test_gguf_structure_breaking_the_format_is_named(tiny, tmp_path, capsys) -> None:
    dup = tmp_path / "dup.gguf"
    dup.write_bytes(tiny.read_bytes())
    patch_tensor_table(dup, b"blk.1.ffn_down.weight", b"blk.0.ffn_down.weight")
    assert_one_line(*run(capsys, dup), "dup.gguf", "tensor blk.0.ffn_down.weight appears twice")
    unaligned = tmp_path / "unaligned.gguf"
    unaligned.write_bytes(tiny.read_bytes())
    patch_tensor_table(unaligned, b"blk.1.ffn_down.weight", offset_delta=4)
    assert_one_line(*run(capsys, unaligned), "unaligned.gguf", "blk.1.ffn_down.weight: offset",
                    "not a multiple of the alignment 32")
    many = tmp_path / "many.gguf"
    data = bytearray(tiny.read_bytes())
    data[16:24] = (1 << 40).to_bytes(8, "little")  # n_kv: a trillion key-value pairs
    many.write_bytes(bytes(data))
    assert_one_line(*run(capsys, many), "many.gguf", "metadata of 1099511627776 items")


# ---------------------------------------------------------------- 1/2: safetensors and config.json


def folder_with(tmp_path: Path, config: dict | None = None, header: Any = None, index: Any = None) -> Path:
    path, _ = tiny_folder(tmp_path / "m", shards=index is not None)
    if config is not None:
        cfg = json.loads((path / "config.json").read_text())
        (path / "config.json").write_text(json.dumps({**cfg, **config}))
    if header is not None:
        raw = header.encode() if isinstance(header, str) else json.dumps(header).encode()
        (path / "model.safetensors").write_bytes(struct.pack("<Q", len(raw)) + raw)
    if index is not None:
        (path / "model.safetensors.index.json").write_text(index if isinstance(index, str) else json.dumps(index))
    return path


FOLDER_CASES = [
    ({"header": []}, "model.safetensors: safetensors header: expected a JSON object, got an array"),
    ({"header": DEEP}, "model.safetensors: safetensors header: JSON nested too deeply"),
    ({"header": {"w": {"dtype": "F32", "shape": [2], "data_offsets": [-8, 0]}}},
     "tensor w: data_offsets begin: -8 is below the minimum 0"),
    ({"header": {"w": {"dtype": "F32", "shape": [2], "data_offsets": [8, 0]}}},
     "tensor w: data_offsets end: 0 is below the minimum 8"),
    ({"header": {"w": {"dtype": "F32", "shape": [1.5], "data_offsets": [0, 0]}}},
     "tensor w: shape: expected an integer, got a number"),
    ({"header": {"w": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}}},
     "tensor w: truncated safetensors file: data_offsets end 16 is past the 0 bytes of data"),
    ({"index": []}, "model.safetensors.index.json: expected a JSON object, got an array"),
    ({"index": {"weight_map": {"model.norm.weight": "../../x.safetensors"}}}, "leads outside the model folder"),
    ({"index": {"weight_map": {"model.norm.weight": "/etc/passwd"}}}, "is not a relative path inside the model"),
    ({"config": {"num_attention_heads": 0}}, "config.json: num_attention_heads: 0 is below the minimum 1"),
    ({"config": {"hidden_size": "32"}}, "config.json: hidden_size: expected an integer, got a string"),
    ({"config": {"rope_scaling": ["llama3"]}}, "config.json: rope_scaling: expected a JSON object, got an array"),
    ({"config": {"rope_scaling": {"rope_type": "llama3", "factor": "8"}}},
     "config.json: rope_scaling.factor: expected a number, got a string"),
]


@pytest.mark.parametrize("kwargs,message", FOLDER_CASES, ids=[m[:40] for _, m in FOLDER_CASES])
def test_hugging_face_folder_fields_are_checked(tmp_path, capsys, kwargs, message) -> None:
    path = folder_with(tmp_path, **kwargs)
    assert_one_line(*run(capsys, path), message)
    from tracelm.io.safetensors_file import HFFolder

    with pytest.raises(ModelFormatError, match="."):  # the API raises the typed error
        HFFolder(path)


def test_config_json_nested_too_deeply_is_named(tmp_path, capsys) -> None:
    path = folder_with(tmp_path)
    (path / "config.json").write_text(DEEP)
    assert_one_line(*run(capsys, path), "config.json: JSON nested too deeply")


def test_a_good_folder_still_loads(tmp_path) -> None:
    from tracelm.io.safetensors_file import HFFolder

    path, t = tiny_folder(tmp_path / "ok")
    write_safetensors(path / "model.safetensors", t)
    assert HFFolder(path).cfg.n_head == 4


# ---------------------------------------------------------------- 3: non-finite values located


def test_an_infinite_weight_is_located_by_layer_stage_and_token(tiny, tmp_path, capsys) -> None:
    down = next(t for t in gguf.GGUFReader(tiny).tensors if t.name == "blk.1.ffn_down.weight")
    bad_down = np.array(down.data).copy()
    bad_down[:, 0] = np.inf
    bad = rewrite_gguf(tiny, tmp_path / "inf.gguf", tensors={"blk.1.ffn_down.weight": bad_down})
    assert_one_line(*run(capsys, bad, "--prompt", "hello"), "non-finite value", "layer 1, stage ffn, token 0")
    for compute in ("kernels", "reference"):
        from tracelm.session import Session

        with Session(str(bad), settings=[f"compute={compute}", "context=64", "max_tokens=2"]) as s:
            with pytest.raises(NonFiniteError, match="layer 1, stage ffn, token 0"):
                s.generate("hello", temperature=0)


def test_a_nan_embedding_row_is_located_at_its_token(tiny, tmp_path) -> None:
    from tracelm.session import Session

    embd = next(t for t in gguf.GGUFReader(tiny).tensors if t.name == "token_embd.weight")
    rows = np.array(embd.data).copy()
    with Session(str(tiny), settings=["context=64"]) as s:
        ids = s.encode("a b")
    rows[ids[-1], 3] = np.nan
    bad = rewrite_gguf(tiny, tmp_path / "nan.gguf", tensors={"token_embd.weight": rows})
    with Session(str(bad), settings=["context=64", "max_tokens=2"]) as s:
        with pytest.raises(NonFiniteError, match=f"NaN.*outside the layers, stage embed, token {len(ids) - 1}"):
            s.generate(ids, temperature=0)


# ---------------------------------------------------------------- 4: bounds decided before allocation


def test_a_huge_context_fails_at_once(tiny, capsys) -> None:
    t0 = time.perf_counter()
    code, err = run(capsys, tiny, "--set", "context=10000000")
    assert_one_line(code, err, "context 10000000 exceeds tiny.gguf's trained context of 4096 positions",
                    "rope_scale >= 2441")
    assert time.perf_counter() - t0 < 10


def test_memory_is_checked_with_the_estimate(tiny, tmp_path, capsys, monkeypatch) -> None:
    import tracelm.pipeline.bounds as bounds

    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal: 1000000 kB\nMemAvailable: 10240 kB\n")  # 10 MiB
    monkeypatch.setattr(bounds, "MEMINFO", str(meminfo))
    code, err = run(capsys, tiny, "--set", "context=40000", "--set", "rope_scale=10")
    kv = bounds.kv_cache_bytes(ModelFile(str(tiny)).cfg, 40000)
    assert_one_line(code, err, f"context 40000 needs about {bounds.mib(kv)} of KV cache", "10 MiB of memory available")
    meminfo.write_text("MemAvailable: 8000000 kB\n")
    assert run(capsys, tiny, "--set", "context=1000")[0] == 0  # within both bounds: runs


def test_rope_scale_stretches_the_trained_context(tiny) -> None:
    from tracelm.session import Session

    with Session(str(tiny), settings=["context=8192", "rope_scale=2", "max_tokens=3"]) as s:
        assert s.model.cfg.rope_freq_factors == (2.0,) * (s.model.cfg.rope_dim // 2)
        assert len(s.runner.cache.tokens) == 0 and s.generate("hi", temperature=0) is not None
    with pytest.raises(ResourceError, match="trained context of 4096"):
        Session(str(tiny), settings=["context=8193", "rope_scale=2"])


# ---------------------------------------------------------------- 6: interrupted runs


def traced(tiny: Path, out: Path, cancel=None, max_tokens: int = 12) -> None:
    from tracelm.session import Session

    with Session(str(tiny), settings=["context=256", "sampling.seed=5", "sampling.temperature=0.9"]) as s:
        s.generate("hello there", max_tokens=max_tokens, trace=out, cancel=cancel)


def after(n: int, action):
    calls = {"n": 0}

    def cancel() -> bool:
        calls["n"] += 1
        return action() if calls["n"] > n else False
    return cancel


@pytest.mark.parametrize("how", ["cancel", "keyboard_interrupt"])
def test_an_interrupted_run_verifies_and_replays_up_to_it(tiny, tmp_path, capsys, how) -> None:
    from tracelm.audit.replay import REPRODUCED, replay

    out = tmp_path / "cut.jsonl"
    if how == "cancel":
        traced(tiny, out, after(4, lambda: True))
    else:
        def interrupt() -> bool:
            raise KeyboardInterrupt
        with pytest.raises(KeyboardInterrupt):
            traced(tiny, out, after(4, interrupt))
    footer = json.loads(out.read_text().splitlines()[-1])
    assert footer["status"] == "interrupted" and footer["last_token"] == 3
    code = main(["trace", "verify", str(out), "--require", "intact"])
    text = capsys.readouterr().out
    assert code == 0 and "interrupted at token 3" in text, text
    report = replay(out)
    assert report.status == REPRODUCED and report.interrupted_at == 3, report.describe()
    assert "up to the interruption at token 3" in report.describe()


def test_ctrl_c_during_a_traced_cli_run_writes_an_interrupted_footer(tiny, tmp_path) -> None:
    out = tmp_path / "sigint.jsonl"
    proc = subprocess.Popen([sys.executable, "-m", "tracelm.cli", "run", CONFIG, "--model", str(tiny), "--set",
                             "context=4096", "--max-tokens", "4000", "--prompt", "hi", "--trace", str(out)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 60
    while time.time() < deadline and (not out.exists() or out.read_text().count('"event":"token"') < 3):
        time.sleep(0.05)
    os.kill(proc.pid, signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130 and "Traceback" not in err, err
    footer = json.loads(out.read_text().splitlines()[-1])
    assert footer["status"] == "interrupted" and footer["finish_reason"] == "cancelled"
    verify = subprocess.run([sys.executable, "-m", "tracelm.cli", "trace", "verify", str(out), "--require", "intact"],
                            capture_output=True, text=True, timeout=60)
    assert verify.returncode == 0 and f"interrupted at token {footer['last_token']}" in verify.stdout


def test_a_version_2_trace_still_verifies_and_replays(tiny, tmp_path) -> None:
    from tracelm.audit.replay import REPRODUCED, replay
    from tracelm.audit.verify import read_trace, verify

    out = tmp_path / "v3.jsonl"
    traced(tiny, out)

    def as_v2(events: list[dict]) -> None:
        events[0]["trace_version"] = 2
        for k in ("status", "last_token"):
            events[-1].pop(k)
    old = edit_trace(out, tmp_path / "v2.jsonl", as_v2)
    assert verify(read_trace(old)).intact
    assert replay(old).status == REPRODUCED


# ---------------------------------------------------------------- 7: replay checks what it recomputes


@pytest.mark.parametrize("field", ["output_text", "output_ids", "stage_mean", "prompt_text", "token_text"])
def test_replay_catches_a_rechained_forgery(tiny, tmp_path, field) -> None:
    from tracelm.audit.replay import DIVERGED, REPRODUCED, replay
    from tracelm.audit.verify import read_trace, verify

    out = tmp_path / "run.jsonl"
    traced(tiny, out)
    honest = replay(out)
    said = honest.describe()
    assert honest.status == REPRODUCED and "unsigned" in said and "footer status, output_ids" in said, said

    def forge(events: list[dict]) -> None:
        stage = next(e for e in events if e["event"] == "stage" and e["layer"] == 1)
        token = next(e for e in events if e["event"] == "token")
        {"output_text": lambda: events[-1].update(output_text="I was edited"),
         "output_ids": lambda: events[-1].update(output_ids=[1, 2, 3]),
         "stage_mean": lambda: stage.update(mean=float(stage["mean"]) + 1e-5),
         "prompt_text": lambda: events[0].update(prompt_text="something else"),
         "token_text": lambda: token.update(text="forged")}[field]()
    forged = edit_trace(out, tmp_path / "forged.jsonl", forge)
    assert verify(read_trace(forged)).intact  # the chain alone cannot tell
    report = replay(forged)
    assert report.status == DIVERGED, report.describe()
    assert "bit-identical" not in report.describe().splitlines()[-1]
    reason = {"output_text": "footer output_text", "output_ids": "footer output_ids", "stage_mean": "mean differ",
              "prompt_text": "header prompt_text", "token_text": "different text"}[field]
    assert reason in report.divergence.reason


def test_deeply_nested_trace_lines_are_named(tiny, tmp_path, capsys) -> None:
    out = tmp_path / "run.jsonl"
    traced(tiny, out, max_tokens=2)
    lines = out.read_text().splitlines()
    (tmp_path / "deep_line.jsonl").write_text("\n".join([*lines[:2], DEEP, *lines[2:]]) + "\n")
    code = main(["trace", "verify", str(tmp_path / "deep_line.jsonl")])
    captured = capsys.readouterr()
    assert code == 1 and "line 3: not a trace event" in captured.out and "Traceback" not in captured.err
    (tmp_path / "deep_head.jsonl").write_text(DEEP + "\n")
    assert_one_line(*cli(capsys, "trace", "verify", str(tmp_path / "deep_head.jsonl")), "not a tracelm trace")


# ---------------------------------------------------------------- 9: the run config takes what the server takes


@pytest.mark.parametrize("setting,message", [
    ('stop=[""]', "config key stop: stop strings must have 1 to 1024 characters"),
    ("sampling.seed=100000000000000000000000000", "sampling.seed 100000000000000000000000000 is not an integer"),
    ("sampling.seed=1e26", "config key sampling.seed: expected int"),
    ("sampling.seed=-1", "sampling.seed"),
    (f"stop={json.dumps(['s'] * 17)}", "stop takes at most 16 strings"),
])
def test_run_config_rejects_what_the_server_rejects(tiny, capsys, setting, message) -> None:
    assert_one_line(*run(capsys, tiny, "--set", setting), message)


def test_the_api_gets_a_typed_error_for_an_empty_stop(tiny) -> None:
    from tracelm.session import Session

    with Session(str(tiny), settings=["context=64"]) as s, pytest.raises(TracelmError, match="stop strings"):
        s.generate("hi", stop=[""], max_tokens=2)


# ---------------------------------------------------------------- fuzz: mutated GGUF metadata


def _value_strategy() -> st.SearchStrategy:
    ints = st.integers(-(2**40), 2**40)
    return st.one_of(
        ints.map(lambda v: (v, VT.INT64)),
        st.integers(0, 2**32 - 1).map(lambda v: (v, VT.UINT32)),
        st.integers(-4, 300).map(lambda v: (v, VT.INT32)),
        st.floats(allow_nan=True, allow_infinity=True, width=32).map(lambda v: (v, VT.FLOAT32)),
        st.booleans().map(lambda v: (v, VT.BOOL)),
        st.text(max_size=8).map(lambda v: (v, VT.STRING)),
        st.lists(st.integers(-5, 300), min_size=1, max_size=6).map(lambda v: (v, VT.ARRAY, VT.INT32)),
        st.lists(st.text(max_size=4), min_size=1, max_size=6).map(lambda v: (v, VT.ARRAY, VT.STRING)),
        st.just(None),  # the key removed
    )


@pytest.fixture(scope="module")
def fuzz_keys(tiny) -> list[str]:
    keys = [k for k in gguf.GGUFReader(tiny).fields if not k.startswith("GGUF.") and k != "general.architecture"]
    return [*keys, "general.alignment", "llama.attention.key_length", "llama.attention.sliding_window",
            "llama.attention.scale", "tokenizer.ggml.scores"]


@settings(max_examples=200, deadline=None, suppress_health_check=list(HealthCheck))
@given(data=st.data())
def test_fuzzed_gguf_metadata_loads_or_raises_tracelm_error(tiny, fuzz_keys, tmp_path_factory, data) -> None:
    from tracelm.io.loader import load_model

    changes = data.draw(st.dictionaries(st.sampled_from(fuzz_keys), _value_strategy(), min_size=1, max_size=3))
    path = rewrite_gguf(tiny, tmp_path_factory.mktemp("fuzz") / "f.gguf", changes)
    try:
        load_model(str(path), progress=False)
    except TracelmError:
        pass
    finally:
        path.unlink()
