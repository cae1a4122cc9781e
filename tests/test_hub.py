"""Models from the Hugging Face Hub and the local caches (issue 30 item 2), against tests/hub_server.py: a Hub on
127.0.0.1 serving real files the tests make, reached by huggingface_hub through HF_ENDPOINT. Every download runs
in a child process whose environment (HF_HOME, HF_ENDPOINT, HF_HUB_OFFLINE, HF_TOKEN, OLLAMA_MODELS) is its own."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest

from tests.conftest import child_env, peak_rss_run
from tests.hf_synth import hf_model_folder
from tests.hub_server import COMMIT, Hub


def tracelm(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tracelm.cli", *args], capture_output=True, text=True, timeout=600,
                          env=child_env(**env), stdin=subprocess.DEVNULL)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return hf_model_folder(tmp_path_factory.mktemp("hf") / "tiny-hf")


@pytest.fixture(scope="module")
def ggufs(folder, tmp_path_factory):
    """A repo of two GGUF files (Q4_K_M and Q8_0 by name) made by `tracelm quantize`."""
    out = tmp_path_factory.mktemp("ggufs")
    for name, qtype in (("tiny-Q4_K_M.gguf", "q4_k"), ("tiny-Q8_0.gguf", "q8_0")):
        proc = subprocess.run([sys.executable, "-m", "tracelm.cli", "quantize", str(folder), str(out / name), "--type",
                               qtype], capture_output=True, text=True, env=child_env(), timeout=600)
        assert proc.returncode == 0, proc.stderr
    (out / "README.md").write_text("two quants\n")
    return out


@pytest.fixture
def hub(folder, ggufs):
    with Hub() as h:
        h.add("org/tiny", folder)
        h.add("org/tiny-gguf", ggufs)
        yield h


@pytest.fixture
def env(hub, tmp_path):
    return {"HF_HOME": str(tmp_path / "hf"), "HF_ENDPOINT": hub.url, "HF_HUB_DISABLE_TELEMETRY": "1",
            "HF_HUB_OFFLINE": "0", "HF_TOKEN": "", "OLLAMA_MODELS": str(tmp_path / "ollama"),
            "TRACELM_HOME": str(tmp_path / "tracelm")}


def test_run_hf_repo_downloads_quantizes_and_answers(folder, hub, env, tmp_path) -> None:
    """`tracelm run --model hf:ORG/REPO --quantize q4_k`: the folder comes from the Hub into huggingface_hub's cache,
    its matrices are quantized on load, and the answer is the one the local folder gives; the process's peak RSS
    stays under the quantized weights + KV cache + 200 MB (test_quantize.py sizes a model where that bites)."""
    from tracelm import Session
    from tracelm.session import held_bytes

    args = ["run", "--prompt", "hello there", "--max-tokens", "6", "--temperature", "0", "--quantize", "q4_k",
            "--context", "64"]
    proc, peak = peak_rss_run([sys.executable, "-m", "tracelm.cli", *args, "--model", "hf:org/tiny"], child_env(**env))
    assert proc.returncode == 0, proc.stderr
    s = Session(str(folder), quantize="q4_k", settings=["context=64"])
    want = s.generate("hello there", max_tokens=6, temperature=0)
    assert proc.stdout == want + "\n" and "6 generated" in proc.stderr
    bound = s.source.weights_bytes(quantize="q4_k") + held_bytes(s.runner) + 200 * 2**20
    assert peak < bound, (peak / 2**20, bound / 2**20)
    snapshot = tmp_path / "hf" / "hub" / "models--org--tiny" / "snapshots" / COMMIT
    assert sorted(p.name for p in snapshot.iterdir()) == sorted(p.name for p in folder.iterdir())
    got = {path for method, path, _r, _a in hub.requests if method == "GET" and "/resolve/" in path}
    assert {f"/org/tiny/resolve/{COMMIT}/{n}" for n in ("config.json", "model.safetensors", "tokenizer.json")} <= got

    hub.server.shutdown()  # the Hub gone: the cache serves, by hf: name (offline) and by ORG/REPO alone
    for model, offline in (("hf:org/tiny", "1"), ("org/tiny", "0")):
        proc = tracelm(*args, "--model", model, env={**env, "HF_HUB_OFFLINE": offline})
        assert proc.returncode == 0 and proc.stdout == want + "\n", (model, proc.stderr)


def test_pull_picks_a_gguf_by_quant(ggufs, hub, env, tmp_path) -> None:
    proc = tracelm("pull", "org/tiny-gguf:Q8_0", "-q", env=env)
    assert proc.returncode == 0, proc.stderr
    path = proc.stdout.strip()
    assert path.endswith("/snapshots/" + COMMIT + "/tiny-Q8_0.gguf")
    assert open(path, "rb").read() == (ggufs / "tiny-Q8_0.gguf").read_bytes()
    proc = tracelm("pull", "hf:org/tiny-gguf", "-q", env=env)  # several GGUFs, none named: Q4_K_M
    assert proc.returncode == 0 and proc.stdout.strip().endswith("tiny-Q4_K_M.gguf"), proc.stderr
    proc = tracelm("run", "--model", "hf:org/tiny-gguf:q8_0", "--prompt", "hi", "--max-tokens", "2", "--context", "64",
                   env={**env, "HF_HUB_OFFLINE": "1"})  # cached: no Hub needed, any case of the quant
    assert proc.returncode == 0, proc.stderr

    for spec, words in (("org/tiny-gguf:Q5_K_M", ["Q5_K_M", "Q4_K_M, Q8_0"]), ("org/missing", ["no such repository"]),
                        ("org/tiny-gguf:nope.gguf", ["nope.gguf", "not found"]), ("bad spec", ["hf:ORG/REPO"])):
        proc = tracelm("pull", spec, "-q", env=env)
        lines = proc.stderr.strip().splitlines()
        assert proc.returncode == 2 and len(lines) == 1 and all(w in lines[0] for w in words), (spec, proc.stderr)
    proc = tracelm("pull", "org/tiny-gguf:Q4_K_M", "-q", env={**env, "HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path)})
    assert proc.returncode == 2 and "HF_HUB_OFFLINE" in proc.stderr, proc.stderr


def test_download_resumes_and_sends_the_token(hub, env, tmp_path) -> None:
    """A connection dropped after 12 MB of a 16 MB file: the download resumes from what it kept -- in the same
    pull (huggingface_hub 2.4 retries from its last whole chunk) or in the next one (0.25 leaves the partial blob in
    the cache for the next pull to continue; the first says why it stopped, in one line) -- with a Range request,
    and the file is whole. HF_TOKEN goes to the Hub as a bearer token."""
    import numpy as np

    data = np.random.default_rng(0).integers(0, 256, 16 << 20, dtype=np.uint8).tobytes()
    repo = tmp_path / "big"
    repo.mkdir()
    (repo / "weights.bin").write_bytes(data)
    hub.add("org/big", repo)
    hub.cut_once["weights.bin"] = 12 << 20
    pull = ("pull", "org/big:weights.bin", "-q")
    proc = tracelm(*pull, env={**env, "HF_TOKEN": "hf_secret"})
    if proc.returncode != 0:
        assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
        proc = tracelm(*pull, env={**env, "HF_TOKEN": "hf_secret"})
    assert proc.returncode == 0, proc.stderr
    assert open(proc.stdout.strip(), "rb").read() == data
    ranges = [r for m, p, r, _a in hub.requests if m == "GET" and p.endswith("weights.bin") and r]
    assert len(ranges) == 1 and 0 < int(ranges[0].removeprefix("bytes=").split("-")[0]) <= 12 << 20, hub.requests
    assert {a for *_x, a in hub.requests} == {"Bearer hf_secret"}


def test_models_list_shows_the_local_caches(ggufs, hub, env, tmp_path) -> None:
    """The Hugging Face cache's models and Ollama's (manifests naming GGUF blobs) are listed and run by name."""
    assert tracelm("pull", "org/tiny", "-q", env=env).returncode == 0
    assert tracelm("pull", "org/tiny-gguf:Q8_0", "-q", env=env).returncode == 0
    blob = (ggufs / "tiny-Q8_0.gguf").read_bytes()
    import hashlib

    digest = hashlib.sha256(blob).hexdigest()
    ollama = tmp_path / "ollama"
    (ollama / "blobs").mkdir(parents=True)
    (ollama / "blobs" / f"sha256-{digest}").write_bytes(blob)
    manifest = ollama / "manifests" / "registry.ollama.ai" / "library" / "tinyllm" / "latest"
    manifest.parent.mkdir(parents=True)
    manifest.write_text(json.dumps({"schemaVersion": 2, "layers": [
        {"mediaType": "application/vnd.ollama.image.model", "digest": f"sha256:{digest}", "size": len(blob)},
        {"mediaType": "application/vnd.ollama.image.template", "digest": "sha256:" + "0" * 64, "size": 1}]}))
    broken = manifest.parent.parent / "broken" / "latest"
    broken.parent.mkdir()
    broken.write_text("{not json")

    proc = tracelm("models", "list", env=env)
    assert proc.returncode == 0, proc.stderr
    names = {line.split()[0]: line for line in proc.stdout.splitlines()}
    assert "smollm2-135m-instruct" in names
    assert "hf:org/tiny" in names and "hf:org/tiny-gguf:tiny-Q8_0.gguf" in names
    assert "tinyllm:latest" in names and str(ollama / "blobs") in names["tinyllm:latest"]
    assert not any("broken" in n for n in names)
    hub.server.shutdown()
    for model in ("ollama:tinyllm", "tinyllm:latest", "org/tiny-gguf:Q8_0"):
        proc = tracelm("run", "--model", model, "--prompt", "hi", "--max-tokens", "2", "--context", "64", env=env)
        assert proc.returncode == 0, (model, proc.stderr)
    proc = tracelm("run", "--model", "org/unknown", "--prompt", "hi", env=env)
    assert proc.returncode == 2 and "hf:org/unknown" in proc.stderr, proc.stderr
    shutil.rmtree(ollama)
