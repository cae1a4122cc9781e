"""A Hugging Face folder's own chat template (tokenizer_config.json's `chat_template`, or `chat_template.jinja`,
which wins as it does in transformers) is the one Session, `tracelm chat` and the server render."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import byte_level_vocab, child_env
from tests.test_formats_safetensors import tiny_folder
from tests.test_server_helpers import ServerProcess

# not ChatML: roles in capitals between <s> and </s>
TEMPLATE = ("{% for m in messages %}<s>{{ m['role'] | upper }}: {{ m['content'] }}</s>\n{% endfor %}"
            "{% if add_generation_prompt %}<s>ASSISTANT: {% endif %}")
RENDERED = "<s>USER: hi</s>\n<s>ASSISTANT: "
ASK = [{"role": "user", "content": "hi"}]


def hf_folder(path: Path, where: str, pad: bool = True) -> Path:
    """The tiny safetensors folder with a byte-level tokenizer.json and the template `where` says: in
    tokenizer_config.json, in chat_template.jinja, or both (the config's then a decoy). Its tokenizer has 258
    tokens, padded to the model's 512 rows unless `pad` is false."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    tiny_folder(path)
    tok = Tokenizer(models.BPE(vocab={p: i for i, p in enumerate(byte_level_vocab())}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(["<s>", "</s>", *(f"<pad{i}>" for i in range(254 if pad else 0))])
    tok.save(str(path / "tokenizer.json"))
    config = {"bos_token": "<s>", "eos_token": "</s>"}
    if where == "config":
        config["chat_template"] = TEMPLATE
    if where == "both":
        config["chat_template"] = "{{ 'decoy' }}"
    if where in ("jinja", "both"):
        (path / "chat_template.jinja").write_text(TEMPLATE, encoding="utf-8")
    (path / "tokenizer_config.json").write_text(json.dumps(config), encoding="utf-8")
    return path


@pytest.mark.parametrize("where", ["config", "jinja", "both"])
def test_session_renders_the_folders_template(tmp_path, where):
    from tracelm import Session
    from tracelm.session import chat_prompt

    folder = hf_folder(tmp_path / "m", where)
    with Session(str(folder), settings=["context=64", "max_tokens=2", "threads=1"]) as s:
        assert s.model.chat_template == TEMPLATE
        assert s.tokenizer.decode(chat_prompt(s.model, ASK)) == RENDERED
        s.chat("hi", temperature=0.0)
        assert s.tokenizer.decode(s.runner.cache.tokens[:len(chat_prompt(s.model, ASK))]) == RENDERED


def header(trace: Path) -> dict:
    return json.loads(trace.read_text(encoding="utf-8").splitlines()[0])


def test_chat_command_renders_the_folders_template(tmp_path):
    folder = hf_folder(tmp_path / "m", "config")
    trace = tmp_path / "chat.jsonl"
    proc = subprocess.run([sys.executable, "-m", "tracelm.cli", "chat", "--model", str(folder), "--message", "hi",
                           "--max-tokens", "2", "--context", "64", "--trace", str(trace)],
                          capture_output=True, text=True, timeout=120, env=child_env(), stdin=subprocess.DEVNULL)
    assert proc.returncode == 0, proc.stderr
    assert header(trace)["prompt_text"] == RENDERED


def test_server_renders_the_folders_template(tmp_path):
    folder = hf_folder(tmp_path / "m", "jinja")
    config = {"model": str(folder), "context": 64, "max_tokens": 2, "threads": 1,
              "server": {"trace_dir": str(tmp_path / "traces")}}
    server = ServerProcess(tmp_path / "work", config)
    try:
        r = server.request("POST", "/v1/chat/completions", {"model": "m", "messages": ASK})
        assert r.status == 200, r.text
        assert header(tmp_path / "traces" / f"{r.json()['id']}.jsonl")["prompt_text"] == RENDERED
    finally:
        server.stop()


def test_rows_past_the_vocabulary_are_never_sampled(tmp_path):
    """A model with more embedding rows than its tokenizer has tokens (Qwen2.5's folders: 151936 rows, 151665
    tokens) samples only tokens: the padding rows are no candidates."""
    from tracelm import Session

    folder = hf_folder(tmp_path / "m", "config", pad=False)
    with Session(str(folder), settings=["context=64", "threads=1"]) as s:
        assert s.tokenizer.n_vocab == 258 and s.model.cfg.n_vocab == 512
        s.generate("hi", max_tokens=40, temperature=1.5, seed=1)
        assert len(s.stats.tokens) == 40 and max(s.stats.tokens) < 258
