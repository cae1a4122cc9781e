"""Issue 18: public-key trace signing. `tracelm trace keygen` writes an Ed25519 key pair; `--sign-key FILE` signs a
trace's footer over its chain hash (run, batch, the server's per-request traces); `trace verify --public-key FILE`
and `replay --public-key FILE` check it with the public key alone. Forgeries, other keys, bad key files and
older (version 3) traces each get their verdict."""

from __future__ import annotations

import hashlib
import json
import re
import stat
from pathlib import Path

import pytest

from tests.test_hardening import assert_one_line, cli, edit_trace
from tracelm.audit.replay import REPRODUCED, replay
from tracelm.audit.verify import read_trace, verify
from tracelm.cli import main

CONFIG = str(Path(__file__).resolve().parents[1] / "configs" / "smollm2.yaml")


@pytest.fixture(scope="module")
def keys(tmp_path_factory) -> dict[str, Path]:
    """Two key pairs, A and B: {"a": private, "a.pub": public, "b": ..., "b.pub": ...}."""
    d = tmp_path_factory.mktemp("keys")
    for name in ("a", "b"):
        assert main(["trace", "keygen", "--out", str(d / name)]) == 0
    return {p.name: p for p in d.iterdir()}


def fp(public: Path) -> str:
    from tracelm.io.trace_keys import fingerprint, load_public_key

    return fingerprint(load_public_key(public))[:16]


def record(model: Path, out: Path, *extra: str) -> list[str]:
    code = main(["run", CONFIG, "--model", str(model), "--prompt", "hello world", "--max-tokens", "5",
                 "--temperature", "0.9", "--seed", "3", "--trace", str(out), *extra])
    assert code == 0
    return out.read_text(encoding="utf-8").splitlines()


@pytest.fixture(scope="module")
def signed(tiny_gguf, keys, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("signed") / "run.jsonl"
    record(tiny_gguf, out, "--sign-key", str(keys["a"]))
    return out


def verify_cli(capsys, path: Path, *extra: str) -> tuple[int, str]:
    code = main(["trace", "verify", str(path), *extra])
    cap = capsys.readouterr()
    return code, cap.out + cap.err


def rechain_keeping_sig(lines: list[str]) -> list[str]:
    """Every prev/hash recomputed after an edit, the footer keeping the signature it had: a forger without the
    private key."""
    out, prev = [], "0" * 64
    for line in lines:
        m = re.match(r'^(\{.*),"hash":"[0-9a-f]{64}"(,"sig":"[0-9a-f]{128}")?\}$', line)
        assert m, line
        body = re.sub(r'"prev":"[0-9a-f]{64}"$', f'"prev":"{prev}"', m.group(1))
        prev = hashlib.sha256(body.encode()).hexdigest()
        out.append(f'{body},"hash":"{prev}"{m.group(2) or ""}}}')
    return out


# ---------------------------------------------------------------- keygen


def test_keygen_writes_a_private_key_only_its_owner_reads_and_never_overwrites(tmp_path, capsys) -> None:
    out = tmp_path / "signer"
    code = main(["trace", "keygen", "--out", str(out)])
    printed = capsys.readouterr().out
    assert code == 0
    assert stat.S_IMODE(out.stat().st_mode) == 0o600
    assert stat.S_IMODE(Path(f"{out}.pub").stat().st_mode) == 0o644
    assert out.read_text().startswith("-----BEGIN PRIVATE KEY-----")
    assert Path(f"{out}.pub").read_text().startswith("-----BEGIN PUBLIC KEY-----")
    assert str(out) in printed and f"{out}.pub" in printed and fp(Path(f"{out}.pub")) in printed
    before = out.read_bytes()
    assert_one_line(*cli(capsys, "trace", "keygen", "--out", str(out)), "already exists", "never overwrites")
    assert out.read_bytes() == before
    Path(f"{tmp_path}/lone.pub").write_text("x")  # the .pub alone exists: still refused, nothing written
    assert_one_line(*cli(capsys, "trace", "keygen", "--out", str(tmp_path / "lone")), "lone.pub: already exists")
    assert not (tmp_path / "lone").exists()
    assert_one_line(*cli(capsys, "trace", "keygen"), "give --out FILE")


# ---------------------------------------------------------------- signed runs verify with the public key alone


def test_a_signed_run_verifies_with_the_public_key(signed, keys, capsys) -> None:
    lines = signed.read_text().splitlines()
    header, footer = json.loads(lines[0]), json.loads(lines[-1])
    assert header["trace_version"] == 4 and header["signature_algorithm"] == "ed25519"
    assert header["public_key_sha256"].startswith(fp(keys["a.pub"])) and "sig" in footer
    assert sum('"sig":' in line for line in signed.read_text().splitlines()) == 1  # the footer only
    code, out = verify_cli(capsys, signed, "--public-key", str(keys["a.pub"]))
    assert code == 0, out
    assert f"trusted: signed by key {fp(keys['a.pub'])} (ed25519)" in out
    # issue 31: no key given, the header's own key is checked but trusted by no one: exit 4, no longer 0
    code, out = verify_cli(capsys, signed)
    assert code == 4 and f"signed by key {fp(keys['a.pub'])} (ed25519), which the default policy does not " \
                         "trust" in out, out
    report = replay(signed, public_key=_public(keys["a.pub"]))
    assert report.status == REPRODUCED and report.exit_status == 0, report.describe()
    assert f"trust: trusted: signed by key {fp(keys['a.pub'])}" in report.describe()
    assert main(["replay", str(signed), "--public-key", str(keys["a.pub"])]) == REPRODUCED
    assert main(["replay", str(signed)]) == 4  # reproduced, but by a key no one named


def _public(path: Path):
    from tracelm.io.trace_keys import load_public_key

    return load_public_key(path)


def test_an_unsigned_trace_is_said_to_be_unsigned(tiny_gguf, keys, tmp_path, capsys) -> None:
    out = tmp_path / "plain.jsonl"
    record(tiny_gguf, out)
    code, text = verify_cli(capsys, out)  # issue 31: intact but unsigned is exit 3 (was 0)
    assert code == 3 and "intact but unsigned" in text and "nothing was authenticated" in text, text
    code, text = verify_cli(capsys, out, "--public-key", str(keys["a.pub"]))  # (was 1: "not signed")
    assert code == 3 and "intact but unsigned" in text, text
    assert verify_cli(capsys, out, "--require", "intact")[0] == 0  # an auditor who accepts unsigned traces says so


def test_another_key_is_named_by_both_fingerprints(signed, keys, capsys) -> None:
    code, out = verify_cli(capsys, signed, "--public-key", str(keys["b.pub"]))  # issue 31: exit 4 (was 1, TAMPERED)
    assert code == 4 and "TAMPERED" not in out, out
    assert f"signed by key {fp(keys['a.pub'])} (ed25519), which --public-key {keys['b.pub']} does not trust" in out
    assert main(["replay", str(signed), "--public-key", str(keys["b.pub"])]) == 4  # reproduced, untrusted (was 2)


def test_a_rechained_forgery_fails_at_the_footer(signed, keys, tmp_path, capsys) -> None:
    lines = signed.read_text().splitlines()
    i = next(k for k, line in enumerate(lines) if '"event":"token"' in line)
    edited = re.sub(r'"text":"[^"]*"', '"text":"forged"', lines[i])
    assert edited != lines[i]
    forged = tmp_path / "forged.jsonl"
    forged.write_text("\n".join(rechain_keeping_sig([*lines[:i], edited, *lines[i + 1:]])) + "\n")
    code, out = verify_cli(capsys, forged, "--public-key", str(keys["a.pub"]))
    assert code == 1 and f"line {len(lines)}: the footer's signature does not match its chain hash" in out, out
    assert verify_cli(capsys, forged)[0] == 1  # the header's own key catches it too

    def strip_signature(events: list[dict]) -> None:  # the forger drops the signing instead
        for k in ("signature_algorithm", "public_key", "public_key_sha256"):
            events[0].pop(k)
        events[-1].pop("sig")
    unsigned = edit_trace(signed, tmp_path / "stripped.jsonl", strip_signature)
    code, out = verify_cli(capsys, unsigned, "--public-key", str(keys["a.pub"]))
    assert code == 3 and "intact but unsigned" in out, out  # whole, but the key you trust signed nothing


def test_a_signature_elsewhere_or_missing_is_refused(signed, keys, tmp_path, capsys) -> None:
    lines = signed.read_text().splitlines()
    sig = re.search(r',"sig":"[0-9a-f]{128}"', lines[-1]).group()
    moved = [lines[0], lines[1][:-1] + sig + "}", *lines[2:-1], lines[-1].replace(sig, "")]
    (tmp_path / "moved.jsonl").write_text("\n".join(moved) + "\n")
    code, out = verify_cli(capsys, tmp_path / "moved.jsonl", "--public-key", str(keys["a.pub"]))
    assert code == 1 and "line 2: a signature (sig) where none belongs" in out, out
    (tmp_path / "bare.jsonl").write_text("\n".join([*lines[:-1], lines[-1].replace(sig, "")]) + "\n")
    code, out = verify_cli(capsys, tmp_path / "bare.jsonl", "--public-key", str(keys["a.pub"]))
    assert code == 1 and "the footer of a signed trace has no signature" in out, out


# ---------------------------------------------------------------- interrupted runs, older traces, batch


def test_an_interrupted_signed_run_verifies(tiny_gguf, keys, tmp_path, capsys) -> None:
    from tests.test_hardening import after
    from tracelm.session import Session

    out = tmp_path / "cut.jsonl"
    settings = ["context=256", "sampling.seed=5", "sampling.temperature=0.9", f"trace.sign_key={keys['a']}"]
    with Session(str(tiny_gguf), settings=settings) as s:
        s.generate("hello there", max_tokens=12, trace=out, cancel=after(4, lambda: True))
    footer = json.loads(out.read_text().splitlines()[-1])
    assert footer["status"] == "interrupted" and "sig" in footer
    code, text = verify_cli(capsys, out, "--public-key", str(keys["a.pub"]))
    assert code == 0 and "interrupted at token 3" in text and f"trusted: signed by key {fp(keys['a.pub'])}" in text


def test_a_version_3_trace_still_verifies_and_replays(tiny_gguf, tmp_path) -> None:
    plain = tmp_path / "v4.jsonl"
    record(tiny_gguf, plain)

    def as_v3(events: list[dict]) -> None:
        events[0]["trace_version"] = 3
        events[0].pop("signature_algorithm")
    old = edit_trace(plain, tmp_path / "v3.jsonl", as_v3)
    verdict = verify(read_trace(old))
    assert verdict.intact and "unsigned" in verdict.message, verdict.message
    assert replay(old).status == REPRODUCED


def test_batch_traces_are_signed(tiny_gguf, keys, tmp_path, capsys) -> None:
    items = tmp_path / "in.jsonl"
    items.write_text("\n".join(json.dumps({"id": f"q{i}", "prompt": f"hello {i}", "max_tokens": 3}) for i in range(3)))
    code = main(["batch", "--model", str(tiny_gguf), "--set", "context=128", "--input", str(items), "--output",
                 str(tmp_path / "out.jsonl"), "--traces", str(tmp_path / "traces"), "--sign-key", str(keys["b"])])
    assert code == 0
    for r in map(json.loads, (tmp_path / "out.jsonl").read_text().splitlines()):
        code, out = verify_cli(capsys, tmp_path / "traces" / r["trace"], "--public-key", str(keys["b.pub"]))
        assert code == 0 and f"key {fp(keys['b.pub'])}" in out, out
        assert json.loads((tmp_path / "traces" / r["trace"]).read_text().splitlines()[-1])["hash"] == r["trace_hash"]


# ---------------------------------------------------------------- bad key files: one line, exit 2


@pytest.mark.parametrize("content,message", [
    (None, "cannot read the signing key"),
    ("not a key\n", "not a PEM private key"),
    ("public", "not a PEM private key (this is a public key: sign with the private one)"),
])
def test_a_bad_sign_key_is_one_line(tiny_gguf, keys, tmp_path, capsys, content, message) -> None:
    key = tmp_path / "key.pem"
    if content == "public":
        key.write_bytes(keys["a.pub"].read_bytes())
    elif content is not None:
        key.write_text(content)
    out = tmp_path / "t.jsonl"
    code, err = cli(capsys, "run", CONFIG, "--model", str(tiny_gguf), "--max-tokens", "2", "--trace", str(out),
                    "--sign-key", str(key))
    assert_one_line(code, err, "key.pem", message)
    assert not out.exists()  # refused before anything ran


def test_an_rsa_key_is_named_as_not_ed25519(tmp_path, capsys, signed) -> None:
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import rsa

    rsa_key = rsa.generate_private_key(public_exponent=65537, key_size=1024)
    (tmp_path / "rsa.pub").write_bytes(rsa_key.public_key().public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo))
    assert_one_line(*cli(capsys, "trace", "verify", str(signed), "--public-key", str(tmp_path / "rsa.pub")),
                    "rsa.pub: a RSAPublicKey key, not Ed25519")
    assert_one_line(*cli(capsys, "trace", "verify", str(signed), "--public-key", str(tmp_path / "none.pub")),
                    "none.pub: cannot read the public key")
