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
    assert "tracelm: ignored: -ngl 99 (tracelm computes on the CPU)" in err
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


def test_llama_cli_options_map_are_ignored_or_refused(monkeypatch, capsys):
    """llama-cli's options (tools/llama_flags.py): the ones with a tracelm meaning take it (-r as a stop string,
    --predict, -e's escapes), the ones with nothing to change are named on stderr with the reason, a sampler tracelm
    lacks is accepted only off, an interactive mode on run points to chat -- and none is misread as a short option
    cluster (-fa as -f a, -tb as -t b, -sys as -s ys, -cnv as -c nv, -no-cnv as -n o-cnv)."""
    import tracelm.cli as cli

    seen = {}

    def fake(args):
        seen.update(cfg=cli._load_config(args), args=args)
        return 0

    monkeypatch.setattr(cli, "cmd_run", fake)
    monkeypatch.setattr(cli, "cmd_chat", fake)
    monkeypatch.setattr(cli, "cmd_serve", fake)
    assert main(["run", "-m", "smollm2-135m-instruct", "-p", r"Q:\tone\nA:\x41 \d", "-e", "-r", r"\nQ:", "-r", "User:",
                 "--predict", "7", "-fa", "-tb", "4", "-b", "512", "-ub", "128", "--mlock", "--no-mmap", "-no-cnv",
                 "--no-display-prompt", "--color", "on", "--typical", "1", "--mirostat", "0", "--numa", "isolate",
                 "--jinja", "--no-warmup", "--ignore-eos"]) == 0
    cfg, err = seen["cfg"], capsys.readouterr().err
    assert cfg.prompt == "Q:\tone\nA:A \\d" and cfg.stop == ("\nQ:", "User:") and cfg.max_tokens == 7
    assert seen["args"].ignore_eos is True
    note = next(line for line in err.splitlines() if line.startswith("tracelm: ignored: "))
    for said in ("-fa (", "-tb 4 (-t sets", "-b 512 (", "-ub 128 (", "--mlock (", "--no-mmap (", "-no-cnv (",
                 "--color on (", "--numa isolate (", "--jinja (", "--no-warmup ("):
        assert said in note, said
    # without -e the prompt is the text as given (tracelm's default; llama.cpp's is -e)
    assert main(["run", "-m", "smollm2-135m-instruct", "-p", r"a\nb", "--no-escape"]) == 0
    assert seen["cfg"].prompt == r"a\nb" and "ignored" not in capsys.readouterr().err
    for argv, message in ((["--typical", "0.9"], "--typical 0.9: tracelm has no such sampler; only 1 (off)"),
                          (["--mirostat", "2"], "--mirostat 2: tracelm has no such sampler; only 0 (off)"),
                          (["-sys", "Be brief."], "-sys: tracelm run is one completion without a chat template"),
                          (["-cnv"], "a conversation (with a system prompt, -sys) is `tracelm chat`"),
                          (["-i"], "-i: tracelm run is one completion"), (["-e", "--no-escape"], "not allowed with")):
        with pytest.raises(SystemExit) as e:
            main(["run", "-m", "smollm2-135m-instruct", "-p", "x", *argv])
        assert e.value.code == 2 and message in capsys.readouterr().err, argv
    # chat takes -sys, -r and the ignored ones; serve llama-server's ignored ones; batch keeps its own --batch-size
    assert main(["chat", "-m", "smollm2-135m-instruct", "-sys", "Terse.", "-r", "User:", "-fa", "on", "-ngl",
                 "99"]) == 0
    assert seen["cfg"].system == "Terse." and seen["cfg"].stop == ("User:",)
    assert "-fa on (" in capsys.readouterr().err
    assert main(["serve", "-m", "smollm2-135m-instruct", "-ngl", "99", "-fa", "on", "--mlock", "-b", "2048"]) == 0
    assert "tracelm: ignored: -ngl 99 (" in capsys.readouterr().err
    args = cli.build_parser().parse_args(["batch", "--input", "i", "--output", "o", "--batch-size", "4", "-ngl", "9"])
    assert args.batch_size == 4 and args.llama_ignored and "-ngl 9" in args.llama_ignored[0]
    with pytest.raises(SystemExit):
        cli.build_parser().parse_args(["batch", "--input", "i", "--output", "o", "-b", "4"])


def test_process_escapes_is_llama_cpps():
    from tracelm.tools.llama_flags import process_escapes

    assert process_escapes(r"a\nb\tc\rd\'e\"f\\g\x41\x4a") == "a\nb\tc\rd'e\"f\\gAJ"
    assert process_escapes(r"\d \u00e9 \x4 \\n") == r"\d \u00e9 \x4 \n"  # unknown and short ones stay


def test_ignore_eos_runs_past_the_end_token(tiny_gguf, capsys):
    """The tiny model at seed 2 ends (an end-of-generation token) after 16 tokens; --ignore-eos goes on to -n."""
    argv = ["run", "-m", str(tiny_gguf), "-p", "hello", "-n", "30", "--temp", "1.5", "-s", "2"]
    assert main(argv) == 0
    assert "16 generated (stop)" in capsys.readouterr().err
    assert main([*argv, "--ignore-eos"]) == 0
    assert "30 generated (length)" in capsys.readouterr().err


def test_llama_server_and_cache_options_set_their_keys(monkeypatch, capsys):
    """llama-server's -np / -a / -to / --pooling on serve, and -ctk / -ctv / --rope-scale / --rope-freq-scale on
    every model command, set the config keys they name; llama-server's options with nothing to change are named."""
    import tracelm.cli as cli

    seen = {}

    def fake(args):
        seen.update(cfg=cli._load_config(args))
        return 0

    monkeypatch.setattr(cli, "cmd_serve", fake)
    monkeypatch.setattr(cli, "cmd_run", fake)
    assert main(["serve", "-m", "smollm2-135m-instruct", "-np", "4", "-a", "my-model", "-to", "60", "--pooling",
                 "last", "-ctk", "q8_0", "-ctv", "q8_0", "--rope-freq-scale", "0.5", "--metrics", "--embeddings",
                 "-cb", "--threads-http", "8", "--slots", "-kvu"]) == 0
    cfg, err = seen["cfg"], capsys.readouterr().err
    assert (cfg.server.max_batch, cfg.server.alias, cfg.server.request_timeout, cfg.server.pooling) == (
        4, "my-model", 60.0, "last")
    assert cfg.kv_cache == "q8_0" and cfg.rope_scale == 2.0
    for said in ("--metrics (", "--embeddings (", "-cb (", "--threads-http 8 (", "--slots (", "-kvu ("):
        assert said in err, said
    assert main(["run", "-m", "smollm2-135m-instruct", "-p", "x", "-ctk", "f32", "--rope-scale", "2"]) == 0
    assert seen["cfg"].kv_cache == "f32" and seen["cfg"].rope_scale == 2.0
    for argv, message in ((["-ctk", "q8_0", "-ctv", "f16"], "-ctk q8_0 -ctv f16: tracelm's KV cache holds keys and "
                           "values in one type"),
                          (["-ctk", "q4_0"], "kv_cache"),
                          (["--rope-scale", "2", "--rope-freq-scale", "0.25"], "disagree"),
                          (["--rope-freq-scale", "0"], "--rope-freq-scale 0: must be > 0"),
                          (["-np", "16"], "server.max_batch")):
        assert main(["serve", "-m", "smollm2-135m-instruct", *argv]) == 2, argv
        assert message in capsys.readouterr().err, argv
    with pytest.raises(SystemExit):
        main(["serve", "-m", "smollm2-135m-instruct", "--rope-scaling", "yarn"])
