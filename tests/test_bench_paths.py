"""`tracelm bench paths`: every kernel path on one model, alternated, with their bits compared."""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import pytest

from tests.conftest import write_tiny_gguf
from tracelm import cli, kernels
from tracelm.state.errors import TracelmError
from tracelm.tools.bench_paths import bench_paths


@pytest.fixture(scope="module")
def tiny_q8(tmp_path_factory):
    return write_tiny_gguf(tmp_path_factory.mktemp("paths") / "tiny-q8.gguf", qtype=gguf.GGMLQuantizationType.Q8_0)


def test_every_path_rated_with_ratios_and_the_same_bits(tiny_q8, kernels_restored):
    names = kernels.paths()
    before = kernels.path()
    report = bench_paths(str(tiny_q8), n_prompt=16, n_decode=3, rounds=2, paths=names, threads=1)
    assert report["same_bits"] is True and report["rounds"] == 2
    assert kernels.path() == before  # put back
    base = "avx2" if "avx2" in names else names[0]
    for p in names:
        entry = report[p]
        for what in ("prefill", "decode", "products"):
            spread = entry[f"{what}_tok_s"]
            assert 0 < spread["min"] <= spread["median"] <= spread["max"]
            assert (f"{what}_vs_{base}" in entry) == (p != base)
        assert report["selftest"][p].startswith("passed")


def test_a_path_this_cpu_cannot_run_is_refused(tiny_q8):
    with pytest.raises(TracelmError, match="cannot run here"):
        bench_paths(str(tiny_q8), n_prompt=8, n_decode=1, rounds=1, paths=("neon",))


def test_cli(tiny_q8, capsys, kernels_restored):
    assert cli.main(["bench", "paths", "--model", str(tiny_q8), "--prompt-tokens", "8", "--decode-tokens", "2",
                     "--repeats", "1", "--threads", "1", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["same_bits"] is True
    assert [p for p in kernels.paths() if p != "portable"] == [k for k in report if k in kernels.paths()]


def test_cli_paths_picks_the_paths(tiny_q8, capsys, kernels_restored):
    """`--paths A,B` alternates those paths alone."""
    assert cli.main(["bench", "paths", "--model", str(tiny_q8), "--prompt-tokens", "8", "--decode-tokens", "2",
                     "--repeats", "1", "--threads", "1", "--paths", "portable", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert [k for k in report if k in kernels.paths()] == ["portable"]


def test_prefetch_distances_alternated_as_variants(tiny_q8, kernels_restored):
    """`k_ahead`: each path at each distance, a variant each with the same bits, the ratios to the first distance;
    the distance in use put back."""
    before = kernels.k_ahead()
    path = kernels.path()
    report = bench_paths(str(tiny_q8), n_prompt=8, n_decode=2, rounds=1, paths=(path,), k_ahead=(2, 0), threads=1)
    assert report["same_bits"] is True and report["k_ahead"] == before and kernels.k_ahead() == before
    first, second = f"{path} k_ahead=2", f"{path} k_ahead=0"
    assert set(report) >= {first, second} and path not in report
    assert f"decode_vs_{first}" in report[second] and f"decode_vs_{first}" not in report[first]


def test_cli_k_ahead(tiny_q8, capsys, kernels_restored):
    assert cli.main(["bench", "paths", "--model", str(tiny_q8), "--prompt-tokens", "8", "--decode-tokens", "1",
                     "--repeats", "1", "--threads", "1", "--paths", "portable", "--k-ahead", "0,8", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert {"portable k_ahead=0", "portable k_ahead=8"} <= set(report)
    assert cli.main(["bench", "paths", "--model", str(tiny_q8), "--k-ahead", "4,65"]) != 0
    assert "prefetch distance 65 is not 0..64 super-blocks" in capsys.readouterr().err
    assert cli.main(["bench", "paths", "--model", str(tiny_q8), "--k-ahead", "4,-1"]) != 0
    assert "--k-ahead '4,-1': expected distinct integers from 0 on" in capsys.readouterr().err


def test_prefetch_hints_and_distances_alternated_as_variants(tiny_q8, kernels_restored):
    """`hints`: each path at each prefetch hint (and, with `k_ahead`, at each distance at each hint), a variant each
    with the same bits, the ratios to the first; the hint in use put back and named."""
    kernels.set_prefetch_hint("t0")
    path = kernels.path()
    report = bench_paths(str(tiny_q8), n_prompt=8, n_decode=2, rounds=1, paths=(path,), k_ahead=(4, 1),
                         hints=("nta", "t0"), threads=1)
    assert report["same_bits"] is True and report["prefetch_hint"] == "t0" and kernels.prefetch_hint() == "t0"
    names = [f"{path} k_ahead={a} hint={h}" for a in (4, 1) for h in ("nta", "t0")]
    assert [k for k in report if k.startswith(path)] == names
    assert all(f"decode_vs_{names[0]}" in report[n] for n in names[1:])
    with pytest.raises(TracelmError, match="prefetch hint 't1' is not one of t0, nta"):
        bench_paths(str(tiny_q8), n_prompt=8, n_decode=1, rounds=1, paths=(path,), hints=("t0", "t1"), threads=1)


def test_cli_prefetch_hints(tiny_q8, capsys, kernels_restored):
    kernels.set_prefetch_hint("t0")
    assert cli.main(["bench", "paths", "--model", str(tiny_q8), "--prompt-tokens", "8", "--decode-tokens", "1",
                     "--repeats", "1", "--threads", "1", "--paths", "portable", "--prefetch-hints", "t0,nta",
                     "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert {"portable hint=t0", "portable hint=nta"} <= set(report) and report["prefetch_hint"] == "t0"
    assert cli.main(["bench", "paths", "--model", str(tiny_q8), "--prefetch-hints", "t0,x"]) != 0
    assert "prefetch hint 'x' is not one of t0, nta" in capsys.readouterr().err
    assert cli.main(["bench", "--model", str(tiny_q8), "--prefetch-hints", "nta"]) == 2
    assert "--k-ahead and --prefetch-hints apply to bench paths only" in capsys.readouterr().err


def test_huge_pages_read_from_the_kernels_account(tmp_path):
    """AnonHugePages of smaps_rollup in MB; None where the file or the line is missing."""
    from tracelm.tools.bench import huge_pages_mb

    smaps = tmp_path / "smaps_rollup"
    smaps.write_text("Rss:  4677680 kB\nAnonHugePages:   4562944 kB\nShmemPmdMapped:  0 kB\n")
    assert huge_pages_mb(str(smaps)) == 4456.0
    smaps.write_text("Rss:  10 kB\n")
    assert huge_pages_mb(str(smaps)) is None
    assert huge_pages_mb(str(tmp_path / "absent")) is None


def test_steal_read_from_the_kernels_account(tmp_path):
    """/proc/stat's first line: every CPU's ticks and the stolen ones; the stolen share between two reads; None
    where the file, the line or its steal column is missing, or no time passed."""
    from tracelm.tools.bench import cpu_times, steal_share

    stat = tmp_path / "stat"
    stat.write_text("cpu  600 0 100 200 50 0 15 35 7 0\ncpu0 300 0 50 100 25 0 8 17 3 0\nintr 5\n")
    assert cpu_times(str(stat)) == (1000, 35)  # user .. steal; guest time is already in user
    assert steal_share((1000, 35), (3000, 1035)) == 0.5  # half the CPU time: one core of two
    assert steal_share((1000, 35), (1800, 35)) == 0.0
    assert steal_share((1000, 35), (1000, 35)) is None and steal_share(None, (3000, 1035)) is None
    stat.write_text("cpu  600 0 100 200\n")  # a kernel that does not count steal
    assert cpu_times(str(stat)) is None
    assert cpu_times(str(tmp_path / "absent")) is None
    if Path("/proc/stat").exists():  # this machine's own account
        total, stolen = cpu_times()
        assert 0 <= stolen <= total


def test_a_bench_report_names_the_kernels_tuning_variables_set(monkeypatch):
    """A sweep's reports say what each ran with: the kernels' variables set in the environment, and only those."""
    from tracelm.tools.bench import KERNELS_ENV, kernels_in_use

    assert {"TRACELM_KERNELS", "TRACELM_K_AHEAD", "TRACELM_TASKS_PER_THREAD", "TRACELM_SPIN_US"} <= set(KERNELS_ENV)
    for name in KERNELS_ENV:
        monkeypatch.delenv(name, raising=False)
    assert "kernels_env" not in kernels_in_use()
    monkeypatch.setenv("TRACELM_K_AHEAD", "8")
    monkeypatch.setenv("TRACELM_SPIN_US", "")
    report = kernels_in_use()
    assert report["kernels_env"] == {"TRACELM_K_AHEAD": "8"} and report["kernels_path"] == kernels.path()
    assert report["k_ahead"] == kernels.k_ahead()  # what the extension runs with (it read the variable at import)
    assert report["prefetch_hint"] == kernels.prefetch_hint()
