"""`tracelm bench --compare`: the report's shape from fake engine results, the child-process runner on the
tiny GGUF, absent and failing engines reported as such, and (with transformers) a small real run."""

from __future__ import annotations

import json

import pytest

from tests.conftest import require_reference
from tracelm import TracelmError
from tracelm.cli import main
from tracelm.tools import bench_compare as bc


def _ok(engine: str, prefill: float, decode: float, tokens: list[int]) -> dict:
    return {"engine": engine, "status": "ok", "version": "1.0", "threads": 2, "load_seconds": 0.5,
            "import_seconds": 0.1, "prefill_tok_s": prefill, "decode_tok_s": decode, "peak_rss_mb": 100.0,
            "tokens": tokens}


def test_report_ratios_agreement_and_table():
    results = {
        "tracelm": _ok("tracelm", 600.0, 30.0, [1, 2, 3, 4]),
        "llama.cpp": _ok("llama.cpp", 500.0, 100.0, [1, 2, 9, 4]),
        "transformers": _ok("transformers", 400.0, 20.0, [1, 2, 3, 4]),
    }
    rep = bc.build_report("m.gguf", 2, 256, 128, results)
    json.dumps(rep)  # plain JSON
    r = rep["ratios"]
    assert r["prefill_vs_llama_cpp"]["value"] == pytest.approx(1.2) and r["prefill_vs_llama_cpp"]["met"] is False
    assert r["decode_vs_llama_cpp"]["value"] == pytest.approx(0.3) and r["decode_vs_llama_cpp"]["met"] is False
    assert r["prefill_vs_transformers"]["value"] == pytest.approx(1.5) and r["prefill_vs_transformers"]["met"] is True
    assert r["decode_vs_transformers"]["value"] == pytest.approx(1.5) and r["decode_vs_transformers"]["met"] is False
    assert rep["engines"]["llama.cpp"]["greedy_same_as_tracelm"] == 2
    assert rep["engines"]["transformers"]["greedy_same_as_tracelm"] == 4
    assert "tokens" not in rep["engines"]["tracelm"]
    table = bc.format_table(rep)
    assert "1.20x" in table and "1.50x" in table and "not met" in table
    assert "2/4" in table and "600.0" in table


def test_report_with_absent_and_failed_engines():
    results = {
        "tracelm": _ok("tracelm", 600.0, 30.0, [1, 2]),
        "llama.cpp": {"engine": "llama.cpp", "status": "not installed", "error": "no module llama_cpp"},
        "transformers": {"engine": "transformers", "status": "failed", "error": "ValueError: cannot read"},
    }
    rep = bc.build_report("m.gguf", 2, 256, 128, results)
    assert all(r["value"] is None and r["met"] is None for r in rep["ratios"].values())
    table = bc.format_table(rep)
    assert "llama.cpp      not installed: no module llama_cpp" in table
    assert "transformers   failed: ValueError: cannot read" in table
    assert table.count("n/a") == 4


def test_tracelm_child_on_tiny_gguf(tiny_gguf):
    from tracelm.io.loader import load_model
    from tracelm.tools.bench import bench_ids
    from tracelm.tools.validate import greedy

    model = load_model(str(tiny_gguf), progress=False)
    ids = bench_ids(model.tokenizer, 24)
    r = bc.run_engine("tracelm", str(tiny_gguf), ids, n_decode=6, threads=1, repeats=2)
    assert r["status"] == "ok", r
    assert r["threads"] == 1
    assert r["prefill_tok_s"] > 0 and r["decode_tok_s"] > 0
    assert 10 < r["peak_rss_mb"] < 4096
    assert 0 <= r["load_seconds"] < 60
    assert r["tokens"] == greedy(model, ids, 7)  # the child decoded the same greedy tokens as in-process


def test_absent_engine_is_reported_not_a_crash(tiny_gguf, monkeypatch):
    monkeypatch.setitem(bc.REQUIRES, "llama.cpp", ("tracelm_no_such_module",))
    rep = bc.run_compare(str(tiny_gguf), threads=1, n_prompt=8, n_decode=4, repeats=1,
                         engines=("tracelm", "llama.cpp"))
    assert rep["engines"]["llama.cpp"]["status"] == "not installed"
    assert "tracelm_no_such_module" in rep["engines"]["llama.cpp"]["error"]
    assert rep["engines"]["tracelm"]["status"] == "ok"
    assert rep["ratios"]["prefill_vs_llama_cpp"]["value"] is None
    assert rep["load_average_1m"]["cores"] >= 1 and rep["load_average_1m"]["before"] >= 0
    table = bc.format_table(rep)
    assert "not installed" in table and "load average (1 min)" in table


def test_failing_child_reports_its_error_line(tmp_path):
    r = bc.run_engine("tracelm", str(tmp_path / "missing.gguf"), [1, 2, 3], n_decode=2, threads=1, repeats=1)
    assert r["status"] == "failed"
    assert "missing.gguf" in r["error"] and "Traceback" not in r["error"]


def test_compare_user_errors(tiny_gguf, capsys):
    with pytest.raises(TracelmError, match="unknown engine"):
        bc.run_compare(str(tiny_gguf), engines=("vllm",))
    with pytest.raises(TracelmError, match="must be >= 1"):
        bc.run_compare(str(tiny_gguf), n_decode=0)
    assert main(["bench", "tokenizer", "--compare", "--model", str(tiny_gguf)]) == 2
    assert "--compare applies to the model bench only" in capsys.readouterr().err


@pytest.mark.reference
def test_compare_cli_with_transformers(tiny_gguf, monkeypatch, capsys):
    require_reference()
    monkeypatch.setitem(bc.REQUIRES, "llama.cpp", ("tracelm_no_such_module",))  # keep the run small and fixed
    argv = ["bench", "--compare", "--model", str(tiny_gguf), "--threads", "1", "--prompt-tokens", "16",
            "--decode-tokens", "8", "--repeats", "1", "--json"]
    assert main(argv) == 0
    rep = json.loads(capsys.readouterr().out)
    hf = rep["engines"]["transformers"]
    if hf["status"] == "failed":
        pytest.skip(f"transformers cannot load the tiny random GGUF: {hf['error']}")
    assert hf["status"] == "ok" and hf["threads"] == 1
    assert hf["greedy_same_as_tracelm"] == hf["greedy_tokens"] == 9  # both in f32 on the same weights
    assert rep["ratios"]["prefill_vs_transformers"]["value"] > 0
    assert rep["ratios"]["decode_vs_transformers"]["value"] > 0
    assert rep["engines"]["llama.cpp"]["status"] == "not installed"


def test_crashed_child_is_retried_with_the_engines_fallback(monkeypatch):
    """A child killed by a signal (llama.cpp's AMX buffers on some machines) is run once more with the engine's
    fallback options, and the report says why; a second crash is a plain failure naming the signal."""
    from tracelm.tools.child import ChildKilled

    monkeypatch.setattr(bc, "missing_modules", lambda engine: [])
    requests = []

    def fake_run_child(fn, engine, request, timeout=None):
        requests.append(request)
        if request["options"].get("extra_buffers") is False and len(requests) == 2:
            return _ok("llama.cpp", 500.0, 100.0, [1]) | {"options": request["options"]}
        raise ChildKilled("SIGSEGV")

    monkeypatch.setattr(bc, "run_child", fake_run_child)
    r = bc.run_engine("llama.cpp", "m.gguf", [1, 2], n_decode=2, threads=2)
    assert [q["options"] for q in requests] == [{}, {"extra_buffers": False}]
    assert r["status"] == "ok" and r["options"] == {"extra_buffers": False}
    assert "SIGSEGV" in r["note"] and "AMX" in r["note"]
    assert "note: extra weight buffer types" in bc.format_table(bc.build_report("m", 2, 2, 2, {"llama.cpp": r}))

    requests.clear()
    r = bc.run_engine("transformers", "m.gguf", [1, 2], n_decode=2, threads=2)  # no fallback: one try
    assert len(requests) == 1
    assert r == {"engine": "transformers", "status": "failed", "error": "child killed by SIGSEGV"}
    requests.append({})  # the fallback crashes too
    r = bc.run_engine("llama.cpp", "m.gguf", [1, 2], n_decode=2, threads=2)
    assert r["status"] == "failed" and r["error"] == "child killed by SIGSEGV" and "AMX" in r["note"]


def test_children_are_started_by_function():
    """tools.child runs a function in a fresh interpreter: its value back, its exception as one line, a
    signal and a time limit as clear errors."""
    import os
    import time

    from tracelm.tools.child import ChildKilled, run_child

    assert run_child(sum, [1, 2, 3]) == 6
    with pytest.raises(TracelmError, match="ValueError: invalid literal"):
        run_child(int, "x")
    with pytest.raises(ChildKilled, match="SIGABRT"):
        run_child(os.abort)
    with pytest.raises(TracelmError, match="timed out after 1 s"):
        run_child(time.sleep, 30, timeout=1.0)
