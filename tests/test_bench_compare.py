"""`tracelm bench --compare`: the report's shape from fake engine results, the child-process runner on the
tiny GGUF, absent and failing engines reported as such, and (with transformers) a small real run."""

from __future__ import annotations

import json

import pytest

from tests.conftest import require_reference
from tracelm import TracelmError
from tracelm.cli import main
from tracelm.tools import bench_compare as bc


def _ok(engine: str, prefill: float, decode: float, tokens: list[int], **extra) -> dict:
    return {"engine": engine, "status": "ok", "version": "1.0", "threads": 2, "load_seconds": 0.5,
            "import_seconds": 0.1, "prefill_tok_s": prefill, "decode_tok_s": decode, "peak_rss_mb": 100.0,
            "tokens": tokens, **extra}


def _rounds(engine: str, prefills: list[float], decodes: list[float], tokens: list[int], **extra) -> list[dict]:
    return [_ok(engine, p, d, tokens, **extra) for p, d in zip(prefills, decodes, strict=True)]


def test_report_medians_spreads_and_ratio_spreads():
    """Each rate's median, min and max over the rounds; each ratio's median, min and max over the per-round
    ratios (round i of tracelm over round i of the other), not the ratio of the medians."""
    runs = {
        "tracelm": {"default": _rounds("tracelm", [600, 660, 540], [30, 36, 33], [1, 2, 3, 4])},
        "transformers": {"default": _rounds("transformers", [400, 300, 600], [20, 30, 10], [1, 2, 3, 4])},
    }
    rep = bc.build_report("m.gguf", 2, 256, 128, runs)
    json.dumps(rep)  # plain JSON
    ours = rep["engines"]["tracelm"]
    assert rep["rounds"] == 3 and ours["rounds"] == 3
    assert ours["prefill_tok_s"] == {"median": 600, "min": 540, "max": 660, "rounds": [600, 660, 540]}
    assert ours["decode_tok_s"] == {"median": 33, "min": 30, "max": 36, "rounds": [30, 36, 33]}
    assert ours["load_seconds"]["median"] == 0.5 and ours["peak_rss_mb"] == 100.0 and ours["version"] == "1.0"
    prefill = rep["ratios"]["prefill_vs_transformers"]  # 1.5, 2.2, 0.9
    assert prefill["rounds"] == [1.5, 2.2, 0.9]
    assert (prefill["value"], prefill["min"], prefill["max"]) == (1.5, 0.9, 2.2) and prefill["met"] is True
    decode = rep["ratios"]["decode_vs_transformers"]  # 1.5, 1.2, 3.3: the median of ratios, not 33/20
    assert (decode["value"], decode["min"], decode["max"]) == (1.5, 1.2, 3.3) and decode["met"] is False
    assert rep["engines"]["transformers"]["greedy_same_as_tracelm"] == 4
    assert "tokens" not in ours and "llama_bench" not in str(rep["ratios"])  # llama-bench ratios only when run
    table = bc.format_table(rep)
    assert "600.0 (540.0-660.0)" in table and "33.00 (30.00-36.00)" in table
    assert "1.50x (0.90-2.20)" in table and "not met" in table and "4/4" in table and "3 rounds" in table


def test_a_prefill_target_past_tracelms_integer_bound_is_said():
    """tracelm's child reports its prompt's integer bound; a prefill ratio says what its target asks of it (target x
    the other's median over the bound), and the table says when that is more than the bound allows."""
    details = {"kernels": "avx512vnni", "prefill_int8_bound_tok_s": 80.0}
    runs = {"tracelm": {"default": _rounds("tracelm", [40, 44], [10, 11], [1, 2], details=details)},
            "llama.cpp": {"flash_attn on": _rounds("llama.cpp", [60, 70], [9, 9], [1, 2])},
            "transformers": {"default": _rounds("transformers", [20, 30], [3, 4], [1, 2])}}
    rep = bc.build_report("m.gguf", 2, 256, 128, runs)
    assert rep["engines"]["tracelm"]["prefill_int8_bound_tok_s"] == 80.0
    assert rep["ratios"]["prefill_vs_llama_cpp"]["target_vs_int8_bound"] == 1.219  # 1.5 x 65 / 80
    assert rep["ratios"]["prefill_vs_transformers"]["target_vs_int8_bound"] == 0.312  # 1.0 x 25 / 80
    assert "target_vs_int8_bound" not in rep["ratios"]["decode_vs_llama_cpp"]
    table = bc.format_table(rep)
    assert table.count("integer bound") == 1 and "the target is 1.22x tracelm's integer bound" in table
    del details["prefill_int8_bound_tok_s"]  # the portable path, or reference weights: no bound, nothing said
    rep = bc.build_report("m.gguf", 2, 256, 128, runs)
    assert "target_vs_int8_bound" not in rep["ratios"]["prefill_vs_llama_cpp"]


def test_llama_cpp_best_of_flash_attention_named_and_used_per_rate():
    """llama.cpp is measured with flash attention off and on; per rate the better median is its figure, the
    report names which, and the ratios pair tracelm's rounds with that variant's."""
    runs = {
        "tracelm": {"default": _rounds("tracelm", [600, 600], [150, 150], [5, 6, 7])},
        "llama.cpp": {
            "flash_attn off": _rounds("llama.cpp", [300, 200], [100, 120], [5, 6, 7], details={"flash_attn": False,
                                      "system_info": "CPU : AVX2 = 1 | REPACK = 1", "build_flags": None}),
            "flash_attn on": _rounds("llama.cpp", [400, 300], [90, 80], [5, 6, 7], details={"flash_attn": True,
                                     "system_info": "CPU : AVX2 = 1 | REPACK = 1", "build_flags": None}),
        },
    }
    rep = bc.build_report("m.gguf", 2, 256, 128, runs)
    llama = rep["engines"]["llama.cpp"]
    assert llama["best"] == {"prefill_tok_s": "flash_attn on", "decode_tok_s": "flash_attn off"}
    assert llama["prefill_tok_s"]["median"] == 350 and llama["decode_tok_s"]["median"] == 110
    assert llama["variants"]["flash_attn on"]["flash_attn"] is True
    assert llama["variants"]["flash_attn off"]["greedy_same_as_tracelm"] == 3
    assert llama["system_info"] == "CPU : AVX2 = 1 | REPACK = 1"
    prefill, decode = rep["ratios"]["prefill_vs_llama_cpp"], rep["ratios"]["decode_vs_llama_cpp"]
    assert prefill["against"] == "flash_attn on" and prefill["rounds"] == [1.5, 2.0] and prefill["value"] == 1.75
    assert decode["against"] == "flash_attn off" and decode["rounds"] == [1.5, 1.25] and decode["value"] == 1.375
    table = bc.format_table(rep)
    assert "llama.cpp (flash_attn off)" in table and "llama.cpp (flash_attn on)" in table
    assert "llama.cpp's figure: prefill flash_attn on, decode flash_attn off" in table
    assert "system info: CPU : AVX2 = 1 | REPACK = 1" in table
    assert "build flags: not recorded" in table
    assert "tracelm prefill / llama.cpp prefill vs flash_attn on" in table


def test_agreement_is_asserted_and_says_where_they_part():
    tracelm = [[1, 2, 3, 4, 5, 6], [1, 2, 3, 4, 5, 6]]
    ok = bc.agreement({"tracelm": tracelm, "llama.cpp (flash_attn on)": [[1, 2, 3, 4, 9, 9]] * 2}, required=4)
    assert ok == {"required_tokens": 4, "ok": True, "disagreements": []}  # parting after the first 4 is allowed
    bad = bc.agreement({"tracelm": tracelm, "transformers": [[1, 2, 3, 4, 5, 6], [1, 2, 7, 4, 5, 6]]}, required=4)
    assert bad["ok"] is False
    assert bad["disagreements"] == [{"engine": "transformers", "round": 2, "parts_at": 2, "tracelm_token": 3,
                                     "engine_token": 7, "against": "tracelm"}]
    assert "transformers parts from tracelm at token 2 in round 2 (7 where tracelm has 3)" in bc.agreement_line(bad)
    drift = bc.agreement({"tracelm": [[1, 2, 3], [1, 8, 3]]}, required=32)  # tracelm must repeat itself
    assert drift["disagreements"][0] == {"engine": "tracelm", "round": 2, "parts_at": 1, "tracelm_token": 2,
                                              "engine_token": 8, "against": "tracelm round 1"}


def test_report_with_absent_and_failed_engines():
    runs = {
        "tracelm": {"default": [_ok("tracelm", 600.0, 30.0, [1, 2])]},
        "llama.cpp": {"default": [{"engine": "llama.cpp", "status": "not installed", "error": "no module llama_cpp"}]},
        "transformers": {"default": [{"engine": "transformers", "status": "failed",
                                      "error": "ValueError: cannot read"}]},
    }
    rep = bc.build_report("m.gguf", 2, 256, 128, runs)
    assert all(r["value"] is None and r["met"] is None for r in rep["ratios"].values())
    assert rep["agreement"]["ok"] is True
    table = bc.format_table(rep)
    assert "llama.cpp      not installed: no module llama_cpp" in table
    assert "transformers   failed: ValueError: cannot read" in table
    assert table.count("n/a") == 4


def test_failure_in_a_later_round_stops_that_variant_and_is_reported():
    runs = {"tracelm": {"default": [_ok("tracelm", 600.0, 30.0, [1]),
                                    {"engine": "tracelm", "status": "failed", "error": "child killed by SIGKILL"}]}}
    r = bc.build_report("m.gguf", 2, 256, 128, runs)["engines"]["tracelm"]
    assert r == {"engine": "tracelm", "status": "failed", "error": "child killed by SIGKILL", "rounds_ok": 1}


def _one_engine(path, ids, n_decode, rounds=1, repeats=1, engine="tracelm", threads=1) -> list[dict]:
    return bc.run_rounds(str(path), ids, n_decode, threads, repeats, rounds, (engine,), 600.0, {})[engine]["default"]


def test_tracelm_child_on_tiny_gguf(tiny_gguf):
    from tracelm.io.loader import load_model
    from tracelm.tools.bench import bench_ids
    from tracelm.tools.validate import greedy

    model = load_model(str(tiny_gguf), progress=False)
    ids = bench_ids(model.tokenizer, 24)
    results = _one_engine(tiny_gguf, ids, n_decode=6, rounds=2, repeats=2)
    assert len(results) == 2
    for r in results:
        assert r["status"] == "ok", r
        assert r["threads"] == 1
        assert r["prefill_tok_s"] > 0 and r["decode_tok_s"] > 0
        assert 10 < r["peak_rss_mb"] < 4096
        assert 0 <= r["load_seconds"] < 60
        assert r["tokens"] == greedy(model, ids, 7)  # the child decoded the same greedy tokens as in-process
        assert "prefill_int8_bound_tok_s" not in r["details"]  # f32 weights: no integer work, no integer bound


def test_tracelm_child_reports_its_prompts_integer_bound(tmp_path):
    """On quantized weights the child names the bound its prefill meets: the path's dot at its peak on its threads
    over the prompt's int8 products per token (none on the portable path)."""
    import gguf

    from tests.conftest import write_tiny_gguf

    path = write_tiny_gguf(tmp_path / "tiny-q8.gguf", qtype=gguf.GGMLQuantizationType.Q8_0)
    [r] = _one_engine(path, list(range(1, 17)), n_decode=2)
    assert r["status"] == "ok", r
    if r["details"]["kernels"] == "portable":
        assert "prefill_int8_bound_tok_s" not in r["details"]
    else:
        peak = r["details"]["int8_dot_peak"]
        assert peak["threads"] == 1 and peak["path"] == r["details"]["kernels"]
        assert r["details"]["prefill_int8_bound_tok_s"] > r["prefill_tok_s"] > 0


def test_absent_engine_is_reported_not_a_crash(tiny_gguf, monkeypatch):
    monkeypatch.setitem(bc.REQUIRES, "llama.cpp", ("tracelm_no_such_module",))
    rep = bc.run_compare(str(tiny_gguf), threads=1, n_prompt=8, n_decode=4, repeats=1, rounds=1,
                         engines=("tracelm", "llama.cpp"))
    assert rep["engines"]["llama.cpp"]["status"] == "not installed"
    assert "tracelm_no_such_module" in rep["engines"]["llama.cpp"]["error"]
    assert rep["engines"]["tracelm"]["status"] == "ok"
    assert rep["ratios"]["prefill_vs_llama_cpp"]["value"] is None
    assert rep["load_average_1m"]["cores"] >= 1 and rep["load_average_1m"]["before"] >= 0
    assert rep["cpu_steal_share"] is None or 0 <= rep["cpu_steal_share"] <= 1
    stolen = bc.format_table({**rep, "cpu_steal_share": 0.25})
    assert "the host took 25.0 % of the machine's CPU time (steal)" in stolen
    assert rep["cpu"] == bc.cpu_name() and (rep["cpu"] is None or rep["cpu"] in bc.format_table(rep))
    assert rep["engines"]["tracelm"]["kernels"]  # the kernels' path in use, named, with its self-test's result
    assert rep["engines"]["tracelm"]["selftest"].startswith("passed")
    table = bc.format_table(rep)
    assert "not installed" in table and "load average (1 min)" in table


def test_failing_child_reports_its_error_line(tmp_path):
    [r] = _one_engine(tmp_path / "missing.gguf", [1, 2, 3], n_decode=2)
    assert r["status"] == "failed"
    assert "missing.gguf" in r["error"] and "Traceback" not in r["error"]


def test_compare_user_errors(tiny_gguf, capsys):
    with pytest.raises(TracelmError, match="unknown engine"):
        bc.run_compare(str(tiny_gguf), engines=("vllm",))
    with pytest.raises(TracelmError, match="must be >= 1"):
        bc.run_compare(str(tiny_gguf), n_decode=0)
    with pytest.raises(TracelmError, match=r"rounds \(0\), repeats \(3\) and turn steps \(8\) must be >= 1"):
        bc.run_compare(str(tiny_gguf), rounds=0)
    with pytest.raises(TracelmError, match=r"turn steps \(0\) must be >= 1"):
        bc.run_compare(str(tiny_gguf), turn_steps=0)
    assert main(["bench", "--compare", "--model", str(tiny_gguf), "--llama-bench", str(tiny_gguf)]) == 2
    assert f"--llama-bench {tiny_gguf}: not an executable file" in capsys.readouterr().err
    assert main(["bench", "--llama-bench", "x", "--model", str(tiny_gguf)]) == 2
    assert "apply to --compare only" in capsys.readouterr().err
    assert main(["bench", "tokenizer", "--compare", "--model", str(tiny_gguf)]) == 2
    assert "--compare applies to the model bench only" in capsys.readouterr().err
    assert main(["bench", "--compare", "--model", str(tiny_gguf), "--engines", "llama.cpp"]) == 2
    assert "the engines (llama.cpp) must include tracelm" in capsys.readouterr().err
    assert main(["bench", "--compare", "--model", str(tiny_gguf), "--engines", "tracelm,vllm"]) == 2
    assert "unknown engine 'vllm'" in capsys.readouterr().err


@pytest.mark.reference
def test_compare_cli_with_transformers(tiny_gguf, monkeypatch, capsys):
    require_reference()
    monkeypatch.setitem(bc.REQUIRES, "llama.cpp", ("tracelm_no_such_module",))  # keep the run small and fixed
    argv = ["bench", "--compare", "--model", str(tiny_gguf), "--threads", "1", "--prompt-tokens", "16",
            "--decode-tokens", "8", "--repeats", "1", "--rounds", "1", "--json"]
    assert main(argv) == 0
    rep = json.loads(capsys.readouterr().out)
    hf = rep["engines"]["transformers"]
    if hf["status"] == "failed":
        pytest.skip(f"transformers cannot load the tiny random GGUF: {hf['error']}")
    assert hf["status"] == "ok" and hf["threads"] == 1 and hf["attention"] in ("sdpa", "eager")
    assert hf["greedy_same_as_tracelm"] == hf["greedy_tokens"] == 9  # both in f32 on the same weights
    assert rep["ratios"]["prefill_vs_transformers"]["value"] > 0
    assert rep["ratios"]["decode_vs_transformers"]["value"] > 0
    assert rep["engines"]["llama.cpp"]["status"] == "not installed"


class FakeChildren:
    """Stands in for tools.child.Child: builds a FakeChild per engine variant, whose figures per round come from a
    table (in turn, over again when it runs out); every start and every call recorded in order. `crash(engine,
    options)` says whether the child dies (a signal) at its first prefill."""

    def __init__(self, figures: dict[str, list[tuple[float, float, list[int]]]], crash=lambda engine, options: False):
        self.figures, self.crash, self.starts, self.calls = figures, crash, [], []

    def __call__(self, factory, engine, request, timeout=None):
        assert factory is bc.EngineChild
        return FakeChild(self, engine, request)


class FakeChild:
    def __init__(self, table: FakeChildren, engine: str, request: dict):
        self.table, self.engine, self.options = table, engine, request["options"]
        self.n_prompt, self.begun = len(request["ids"]), 0
        base = bc._label(engine, {None: "default", False: "flash_attn off", True: "flash_attn on"}[
            self.options.get("flash_attn")])
        self.label = base[:-1] + ", no extra buffers)" if self.options.get("extra_buffers") is False else base
        self.figures = table.figures.get(self.label) or table.figures.get(base) or table.figures[engine]
        table.starts.append((self.label, dict(self.options)))

    def call(self, method, timeout=None, **kwargs):
        from tracelm.tools.child import ChildKilled

        self.table.calls.append((self.label, method))
        if method == "prefill" and self.table.crash(self.engine, self.options):
            raise ChildKilled("SIGSEGV")
        prefill, decode, tokens = self.figures[max(self.begun - (method != "prefill"), 0) % len(self.figures)]
        if method == "prefill":
            return self.n_prompt / prefill
        if method == "begin_decode":
            self.begun += 1
            return None
        if method == "decode":
            return kwargs["n"] / decode
        if method == "greedy_tokens":
            return tokens
        assert method == "finish", method
        return {"version": "1.0", "threads": 2, "options": self.options, "load_seconds": 0.5, "import_seconds": 0.1,
                "peak_rss_mb": 100.0, "details": {}}

    def close(self):
        pass


def _fake_engines(monkeypatch, figures, crash=lambda engine, options: False) -> FakeChildren:
    children = FakeChildren(figures, crash)
    monkeypatch.setattr(bc, "missing_modules", lambda engine: [])
    monkeypatch.setattr(bc, "Child", children)
    monkeypatch.setattr(bc, "SETTLE_SECONDS", 0.0)
    return children


@pytest.mark.parametrize("crashes_without", ["amx_buffers", "extra_buffers"])
def test_a_crash_fallback_carries_to_the_engines_other_variants(tiny_gguf, monkeypatch, crashes_without):
    """llama.cpp's AMX buffers crash whatever flash attention is: once the first variant needed a fallback (AMX
    off, repacking kept; failing that, every extra buffer type off), the second starts with it (no crash and
    reload to pay), and its figures say why; the generic variants keep their own setting."""
    crash = lambda engine, options: (engine == "llama.cpp" and  # noqa: E731
                                     False not in (options.get(crashes_without), options.get("extra_buffers")))
    toks = [1, 2, 3]
    children = _fake_engines(monkeypatch, {"tracelm": [(500, 100, toks)], "llama.cpp": [(500, 100, toks)]}, crash)
    rep = bc.run_compare(str(tiny_gguf), threads=2, n_prompt=8, n_decode=2, rounds=2, engines=("tracelm", "llama.cpp"))
    llama = [o for label, o in children.starts if label.startswith("llama.cpp")]
    fallback = {"amx_buffers": False} | ({"extra_buffers": False} if crashes_without == "extra_buffers" else {})
    tries = [{"flash_attn": False}, {"flash_attn": False, "amx_buffers": False}]
    if crashes_without == "extra_buffers":
        tries.append({"flash_attn": False} | fallback)
    generic = [{"flash_attn": False, "extra_buffers": False}, {"flash_attn": True, "extra_buffers": False}]
    assert llama == tries + [{"flash_attn": True} | fallback] + generic  # each loaded once, for every round
    variants = rep["engines"]["llama.cpp"]["variants"]
    assert all(v["status"] == "ok" and v["rounds"] == 2 for v in variants.values())
    assert variants["flash_attn on"]["options"] == {"flash_attn": True} | fallback
    assert "note" not in variants["flash_attn on, no extra buffers"]  # its own setting, not a fallback
    assert "child killed by SIGSEGV" in variants["flash_attn off"]["note"]
    why = "extra weight buffer types" if crashes_without == "extra_buffers" else "AMX weight buffer type off"
    assert variants["flash_attn on"]["note"].startswith(why)
    assert "(in llama.cpp (flash_attn off))" in variants["flash_attn on"]["note"]


def test_crashed_child_is_retried_with_the_engines_fallback(monkeypatch):
    """A child killed by a signal (llama.cpp's AMX buffers on some machines) is started again with the engine's
    fallbacks in turn (AMX off with repacking kept, then every extra buffer type off), and the note says why; a
    crash with the last is a plain failure naming the signal."""
    request = {"path": "m.gguf", "ids": [1, 2], "n_decode": 2, "threads": 2, "options": {}}
    children = _fake_engines(monkeypatch, {"llama.cpp": [(500, 100, [1])], "transformers": [(5, 1, [1])]},
                             crash=lambda engine, options: options.get("amx_buffers") is not False)
    child, info = bc.start_engine("llama.cpp", request)
    assert [o for _, o in children.starts] == [{}, {"amx_buffers": False}]
    assert child is not None and info["options"] == {"amx_buffers": False}
    assert "SIGSEGV" in info["note"] and info["note"].startswith("AMX weight buffer type off (repacked layouts kept)")
    r = {**_ok("llama.cpp", 500.0, 100.0, [1]), **info}
    table = bc.format_table(bc.build_report("m", 2, 2, 2, {"llama.cpp": {"flash_attn off": [r]}}))
    assert "note: AMX weight buffer type off" in table

    children.starts.clear()
    child, info = bc.start_engine("transformers", request)  # no fallback: one try
    assert len(children.starts) == 1 and child is None
    assert info == {"engine": "transformers", "status": "failed", "error": "child killed by SIGSEGV"}
    children.starts.clear()
    children.crash = lambda engine, options: True  # every fallback crashes too
    child, info = bc.start_engine("llama.cpp", request)
    assert [o for _, o in children.starts] == [{}, {"amx_buffers": False}, {"amx_buffers": False,
                                                                           "extra_buffers": False}]
    assert child is None and info["status"] == "failed" and info["error"] == "child killed by SIGSEGV"
    assert "AMX weight buffer type off" in info["note"] and "extra weight buffer types" in info["note"]


class Tally:
    """A small object for tools.child.Child to keep in its process."""

    def __init__(self, start: int):
        self.total = start

    def add(self, n: int) -> int:
        self.total += n
        return self.total

    def pid(self) -> int:
        import os

        return os.getpid()

    def fail(self) -> None:
        raise ValueError("no good")

    def abort(self) -> None:
        import os

        os.abort()

    def sleep(self, seconds: float) -> None:
        import time

        time.sleep(seconds)


def test_children_are_started_by_function():
    """tools.child runs a function in a fresh interpreter (its value back, its exception as one line, a signal and
    a time limit as clear errors), or keeps an object there and runs its methods on call, under the same rules."""
    import os
    import time

    from tracelm.tools.child import Child, ChildKilled, run_child

    assert run_child(sum, [1, 2, 3]) == 6
    with pytest.raises(TracelmError, match="ValueError: invalid literal"):
        run_child(int, "x")
    with pytest.raises(ChildKilled, match="SIGABRT"):
        run_child(os.abort)
    with pytest.raises(TracelmError, match="timed out after 1 s"):
        run_child(time.sleep, 30, timeout=1.0)

    child = Child(Tally, 10)
    assert child.call("add", n=5) == 15 and child.call("add", n=1) == 16  # one object, kept between calls
    assert child.call("pid") != os.getpid()
    with pytest.raises(TracelmError, match="ValueError: no good"):
        child.call("fail")
    with pytest.raises(TracelmError, match="child exited|child killed"):  # a failed call ends the child
        child.call("add", n=1)
    child.close()  # again: nothing to do
    with pytest.raises(TracelmError, match="TypeError"):
        Child(Tally)  # the build's own error
    with pytest.raises(ChildKilled, match="SIGABRT"):
        Child(Tally, 0).call("abort")
    slow = Child(Tally, 0)
    with pytest.raises(TracelmError, match="timed out after 1 s"):
        slow.call("sleep", seconds=30, timeout=1.0)


def test_rounds_take_turns_and_each_variant_loads_once(tiny_gguf, monkeypatch):
    """Every engine variant (llama.cpp with flash attention off, then on, with its extra buffer types and without)
    is loaded once; in every round each prefill repeat goes round them all, then decode goes round in turns of
    --turn-steps steps, the order rotated by one a turn. The report's spreads are over the rounds, llama.cpp's best
    per rate named."""
    toks = [1, 2, 3]
    children = _fake_engines(monkeypatch, {
        "tracelm": [(600, 60, toks), (500, 50, toks), (700, 70, toks)],
        "llama.cpp (flash_attn off)": [(300, 40, toks)] * 3,
        "llama.cpp (flash_attn on)": [(310, 30, toks)] * 3,
        "llama.cpp (flash_attn on, no extra buffers)": [(320, 20, toks)] * 3,
        "transformers": [(100, 10, toks)] * 3,
    })
    rep = bc.run_compare(str(tiny_gguf), threads=2, n_prompt=8, n_decode=5, rounds=3, repeats=2, turn_steps=2)
    order = ["tracelm", "llama.cpp (flash_attn off)", "llama.cpp (flash_attn on)",
             "llama.cpp (flash_attn off, no extra buffers)", "llama.cpp (flash_attn on, no extra buffers)",
             "transformers"]
    assert [s[0] for s in children.starts] == order
    assert children.starts[0][1] == {"activations": "int16"} and children.starts[2][1] == {"flash_attn": True}
    assert children.starts[4][1] == {"flash_attn": True, "extra_buffers": False}

    def turned(i):
        return order[i:] + order[:i]

    probe = [(label, "prefill") for label in order]  # each child's first prefill, where a crash shows
    one_round = ([(label, "prefill") for i in range(3) for label in turned(i)]  # 1 untimed + 2 repeats
                 + [(label, "begin_decode") for label in order]
                 + [(label, "decode") for i in range(3) for label in turned(i)]  # 5 steps: 2 + 2 + 1
                 + [(label, "greedy_tokens") for label in order])
    assert children.calls == probe + one_round * 3 + [(label, "finish") for label in order]
    assert rep["rounds"] == 3 and rep["turn_steps"] == 2
    assert rep["engines"]["tracelm"]["decode_tok_s"] == {"median": 60, "min": 50, "max": 70, "rounds": [60, 50, 70]}
    assert rep["engines"]["tracelm"]["prefill_tok_s"]["rounds"] == [600, 500, 700]
    assert rep["engines"]["llama.cpp"]["best"] == {"prefill_tok_s": "flash_attn on, no extra buffers",
                                                   "decode_tok_s": "flash_attn off"}
    assert rep["ratios"]["prefill_vs_llama_cpp"]["rounds"] == [1.875, 1.562, 2.188]
    assert rep["ratios"]["decode_vs_llama_cpp"]["rounds"] == [1.5, 1.25, 1.75]
    assert rep["agreement"]["ok"] is True
    assert "engines taking turns, 2 decode steps a turn" in bc.format_table(rep)


def test_a_child_failing_in_a_round_is_left_out_from_then_on(tiny_gguf, monkeypatch):
    toks = [1, 2]
    children = _fake_engines(monkeypatch, {"tracelm": [(600, 60, toks)], "llama.cpp": [(300, 30, toks)]})
    real_call = FakeChild.call

    def call(self, method, timeout=None, **kwargs):
        if self.label == "llama.cpp (flash_attn on)" and method == "decode" and self.begun == 2:
            raise TracelmError("child killed by SIGKILL")
        return real_call(self, method, timeout, **kwargs)

    monkeypatch.setattr(FakeChild, "call", call)
    rep = bc.run_compare(str(tiny_gguf), threads=2, n_prompt=8, n_decode=4, rounds=3, engines=("tracelm", "llama.cpp"))
    on = rep["engines"]["llama.cpp"]["variants"]["flash_attn on"]
    assert on == {"engine": "llama.cpp", "status": "failed", "error": "child killed by SIGKILL", "rounds_ok": 1}
    assert rep["engines"]["llama.cpp"]["variants"]["flash_attn off"]["rounds"] == 3
    assert sum(1 for c in children.calls if c[0] == "llama.cpp (flash_attn on)" and c[1] == "begin_decode") == 2
    assert rep["engines"]["tracelm"]["decode_tok_s"]["rounds"] == [60, 60, 60]


def test_engines_picks_the_engines_run(tiny_gguf, monkeypatch, capsys):
    """--engines tracelm,llama.cpp: transformers is neither run nor reported (on a machine where it is installed it
    would cost a load of the f32 weights and their memory)."""
    toks = [1, 2, 3]
    children = _fake_engines(monkeypatch, {"tracelm": [(600, 60, toks)] * 2,
                                           "llama.cpp (flash_attn off)": [(300, 40, toks)] * 2,
                                           "llama.cpp (flash_attn on)": [(310, 30, toks)] * 2,
                                           "transformers": [(100, 10, toks)] * 2})
    argv = ["bench", "--compare", "--model", str(tiny_gguf), "--threads", "2", "--prompt-tokens", "8",
            "--decode-tokens", "2", "--rounds", "2", "--engines", "tracelm, llama.cpp", "--json"]
    assert main(argv) == 0
    captured = capsys.readouterr()
    rep = json.loads(captured.out)
    assert [c[0] for c in children.starts] == ["tracelm", "llama.cpp (flash_attn off)", "llama.cpp (flash_attn on)",
                                               "llama.cpp (flash_attn off, no extra buffers)",
                                               "llama.cpp (flash_attn on, no extra buffers)"]
    assert set(rep["engines"]) == {"tracelm", "llama.cpp"}
    assert rep["ratios"]["decode_vs_llama_cpp"]["value"] == 1.5
    # each child's figures on stderr as it ends: a run cut short has still said what it measured
    assert "round 2/2: llama.cpp (flash_attn on): prefill 310" in captured.err


def test_greedy_disagreement_exits_nonzero_unless_allowed(tiny_gguf, monkeypatch, capsys):
    same = (300, 30, [1, 2, 3, 4])
    _fake_engines(monkeypatch, {"tracelm": [(600, 60, [1, 2, 3, 4])], "llama.cpp (flash_attn off)": [same],
                                "llama.cpp (flash_attn on)": [same],
                                "transformers": [(100, 10, [1, 2, 3, 4]), (100, 10, [1, 9, 3, 4])]})
    argv = ["bench", "--compare", "--model", str(tiny_gguf), "--prompt-tokens", "8", "--decode-tokens", "3",
            "--rounds", "2"]
    assert main(argv) == 1
    out, err = capsys.readouterr()
    assert "greedy agreement: FAILED" in out
    assert "transformers parts from tracelm at token 1 in round 2 (9 where tracelm has 2)" in err
    assert "--allow-disagreement" in err
    assert main([*argv, "--allow-disagreement", "--json"]) == 0
    rep = json.loads(capsys.readouterr().out)
    assert rep["agreement"]["ok"] is False and rep["agreement"]["disagreements"][0]["parts_at"] == 1
    assert rep["engines"]["transformers"]["greedy_same_as_tracelm"] == 1
    assert main([*argv, "--agree-tokens", "1"]) == 0  # they part after the first token: allowed


LLAMA_BENCH_SCRIPT = """#!{python}
import json, sys
open({log!r}, "a").write(" ".join(sys.argv[1:]) + "\\n")
args = dict(zip(sys.argv[1::2], sys.argv[2::2]))
tests = []
for fa, (pp, tg) in (("0", (200.0, 50.0)), ("1", (250.0, 40.0))):
    for n_prompt, n_gen, ts in ((int(args["-p"]), 0, pp), (0, int(args["-n"]), tg)):
        tests.append({{"build_commit": "8cf427ff", "build_number": 5163, "cpu_info": "Fake CPU", "gpu_info": "",
                      "backends": "CPU", "model_filename": args["-m"], "model_type": "llama ?B Q4_0",
                      "n_batch": 2048, "n_ubatch": 512, "n_threads": int(args["-t"]), "type_k": "f16",
                      "type_v": "f16", "flash_attn": fa == "1", "n_prompt": n_prompt, "n_gen": n_gen, "n_depth": 0,
                      "test_time": "2025-04-24T11:58:50Z", "avg_ns": 1, "stddev_ns": 0, "avg_ts": ts,
                      "stddev_ts": 0.0, "samples_ns": [1], "samples_ts": [ts]}})
print(json.dumps(tests, indent=2))
"""


def _script(tmp_path, body: str) -> str:
    path = tmp_path / "llama-bench"
    path.write_text(body)
    path.chmod(0o755)
    return str(path)


def test_llama_bench_figures_and_ratios_in_the_report(tiny_gguf, tmp_path, monkeypatch):
    """--llama-bench runs the binary in every round with the same model, threads, prompt and decode lengths and
    both flash attention settings; its JSON becomes one more engine with its best-of and its ratios."""
    import sys

    _fake_engines(monkeypatch, {"tracelm": [(500, 60, [1, 2]), (600, 80, [1, 2])]})
    log = tmp_path / "calls.txt"
    exe = _script(tmp_path, LLAMA_BENCH_SCRIPT.format(python=sys.executable, log=str(log)))
    rep = bc.run_compare(str(tiny_gguf), threads=3, n_prompt=8, n_decode=4, rounds=2, engines=("tracelm",),
                         llama_bench=exe)
    assert log.read_text().splitlines() == [f"-m {tiny_gguf} -p 8 -n 4 -t 3 -fa 0,1 -r 1 -o json"] * 2
    lb = rep["engines"]["llama-bench"]
    assert lb["status"] == "ok" and lb["version"] == "8cf427ff (build 5163)" and lb["threads"] == 3
    assert lb["best"] == {"prefill_tok_s": "flash_attn on", "decode_tok_s": "flash_attn off"}
    assert lb["prefill_tok_s"]["median"] == 250 and lb["decode_tok_s"]["rounds"] == [50, 50]
    assert lb["cpu_info"] == "Fake CPU" and lb["decode_depth"] == 0
    assert rep["ratios"]["decode_vs_llama_bench"]["rounds"] == [1.2, 1.6]
    assert rep["ratios"]["prefill_vs_llama_bench"]["rounds"] == [2.0, 2.4]
    assert rep["ratios"]["prefill_vs_llama_bench"]["against"] == "flash_attn on"
    assert rep["llama_bench_command"].endswith("-fa 0,1 -r 1 -o json")
    table = bc.format_table(rep)
    assert "llama-bench (flash_attn on)" in table and "tracelm decode / llama-bench decode vs flash_attn off" in table
    assert "1.40x (1.20-1.60)" in table


def test_llama_bench_failures_are_reported_not_raised(tmp_path):
    exe = _script(tmp_path, "#!/bin/sh\necho 'error: failed to load model' >&2\nexit 3\n")
    r = bc.run_llama_bench(exe, "m.gguf", 8, 4, 1)
    assert r["flash_attn on"] == {"engine": "llama-bench", "status": "failed",
                                  "error": f"{exe} exited with code 3: error: failed to load model"}
    exe = _script(tmp_path, "#!/bin/sh\necho '| model | size |'\n")
    assert "its output is not JSON" in bc.run_llama_bench(exe, "m.gguf", 8, 4, 1)["flash_attn off"]["error"]
    with pytest.raises(ValueError, match="no decode test with flash_attn off"):
        bc.parse_llama_bench(json.dumps([{"n_prompt": 8, "n_gen": 0, "flash_attn": 0, "avg_ts": 1.0}]), 8, 4)
    with pytest.raises(ValueError, match="'avg_ts' is 'fast', not a number"):
        bc.parse_llama_bench(json.dumps([{"n_prompt": 8, "n_gen": 0, "avg_ts": "fast"}]), 8, 4)
    with pytest.raises(ValueError, match="no -p 8 or -n 4 test"):
        bc.parse_llama_bench("[]", 8, 4)
    rep = bc.build_report("m", 1, 8, 4, {"tracelm": {"default": [_ok("tracelm", 1, 1, [1])]},
                                         "llama-bench": {k: [v] for k, v in bc._llama_bench_failed("boom").items()}})
    assert rep["engines"]["llama-bench"]["status"] == "failed"
    assert rep["ratios"]["decode_vs_llama_bench"]["value"] is None


def test_llama_cpp_engine_passes_flash_attn_and_reports_its_build(tmp_path, monkeypatch):
    """The llama.cpp engine (on a stand-in llama_cpp module) passes flash_attn to Llama and reports
    llama_print_system_info() and the GGML_* settings of the install's ggml-config.cmake."""
    import sys
    import types

    package = tmp_path / "llama_cpp"
    (package / "lib" / "cmake" / "ggml").mkdir(parents=True)
    (package / "lib" / "cmake" / "ggml" / "ggml-config.cmake").write_text(
        'set(GGML_NATIVE "ON")\nset(GGML_AVX2 "ON")\nset(GGML_CUDA "OFF")\nset(GGML_BLAS_VENDOR "")\n'
        'set_and_check(GGML_INCLUDE_DIR "/x")\n')
    made = []

    class Llama:
        def __init__(self, **kwargs):
            made.append(kwargs)

        def n_vocab(self):
            return 8

    fake = types.ModuleType("llama_cpp")
    fake.__file__ = str(package / "__init__.py")
    fake.Llama = Llama
    fake.llama_print_system_info = lambda: b"CPU : SSE3 = 1 | AVX2 = 1 | REPACK = 1 | "
    monkeypatch.setitem(sys.modules, "llama_cpp", fake)
    engine = bc.LlamaCppEngine("m.gguf", threads=2, n_ctx=64, flash_attn=True)
    assert made[0]["flash_attn"] is True and made[0]["n_threads"] == made[0]["n_threads_batch"] == 2
    assert engine.describe() == {"flash_attn": True, "system_info": "CPU : SSE3 = 1 | AVX2 = 1 | REPACK = 1 |",
                                 "build_flags": {"GGML_NATIVE": "ON", "GGML_AVX2": "ON", "GGML_CUDA": "OFF"}}
    bc.LlamaCppEngine("m.gguf", threads=2, n_ctx=64)
    assert made[1]["flash_attn"] is False
    (package / "lib" / "cmake" / "ggml" / "ggml-config.cmake").unlink()
    assert engine.describe()["build_flags"] is None

    class Later(Llama):  # a version whose Llama drops an argument it no longer knows (it takes **kwargs)
        context_params = types.SimpleNamespace(flash_attn_type=-1)

    with pytest.raises(TracelmError, match="AMX buffer type cannot be turned off here: .*libggml"):
        bc.LlamaCppEngine("m.gguf", threads=2, n_ctx=64, amx_buffers=False)  # the stand-in has no libraries
    assert len(made) == 2

    fake.Llama = Later
    with pytest.raises(TracelmError, match="did not apply flash_attn=True"):
        bc.LlamaCppEngine("m.gguf", threads=2, n_ctx=64, flash_attn=True)
    Later.context_params = types.SimpleNamespace(flash_attn_type=1)
    assert bc.LlamaCppEngine("m.gguf", threads=2, n_ctx=64, flash_attn=True).describe()["flash_attn"] is True


def test_cpu_name_reads_the_first_model_name(tmp_path):
    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nvendor_id\t: GenuineIntel\nmodel name\t: Intel(R) Xeon(R) Gold 6526Y\n\n"
                    "processor\t: 1\nmodel name\t: other\n")
    assert bc.cpu_name(str(info)) == "Intel(R) Xeon(R) Gold 6526Y"
    info.write_text("processor\t: 0\nBogoMIPS\t: 50.00\n")  # (an Arm board's cpuinfo names no model)
    assert bc.cpu_name(str(info)) is None
    assert bc.cpu_name(str(tmp_path / "absent")) is None


def test_the_amx_buffer_type_is_taken_out_and_nothing_else():
    """Where llama-cpp-python is installed (the `compare` extra; not in CI): the AMX buffer type leaves the CPU
    device's extra buffer types, the repacked layouts stay, and a second call finds nothing more to take."""
    llama_cpp = pytest.importorskip("llama_cpp")
    kept = bc.drop_amx_buffer_type(llama_cpp)
    assert "AMX" not in kept and bc.drop_amx_buffer_type(llama_cpp) == kept
    assert "CPU_REPACK" in kept or "REPACK = 1" not in llama_cpp.llama_print_system_info().decode()


def test_memory_estimates_of_the_variants_and_the_shortfall(tiny_gguf):
    """llama.cpp adds its KV cache and buffers, and with its extra buffer types repacked copies of the weights (at
    most the file); transformers the weights in f32 and torch; tracelm checks its own load. A variant is refused
    when its estimate passes MemAvailable less the model file's pages (mapped by the engines), and the reason names
    every figure; where the machine says nothing, nothing is refused."""
    from tracelm.io.loader import ModelFile
    from tracelm.pipeline.bounds import kv_cache_bytes

    source = ModelFile(str(tiny_gguf))
    fp = bc.footprint(source, 40)
    assert fp.file == tiny_gguf.stat().st_size and fp.kv == kv_cache_bytes(source.cfg, 40) > 0
    assert fp.f32 == source.weights_bytes(compute="reference") > 0

    fp = bc.Footprint(file=4 << 30, kv=64 << 20, f32=30 << 30)
    assert bc.variant_bytes(fp, "tracelm", {})[0] == 0
    assert bc.variant_bytes(fp, "llama.cpp", {"flash_attn": True})[0] == (4 << 30) + (64 << 20) + bc.LLAMA_CPP_BYTES
    assert bc.variant_bytes(fp, "llama.cpp", {"extra_buffers": False})[0] == (64 << 20) + bc.LLAMA_CPP_BYTES
    assert bc.variant_bytes(fp, "transformers", {})[0] == (30 << 30) + bc.TORCH_BYTES
    need = (4 << 30) + (64 << 20) + bc.LLAMA_CPP_BYTES
    assert bc.memory_shortfall(fp, "llama.cpp", {}, None) is None
    assert bc.memory_shortfall(fp, "llama.cpp", {}, fp.file + need) is None
    assert bc.memory_shortfall(fp, "tracelm", {}, 0) is None
    why = bc.memory_shortfall(fp, "llama.cpp", {}, fp.file + need - 1)
    assert why == ("not loaded: needs about 4.3 GiB (KV 64 MiB + buffers 256 MiB + repacked weights 4.0 GiB) beside "
                   "the variants loaded before it; 4.3 GiB available (MemAvailable 8.3 GiB less the model file's "
                   "4.0 GiB, which the engines map)")
    assert "f32 weights 30.0 GiB + torch 512 MiB" in bc.memory_shortfall(fp, "transformers", {}, 8 << 30)


def test_a_variant_that_does_not_fit_is_not_loaded_and_the_others_run(tiny_gguf, tmp_path, monkeypatch):
    """Every variant stays loaded for the run, so each is checked against what is left when its turn to load
    comes: here llama.cpp's repacked variants (a private copy of the weights each) and transformers do not fit,
    llama.cpp's generic ones do; those run, the others are reported not loaded, llama.cpp's best among what ran.
    llama-bench, which loads the model again with its extra buffers, is not run either."""
    toks = [1, 2, 3]
    log = tmp_path / "calls.txt"
    exe = _script(tmp_path, f"#!/bin/sh\necho run >> {log}\nexit 1\n")
    children = _fake_engines(monkeypatch, {"tracelm": [(600, 60, toks)], "llama.cpp": [(300, 30, toks)],
                                           "transformers": [(100, 10, toks)]})
    fp = bc.Footprint(file=2 << 30, kv=16 << 20, f32=8 << 30)
    monkeypatch.setattr(bc, "footprint", lambda source, n_ctx: fp)
    monkeypatch.setattr(bc, "available_memory", lambda: (3 << 30))  # 1 GiB beside the file
    rep = bc.run_compare(str(tiny_gguf), threads=2, n_prompt=8, n_decode=2, rounds=2, llama_bench=exe)
    assert not log.exists()
    assert rep["engines"]["llama-bench"]["error"].startswith("not loaded: needs about 2.3 GiB")
    assert [label for label, _ in children.starts] == ["tracelm", "llama.cpp (flash_attn off, no extra buffers)",
                                                       "llama.cpp (flash_attn on, no extra buffers)"]
    variants = rep["engines"]["llama.cpp"]["variants"]
    for name in ("flash_attn off", "flash_attn on"):
        assert variants[name]["status"] == "failed"
        assert variants[name]["error"].startswith("not loaded: needs about 2.3 GiB (KV 16 MiB + buffers 256 MiB + "
                                                  "repacked weights 2.0 GiB)")
    assert variants["flash_attn on, no extra buffers"]["rounds"] == 2
    assert rep["engines"]["llama.cpp"]["best"]["decode_tok_s"].endswith("no extra buffers")
    assert rep["ratios"]["decode_vs_llama_cpp"]["value"] == 2.0
    assert rep["engines"]["transformers"]["status"] == "failed"
    assert "f32 weights 8.0 GiB" in rep["engines"]["transformers"]["error"]
    assert "not loaded: needs about" in bc.format_table(rep)
