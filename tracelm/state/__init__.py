"""Frozen records and the one mutable Cache."""
