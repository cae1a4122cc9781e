"""A software TPM for the attestation tests (no tests here): Debian's `swtpm` on free loopback ports in a temporary
directory, provisioned with tracelm's own `attest tpm-setup` (a persistent EK and AK), stopped at the end.

The tests skip without swtpm and tpm2-tools, except where TRACELM_REQUIRE_SWTPM=1 (.ci/run sets it and installs
both), where a missing one fails them."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

TOOLS = ("swtpm", "tpm2_quote", "tpm2_createak", "tpm2_pcrextend")


def _free_pair() -> int:
    """A port P with P and P + 1 free on loopback (swtpm's server and control ports)."""
    for _ in range(50):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port < 65535:
            try:
                with socket.socket() as s:
                    s.bind(("127.0.0.1", port + 1))
                return port
            except OSError:
                continue
    raise RuntimeError("no two consecutive free ports")


class SwTpm:
    def __init__(self, workdir: Path):
        missing = [t for t in TOOLS if shutil.which(t) is None]
        if missing:
            why = f"{', '.join(missing)} not installed (apt-get install swtpm swtpm-tools tpm2-tools)"
            if os.environ.get("TRACELM_REQUIRE_SWTPM") == "1":
                pytest.fail(why)
            pytest.skip(why)
        self.dir = workdir
        (workdir / "state").mkdir(parents=True)
        self.port = _free_pair()
        self.tcti = f"swtpm:host=127.0.0.1,port={self.port}"
        self.proc = subprocess.Popen(
            ["swtpm", "socket", "--tpm2", "--tpmstate", f"dir={workdir / 'state'}", "--server",
             f"type=tcp,port={self.port}", "--ctrl", f"type=tcp,port={self.port + 1}", "--flags",
             "not-need-init,startup-clear"], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        deadline = time.monotonic() + 20
        while True:
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=1).close()
                break
            except OSError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    self.stop()
                    raise RuntimeError(f"swtpm did not start: {self.proc.stderr.read()!r}") from None  # type: ignore
                time.sleep(0.05)
        from tracelm.io.attest.provider import TpmOptions, tpm_setup

        self.ak_pem = workdir / "ak.pem"
        tpm_setup(TpmOptions(tcti=self.tcti), str(self.ak_pem))

    def tool(self, *args: str) -> str:
        done = subprocess.run(args, capture_output=True, text=True, timeout=60, check=True,
                              env={**os.environ, "TPM2TOOLS_TCTI": self.tcti})
        return done.stdout

    def extend(self, pcr: int, digest: bytes) -> None:
        self.tool("tpm2_pcrextend", f"{pcr}:sha256={digest.hex()}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)


def swtpm_fixture(tmp_path_factory: pytest.TempPathFactory, name: str) -> Iterator[SwTpm]:
    tpm = SwTpm(tmp_path_factory.mktemp(name))
    try:
        yield tpm
    finally:
        tpm.stop()
