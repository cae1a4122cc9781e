"""`tracelm chat`: a conversation with the model's chat template.

At a terminal (`ChatRepl`): a banner, line editing and history (readline; history in TRACELM_HOME/chat_history),
Ctrl-C stops the reply being written and keeps the conversation, Ctrl-D or /exit quits, and /commands (HELP).
Model output is shown with control characters made visible, so a reply cannot drive the terminal. When the
conversation no longer fits the context it says so and offers /reset or /shift instead of ending.

Otherwise (`chat_lines`: --message, or stdin a pipe or a file): one user turn per line, the reply on stdout and a
one-line summary of each turn on stderr.
"""

from __future__ import annotations

import contextlib
import signal
import sys
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any, TextIO

import attrs
import yaml

from tracelm.io.registry import home
from tracelm.io.run_config import config_as_dict, run_config_from_dict
from tracelm.pipeline.trace import decode_rate
from tracelm.session import Session, session_path
from tracelm.state.errors import TracelmError
from tracelm.state.run_config import TraceOptions

HELP = """commands:
  /help              this list
  /reset             start a new conversation (the system prompt stays)
  /system TEXT       set the system prompt, keeping the conversation (/system alone shows it)
  /save NAME         save the conversation and its KV cache (TRACELM_HOME/sessions/NAME.tlsession)
  /load NAME         resume a saved conversation
  /stats             the last reply's numbers and how full the context is
  /trace FILE        trace each next reply to FILE (/trace off stops; /trace alone says where)
  /shift             when the context is full: keep the system prompt and the latest tokens (context_policy shift)
  /set KEY=VALUE     change max_tokens, stop, context_policy, shift_keep or a sampling.* key (temperature, ...)
  /exit              quit (Ctrl-D too)
Ctrl-C stops a reply and keeps the conversation; a line starting with // sends it with one / dropped."""
SETTABLE = ("max_tokens", "stop", "context_policy", "shift_keep", "sampling.")
SAMPLING_SHORT = ("temperature", "top_k", "top_p", "min_p", "seed", "repeat_penalty", "repeat_last_n")
_CONTROLS = {c: chr(0x2400 + c) for c in range(32) if chr(c) not in "\n\t"} | {127: "\u2421"}
_CONTROLS |= {c: f"\\x{c:02x}" for c in range(0x80, 0xA0)}


def visible(text: str) -> str:
    """Text with the control characters a terminal would act on (escape sequences, shift-out, bell, ...) replaced
    by visible stand-ins; newlines and tabs stay."""
    return text.translate(_CONTROLS)


def chat_lines(session: Session, lines: Iterable[str], name: str | None) -> int:
    """One user turn per line (blank lines skipped): the reply on stdout, a summary on stderr; saved after each
    reply as `name` when given (resumed first if it exists)."""
    saved = _resume(session, name)
    for line in lines:
        line = line.rstrip("\n")
        if not line.strip():
            continue
        for piece in session.chat_stream(line):
            sys.stdout.write(piece)
            sys.stdout.flush()
        sys.stdout.write("\n")
        sys.stdout.flush()
        if saved is not None:
            session.save(saved)
        print(_turn_summary(session), file=sys.stderr)
    return 0


def _resume(session: Session, name: str | None) -> Path | None:
    saved = session_path(name) if name else None
    if saved is not None and saved.exists():
        session.load(saved)
        print(f"[resumed session {name}: {len(session.messages)} messages]", file=sys.stderr)
    return saved


def _turn_summary(session: Session) -> str:
    s = session.stats
    shift = f", context shifted: {session.shifted} tokens left out" if session.shifted else ""
    return f"[reused {s.n_reused} of {s.n_prompt} prompt tokens, {s.n_generated} generated{shift}]"


class StopFlag:
    """While a reply is written: the first Ctrl-C sets the flag (the reply stops at the next token), a second
    one interrupts at once."""

    def __init__(self) -> None:
        self.set = False

    def _handler(self, _signum: int, _frame: Any) -> None:
        if self.set:
            raise KeyboardInterrupt
        self.set = True

    @contextlib.contextmanager
    def armed(self) -> Iterator[StopFlag]:
        self.set = False
        previous = signal.signal(signal.SIGINT, self._handler)
        try:
            yield self
        finally:
            signal.signal(signal.SIGINT, previous)


@attrs.define
class ChatRepl:
    """The terminal chat: reads lines with `read` (readline's input), writes to `out`."""

    session: Session
    name: str | None = None  # --session NAME: resumed at the start, saved after each reply
    out: TextIO = sys.stdout
    read: Callable[[str], str] = input
    saved: Path | None = None
    stopped: bool = False  # the last reply was stopped by Ctrl-C
    history: Path | None = None

    def run(self) -> int:
        self.history = _start_readline()
        try:
            self.saved = _resume(self.session, self.name)
            self.banner()
            while self.turn():
                pass
        finally:
            _save_history(self.history)
        return 0

    def say(self, text: str) -> None:
        self.out.write(text + "\n")
        self.out.flush()

    def banner(self) -> None:
        cfg = self.session.cfg
        model = self.session.model  # load now, so the first reply does not wait for it
        self.say(f"tracelm chat: {Path(str(model.path)).name}, context {cfg.context} tokens, replies of up to "
                 f"{cfg.max_tokens} tokens, context_policy {cfg.context_policy}")
        self.say("/help lists the commands; Ctrl-C stops a reply; Ctrl-D or /exit quits.")

    def turn(self) -> bool:
        """Read one line and act on it; False when the chat ends."""
        try:
            line = self.read("> ")
        except EOFError:
            self.say("")
            return False
        except KeyboardInterrupt:
            self.say("\n(Ctrl-D or /exit quits)")
            return True
        line = line.strip()
        if not line:
            return True
        if line.startswith("/") and not line.startswith("//"):
            return self.command(line)
        self.reply(line[1:] if line.startswith("//") else line)
        return True

    def command(self, line: str) -> bool:
        name, _, arg = line.partition(" ")
        arg = arg.strip()
        if name in ("/exit", "/quit"):
            return False
        actions: dict[str, Callable[[str], None]] = {
            "/help": lambda _a: self.say(HELP), "/reset": self.reset, "/system": self.system, "/save": self.save,
            "/load": self.load, "/stats": self.stats, "/trace": self.trace, "/shift": self.shift, "/set": self.set,
        }
        action = actions.get(name)
        if action is None:
            self.say(f"unknown command {name}: /help lists them (start a line with // to send a '/')")
            return True
        try:
            action(arg)
        except TracelmError as e:
            self.say(f"{name}: {e}")
        return True

    def reply(self, message: str) -> None:
        """The model's reply, streamed; Ctrl-C stops it and keeps what was written."""
        self.stopped = False
        parts: list[str] = []
        before = len(self.session.messages)
        try:
            with StopFlag().armed() as flag:
                pieces = self.session.chat_stream(message)
                for piece in pieces:
                    parts.append(piece)
                    self.out.write(visible(piece))
                    self.out.flush()
                    if flag.set:
                        pieces.close()  # at a token boundary: the Cache holds every position fed
                        break
                self.stopped = flag.set
        except TracelmError as e:
            if len(self.session.messages) == before + 1:  # the turn failed: it is not part of the conversation
                self.session.messages.pop()
            return self.say(self._context_full(e) or f"error: {e}")
        except KeyboardInterrupt:
            self.stopped = True
        if self.stopped:
            self._keep_partial(before, "".join(parts))
        self.say("")
        self.say(self._after_reply())
        if self.saved is not None:
            self.session.save(self.saved)

    def _keep_partial(self, before: int, text: str) -> None:
        """A stopped reply stays in the conversation as far as it got."""
        messages = self.session.messages
        if len(messages) == before + 1 and messages[-1]["role"] == "user":
            messages.append({"role": "assistant", "content": text.strip()})

    def _after_reply(self) -> str:
        s, cfg = self.session.stats, self.session.cfg
        if self.stopped:
            return f"[stopped: {len(self.session.messages)} messages kept]"
        note = f"[{s.n_generated} tokens, {s.n_reused} of {s.n_prompt} prompt tokens reused"
        if self.session.shifted:
            note += f", context shifted: {self.session.shifted} tokens left out"
        note += "]"
        if s.finish_reason == "length" and s.n_prompt + s.n_generated >= cfg.context:
            note += (f"\n[the reply was cut: the context of {cfg.context} tokens is full. /reset starts over; /shift "
                     "keeps the system prompt and the latest tokens]")
        return note

    def _context_full(self, e: TracelmError) -> str | None:
        if "no longer fits the context" not in str(e):
            return None
        return (f"the context is full ({e}).\n/reset starts a new conversation; /shift keeps the system prompt and "
                "the latest tokens and goes on (context_policy shift); then send your message again")

    def reset(self, _arg: str) -> None:
        self.session.reset()
        self.say("[a new conversation]")

    def system(self, text: str) -> None:
        cfg = self.session.cfg
        if not text:
            return self.say(f"system prompt: {cfg.system!r}" if cfg.system else "no system prompt (the template's)")
        self.session.cfg = attrs.evolve(cfg, system=text)
        messages = [m for m in self.session.messages if m["role"] != "system"]
        self.session.messages = [{"role": "system", "content": text}, *messages]
        self.say("[system prompt set; the conversation goes on with it (/reset starts over)]")

    def save(self, name: str) -> None:
        path = session_path(_needs(name, "/save NAME"))
        path.parent.mkdir(parents=True, exist_ok=True)
        size = self.session.save(path)
        self.say(f"[saved {len(self.session.messages)} messages as {name} ({size >> 10} KiB): {path}]")

    def load(self, name: str) -> None:
        path = session_path(_needs(name, "/load NAME"))
        if not path.exists():
            raise TracelmError(f"no saved session {name} ({path})")
        self.session.load(path)
        self.say(f"[resumed session {name}: {len(self.session.messages)} messages]")
        for m in self.session.messages[-2:]:
            self.say(f"  {m['role']}: {visible(m['content'])[:200]}")

    def stats(self, _arg: str) -> None:
        s, cfg = self.session.stats, self.session.cfg
        used = len(self.session.runner.cache.tokens)
        rate = decode_rate(s.n_generated, s.decode_seconds)
        self.say(f"conversation: {len(self.session.messages)} messages; context: {used} of {cfg.context} positions "
                 f"held, context_policy {cfg.context_policy}")
        self.say(f"last reply: {s.n_generated} tokens ({'stopped' if self.stopped else s.finish_reason or '-'}), "
                 f"{s.n_reused} of {s.n_prompt} prompt tokens reused, prefill {s.prefill_seconds:.2f} s, "
                 f"decode {rate:.1f} tok/s")

    def trace(self, arg: str) -> None:
        cfg = self.session.cfg
        if not arg:
            where = cfg.trace.file if cfg.trace.level != "off" and cfg.trace.file else "nowhere"
            last = self.session.trace_chain
            return self.say(f"replies are traced to {where}" + (f"; the last trace ends in {last}" if last else ""))
        if arg == "off":
            self.session.cfg = attrs.evolve(cfg, trace=TraceOptions())
            return self.say("[tracing off]")
        level = cfg.trace.level if cfg.trace.level != "off" else "digest"
        self.session.cfg = attrs.evolve(cfg, trace=TraceOptions(level=level, file=arg))
        self.say(f"[each next reply is traced to {arg} (level {level}); `tracelm trace view {arg}` shows it]")

    def shift(self, _arg: str) -> None:
        self.session.cfg = attrs.evolve(self.session.cfg, context_policy="shift")
        self.say("[context_policy shift: a full context keeps the system prompt and the latest tokens]")

    def set(self, arg: str) -> None:
        self.session.cfg = evolve_setting(self.session.cfg, arg)
        key = _full_key(arg.partition("=")[0].strip())
        self.say(f"[{key} = {_lookup(config_as_dict(self.session.cfg), key)!r}]")


def evolve_setting(cfg: Any, item: str) -> Any:
    """The RunConfig with one KEY=VALUE applied (YAML value, as --set takes it); only what may change mid-chat."""
    key, sep, raw = item.partition("=")
    key = _full_key(key.strip())
    if not sep or not key:
        raise TracelmError("expected KEY=VALUE, e.g. /set temperature=0.7")
    if not key.startswith(SETTABLE[-1]) and key not in SETTABLE:
        raise TracelmError(f"{key} cannot change during a chat (settable: max_tokens, stop, context_policy, "
                           "shift_keep, sampling.*)")
    tree = config_as_dict(cfg)
    node = tree
    *parents, leaf = key.split(".")
    for p in parents:
        node = node[p]
    if leaf not in node:
        raise TracelmError(f"no setting {key}")
    try:
        node[leaf] = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError:
        node[leaf] = raw
    return run_config_from_dict(tree, "/set")


def _full_key(key: str) -> str:
    return f"sampling.{key}" if key in SAMPLING_SHORT else key


def _lookup(tree: dict[str, Any], key: str) -> Any:
    for part in key.split("."):
        tree = tree[part]
    return tree


def _needs(arg: str, usage: str) -> str:
    if not arg:
        raise TracelmError(f"usage: {usage}")
    return arg


def _start_readline() -> Path | None:
    """Line editing and history through readline, the history kept in TRACELM_HOME/chat_history."""
    try:
        import readline
    except ImportError:  # a Python without readline: plain input()
        return None
    path = home() / "chat_history"
    with contextlib.suppress(OSError):
        readline.read_history_file(path)
    readline.set_history_length(1000)
    return path


def _save_history(path: Path | None) -> None:
    if path is None:
        return
    import readline

    with contextlib.suppress(OSError):
        path.parent.mkdir(parents=True, exist_ok=True)
        readline.write_history_file(path)
