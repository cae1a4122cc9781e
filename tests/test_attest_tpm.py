"""Issue 31 with a TPM: `tracelm serve --attest tpm` against swtpm signs every trace with an ephemeral key that a TPM
quote binds; `trace verify --policy P` says attested and `replay --policy P` reproduces it bit for bit. Each way
attestation can be wrong is refused with its own message and exit status: a trace signed by a key the evidence does
not bind, evidence over another key, a PCR other than the policy's, a quote replayed for another nonce, a quote
with one byte changed, a forger's self-signed trace without evidence, and evidence from another TPM."""

from __future__ import annotations

import hashlib
import json
import subprocess
from pathlib import Path

import pytest

from tests.swtpm import SwTpm, swtpm_fixture
from tests.test_server_helpers import ServerProcess
from tests.test_trust import forge
from tracelm.audit.attest import REFUSALS
from tracelm.cli import main
from tracelm.io.registry import path_sha256
from tracelm.session import Session

MEASURED_PCR = 23


@pytest.fixture(scope="module")
def tpm(tmp_path_factory):
    yield from swtpm_fixture(tmp_path_factory, "swtpm")


@pytest.fixture(scope="module")
def other_tpm(tmp_path_factory):
    yield from swtpm_fixture(tmp_path_factory, "swtpm-other")


@pytest.fixture(scope="module")
def measured(tpm: SwTpm, tiny_gguf: Path) -> bytes:
    """The model measured into PCR 23 as an operator's boot script would; the value the auditor expects, computed
    from the file alone."""
    digest = bytes.fromhex(path_sha256(tiny_gguf))
    tpm.extend(MEASURED_PCR, digest)
    return hashlib.sha256(bytes(32) + digest).digest()


def write_policy(path: Path, ak: Path, pcr23: bytes, **extra: object) -> Path:
    tpm_policy = {"ak": str(ak), "pcrs": {"sha256": {MEASURED_PCR: pcr23.hex()}}, **extra}
    path.write_text(json.dumps({"attestation": {"tpm": tpm_policy}}))  # JSON is YAML
    return path


@pytest.fixture(scope="module")
def policy(tpm: SwTpm, measured: bytes, tmp_path_factory) -> Path:
    return write_policy(tmp_path_factory.mktemp("policy") / "policy.yaml", tpm.ak_pem, measured)


def settings(tpm: SwTpm) -> list[str]:
    return ["context=128", "sampling.temperature=0.9", "sampling.seed=5", "attest.provider=tpm",
            f"attest.tpm_tcti={tpm.tcti}"]


@pytest.fixture(scope="module")
def attested(tiny_gguf, tpm, measured, tmp_path_factory) -> tuple[Path, Session]:
    """A trace of a run attested by the swtpm (in-process: the session, its ephemeral key, kept for the tests that
    need the key itself)."""
    out = tmp_path_factory.mktemp("attested") / "run.jsonl"
    session = Session(str(tiny_gguf), settings=settings(tpm))
    session.generate("hello world", max_tokens=4, trace=out)
    session.close()
    return out, session


def verify(capsys, path: Path, *extra: str) -> tuple[int, str]:
    code = main(["trace", "verify", str(path), *extra])
    cap = capsys.readouterr()
    return code, cap.out + cap.err


# ---------------------------------------------------------------- the acceptance run: serve, verify, replay


def test_serve_attest_tpm_then_verify_and_replay_with_the_policy(tiny_gguf, tpm, policy, tmp_path, capsys) -> None:
    config = {"model": str(tiny_gguf), "context": 128, "max_tokens": 6, "threads": 1,
              "sampling": {"temperature": 0.0}, "server": {"trace_dir": str(tmp_path / "traces")},
              "attest": {"tpm_tcti": tpm.tcti}}
    server = ServerProcess(tmp_path / "serve", config, env={"TRACELM_API_KEY": "k-123"}, args=("--attest", "tpm"))
    auth = {"Authorization": "Bearer k-123"}
    try:
        r = server.request("POST", "/v1/chat/completions", {"model": "tiny", "messages": [
            {"role": "user", "content": "hello"}], "max_tokens": 6}, auth)
        assert r.status == 200, r.text
        assert server.request("GET", "/v1/attestation?nonce=" + "ab" * 32).status == 401  # behind the API key
        fresh = server.request("GET", "/v1/attestation?nonce=" + "ab" * 32, headers=auth)
        assert fresh.status == 200, fresh.text
        for bad in ("zz", "", "00" * 65):
            assert server.request("GET", f"/v1/attestation?nonce={bad}", headers=auth).status == 400
    finally:
        server.stop()
    (trace,) = (tmp_path / "traces").iterdir()
    header = json.loads(trace.read_text().splitlines()[0])
    assert header["signature_algorithm"] == "ed25519" and header["attestation"]["evidence"]["provider"] == "tpm"
    assert header["config"]["trace"]["key"] == "ephemeral"
    code, out = verify(capsys, trace, "--policy", str(policy))
    assert code == 0 and "attested (tpm, AK" in out and f"PCRs sha256:{MEASURED_PCR}" in out, out
    assert "[FAIL]" not in out
    code = main(["replay", str(trace), "--policy", str(policy)])
    out = capsys.readouterr().out
    assert code == 0 and "every stage output bit-identical" in out and "trust: attested (tpm" in out, out
    assert "  [ok] quote signed by the AK" in out and "  [ok] report data: key, version, model" in out  # each step
    # the client's check before sending anything: fresh evidence over its nonce, the same key as the traces'
    doc = tmp_path / "attestation.json"
    doc.write_text(fresh.text)
    assert json.loads(fresh.text)["public_key"] == header["public_key"]
    code = main(["attest", "verify", str(doc), "--policy", str(policy), "--nonce", "ab" * 32])
    out = capsys.readouterr().out
    assert code == 0 and "attested (tpm" in out, out
    # the key was made in memory: nothing of it was written anywhere the server could reach
    assert not any(header["public_key"] in p.read_text(errors="replace") for p in (tmp_path / "serve").iterdir()
                   if p.is_file() and p.name != "server.log")


def test_the_quote_verifies_with_tpm2_checkquote_too(attested, tpm, tmp_path) -> None:
    """tracelm's own reading of TPMS_ATTEST (its qualifying data: the binding's report data) and TPMT_SIGNATURE
    agrees with tpm2-tools' checkquote; a changed qualifying data fails there too."""
    from tracelm.io.attest.binding import binding_from_dict
    from tracelm.io.attest.tpm import parse_attest

    attestation = json.loads(attested[0].read_text().splitlines()[0])["attestation"]
    evidence = attestation["evidence"]
    for name in ("quote", "signature"):
        (tmp_path / name).write_bytes(bytes.fromhex(evidence[name]))
    quote = parse_attest(bytes.fromhex(evidence["quote"]))
    assert quote.extra_data == binding_from_dict(attestation["binding"]).report_data()
    check = ("tpm2_checkquote", "-u", str(tpm.ak_pem), "-m", str(tmp_path / "quote"), "-s",
             str(tmp_path / "signature"), "-g", "sha256", "-q")
    tpm.tool(*check, quote.extra_data.hex())
    with pytest.raises(subprocess.CalledProcessError):
        tpm.tool(*check, bytes(64).hex())


# ---------------------------------------------------------------- each refusal: its message and exit status


def test_the_attested_trace_passes_and_names_every_step(attested, policy, capsys) -> None:
    code, out = verify(capsys, attested[0], "--policy", str(policy))
    assert code == 0, out
    for step in ("evidence present", "binding names the signing key", "quote signed by the AK", "AK is the policy's",
                 "PCR digest", f"PCR sha256:{MEASURED_PCR}", "report data: nonce", "report data: key, version, model"):
        assert f"[ok] {step}" in out, (step, out)


def test_a_trace_signed_by_a_key_not_in_the_evidence(attested, policy, tmp_path, capsys, keys) -> None:
    """A forger copies genuine evidence into a trace signed with their own key."""
    forged = forge(attested[0], tmp_path / "forged.jsonl", lambda events: None, signer=keys["forger"])
    code, out = verify(capsys, forged, "--policy", str(policy))
    assert code == REFUSALS["key_not_in_evidence"] == 11, out
    assert "[FAIL] binding names the signing key: the trace is signed by key" in out and "the evidence binds key" in out


def test_evidence_over_another_key(attested, policy, tmp_path, capsys, keys) -> None:
    """The binding rewritten to name the forger's key: the quote's report data is still the genuine key's."""
    from tracelm.io.trace_keys import public_hex

    def rebind(events):
        events[0]["attestation"]["binding"]["public_key"] = public_hex(keys["forger"].public_key())
    forged = forge(attested[0], tmp_path / "rebound.jsonl", rebind, signer=keys["forger"])
    code, out = verify(capsys, forged, "--policy", str(policy))
    assert code == REFUSALS["other_key"] == 10, out
    assert "[FAIL] report data: key, version, model: the evidence is over another key" in out


def test_a_pcr_value_other_than_the_policys(attested, tpm, tmp_path, capsys) -> None:
    other = write_policy(tmp_path / "other-pcr.yaml", tpm.ak_pem, hashlib.sha256(b"another model").digest())
    code, out = verify(capsys, attested[0], "--policy", str(other))
    assert code == REFUSALS["measurement"] == 8, out
    assert f"[FAIL] PCR sha256:{MEASURED_PCR}: " in out and ", the policy names " in out


def test_a_quote_replayed_with_a_different_nonce(attested, policy, tmp_path, capsys) -> None:
    session = attested[1]
    doc = tmp_path / "doc.json"
    doc.write_text(json.dumps(session.attestation(b"\x01" * 32)))
    code, out = main(["attest", "verify", str(doc), "--policy", str(policy), "--nonce", "02" * 32]), \
        capsys.readouterr().out
    assert code == REFUSALS["stale_nonce"] == 9 and "[FAIL] binding names your nonce" in out and "replayed" in out
    # the same quote presented as the answer to the new nonce (the binding edited to say so): its report data
    # still commits to the old one
    edited = json.loads(doc.read_text())
    edited["binding"]["nonce"] = "02" * 32
    doc.write_text(json.dumps(edited))
    code, out = main(["attest", "verify", str(doc), "--policy", str(policy), "--nonce", "02" * 32]), \
        capsys.readouterr().out
    assert code == 9 and "[FAIL] report data: nonce: the evidence was made for another nonce" in out, out

    def renonce(events):  # in a trace: the start evidence of another time
        events[0]["attestation"]["binding"]["nonce"] = "00" * 8
    forged = forge(attested[0], tmp_path / "renonce.jsonl", renonce, signer=session.signer)
    code, out = verify(capsys, forged, "--policy", str(policy))
    assert code == 9 and "[FAIL] report data: nonce" in out, out


@pytest.mark.parametrize("where", ["quote", "signature", "ak_public"])
def test_a_quote_with_one_byte_changed(attested, policy, tmp_path, capsys, where) -> None:
    session = attested[1]  # even the key's holder cannot change the quote: the AK signed it

    def flip(events):
        evidence = events[0]["attestation"]["evidence"]
        raw = bytearray.fromhex(evidence[where])
        at = {"quote": 40, "signature": 10, "ak_public": len(raw) - 5}[where]  # clock info; r; the key's y
        raw[at] ^= 0x01
        evidence[where] = raw.hex()
    forged = forge(attested[0], tmp_path / f"flip-{where}.jsonl", flip, signer=session.signer)
    code, out = verify(capsys, forged, "--policy", str(policy))
    assert code == REFUSALS["evidence_invalid"] == 6, out
    failed = {"quote": "quote signed by the AK", "signature": "quote signed by the AK",
              "ak_public": "attestation key (TPMT_PUBLIC)"}[where]
    assert f"[FAIL] {failed}" in out, out


def test_a_forgers_self_signed_trace_without_evidence(tiny_gguf, policy, tmp_path, capsys, keys, key_files) -> None:
    out = tmp_path / "self.jsonl"
    assert main(["run", "--model", str(tiny_gguf), "--set", "context=64", "--max-tokens", "2", "--trace", str(out),
                 "--sign-key", str(key_files["forger"])]) == 0
    code, text = verify(capsys, out, "--policy", str(policy))
    assert code == REFUSALS["no_evidence"] == 5, text
    assert "[FAIL] evidence present: the trace carries no attestation evidence" in text
    assert verify(capsys, out)[0] == 4  # the default policy: a key no one named


def test_evidence_from_another_tpm(tiny_gguf, other_tpm, policy, tmp_path, capsys) -> None:
    """A run on another TPM (another AK): its quote is genuine, but not from the TPM the policy names."""
    out = tmp_path / "other.jsonl"
    with Session(str(tiny_gguf), settings=settings(other_tpm)) as session:
        session.generate("hello", max_tokens=2, trace=out)
    code, text = verify(capsys, out, "--policy", str(policy))
    assert code == REFUSALS["other_platform"] == 7, text
    assert "[ok] quote signed by the AK" in text and "[FAIL] AK is the policy's: the quote is signed by AK" in text


def test_batch_traces_are_attested(tiny_gguf, tpm, policy, tmp_path, capsys) -> None:
    """`tracelm batch --attest tpm`: one ephemeral key for the run signs every item's trace, each attested."""
    items = tmp_path / "in.jsonl"
    items.write_text("\n".join(json.dumps({"id": f"q{i}", "prompt": f"hello {i}", "max_tokens": 2}) for i in range(3)))
    assert main(["batch", "--model", str(tiny_gguf), "--set", "context=64", "--input", str(items), "--output",
                 str(tmp_path / "out.jsonl"), "--traces", str(tmp_path / "traces"), "--attest", "tpm", "--set",
                 f"attest.tpm_tcti={tpm.tcti}"]) == 0
    keys = set()
    for trace in (tmp_path / "traces").iterdir():
        code, out = verify(capsys, trace, "--policy", str(policy))
        assert code == 0 and "attested (tpm" in out, out
        keys.add(json.loads(trace.read_text().splitlines()[0])["public_key"])
    assert len(keys) == 1


def test_hostile_attestation_fields_get_a_verdict_never_a_traceback(attested, policy) -> None:
    """Whatever a forger puts in the header's attestation (wrong types, sizes, nesting), the verdict names a
    refusal: 300 mutations, each re-chained and re-signed with the run's own key."""
    import random

    from tracelm.audit.policy import load_policy
    from tracelm.audit.trust import judge
    from tracelm.audit.verify import parse_trace

    path, session = attested
    rng = random.Random(31)
    values = [None, 0, -1, 2 ** 70, 1.5, True, "", "zz", "00", "ff" * 200, [], {}, [1, 2], {"a": {"b": []}}]
    pol = load_policy(policy)

    def leaves(obj, at=()):
        if isinstance(obj, dict):
            for k, v in obj.items():
                yield from leaves(v, (*at, k))
        yield at

    original = json.loads(path.read_text().splitlines()[0])["attestation"]
    spots = list(leaves(original))
    for i in range(300):
        def mutate(events):
            node, spot = events[0], ("attestation", *rng.choice(spots))
            for k in spot[:-1]:
                node = node[k]
            if spot[-1] in node and rng.random() < 0.15:
                del node[spot[-1]]
            else:
                node[spot[-1]] = rng.choice(values)
        forged = forge(path, path.with_name(f"mut{i}.jsonl"), mutate, signer=session.signer)
        verdict = judge(parse_trace(forged.read_bytes(), forged), pol)
        assert verdict.level != "attested" or verdict.ok, verdict.describe()
        assert verdict.exit_status in (0, *REFUSALS.values()), verdict.describe()


def make_ca(name: str):
    """A CA key and its self-signed certificate (a cloud vTPM vendor's stand-in)."""
    import datetime as dt

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    now = dt.datetime.now(dt.UTC)
    cert = (x509.CertificateBuilder().subject_name(subject).issuer_name(subject).public_key(key.public_key())
            .serial_number(1).not_valid_before(now - dt.timedelta(days=1)).not_valid_after(now + dt.timedelta(days=30))
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .sign(key, hashes.SHA256()))
    return key, cert


def ak_certificate(ca, ak_pem: Path, out: Path) -> Path:
    import datetime as dt

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.x509.oid import NameOID

    key, ca_cert = ca
    now = dt.datetime.now(dt.UTC)
    cert = (x509.CertificateBuilder().subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "AK")]))
            .issuer_name(ca_cert.subject).public_key(serialization.load_pem_public_key(ak_pem.read_bytes()))
            .serial_number(2).not_valid_before(now - dt.timedelta(days=1)).not_valid_after(now + dt.timedelta(days=30))
            .sign(key, hashes.SHA256()))
    out.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    return out


def test_an_ak_certificate_chaining_to_the_policys_ca(tiny_gguf, tpm, measured, tmp_path, capsys) -> None:
    """A policy may name the CA of the AK's certificate (as a cloud vTPM's vendor issues one) instead of the AK:
    the evidence carries the certificate (attest.tpm_ak_cert); another CA's is refused."""
    from cryptography.hazmat.primitives.serialization import Encoding

    vendor, other = make_ca("vTPM vendor CA"), make_ca("another CA")
    for name, ca in (("vendor", vendor), ("other", other)):
        (tmp_path / f"{name}.pem").write_bytes(ca[1].public_bytes(Encoding.PEM))
    cert = ak_certificate(vendor, tpm.ak_pem, tmp_path / "ak-cert.pem")
    out = tmp_path / "run.jsonl"
    with Session(str(tiny_gguf), settings=[*settings(tpm), f"attest.tpm_ak_cert={cert}"]) as session:
        session.generate("hello", max_tokens=2, trace=out)
    by_ca = tmp_path / "by-ca.yaml"
    by_ca.write_text(json.dumps({"attestation": {"tpm": {"ak_ca": [str(tmp_path / "vendor.pem")],
                                                         "pcrs": {"sha256": {"23": measured.hex()}}}}}))
    code, text = verify(capsys, out, "--policy", str(by_ca))
    assert code == 0 and "[ok] AK certificate chains to the policy's CA: vTPM vendor CA" in text, text
    by_ca.write_text(json.dumps({"attestation": {"tpm": {"ak_ca": [str(tmp_path / "other.pem")]}}}))
    code, text = verify(capsys, out, "--policy", str(by_ca))
    assert code == REFUSALS["other_platform"] and "[FAIL] AK certificate chains to the policy's CA" in text, text


def test_replay_refuses_with_the_same_status(attested, tpm, tmp_path, capsys) -> None:
    other = write_policy(tmp_path / "other-pcr.yaml", tpm.ak_pem, bytes(32))
    assert main(["replay", str(attested[0]), "--policy", str(other)]) == 8
    out = capsys.readouterr().out
    assert "reproduced" in out and "not attested: PCR sha256:23" in out, out


# ---------------------------------------------------------------- bad input: one line, exit 2


def test_bad_policies_and_a_missing_tpm_are_one_line(tpm, tiny_gguf, attested, tmp_path, capsys) -> None:
    from tests.test_hardening import assert_one_line

    cases = {
        "unknown.yaml": ("attestation: {tpm: {ak: ak.pem, pcr: {}}}", "unknown key 'pcr'"),
        "nokey.yaml": ("attestation: {tpm: {pcrs: {sha256: {23: '00'}}}}", "name the attestation key"),
        "badhex.yaml": (f"attestation: {{tpm: {{ak: {tpm.ak_pem}, pcrs: {{sha256: {{23: xyz}}}}}}}}", "not hex"),
        "require.yaml": ("require: attested", "names no attestation requirements"),
        "level.yaml": ("require: perfect", "require 'perfect' is not one of"),
    }
    for name, (text, message) in cases.items():
        (tmp_path / name).write_text(text)
        code = main(["trace", "verify", str(attested[0]), "--policy", str(tmp_path / name)])
        assert_one_line(code, capsys.readouterr().err, message)
    code = main(["run", "--model", str(tiny_gguf), "--max-tokens", "1", "--trace", str(tmp_path / "t.jsonl"),
                 "--attest", "tpm", "--set", "attest.tpm_tcti=swtpm:host=127.0.0.1,port=1"])
    assert_one_line(code, capsys.readouterr().err, "attest tpm: tpm2_quote")
    code = main(["run", "--model", str(tiny_gguf), "--max-tokens", "1", "--attest", "tpm", "--sign-key",
                 str(tpm.ak_pem)])
    assert_one_line(code, capsys.readouterr().err, "binds an ephemeral key")


def test_tpm_setup_keeps_an_existing_ak_and_never_overwrites(tpm, tmp_path, capsys) -> None:
    out = tmp_path / "again.pem"
    assert main(["attest", "tpm-setup", "--tcti", tpm.tcti, "--out", str(out)]) == 0
    assert "the AK was already at 0x81010002" in capsys.readouterr().out
    assert out.read_bytes() == tpm.ak_pem.read_bytes()
    assert main(["attest", "tpm-setup", "--tcti", tpm.tcti, "--out", str(out)]) == 2
    assert "never overwrites" in capsys.readouterr().err


def test_attest_pcr_gives_the_value_the_policy_expects(tiny_gguf, measured, tpm, capsys) -> None:
    assert main(["attest", "pcr", str(tiny_gguf)]) == 0
    assert capsys.readouterr().out.splitlines()[-1].startswith(measured.hex())
    read = tpm.tool("tpm2_pcrread", f"sha256:{MEASURED_PCR}")
    assert measured.hex() in read.lower()


@pytest.fixture(scope="module")
def key_files(tmp_path_factory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("forger")
    assert main(["trace", "keygen", "--out", str(d / "forger")]) == 0
    return {"forger": d / "forger"}


@pytest.fixture(scope="module")
def keys(key_files) -> dict:
    from tracelm.io.trace_keys import load_private_key

    return {"forger": load_private_key(key_files["forger"])}


def test_swtpm_is_stopped_by_its_fixture(tmp_path) -> None:
    """The fixture's must-fail side: a stopped swtpm answers no quote."""
    tpm = SwTpm(tmp_path / "short")
    tpm.stop()
    with pytest.raises(subprocess.CalledProcessError):
        tpm.tool("tpm2_pcrread", "sha256:0")
