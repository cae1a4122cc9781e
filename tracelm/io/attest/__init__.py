"""Attestation evidence formats (docs/trust.md): the binding of a trace's signing key into report data
(`binding`), TPM 2.0 structures (`tpm`), AMD SEV-SNP reports (`snp`), Intel TDX quotes and their collateral (`tdx`),
the DER and binary readers they share (`der`, `reader`), and the providers that ask a TEE for evidence (`provider`:
tpm2-tools, Linux configfs-tsm). Verification against an auditor's policy is in tracelm/audit/attest.py."""
