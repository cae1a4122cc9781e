"""A library on a request's path that raises (issue 33): the grammar library's own exceptions reach the client as
a 400 in OpenAI's error shape naming the argument and the library's message, with one log line, and the server
goes on serving. The failures are forced by standing a failing llguidance in for the real one, in process."""

from __future__ import annotations

import logging
import socket
import threading
import time
import types
from pathlib import Path

import pytest

from tests.test_server_helpers import ServerProcess, assert_openai_error
from tracelm.io import grammar
from tracelm.state.errors import GrammarLibraryError
from tracelm.state.records import Constraint

TYPE_ERROR = "argument 'eos_token': 'list' object cannot be interpreted as an integer"  # llguidance 1.6.1's


class InProcessServer(ServerProcess):
    """tracelm's app under uvicorn on a thread of this process, so the test can change what it imports."""

    def __init__(self, model: Path):
        import uvicorn

        from tracelm.server.app import Server
        from tracelm.server.guard import uvicorn_config
        from tracelm.session import Session, run_config

        cfg = run_config(model=str(model), settings=["context=256", "max_tokens=4", "threads=1"])
        app = Server(Session(config=cfg)).app()
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        config = uvicorn_config(app, cfg.server)
        config.host, config.port, config.log_config = "127.0.0.1", self.port, None
        self.uvicorn = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.uvicorn.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 60
        while not self.uvicorn.started:
            assert self.thread.is_alive() and time.monotonic() < deadline, "the in-process server did not start"
            time.sleep(0.05)

    def stop(self) -> None:
        self.uvicorn.should_exit = True
        self.thread.join(30)


@pytest.fixture(scope="module")
def server(tiny_gguf: Path):
    s = InProcessServer(tiny_gguf)
    yield s
    s.stop()


def failing_llguidance(monkeypatch: pytest.MonkeyPatch, **failures: Exception) -> None:
    """llguidance as `grammar` sees it, with the named callables raising: `LLTokenizer` (the token trie) or one of
    `LLMatcher`'s grammar builders (`grammar_from_regex`, ...); the rest is the real library. The caches that would
    hide the change are emptied."""
    import llguidance

    def raiser(e: Exception):
        def f(*_args, **_kwargs):
            raise e
        return staticmethod(f)

    class Matcher:  # the real LLMatcher, but for the failing grammar builders
        def __new__(cls, *args, **kwargs):
            return llguidance.LLMatcher(*args, **kwargs)

    for name in dir(llguidance.LLMatcher):
        if name.startswith("grammar_from"):
            setattr(Matcher, name, raiser(failures[name]) if name in failures else
                    staticmethod(getattr(llguidance.LLMatcher, name)))
    tokenizer = raiser(failures["LLTokenizer"]).__func__ if "LLTokenizer" in failures else llguidance.LLTokenizer
    fake = types.SimpleNamespace(LLTokenizer=tokenizer, TokenizerWrapper=llguidance.TokenizerWrapper, LLMatcher=Matcher)
    monkeypatch.setattr(grammar, "_llguidance", lambda: fake)
    grammar.ll_tokenizer.cache_clear()
    grammar.grammar_text.cache_clear()


@pytest.fixture
def clean_caches():
    yield
    grammar.ll_tokenizer.cache_clear()
    grammar.grammar_text.cache_clear()


def chat(server: ServerProcess, **extra):
    return server.request("POST", "/v1/chat/completions",
                          {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, **extra})


def library_log_lines(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    return [r for r in caplog.records if "grammar library" in r.getMessage()]


def test_a_library_type_error_is_a_400_naming_the_argument(server, monkeypatch, caplog, clean_caches) -> None:
    failing_llguidance(monkeypatch, LLTokenizer=TypeError(TYPE_ERROR))
    caplog.set_level(logging.WARNING, logger="tracelm.server")
    reply = chat(server, response_format={"type": "json_object"})
    err = assert_openai_error(reply, 400, param="response_format")
    assert "llguidance" in err["message"] and TYPE_ERROR in err["message"] and "TypeError" in err["message"]
    lines = library_log_lines(caplog)
    assert len(lines) == 1 and lines[0].exc_info is None and "\n" not in lines[0].getMessage()
    # the same request under guided_regex names that argument; the server serves on
    err = assert_openai_error(chat(server, guided_regex="[a-z]+"), 400, param="guided_regex")
    assert TYPE_ERROR in err["message"]
    assert server.health()["status"] == "ok"
    monkeypatch.undo()
    grammar.ll_tokenizer.cache_clear()
    assert chat(server, guided_regex="[a-z]+").status == 200  # the real library: served


def test_a_grammar_builder_that_raises_is_a_400(server, monkeypatch, caplog, clean_caches) -> None:
    failing_llguidance(monkeypatch, grammar_from_regex=RuntimeError("regex engine panicked\nat src/regex.rs:1"))
    caplog.set_level(logging.WARNING, logger="tracelm.server")
    err = assert_openai_error(chat(server, guided_regex="[0-9]+"), 400, param="guided_regex")
    assert "RuntimeError: regex engine panicked at src/regex.rs:1" in err["message"]  # the message, on one line
    assert len(library_log_lines(caplog)) == 1
    assert chat(server).status == 200  # an unconstrained request does not touch the library


def test_matcher_calls_raise_the_named_error(tiny_gguf, monkeypatch, clean_caches) -> None:
    """Without the server: a Matcher built on a failing library raises GrammarLibraryError, a TracelmError."""
    from tracelm.io.loader import load_model

    tok = load_model(str(tiny_gguf), progress=False).tokenizer
    failing_llguidance(monkeypatch, LLTokenizer=ValueError("bad vocabulary"))
    with pytest.raises(GrammarLibraryError, match=r"token trie: the grammar library \(llguidance [0-9.]+\) raised "
                                                  r"ValueError: bad vocabulary"):
        grammar.Matcher(Constraint("regex", "[a-z]+"), tok)
