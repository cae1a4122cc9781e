"""Issue 30 item 4: the habits users bring from llama.cpp, Ollama and mlx-lm -- a prompt on stdin, a model named
where the config goes, llama.cpp's short flags, --version, help text on every option, a missing config that names
the packaged ones, and the packaged stories260k config outside the source tree."""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import FIXTURES, child_env
from tracelm.cli import build_parser, main
from tracelm.state.records import Constraint
from tracelm.version import __version__


def tracelm(*args: str, cwd: Path | None = None, env: dict[str, str] | None = None,
            stdin: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tracelm.cli", *args], capture_output=True, text=True, timeout=120,
                          cwd=cwd, env=child_env(**(env or {})), input=stdin,
                          stdin=subprocess.DEVNULL if stdin is None else None)


def header(trace: Path) -> dict:
    return json.loads(trace.read_text(encoding="utf-8").splitlines()[0])


def test_stdin_is_the_prompt(tiny_gguf, tmp_path):
    trace = tmp_path / "t.jsonl"
    proc = tracelm("run", "--model", str(tiny_gguf), "-n", "2", "--trace", str(trace), stdin="Tell me a joke\n")
    assert proc.returncode == 0, proc.stderr
    assert header(trace)["prompt_text"] == "Tell me a joke"
    proc = tracelm("run", "--model", str(tiny_gguf), "-n", "2", "-p", "-", "--trace", str(trace), stdin="hello")
    assert proc.returncode == 0, proc.stderr
    assert header(trace)["prompt_text"] == "hello"
    proc = tracelm("run", "--model", str(tiny_gguf), "-n", "2", "--trace", str(trace), stdin="")  # empty: the config's
    assert proc.returncode == 0 and header(trace)["prompt_text"] == "The capital of France is"  # (the default)


def test_a_model_where_the_config_goes(tiny_gguf, tmp_path):
    trace = tmp_path / "t.jsonl"
    proc = tracelm("run", str(tiny_gguf), "-n", "2", "-p", "hi", "--trace", str(trace))
    assert proc.returncode == 0, proc.stderr
    assert header(trace)["model_file"] == str(tiny_gguf)
    proc = tracelm("run", "no-such-model-or-config", "-p", "hi")
    err = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(err) == 1
    assert "'no-such-model-or-config' was read as a model" in err[0] and "smollm2" in err[0]  # the packaged configs
    proc = tracelm("run", str(tiny_gguf), "--model", str(tiny_gguf))
    assert proc.returncode == 2 and "give it once" in proc.stderr


def test_n_minus_one_fills_the_context(tiny_gguf, tmp_path):
    """llama.cpp's `-n -1` / `-n -2`: as many tokens as the context leaves after the prompt (tracelm does not shift
    the context, so both stop there); the trace records that max_tokens. Elsewhere -1 stays an error."""
    trace = tmp_path / "t.jsonl"
    for n in ("-1", "-2"):
        proc = tracelm("run", "--model", str(tiny_gguf), "-p", "hi", "-n", n, "-c", "24", "--temperature", "1",
                       "--trace", str(trace))
        assert proc.returncode == 0, proc.stderr
        assert header(trace)["config"]["max_tokens"] == 22 and "22 generated (length)" in proc.stderr
    proc = tracelm("run", "--model", str(tiny_gguf), "-p", "hi", "-n", "-3")
    assert proc.returncode == 2 and "'max_tokens' must be >= 0: -3" in proc.stderr
    proc = tracelm("chat", "--model", str(tiny_gguf), "-n", "-1", "--message", "hi")
    assert proc.returncode == 2 and "'max_tokens' must be >= 0: -1" in proc.stderr


def test_a_missing_config_names_the_packaged_ones(tmp_path):
    proc = tracelm("run", "configs/smollm2.yaml", cwd=tmp_path)  # as the README says it, outside the source tree
    assert proc.returncode == 2 and "`tracelm run smollm2`" in proc.stderr and "--model NAME" in proc.stderr
    proc = tracelm("run", str(tmp_path / "mine.yaml"))
    assert proc.returncode == 2 and "nor a packaged config (packaged: gemma3, " in proc.stderr
    assert "qwen2.5-coder" in proc.stderr and "stories260k" in proc.stderr


def test_llama_cpp_short_flags_set_the_config(monkeypatch):
    import tracelm.cli as cli

    seen = {}
    monkeypatch.setattr(cli, "cmd_run", lambda args: seen.update(cfg=cli._load_config(args)) or 0)
    main(["run", "-m", "smollm2-135m-instruct", "-t", "3", "-c", "512", "-n", "7", "--top-k", "5", "--top-p", "0.5",
          "--min-p", "0.1", "--temp", "0.3", "-s", "9", "--repeat-penalty", "1.1", "-p", "hi"])
    cfg = seen["cfg"]
    assert (cfg.model, cfg.threads, cfg.context, cfg.max_tokens, cfg.prompt) == ("smollm2-135m-instruct", 3, 512, 7,
                                                                                   "hi")
    s = cfg.sampling
    assert (s.top_k, s.top_p, s.min_p, s.temperature, s.seed, s.repeat_penalty) == (5, 0.5, 0.1, 0.3, 9, 1.1)
    monkeypatch.setattr(cli, "cmd_chat", lambda args: seen.update(chat=cli._load_config(args)) or 0)
    main(["chat", "-m", "smollm2-135m-instruct", "--system", "Be brief.", "--ctx-size", "256", "--n-predict", "4"])
    assert (seen["chat"].system, seen["chat"].context, seen["chat"].max_tokens) == ("Be brief.", 256, 4)
    main(["chat", "-sys", "Terse."])
    assert seen["chat"].system == "Terse."


def test_more_llama_cpp_flags(monkeypatch, tmp_path, capsys):
    """-f FILE (the prompt; one final newline dropped), --repeat-last-n, --presence-penalty, --frequency-penalty,
    -j SCHEMA (inline), -s -1 (a seed drawn and printed), -ngl (accepted, said to be ignored)."""
    import tracelm.cli as cli

    seen = {}

    def fake_run(args):
        cli._stdin_prompt(args)
        seen.update(cfg=cli._load_config(args))
        return 0

    monkeypatch.setattr(cli, "cmd_run", fake_run)
    prompt = tmp_path / "prompt.txt"
    prompt.write_text("Once upon\na time\n\n")
    main(["run", "-m", "smollm2-135m-instruct", "-f", str(prompt), "--repeat-last-n", "32", "--presence-penalty",
          "0.5", "--frequency-penalty", "-0.25", "-j", '{"type": "object"}', "-s", "-1", "-ngl", "99"])
    cfg, err = seen["cfg"], capsys.readouterr().err
    s = cfg.sampling
    assert cfg.prompt == "Once upon\na time\n"
    assert (s.repeat_last_n, s.presence_penalty, s.frequency_penalty) == (32, 0.5, -0.25)
    assert s.constraint == Constraint("json_schema", '{"type": "object"}')
    assert f"tracelm: -s -1: seed {s.seed}" in err and 0 <= s.seed < 2**32
    assert "-ngl 99 ignored: tracelm computes on the CPU" in err
    main(["run", "-m", "smollm2-135m-instruct", "-s", "-1", "-p", "x"])
    assert seen["cfg"].sampling.seed != s.seed  # drawn anew (1 in 2^32 to collide)
    with pytest.raises(SystemExit) as e:
        main(["run", "-f", str(prompt), "-p", "x"])
    assert e.value.code == 2 and "not allowed with argument -f/--file" in capsys.readouterr().err
    assert main(["run", "-m", "smollm2-135m-instruct", "-f", str(tmp_path / "absent.txt")]) == 2
    assert "absent.txt: cannot read -f prompt file" in capsys.readouterr().err


def test_version(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0 and capsys.readouterr().out.strip() == f"tracelm {__version__}"


@pytest.mark.parametrize("command", ["run", "chat", "serve", "batch"])
def test_every_option_has_help(command):
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    missing = [a.dest for a in sub.choices[command]._actions if not a.help or a.help == argparse.SUPPRESS]
    assert missing == []


L2C = FIXTURES / "llama2c"


@pytest.mark.skipif(not (L2C / "stories260K.bin").is_file(), reason=f"fixture {L2C} not present")
def test_packaged_stories260k_outside_the_source_tree(tmp_path):
    """From any working directory, the packaged config by name, its files in the model cache."""
    home = tmp_path / "home"
    proc = tracelm("run", "stories260k", "-n", "4", cwd=tmp_path, env={"TRACELM_HOME": str(home)})
    assert proc.returncode == 2 and "stories260K.bin" in proc.stderr and "Traceback" not in proc.stderr
    (home / "models").mkdir(parents=True)
    for name in ("stories260K.bin", "tok512.bin"):
        shutil.copy(L2C / name, home / "models" / name)
    proc = tracelm("run", "stories260k", "-n", "4", cwd=tmp_path, env={"TRACELM_HOME": str(home)})
    assert proc.returncode == 0, proc.stderr
    assert "4 generated" in proc.stderr
