"""The exit statuses of the audit commands (`trace verify`, `attest verify`, `replay`), in one light module: the
parser's --help prints them without importing `cryptography`. tracelm/audit/trust.py decides which one a verdict
gets; docs/trust.md prints the same tables."""

from __future__ import annotations

EXIT_TABLE = (  # (status, meaning): `--help` and docs/trust.md print this
    (0, "the verdict meets the required level (--require, the policy's require; default: trusted)"),
    (1, "broken: the hash chain breaks (the first bad line is named)"),
    (2, "not a trace, or bad input (a policy, key or option)"),
    (3, "unsigned (intact): nothing authenticated who wrote it"),
    (4, "signed by a key the policy does not trust"),
    (5, "not attested: the trace carries no evidence (a key vouching for itself)"),
    (6, "not attested: the evidence is malformed, or its signature or certificate chain fails"),
    (7, "not attested: evidence from another TPM (attestation key) or chip than the policy names"),
    (8, "not attested: a PCR, measurement, TCB or debug setting other than the policy's"),
    (9, "not attested: evidence made for another nonce (replayed)"),
    (10, "not attested: evidence over another key, tracelm version or model"),
    (11, "not attested: the trace is signed by a key the evidence does not bind"),
)

REPLAY_EXIT_TABLE = (  # `tracelm replay`: the comparison's, then the trust verdict's of a reproduced run
    (0, "reproduced, and the trace meets the required trust level (default: signed by a key you named)"),
    (1, "diverged: the first stage or token where the runs part is named"),
    (2, "cannot replay: not a trace, a broken chain (the first bad line is named), a missing or different model"),
    *((code, "reproduced, but " + meaning) for code, meaning in EXIT_TABLE if code >= 3),
)


def exit_table(table: tuple[tuple[int, str], ...] = EXIT_TABLE) -> str:
    """The exit statuses, one per line (for --help and the docs)."""
    return "\n".join(f"  {code:2d}  {meaning}" for code, meaning in table)
