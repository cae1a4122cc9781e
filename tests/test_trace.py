"""Traces: format, determinism, tamper evidence (`trace verify`), HMAC signing, `trace show`."""

from __future__ import annotations

import hashlib
import hmac
import json
import re
from pathlib import Path

import numpy as np
import pytest

from tracelm.cli import main
from tracelm.pipeline.trace import CHAIN_FIELDS, digest, is_timing_field

CONFIG = str(Path(__file__).resolve().parents[1] / "configs" / "smollm2.yaml")
KEY_ENV = "TRACELM_TEST_TRACE_KEY"


def record(model: Path, out: Path, *extra: str) -> list[str]:
    code = main(["run", CONFIG, "--model", str(model), "--prompt", "hello world", "--max-tokens", "6",
                 "--temperature", "0.9", "--seed", "3", "--trace", str(out), *extra])
    assert code == 0
    return out.read_text(encoding="utf-8").splitlines(keepends=True)


def deterministic(line: str) -> dict:
    """A line without its timing fields and the chain fields that cover them."""
    return {k: v for k, v in json.loads(line).items() if not is_timing_field(k) and k not in CHAIN_FIELDS}


def rechain(lines: list[str], key: bytes | None = None, keep_macs: bool = True) -> list[str]:
    """Recompute every line's prev and hash (as someone without the key would after an edit); with `key`,
    sign too. Written from the format description in docs/trace.md, independently of the tracer."""
    out, prev = [], "0" * 64
    for line in lines:
        m = re.match(r'^(\{.*),"hash":"([0-9a-f]{64})"(,"mac":"[0-9a-f]{64}")?\}\n$', line, re.DOTALL)
        assert m, line
        body = re.sub(r'"prev":"[0-9a-f]{64}"$', f'"prev":"{prev}"', m.group(1))
        h = hashlib.sha256(body.encode()).hexdigest()
        tail = f',"hash":"{h}"'
        if key is not None:
            tail += f',"mac":"{hmac.new(key, h.encode(), "sha256").hexdigest()}"'
        elif keep_macs and m.group(3):
            tail += m.group(3)
        out.append(body + tail + "}\n")
        prev = h
    return out


def verify(path: Path, capsys, *extra: str) -> tuple[int, str]:
    code = main(["trace", "verify", str(path), *extra])
    cap = capsys.readouterr()
    return code, cap.out + cap.err


@pytest.fixture(scope="module")
def traced(tiny_gguf, tmp_path_factory) -> tuple[Path, list[str]]:
    path = tmp_path_factory.mktemp("trace") / "run.jsonl"
    return path, record(tiny_gguf, path)


def test_two_runs_are_identical_apart_from_timing(tiny_gguf, tmp_path) -> None:
    a = record(tiny_gguf, tmp_path / "run.jsonl")
    b = record(tiny_gguf, tmp_path / "run.jsonl")  # the same path: it is part of the recorded config
    assert len(a) == len(b)
    assert [deterministic(x) for x in a] == [deterministic(y) for y in b]
    # and only timing (plus the chain over it) differs: blank out timing values and the chain, then bytes match
    blank = lambda s: re.sub(r'"(\w+_(?:us|seconds))":[-0-9.e]+', r'"\1":0', s.split(',"hash":')[0])  # noqa: E731
    unchain = lambda s: re.sub(r'"prev":"[0-9a-f]{64}"', '"prev":""', blank(s))  # noqa: E731
    assert [unchain(x) for x in a] == [unchain(y) for y in b]


def test_trace_content(tiny_gguf, traced) -> None:
    from tracelm.io.loader import load_model

    _, lines = traced
    events = [json.loads(x) for x in lines]
    header, footer = events[0], events[-1]
    assert header["format"] == "tracelm-trace" and header["trace_version"] == 4 and header["level"] == "digest"
    assert header["model_sha256"] == hashlib.sha256(tiny_gguf.read_bytes()).hexdigest()
    assert len(header["tokenizer_sha256"]) == 64 and header["packages"]["numpy"] == np.__version__
    assert header["rng"]["generator"] == "PCG64" and header["seed"] == 3 == header["config"]["sampling"]["seed"]
    assert header["config"]["sampling"]["temperature"] == 0.9 and header["blas"] is not None
    model = load_model(str(tiny_gguf), progress=False)
    ids = model.tokenizer.encode("hello world")
    assert header["prompt_ids"] == ids and header["prompt_text"] == "hello world"
    gen = events[1]
    assert gen["event"] == "generate" and gen["prompt_ids"] == ids and gen["rng"] == {"generator": "PCG64", "seed": 3}
    # the first stage is the embedding lookup: its digest and statistics are those of the embedding rows
    embed = events[2]
    table = load_model(str(tiny_gguf), progress=False, compute="reference").weights.token_embd  # f32, as dequantized
    rows = np.ascontiguousarray(table[ids], dtype=np.float32)
    assert embed["stage"] == "embed" and embed["shape"] == [list(rows.shape)] and embed["tok"] == 0
    assert embed["digest"] == digest([rows])
    np.testing.assert_allclose([embed["mean"], embed["rms"], embed["maxabs"]],
                               [rows.mean(), np.sqrt((rows.astype(np.float64) ** 2).mean()), np.abs(rows).max()],
                               rtol=1e-5)
    tokens = [e for e in events if e["event"] == "token"]
    assert [t["tok"] for t in tokens] == list(range(len(tokens))) and all(0 < t["prob"] <= 1 for t in tokens)
    per_pass = 1 + 7 * model.cfg.n_layer + 2
    stages = [e for e in events if e["event"] == "stage"]
    assert footer["event"] == "footer" and footer["events"] == len(events)
    assert footer["counts"] == {"generate": 1, "header": 1, "stage": len(stages), "token": len(tokens)}
    assert len(stages) == per_pass * len(tokens)  # a pass per sampled token (the last one is not fed back)
    assert footer["output_ids"] == [t["id"] for t in tokens][: footer["n_generated"]]


def test_verify_intact(traced, capsys) -> None:
    path, lines = traced
    code, out = verify(path, capsys)  # issue 31: whole but unsigned is exit 3 (was 0), nothing authenticated
    assert code == 3 and f"intact: {len(lines)} lines" in out and "nothing was authenticated" in out
    assert verify(path, capsys, "--require", "intact")[0] == 0


def _tampered(tmp_path: Path, lines: list[str]) -> Path:
    p = tmp_path / "tampered.jsonl"
    p.write_text("".join(lines), encoding="utf-8")
    return p


@pytest.mark.parametrize("how, bad_line", [
    ("edit_digest", 9), ("delete", 9), ("swap", 9), ("header", 1), ("garbage", 9), ("edit_and_rehash", 10),
    ("drop_footer", None), ("cut_last_line", None), ("append_after_footer", None),
])
def test_verify_detects_tampering_at_the_right_line(traced, tmp_path, capsys, how, bad_line) -> None:
    _, lines = traced
    lines = list(lines)
    n = len(lines)
    i = 8  # 0-based index of line 9, a stage event
    if how == "edit_digest":
        old = json.loads(lines[i])["digest"]
        lines[i] = lines[i].replace(old, old[:-1] + ("0" if old[-1] != "0" else "1"))
    elif how == "delete":
        del lines[i]
    elif how == "swap":
        lines[i], lines[i + 1] = lines[i + 1], lines[i]
    elif how == "header":
        lines[0] = lines[0].replace('"seed":3', '"seed":4', 1)
    elif how == "garbage":
        lines.insert(i, "this is not json\n")
    elif how == "edit_and_rehash":  # a consistent line on its own, but the next line no longer follows it
        body = lines[i].split(',"hash":')[0].replace('"stage":"', '"stage":"x', 1)
        lines[i] = body + f',"hash":"{hashlib.sha256(body.encode()).hexdigest()}"}}\n'
    elif how == "drop_footer":
        lines.pop()
        bad_line = n - 1
    elif how == "cut_last_line":
        lines[-1] = lines[-1][:40]
        bad_line = n
    elif how == "append_after_footer":
        lines.append(lines[-2])
        bad_line = n + 1
    code, out = verify(_tampered(tmp_path, lines), capsys)
    assert code == 1, out
    assert f"line {bad_line}:" in out, out


def test_verify_rejects_what_is_not_a_trace(tmp_path, traced, capsys) -> None:
    _, lines = traced
    cases = {
        "empty": "",
        "garbage": "hello\nworld\n",
        "newer": lines[0].replace('"trace_version":4', '"trace_version":5') + "".join(lines[1:]),
        "no_header": "".join(lines[1:]),
        "cut_header": lines[0][:200],
    }
    for name, text in cases.items():
        p = tmp_path / f"{name}.jsonl"
        p.write_text(text, encoding="utf-8")
        code, out = verify(p, capsys)
        assert code == 2, (name, out)
        assert out.startswith("tracelm: error: ") and len(out.strip().splitlines()) == 1, out
    _, out = verify(tmp_path / "newer.jsonl", capsys)
    assert "version 5 is newer" in out
    assert "truncated inside its header" in verify(tmp_path / "cut_header.jsonl", capsys)[1]
    code, out = verify(tmp_path / "missing.jsonl", capsys)
    assert code == 2 and "cannot read trace" in out


def test_hmac_signed_trace(tiny_gguf, tmp_path, capsys, monkeypatch) -> None:
    monkeypatch.setenv(KEY_ENV, "correct horse battery staple")
    path = tmp_path / "signed.jsonl"
    lines = record(tiny_gguf, path, "--trace-key-env", KEY_ENV)
    assert all('"mac":"' in x for x in lines)
    code, out = verify(path, capsys, "--key-env", KEY_ENV)  # the secret the auditor gave: trusted
    assert code == 0 and f"trusted: HMAC-signed, every mac checked with the secret in {KEY_ENV}" in out, out
    code, out = verify(path, capsys)  # without the key the macs authenticate nothing: exit 3 (issue 31; was 0)
    assert code == 3 and "macs not checked" in out and "nothing was authenticated" in out, out
    monkeypatch.setenv("OTHER_KEY", "wrong")
    code, out = verify(path, capsys, "--key-env", "OTHER_KEY")
    assert code == 1 and "line 1:" in out
    # edit one digest and re-chain without the key: the chain is whole again, the signature is not
    i = 10
    old = json.loads(lines[i])["digest"]
    edited = list(lines)
    edited[i] = edited[i].replace(old, "0" * 32)
    for keep in (True, False):
        forged = _tampered(tmp_path, rechain(edited, keep_macs=keep))
        code, out = verify(forged, capsys, "--key-env", KEY_ENV)
        assert code == 1 and f"line {i + 1 if keep else 1}:" in out, out
    # re-chained WITH the key, the forgery would pass: the test's re-chaining is faithful
    forged = _tampered(tmp_path, rechain(edited, key=b"correct horse battery staple"))
    assert verify(forged, capsys, "--key-env", KEY_ENV)[0] == 0
    # an unsigned trace cannot be authenticated
    unsigned = tmp_path / "unsigned.jsonl"
    record(tiny_gguf, unsigned)
    code, out = verify(unsigned, capsys, "--key-env", KEY_ENV)  # (issue 31: exit 3, unsigned; was 1)
    assert code == 3 and "the trace carries no macs" in out, out
    monkeypatch.delenv(KEY_ENV)
    code, out = verify(path, capsys, "--key-env", KEY_ENV)
    assert code == 2 and KEY_ENV in out


def test_summary_level_has_statistics_but_no_digests(tiny_gguf, tmp_path, capsys) -> None:
    path = tmp_path / "summary.jsonl"
    lines = record(tiny_gguf, path, "--set", "trace.level=summary")
    stages = [json.loads(x) for x in lines if '"event":"stage"' in x]
    assert stages and all("digest" not in e and e["rms"] > 0 for e in stages)
    assert json.loads(lines[0])["level"] == "summary"
    assert verify(path, capsys, "--require", "intact")[0] == 0


def test_show(traced, capsys) -> None:
    path, lines = traced
    assert main(["trace", "show", str(path)]) == 0
    out = capsys.readouterr().out
    footer = json.loads(lines[-1])
    assert "'hello world'" in out and repr(footer["output_text"]) in out and "integrity  intact" in out
    shares = [float(m) for m in re.findall(r"^(?:embed|attn_norm|qkv|rope|attend|out_proj|ffn_norm|ffn|output_norm|"
                                           r"head)\s+\d+\s+[\d.]+\s+[\d.]+\s+([\d.]+)%$", out, re.M)]
    assert len(shares) == 10 and abs(sum(shares) - 100) < 0.5
    assert re.search(r"hottest layers \(of 2\):\n  layer +[01] ", out)


def test_chain_follows_the_documented_rule(traced) -> None:
    _, lines = traced
    assert rechain(lines) == lines  # the test's own implementation of docs/trace.md reproduces every byte


def test_statistics_of_multi_array_and_non_finite_outputs() -> None:
    import io

    from tracelm.pipeline import trace as trace_mod
    from tracelm.pipeline.trace import Tracer
    from tracelm.state.records import Heads, Hidden

    rng = np.random.default_rng(1)
    q, k, v = (rng.standard_normal(s).astype(np.float32) for s in ((3, 4, 8), (3, 2, 8), (3, 2, 8)))
    bad = rng.standard_normal((2, 16)).astype(np.float32)
    bad[1, 3] = np.nan
    big = rng.standard_normal((trace_mod.BATCH_ELEMENTS // 1000 + 1, 1000)).astype(np.float32)  # past the bound
    stream = io.StringIO()
    tr = Tracer(stream, "digest")
    tr.call("qkv", 0, lambda: Heads(q, k, v, 5))
    tr.call("big", 0, lambda: Hidden(big, 0))
    tr.call("bad", 1, lambda: Hidden(bad, 7))
    tr.call("plain", None, lambda: bad[:1])  # a bare array
    tr.event("token", id=1, piece="a", prob=0.5)
    tr.flush()  # the token's batch is written at the next event or flush
    events = [json.loads(x) for x in stream.getvalue().splitlines()]
    assert [e["seq"] for e in events] == list(range(5)) and [e["event"] for e in events] == ["stage"] * 4 + ["token"]
    e = events[0]
    allv = np.concatenate([q.ravel(), k.ravel(), v.ravel()]).astype(np.float64)
    assert e["shape"] == [[3, 4, 8], [3, 2, 8], [3, 2, 8]] and e["start"] == 5 and e["n"] == 3 and e["layer"] == 0
    np.testing.assert_allclose([e["mean"], e["rms"], e["maxabs"]],
                               [allv.mean(), np.sqrt((allv**2).mean()), np.abs(allv).max()], rtol=1e-5)
    assert e["digest"] == hashlib.sha256(q.tobytes() + k.tobytes() + v.tobytes()).hexdigest()[:32]
    assert events[1]["rms"] == pytest.approx(float(np.sqrt((big.astype(np.float64) ** 2).mean())), rel=1e-5)
    assert events[2]["mean"] == "nan" and events[2]["rms"] == "nan" and events[2]["layer"] == 1
    assert events[3]["layer"] is None and events[3]["shape"] == [[1, 16]]
    assert events[3]["maxabs"] == pytest.approx(float(np.abs(bad[0]).max()), rel=1e-6)
    assert events[4]["tok"] == 0 and tr.n_tokens == 1


def test_outputs_held_for_rendering_stay_bounded() -> None:
    """A long prompt's stage outputs are rendered in batches once they pass BATCH_ELEMENTS, not held to the
    token event: at no call do the unrendered outputs hold more than twice the bound (level digest: at level summary
    an output's bytes are not held at all, only its statistics)."""
    import io

    from tracelm.pipeline.trace import BATCH_ELEMENTS, Tracer
    from tracelm.state.records import Hidden

    stream = io.StringIO()
    tr = Tracer(stream, "digest")
    rows = BATCH_ELEMENTS // 16 // 100  # each output 1/16 of the bound
    most_held = 0
    for i in range(100):
        out = np.full((rows, 100), i, np.float32)
        tr.call("ffn", i, lambda out=out: Hidden(out, 0))
        rendered = len(stream.getvalue().splitlines())
        most_held = max(most_held, (i + 1 - rendered) * out.size)
    assert 0 < most_held <= 2 * BATCH_ELEMENTS
    tr.flush()
    events = [json.loads(x) for x in stream.getvalue().splitlines()]
    assert [e["layer"] for e in events] == list(range(100)) and [e["mean"] for e in events] == list(range(100))


def test_trace_plot_draws_the_grid_and_the_rate(traced, tmp_path, capsys) -> None:
    pytest.importorskip("matplotlib", reason="matplotlib is in the plot extra")
    out = tmp_path / "plot.png"
    assert main(["trace", "plot", str(traced[0]), "--out", str(out), "--stat", "maxabs"]) == 0
    assert "pass 1's grid of max |x|" in capsys.readouterr().err
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 20_000
    assert main(["trace", "plot", str(traced[0]), "--out", str(out), "--token", "99"]) == 2
    assert "--token 99: the trace has passes 0..5" in capsys.readouterr().err


def test_trace_plot_and_show_say_the_same_decode_rate(traced, tmp_path, capsys) -> None:
    """One definition of decode tokens/s (pipeline.trace.decode_rate, over the footer's wall time): `trace show`
    and `trace plot` say the same figure for the same trace."""
    pytest.importorskip("matplotlib", reason="matplotlib is in the plot extra")
    assert main(["trace", "show", str(traced[0])]) == 0
    shown = re.search(r"decode ([0-9.]+) tok/s", capsys.readouterr().out)
    assert main(["trace", "plot", str(traced[0]), "--out", str(tmp_path / "p.png")]) == 0
    plotted = re.search(r"decode ([0-9.]+) tok/s", capsys.readouterr().err)
    assert shown and plotted and shown.group(1) == plotted.group(1)
