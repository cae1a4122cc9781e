"""Audit of recorded runs: verifying a trace file and replaying it stage by stage."""
