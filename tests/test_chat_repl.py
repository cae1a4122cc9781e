"""`tracelm chat` as a terminal chat (tracelm/tools/chat.py): its commands, scripted in-process on the tiny
synthetic model, and a real terminal under tmux: two turns, Ctrl-C in the middle of the second reply, a third turn
that still sees the first two, /save, then /load in a new process."""

from __future__ import annotations

import io
import json
import shlex
import shutil
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from tests.conftest import TINY, child_env, write_tiny_gguf
from tests.test_server_helpers import REPO
from tracelm.io.session_file import read_session
from tracelm.session import Session
from tracelm.tools.chat import ChatRepl, visible

LONG_CONTEXT = 16384
EOS = 259  # the tiny model's <|endoftext|>, biased away where a reply must go on until stopped


def long_context_gguf(path: Path) -> Path:
    """The tiny synthetic model trained (so it says) for LONG_CONTEXT positions: room for a reply to be stopped."""
    saved = TINY["n_ctx"]
    TINY["n_ctx"] = LONG_CONTEXT
    try:
        return write_tiny_gguf(path)
    finally:
        TINY["n_ctx"] = saved


def scripted(session: Session, lines: list[str], name: str | None = None) -> tuple[ChatRepl, io.StringIO]:
    """A ChatRepl fed `lines` (then Ctrl-D), its screen in a StringIO."""
    feed = iter(lines)

    def read(prompt: str) -> str:
        out.write(prompt)
        line = next(feed, None)
        if line is None:
            raise EOFError
        out.write(line + "\n")
        return line

    out = io.StringIO()
    repl = ChatRepl(session, name, out=out, read=read)
    return repl, out


@pytest.fixture
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("TRACELM_HOME", str(tmp_path / "home"))
    return tmp_path / "home"


def tiny_session(model: Path, *settings: str) -> Session:
    return Session(str(model), settings=["threads=1", "sampling.temperature=0.8", *settings])


@pytest.fixture(scope="module")
def long_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return long_context_gguf(tmp_path_factory.mktemp("long") / "tiny-long.gguf")


def test_commands(long_gguf: Path, home: Path) -> None:
    session = tiny_session(long_gguf, "context=1024", "max_tokens=6")
    repl, out = scripted(session, ["/help", "hello", "/system Be brief.", "/system", "/set temperature=0",
                                   "/set model=other", "/set top_k", "/stats", "/nope", "//slash", "/save s1",
                                   "/reset", "/load s1", "/load missing", "/trace", "/exit", "never read"])
    assert repl.run() == 0
    text = out.getvalue()
    assert "tracelm chat: tiny-long.gguf, context 1024 tokens" in text and "Ctrl-D or /exit quits" in text
    assert "/save NAME" in text and "Ctrl-C stops a reply" in text  # /help
    assert "[6 tokens, 0 of" in text
    assert "system prompt: 'Be brief.'" in text and "[sampling.temperature = 0.0]" in text
    assert "/set: model cannot change during a chat" in text and "/set: expected KEY=VALUE" in text
    assert "conversation: 3 messages; context:" in text and "last reply: 6 tokens (length)" in text
    assert "unknown command /nope" in text
    assert session.messages[-2] == {"role": "user", "content": "/slash"}  # // sends a line starting with /
    assert "[saved 5 messages as s1" in text and (home / "sessions" / "s1.tlsession").is_file()
    assert "[a new conversation]" in text and "[resumed session s1: 5 messages]" in text
    assert "/load: no saved session missing" in text and "replies are traced to nowhere" in text
    assert "never read" not in text  # /exit ended the chat


def test_a_full_context_is_said_and_shift_goes_on(tiny_gguf: Path, home: Path) -> None:
    session = tiny_session(tiny_gguf, "context=128", "max_tokens=100", f"sampling.logit_bias=[[{EOS}, -100]]")
    repl, out = scripted(session, ["hello there", "go on", "/shift", "and on"])
    repl.run()
    text = out.getvalue()
    assert "[the reply was cut: the context of 128 tokens is full." in text  # the first reply hit the end
    assert "the context is full (the conversation" in text and "/shift keeps the system prompt" in text
    assert "context shifted:" in text  # after /shift the turn was answered
    assert [m["content"] for m in session.messages[::2]] == ["hello there", "and on"]  # "go on" was refused
    assert [m["role"] for m in session.messages] == ["user", "assistant"] * 2


def test_model_output_cannot_drive_the_terminal() -> None:
    assert visible("a\x1b[2Jb\x0ec\x07\n\td\x7f\x9b") == "a\u241b[2Jb\u240ec\u2407\n\td\u2421\\x9b"


def test_piped_chat_keeps_one_turn_per_line(tiny_gguf: Path, home: Path) -> None:
    out = subprocess.run([sys.executable, "-m", "tracelm.cli", "chat", "--model", str(tiny_gguf), "--max-tokens", "3",
                          "--set", "threads=1"], input="hi\n\n/help\n", capture_output=True, text=True, timeout=120,
                         cwd=REPO)
    assert out.returncode == 0, out.stderr
    assert out.stderr.count("[reused") == 2 and "commands:" not in out.stdout  # a pipe: /help is a message


class Tmux:
    """A tmux session running one command in a terminal 160 x 48; keys in, the screen (with history) out."""

    def __init__(self, command: str):
        self.name = f"tracelm-test-{uuid.uuid4().hex[:8]}"
        subprocess.run(["tmux", "new-session", "-d", "-s", self.name, "-x", "160", "-y", "48", command], check=True)

    def keys(self, *keys: str) -> None:
        subprocess.run(["tmux", "send-keys", "-t", self.name, *keys], check=True)

    def line(self, text: str) -> None:
        self.keys("-l", text)
        self.keys("Enter")

    def screen(self) -> str:
        out = subprocess.run(["tmux", "capture-pane", "-p", "-J", "-S", "-5000", "-t", self.name],
                             capture_output=True, text=True)
        return out.stdout

    def wait_for(self, text: str, count: int = 1, timeout: float = 60.0) -> str:
        deadline = time.monotonic() + timeout
        while True:
            screen = self.screen()
            if screen.count(text) >= count:
                return screen
            if time.monotonic() > deadline:
                raise AssertionError(f"{text!r} (x{count}) not on the screen after {timeout} s:\n{screen[-3000:]}")
            time.sleep(0.1)

    def close(self) -> None:
        subprocess.run(["tmux", "kill-session", "-t", self.name], capture_output=True)


def chat_command(model: Path, home: Path, log: Path) -> str:
    env = f"TRACELM_HOME={home} PYTHONPATH={shlex.quote(child_env()['PYTHONPATH'])}"
    args = (f"{sys.executable} -m tracelm.cli chat --model {model} --context {LONG_CONTEXT} --max-tokens 8 "
            f"--temperature 0.8 --set threads=1 --set 'sampling.logit_bias=[[{EOS}, -100]]'")
    return f"cd {REPO} && env {env} {args} 2>{log}; echo chat exited $?; sleep 60"


@pytest.mark.skipif(shutil.which("tmux") is None, reason="tmux is not installed")
def test_terminal_chat_under_tmux(tmp_path: Path) -> None:
    model = long_context_gguf(tmp_path / "tiny-long.gguf")
    home = tmp_path / "home"
    term = Tmux(chat_command(model, home, tmp_path / "1.err"))
    try:
        term.wait_for("Ctrl-D or /exit quits")
        term.line("hello")
        term.wait_for("[8 tokens, 0 of")
        term.line("/set max_tokens=12000")
        term.wait_for("[max_tokens = 12000]")
        term.line("tell me more")
        time.sleep(0.5)  # well into a reply of up to 12000 tokens
        term.keys("C-c")
        term.wait_for("[stopped: 4 messages kept]", timeout=30)
        term.line("/set max_tokens=8")
        term.line("third")
        screen = term.wait_for("[8 tokens,", count=2)
        reused = int(screen.rsplit("[8 tokens, ", 1)[1].split(" of ")[0])
        assert reused > 0  # the third turn's prompt began with the two before, still in the Cache
        term.line("/stats")
        term.wait_for("conversation: 6 messages")
        term.line("/save talk")
        term.wait_for("[saved 6 messages as talk")
        term.line("/exit")
        term.wait_for("chat exited 0")
    finally:
        term.close()
    messages = read_session(home / "sessions" / "talk.tlsession").messages
    assert [m["content"] for m in messages[::2]] == ["hello", "tell me more", "third"]
    assert len(messages[3]["content"]) > 20  # the stopped reply, as far as it got
    assert "Traceback" not in (tmp_path / "1.err").read_text()

    term = Tmux(chat_command(model, home, tmp_path / "2.err"))
    try:
        term.wait_for("Ctrl-D or /exit quits")
        term.line("/load talk")
        term.wait_for("[resumed session talk: 6 messages]")
        term.line("fourth")
        screen = term.wait_for("[8 tokens,")
        assert int(screen.rsplit("[8 tokens, ", 1)[1].split(" of ")[0]) > 0  # the loaded Cache serves the prefix
        term.line("/stats")
        term.wait_for("conversation: 8 messages")
        term.keys("C-d")
        term.wait_for("chat exited 0")
    finally:
        term.close()


def test_tmux_helper_fails_on_what_is_not_shown(tmp_path: Path) -> None:
    """The must-fail case of the tmux test's waits."""
    if shutil.which("tmux") is None:
        pytest.skip("tmux is not installed")
    term = Tmux("echo hello; sleep 30")
    try:
        term.wait_for("hello")
        with pytest.raises(AssertionError, match="'goodbye' .* not on the screen"):
            term.wait_for("goodbye", timeout=1)
    finally:
        term.close()


def test_stats_after_ctrl_c_show_the_stopped_replys_rate(long_gguf: Path, home: Path, tmp_path: Path) -> None:
    """Ctrl-C stops a reply (chat closes its stream): /stats then says the tokens/s of what was generated, and a
    traced reply ends with an interrupted footer."""
    import signal

    class CtrlCAfter(io.StringIO):
        armed, pieces = False, 0

        def write(self, text: str) -> int:
            if self.armed:
                self.pieces += 1
                if self.pieces == 5:
                    signal.raise_signal(signal.SIGINT)  # as a terminal's Ctrl-C: StopFlag's handler
            return super().write(text)

    session = tiny_session(long_gguf, "context=1024", "max_tokens=200", f"sampling.logit_bias=[[{EOS}, -100]]")
    out = CtrlCAfter()
    lines = iter([f"/trace {tmp_path / 't.jsonl'}", "hello", "/stats"])

    def read(prompt: str) -> str:
        line = next(lines, None)
        if line is None:
            raise EOFError
        out.armed = line == "hello"
        return line

    ChatRepl(session, None, out=out, read=read).run()
    text = out.getvalue()
    assert "[stopped: 2 messages kept]" in text
    rate = float(text.split("last reply: ")[1].split("decode ")[1].split(" tok/s")[0])
    n = session.stats.n_generated
    assert 0 < n < 200 and rate > 0 and f"last reply: {n} tokens (stopped)" in text
    footer = json.loads((tmp_path / "t.jsonl").read_text().splitlines()[-1])
    assert footer["event"] == "footer" and footer["status"] == "interrupted" and footer["n_generated"] == n
