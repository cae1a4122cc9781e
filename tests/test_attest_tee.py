"""Issue 31, confidential VMs: the real SEV-SNP report (a Google Cloud confidential VM's, with its VCEK and AMD's
ASK/ARK) and the real TDX quote (with Intel's collateral) in ../shared/fixtures/attestation verify offline; one
changed byte in each report, signature and certificate is refused at a named step. The configfs-tsm provider is
tested against a temporary directory standing in for /sys/kernel/config/tsm/report."""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path

import pytest
from cryptography.hazmat.primitives.serialization import Encoding

from tests.conftest import FIXTURES
from tracelm.audit.attest import REFUSALS, Checks, Refusal, verify_snp
from tracelm.audit.policy import load_policy
from tracelm.cli import main
from tracelm.io.attest import certs

SNP, TDX = FIXTURES / "attestation" / "snp", FIXTURES / "attestation" / "tdx"
WHEN = "2026-06-01T00:00:00Z"  # inside every certificate's validity (the VCEK from 2025-12-05, the PCK to 2028-08-06)
MEASUREMENT = "b747d55452e0b9e9079770a49e397c5e6d9573581e246da7baac4f28b5cdc5b1b6d19251b8ee600fd16a3708f58406f3"

pytestmark = pytest.mark.skipif(not (SNP / "sev-gcp.bin").exists(), reason="no attestation fixtures in ../shared")


def policy_file(tmp_path: Path, name: str, attestation: dict) -> Path:
    p = tmp_path / name
    p.write_text(json.dumps({"time": WHEN, "attestation": attestation}))
    return p


def snp_policy(tmp_path: Path, vcek: Path = SNP / "sev-gcp-vcek.pem", **fields) -> Path:
    return policy_file(tmp_path, "snp.yaml", {"snp": {"cert_chain": str(SNP / "sev-gcp-cert-chain.pem"),
                                                      "vcek": str(vcek), "measurement": MEASUREMENT, "vmpl": 0,
                                                      **fields}})


def tdx_policy(tmp_path: Path, **extra) -> Path:
    return policy_file(tmp_path, "tdx.yaml", {"tdx": {
        "root": str(TDX / "trustedRootCaCert.pem"), "crls": [str(TDX / "rootCaCrl.der"),
                                                             str(TDX / "intermediateCaCrl.der")],
        "tcb_info": str(TDX / "tcbInfo.json"), "tcb_sign_chain": str(TDX / "tcbSignChain.pem"), **extra}})


def attest_verify(capsys, evidence: Path, policy: Path) -> tuple[int, str]:
    code = main(["attest", "verify", str(evidence), "--policy", str(policy)])
    cap = capsys.readouterr()
    return code, cap.out + cap.err


def flipped(src: Path, dst: Path, at: int) -> Path:
    data = bytearray(src.read_bytes())
    data[at] ^= 0x01
    dst.write_bytes(bytes(data))
    return dst


def cert_with_flipped_signature(src: Path, dst: Path) -> Path:
    """The certificate with one byte of its signature changed (still a well-formed certificate)."""
    der = bytearray(certs.load_certificates(src)[0].public_bytes(Encoding.DER))
    der[-3] ^= 0x01
    dst.write_bytes(certs.certificates(bytes(der), "changed")[0].public_bytes(Encoding.PEM))
    return dst


# ---------------------------------------------------------------- AMD SEV-SNP


def test_the_real_snp_report_verifies(tmp_path, capsys) -> None:
    code, out = attest_verify(capsys, SNP / "sev-gcp.bin", snp_policy(tmp_path))
    assert code == 0, out
    assert f"evidence verified (SEV-SNP, measurement {MEASUREMENT[:16]}..., VMPL 0)" in out
    for step in ("VCEK: SEV-VCEK issued by SEV-Milan", "VCEK: SEV-Milan issued by ARK-Milan",
                 "report signed by the VCEK", "VCEK issued for the report's chip", "VCEK issued for the reported TCB",
                 "MEASUREMENT", "VMPL", "guest policy: debugging"):
        assert f"[ok] {step}" in out, (step, out)
    assert "report data: " + "00" * 64 in out


@pytest.mark.parametrize("what, at, step", [
    ("report", 0x90, "report signed by the VCEK"),  # a byte of MEASUREMENT
    ("signature", 0x2A0 + 7, "report signed by the VCEK"),  # a byte of R
])
def test_one_changed_byte_of_the_snp_report_is_refused(tmp_path, capsys, what, at, step) -> None:
    changed = flipped(SNP / "sev-gcp.bin", tmp_path / f"{what}.bin", at)
    code, out = attest_verify(capsys, changed, snp_policy(tmp_path))
    assert code == REFUSALS["evidence_invalid"] == 6 and f"[FAIL] {step}: the signature does not match" in out, out


def test_one_changed_byte_of_the_vcek_is_refused(tmp_path, capsys) -> None:
    vcek = cert_with_flipped_signature(SNP / "sev-gcp-vcek.pem", tmp_path / "vcek.pem")
    code, out = attest_verify(capsys, SNP / "sev-gcp.bin", snp_policy(tmp_path, vcek))
    assert code == 6 and "[FAIL] VCEK: SEV-VCEK issued by SEV-Milan: not signed by it" in out, out


@pytest.mark.parametrize("fields, kind, step", [
    ({"measurement": "00" * 48}, "measurement", "MEASUREMENT"),
    ({"vmpl": 2}, "measurement", "VMPL"),
    ({"chip_id": "11" * 64}, "other_platform", "CHIP_ID"),
    ({"min_tcb": {"bootloader": 4, "tee": 0, "snp": 28, "microcode": 222}}, "measurement", "TCB at least"),
])
def test_snp_fields_other_than_the_policys(tmp_path, capsys, fields, kind, step) -> None:
    code, out = attest_verify(capsys, SNP / "sev-gcp.bin", snp_policy(tmp_path, **fields))
    assert code == REFUSALS[kind] and f"[FAIL] {step}" in out, out


def test_an_snp_report_outside_the_vceks_validity_is_refused(tmp_path) -> None:
    policy = load_policy(snp_policy(tmp_path))
    import datetime as dt

    checks = Checks()
    with pytest.raises(Refusal) as refused:
        verify_snp(checks, (SNP / "sev-gcp.bin").read_bytes(), policy.snp,
                   dt.datetime(2025, 9, 1, tzinfo=dt.UTC))
    assert refused.value.kind == "evidence_invalid" and "SEV-VCEK valid" in refused.value.message


# ---------------------------------------------------------------- Intel TDX


def test_the_real_tdx_quote_verifies(tmp_path, capsys) -> None:
    code, out = attest_verify(capsys, TDX / "quote.dat", tdx_policy(tmp_path))
    assert code == 0, out
    assert "evidence verified (TDX, MRTD 0000000000000000..., TCB UpToDate)" in out
    for step in ("PCK: Intel SGX PCK Certificate issued by Intel SGX PCK Processor CA",
                 "PCK: Intel SGX PCK Processor CA issued by Intel SGX Root CA", "revocation",
                 "QE report signed by the PCK key", "QE report binds the attestation key",
                 "quote signed by the attestation key", "TCB info signed by Intel", "TCB info is for this platform",
                 "TCB status: UpToDate"):
        assert f"[ok] {step}" in out, (step, out)


def _pck_signature_byte(quote: bytes) -> int:
    der = certs.load_certificates(TDX / "pckCert.pem")[0].public_bytes(Encoding.DER)
    at = quote.find(der)
    assert at > 0
    return at + len(der) - 3


@pytest.mark.parametrize("what, step", [
    ("report", "quote signed by the attestation key"),  # a byte of MRTD
    ("signature", "quote signed by the attestation key"),
    ("qe_report", "QE report signed by the PCK key"),
    ("certificate", "PCK: Intel SGX PCK Certificate issued by Intel SGX PCK Processor CA"),
])
def test_one_changed_byte_of_the_tdx_quote_is_refused(tmp_path, capsys, what, step) -> None:
    quote = (TDX / "quote.dat").read_bytes()
    at = {"report": 48 + 184, "signature": 636 + 5, "qe_report": 636 + 134 + 100,
          "certificate": _pck_signature_byte(quote)}[what]
    code, out = attest_verify(capsys, flipped(TDX / "quote.dat", tmp_path / "quote.dat", at), tdx_policy(tmp_path))
    assert code == REFUSALS["evidence_invalid"] and f"[FAIL] {step}" in out, out


def test_one_changed_byte_of_the_tcb_info_is_refused(tmp_path, capsys) -> None:
    info = (TDX / "tcbInfo.json").read_text().replace('"pcesvn":10593', '"pcesvn":10594')
    (tmp_path / "tcbInfo.json").write_text(info)
    code, out = attest_verify(capsys, TDX / "quote.dat", tdx_policy(tmp_path, tcb_info=str(tmp_path / "tcbInfo.json")))
    assert code == 6 and "[FAIL] TCB info signed by Intel: the TCB info or its signature was changed" in out, out


def test_tdx_measurements_and_tcb_status_other_than_the_policys(tmp_path, capsys) -> None:
    code, out = attest_verify(capsys, TDX / "quote.dat", tdx_policy(tmp_path, mrtd="11" * 48))
    assert code == REFUSALS["measurement"] and "[FAIL] MRTD" in out, out
    code, out = attest_verify(capsys, TDX / "quote.dat", tdx_policy(tmp_path, tcb_status=["OutOfDate"]))
    assert code == 8 and "[FAIL] TCB status: UpToDate; the policy accepts OutOfDate" in out, out


def test_the_sample_qe_identity_is_signed_but_names_another_qe(tmp_path, capsys) -> None:
    """Intel's sample QE identity verifies against the TCB signing chain, but its MRSIGNER is not the sample
    quote's QE's: checked as Intel's QVL does, the quoting enclave does not match (fixture data, named plainly)."""
    code, out = attest_verify(capsys, TDX / "quote.dat", tdx_policy(tmp_path, qe_identity=str(TDX / "qeIdentity.json")))
    assert "[ok] QE identity signed by Intel" in out, out
    assert code == 6 and "[FAIL] QE report matches the QE identity: MRSIGNER differ" in out, out


# ---------------------------------------------------------------- configfs-tsm against a stand-in directory


class FakeTsm:
    """A directory standing in for configfs-tsm: an entry made under it gets `provider` and `generation`, and an
    `outblob` (a FIFO) answered once `inblob` is written, with `generation` moved by `step`."""

    def __init__(self, root: Path, outblob: bytes, provider: str = "sev_guest", step: int = 1):
        self.root, self.outblob, self.provider, self.step = root, outblob, provider, step
        self.inblobs: list[bytes] = []
        root.mkdir()

    def made(self, entry: Path) -> None:
        (entry / "provider").write_text(self.provider + "\n")
        (entry / "generation").write_text("0\n")
        os.mkfifo(entry / "outblob")
        threading.Thread(target=self._answer, args=(entry,), daemon=True).start()

    def _answer(self, entry: Path) -> None:
        with open(entry / "outblob", "wb") as out:  # blocks until the provider reads, after writing inblob
            self.inblobs.append((entry / "inblob").read_bytes())
            (entry / "generation").write_text(f"{self.step}\n")
            out.write(self.outblob)


@pytest.fixture
def fake_tsm(tmp_path, monkeypatch):
    fake = FakeTsm(tmp_path / "report", (SNP / "sev-gcp.bin").read_bytes())
    mkdir = Path.mkdir

    def mkdir_and_populate(self: Path, *args, **kwargs) -> None:
        mkdir(self, *args, **kwargs)
        if self.parent == fake.root:
            fake.made(self)
    monkeypatch.setattr(Path, "mkdir", mkdir_and_populate)
    return fake


def test_the_tsm_provider_writes_the_report_data_and_reads_the_evidence(fake_tsm) -> None:
    from tracelm.io.attest.provider import tsm_report

    evidence = tsm_report(fake_tsm.root, b"\x07" * 64)
    assert fake_tsm.inblobs == [b"\x07" * 64]
    assert evidence == {"provider": "tsm", "tsm_provider": "sev_guest", "outblob": (SNP / "sev-gcp.bin").read_bytes()
                        .hex(), "auxblob": None, "generation": 1}
    fake_tsm.step = 3  # another writer raced this one
    with pytest.raises(Exception, match="generation went from 0 to 3"):
        tsm_report(fake_tsm.root, b"\x07" * 64)


def test_a_run_attested_by_tsm_carries_the_report_and_its_binding_is_checked(fake_tsm, tiny_gguf, tmp_path,
                                                                              capsys) -> None:
    """The whole path on real SNP evidence: the run writes the report into its header; verified under the SNP
    policy every check of the report passes, and the binding fails (the report's data is the fixture's zeros, not
    this run's key): a named refusal."""
    out = tmp_path / "tsm.jsonl"
    assert main(["run", "--model", str(tiny_gguf), "--set", "context=64", "--max-tokens", "2", "--trace", str(out),
                 "--attest", "tsm", "--set", f"attest.tsm_dir={fake_tsm.root}"]) == 0
    capsys.readouterr()
    header = json.loads(out.read_text().splitlines()[0])
    assert header["attestation"]["evidence"]["tsm_provider"] == "sev_guest" and len(fake_tsm.inblobs) == 1
    code = main(["trace", "verify", str(out), "--policy", str(snp_policy(tmp_path))])
    text = capsys.readouterr().out
    assert "[ok] report signed by the VCEK" in text, text
    assert code == REFUSALS["stale_nonce"] and "[FAIL] report data: nonce" in text, text


def test_no_configfs_tsm_is_one_line(tmp_path, capsys, tiny_gguf) -> None:
    from tests.test_hardening import assert_one_line

    code = main(["run", "--model", str(tiny_gguf), "--max-tokens", "1", "--trace", str(tmp_path / "t.jsonl"),
                 "--attest", "tsm", "--set", f"attest.tsm_dir={tmp_path / 'none'}"])
    assert_one_line(code, capsys.readouterr().err, "no configfs-tsm here")
