"""Issue 31 (and issue 29 item 5): verdicts an auditor can act on. Trust comes only from the auditor's policy: a trace
re-signed with a forger's own key no longer exits 0 anywhere (trace verify, replay, the viewer, the server's verify
route); a checked HMAC counts as trusted, an unchecked one as nothing authenticated; replay says in words and exit
status when it authenticated nothing (all-zero macs, a forged "interrupted" footer on an unsigned trace)."""

from __future__ import annotations

import hashlib
import hmac
import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.test_server_helpers import REPO, ServerProcess
from tracelm.cli import main

CONFIG = str(REPO / "configs" / "smollm2.yaml")
SECRET_ENV = "TRACELM_TRUST_TEST_SECRET"


def forge(src: Path, dst: Path, edit, signer: Any = None, hmac_key: bytes | None = None,
          zero_macs: bool = False) -> Path:
    """A forger's trace: `edit(events)` changes the parsed events in place, then every line is re-chained (from the
    format in docs/trace.md, not the tracer), the footer signed with `signer` (an Ed25519 private key the header
    then names), every mac recomputed with `hmac_key` or set to zeros (`zero_macs`)."""
    from tracelm.io.trace_keys import fingerprint, public_hex, sign

    events = [json.loads(x) for x in src.read_text().splitlines()]
    if signer is not None:
        public = signer.public_key()
        events[0].update(signature_algorithm="ed25519", public_key=public_hex(public),
                         public_key_sha256=fingerprint(public))
    edit(events)
    prev, lines = "0" * 64, []
    for e in events:
        for k in ("hash", "mac", "sig", "prev"):
            e.pop(k, None)
        e["prev"] = prev
        body = json.dumps(e, separators=(",", ":"), ensure_ascii=False)[:-1]
        prev = hashlib.sha256(body.encode()).hexdigest()
        tail = f',"hash":"{prev}"'
        if hmac_key is not None:
            tail += f',"mac":"{hmac.new(hmac_key, prev.encode(), "sha256").hexdigest()}"'
        elif zero_macs:
            tail += ',"mac":"' + "0" * 64 + '"'
        if signer is not None and e["event"] == "footer":
            tail += f',"sig":"{sign(signer, prev)}"'
        lines.append(body + tail + "}")
    dst.write_text("\n".join(lines) + "\n")
    return dst


def record(model: Path, out: Path, *extra: str) -> Path:
    assert main(["run", CONFIG, "--model", str(model), "--prompt", "hello world", "--max-tokens", "5",
                 "--temperature", "0.9", "--seed", "3", "--set", "context=128", "--trace", str(out), *extra]) == 0
    return out


@pytest.fixture(scope="module")
def keys(tmp_path_factory) -> dict[str, Path]:
    """The operator's key pair and a forger's: {"operator": private, "operator.pub": public, "forger": ...}."""
    d = tmp_path_factory.mktemp("trust-keys")
    for name in ("operator", "forger"):
        assert main(["trace", "keygen", "--out", str(d / name)]) == 0
    return {p.name: p for p in d.iterdir()}


@pytest.fixture(scope="module")
def traces(tiny_gguf, keys, tmp_path_factory) -> dict[str, Path]:
    """The operator's signed trace, the same re-signed by the forger, and an unsigned one."""
    from tracelm.io.trace_keys import load_private_key

    d = tmp_path_factory.mktemp("trust-traces")
    genuine = record(tiny_gguf, d / "genuine.jsonl", "--sign-key", str(keys["operator"]))
    resigned = forge(genuine, d / "resigned.jsonl", lambda events: None, signer=load_private_key(keys["forger"]))
    return {"genuine": genuine, "resigned": resigned, "unsigned": record(tiny_gguf, d / "unsigned.jsonl")}


def fp(public: Path) -> str:
    from tracelm.io.trace_keys import fingerprint, load_public_key

    return fingerprint(load_public_key(public))


def verify(capsys, path: Path, *extra: str) -> tuple[int, str]:
    code = main(["trace", "verify", str(path), *extra])
    cap = capsys.readouterr()
    return code, cap.out + cap.err


# ---------------------------------------------------------------- the default policy: signed by a key you named


def test_a_resigned_forgery_no_longer_verifies_without_a_key(traces, keys, capsys) -> None:
    code, out = verify(capsys, traces["resigned"])  # before issue 31: exit 0, "intact"
    assert code == 4 and f"signed by key {fp(keys['forger.pub'])[:16]} (ed25519), which the default policy does " \
                         "not trust" in out, out
    code, out = verify(capsys, traces["genuine"])  # the genuine one too: you named no key
    assert code == 4, out
    code, out = verify(capsys, traces["genuine"], "--public-key", str(keys["operator.pub"]))
    assert code == 0 and "trusted: signed by key" in out, out
    code, out = verify(capsys, traces["resigned"], "--public-key", str(keys["operator.pub"]))
    assert code == 4, out


def test_replay_judges_by_the_same_policy(traces, keys, capsys) -> None:
    assert main(["replay", str(traces["resigned"])]) == 4
    out = capsys.readouterr().out
    assert "reproduced" in out and "exit 4: signed" in out, out
    assert main(["replay", str(traces["genuine"]), "--public-key", str(keys["operator.pub"])]) == 0
    assert main(["replay", str(traces["resigned"]), "--public-key", str(keys["operator.pub"])]) == 4


def test_a_policy_file_names_keys_by_file_or_fingerprint(traces, keys, tmp_path, capsys) -> None:
    by_file = tmp_path / "by-file.yaml"
    by_file.write_text(f"trusted_keys: [{keys['operator.pub'].name}]\n")
    (tmp_path / keys["operator.pub"].name).write_bytes(keys["operator.pub"].read_bytes())  # relative to the policy
    by_fp = tmp_path / "by-fp.yaml"
    by_fp.write_text(f"trusted_keys: ['{fp(keys['operator.pub'])}']\n")
    for policy in (by_file, by_fp):
        assert verify(capsys, traces["genuine"], "--policy", str(policy))[0] == 0
        assert verify(capsys, traces["resigned"], "--policy", str(policy))[0] == 4
    code, out = verify(capsys, traces["resigned"], "--policy", str(by_fp), "--require", "signed")
    assert code == 0, out  # an auditor who only asks that someone signed it says so
    assert verify(capsys, traces["unsigned"], "--policy", str(by_fp), "--require", "signed")[0] == 3


def test_the_servers_verify_route_and_the_viewer_judge_alike(tiny_gguf, traces, keys, tmp_path) -> None:
    server = ServerProcess(tmp_path / "server", {"model": str(tiny_gguf), "context": 64, "threads": 1},
                           args=("--policy", str(_policy(tmp_path, keys))))
    try:
        verdicts = {name: server.request("POST", f"/api/trace/verify?name={name}", traces[name].read_bytes()).json()
                    ["verdict"] for name in traces}
    finally:
        server.stop()
    assert verdicts["resigned"]["level"] == "signed" and verdicts["resigned"]["exit_status"] == 4
    assert not verdicts["resigned"]["ok"] and "which the policy does not trust" in verdicts["resigned"]["state"]
    assert verdicts["genuine"]["level"] == "trusted" and verdicts["genuine"]["ok"]
    assert verdicts["unsigned"]["state"] == "chain intact, unsigned: nothing authenticated"
    assert any(s["name"] == "signature" for s in verdicts["genuine"]["steps"])
    for name, public in (("resigned", ()), ("genuine", ("--public-key", str(keys["operator.pub"])))):
        viewer = subprocess.Popen([sys.executable, "-m", "tracelm.cli", "trace", "view", str(traces[name]), *public],
                                  cwd=REPO, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True)
        try:
            url = re.search(r"http://127\.0\.0\.1:(\d+)/trace", viewer.stderr.readline())
            assert url, "no URL printed"
            import http.client

            conn = http.client.HTTPConnection("127.0.0.1", int(url.group(1)), timeout=30)
            conn.request("GET", "/api/trace/preloaded")
            verdict = json.loads(conn.getresponse().read())["verdict"]
        finally:
            viewer.terminate()
            viewer.wait(10)
        assert verdict["exit_status"] == (4 if name == "resigned" else 0), verdict


def _policy(tmp_path: Path, keys: dict[str, Path]) -> Path:
    p = tmp_path / "server-policy.yaml"
    p.write_text(f"trusted_keys: ['{fp(keys['operator.pub'])}']\n")
    return p


# ---------------------------------------------------------------- HMAC: the auditor's shared secret


@pytest.fixture(scope="module")
def hmac_trace(tiny_gguf, tmp_path_factory) -> Path:
    import os

    os.environ[SECRET_ENV] = "correct horse battery staple"
    try:
        return record(tiny_gguf, tmp_path_factory.mktemp("hmac") / "mac.jsonl", "--trace-key-env", SECRET_ENV)
    finally:
        del os.environ[SECRET_ENV]


def test_a_checked_hmac_is_trusted_an_unchecked_one_authenticates_nothing(hmac_trace, capsys, monkeypatch) -> None:
    monkeypatch.setenv(SECRET_ENV, "correct horse battery staple")
    code, out = verify(capsys, hmac_trace, "--key-env", SECRET_ENV)
    assert code == 0 and f"trusted: HMAC-signed, every mac checked with the secret in {SECRET_ENV}" in out, out
    code, out = verify(capsys, hmac_trace)
    assert code == 3 and "macs not checked" in out and "nothing was authenticated" in out, out


def test_all_zero_macs_replay_says_nothing_was_authenticated(hmac_trace, tmp_path, capsys, monkeypatch) -> None:
    """Issue 29: a trace whose macs are all zeros replayed 'reproduced', exit 0, with no word of it."""
    zeros = forge(hmac_trace, tmp_path / "zeros.jsonl", lambda events: None, zero_macs=True)
    assert main(["replay", str(zeros)]) == 3
    out = capsys.readouterr().out
    assert "reproduced" in out and "nothing was authenticated" in out and "macs were not checked" in out, out
    monkeypatch.setenv(SECRET_ENV, "correct horse battery staple")
    code, out = verify(capsys, zeros, "--key-env", SECRET_ENV)  # with the secret: the first mac fails
    assert code == 1 and "line 1: signature (mac) does not match" in out, out


def test_a_forged_interrupted_footer_replays_with_exit_3(traces, tmp_path, capsys) -> None:
    """Issue 29: an unsigned trace cut short, closed by a forged "interrupted" footer, replayed with exit 0."""
    def cut(events: list[dict]) -> None:
        tokens = [i for i, e in enumerate(events) if e["event"] == "token"]
        keep = events[:tokens[1] + 1]
        footer = {**events[-1], "seq": len(keep), "status": "interrupted", "last_token": 1, "events": len(keep) + 1}
        events[:] = [*keep, footer]
    forged = forge(traces["unsigned"], tmp_path / "cut.jsonl", cut)
    assert main(["replay", str(forged)]) == 3
    out = capsys.readouterr().out
    assert "reproduced up to the interruption at token 1" in out and "nothing was authenticated" in out, out
    assert main(["replay", str(forged), "--require", "intact"]) == 0  # accepted when the auditor says so


def test_the_exit_statuses_are_in_the_help() -> None:
    from tracelm.audit.exits import EXIT_TABLE, REPLAY_EXIT_TABLE

    for command, table in ((["trace"], EXIT_TABLE), (["replay"], REPLAY_EXIT_TABLE), (["attest"], EXIT_TABLE)):
        text = subprocess.run([sys.executable, "-m", "tracelm.cli", *command, "--help"], capture_output=True,
                              text=True, cwd=REPO, timeout=60).stdout
        for code, meaning in table:
            assert f"{code:2d}  {meaning[:40]}" in " ".join(text.split("\n")), (command, code)
    assert {code for code, _ in EXIT_TABLE} == set(range(12))


def test_docs_print_the_exit_statuses_the_code_gives() -> None:
    """docs/trust.md's table is the code's (tracelm/audit/exits.py), row for row."""
    from tracelm.audit.exits import EXIT_TABLE

    text = (REPO / "docs" / "trust.md").read_text()
    rows = re.findall(r"^\| (\d+) \| (.+?) \|$", text, re.MULTILINE)
    assert [(int(code), meaning) for code, meaning in rows] == list(EXIT_TABLE)
