"""The suite's prerequisites (tests/conftest.py): a registry model that cannot be fetched, or transformers not
installed, skips a test on a developer's machine and fails it under CI (CI=true, which .ci/run sets)."""

from __future__ import annotations

import sys

import pytest

from tests.conftest import _pull, require_reference
from tracelm import TracelmError
from tracelm.io import registry


@pytest.fixture
def offline(monkeypatch):
    def pull(name: str, progress: bool = True):
        raise TracelmError(f"{name}: no network here")

    monkeypatch.setattr(registry, "pull", pull)


@pytest.fixture
def no_transformers(monkeypatch):
    monkeypatch.delenv("TRACELM_SKIP_REFERENCE", raising=False)
    monkeypatch.setitem(sys.modules, "transformers", None)  # import transformers -> ImportError


@pytest.mark.parametrize("ci", ["true", "1"])
def test_under_ci_a_model_that_cannot_be_fetched_fails(offline, monkeypatch, ci: str) -> None:
    monkeypatch.setenv("CI", ci)
    with pytest.raises(pytest.fail.Exception, match=r"model gemma3-270m not available: .*no network.*CI=true"):
        _pull("gemma3-270m")


@pytest.mark.parametrize("ci", [None, "false", ""])
def test_elsewhere_it_skips(offline, monkeypatch, ci: str | None) -> None:
    if ci is None:
        monkeypatch.delenv("CI", raising=False)
    else:
        monkeypatch.setenv("CI", ci)
    with pytest.raises(pytest.skip.Exception, match="model gemma3-270m not available: .*no network"):
        _pull("gemma3-270m")


def test_under_ci_missing_transformers_fails(no_transformers, monkeypatch) -> None:
    monkeypatch.setenv("CI", "true")
    with pytest.raises(pytest.fail.Exception, match=r"transformers \+ torch not installed.*CI=true"):
        require_reference()
    monkeypatch.delenv("CI")
    with pytest.raises(pytest.skip.Exception, match=r"transformers \+ torch not installed"):
        require_reference()
