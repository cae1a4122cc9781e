"""Shared fixtures: a tiny synthetic llama GGUF (random weights, byte-level vocabulary) and the real
registry models (downloaded once into TRACELM_HOME). A test whose model cannot be fetched, or that needs the
transformers reference where it is not installed, skips with the reason on a developer's machine and fails under
CI (`CI=true`, which .ci/run sets): see `unavailable`."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import NoReturn

import gguf
import numpy as np
import pytest

REPO = Path(__file__).resolve().parents[1]
FIXTURES = REPO.parent / "shared" / "fixtures"


def byte_level_vocab() -> list[str]:
    """The 256 single-byte tokens of byte-level BPE (GPT-2's printable mapping of bytes)."""
    printable = list(range(33, 127)) + list(range(161, 173)) + list(range(174, 256))
    mapping, n = {}, 0
    for b in range(256):
        if b in printable:
            mapping[b] = chr(b)
        else:
            mapping[b] = chr(256 + n)
            n += 1
    return [mapping[b] for b in range(256)]


def child_env(**extra: str) -> dict[str, str]:
    """The environment for a Python child process: this one's, with the parent's whole import path (the checkout
    first, then every folder this interpreter imports from) as PYTHONPATH, so a child finds tracelm and its
    dependencies wherever they are installed (a venv, a `pip install --target` folder on PYTHONPATH, the source
    tree) -- plus `extra`."""
    path = [str(REPO), *(p for p in sys.path if p and Path(p).is_dir())]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(dict.fromkeys(path)), **extra}


def peak_rss_run(cmd: list[str], env: dict[str, str], timeout: float = 600) -> tuple[subprocess.CompletedProcess, int]:
    """Run `cmd` and return it with its peak RSS in bytes (resource.getrusage's ru_maxrss of its process). It runs as
    the child of a small launcher: Linux carries the high-water RSS of the memory a process replaces at exec into its
    own ru_maxrss, and a child of this (large) test process would start with the tests' peak."""
    launcher = ("import resource, subprocess, sys; code = subprocess.run(sys.argv[1:]).returncode; "
                "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024, file=sys.stderr); sys.exit(code)")
    proc = subprocess.run([sys.executable, "-c", launcher, *cmd], capture_output=True, text=True, timeout=timeout,
                          env=env, stdin=subprocess.DEVNULL)
    lines = proc.stderr.rstrip("\n").split("\n")
    proc.stderr = "\n".join(lines[:-1])
    return proc, int(lines[-1])


TINY = dict(n_embd=64, n_layer=2, n_head=4, n_head_kv=2, n_ff=96, n_ctx=4096, rope_base=10000.0)


F32 = gguf.GGMLQuantizationType.F32


def write_tiny_gguf(path: Path, *, arch: str = "llama", qtype: gguf.GGMLQuantizationType = F32,
                    drop: str | None = None, seed: int = 0, tied: bool = True, window: int = 0) -> Path:
    """A 2-layer llama with random weights and a byte-level BPE vocabulary (256 bytes, 3 merges,
    <|endoftext|> as BOS/EOS). `drop` leaves one tensor out; `qtype` stores the matrices quantized;
    `window` > 0 gives every layer that sliding window (mistral-style)."""
    rng = np.random.default_rng(seed)
    t = TINY
    tokens = byte_level_vocab() + ["he", "ll", "hell", "<|endoftext|>"]
    n_vocab, d, hd = len(tokens), t["n_embd"], t["n_embd"] // t["n_head"]
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(t["n_layer"])
    w.add_context_length(t["n_ctx"])
    w.add_embedding_length(d)
    w.add_feed_forward_length(t["n_ff"])
    w.add_head_count(t["n_head"])
    w.add_head_count_kv(t["n_head_kv"])
    w.add_rope_freq_base(t["rope_base"])
    w.add_rope_dimension_count(hd)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types([1] * (n_vocab - 1) + [3])
    w.add_token_merges(["h e", "l l", "he ll"])
    w.add_bos_token_id(n_vocab - 1)
    w.add_eos_token_id(n_vocab - 1)
    w.add_add_bos_token(False)
    if window:
        w.add_sliding_window(window)

    def mat(rows: int, cols: int) -> np.ndarray:
        return (rng.standard_normal((rows, cols)) / np.sqrt(cols)).astype(np.float32)

    tensors = {"token_embd.weight": mat(n_vocab, d), "output_norm.weight": 1 + 0.1 * rng.standard_normal(d)}
    if not tied:
        tensors["output.weight"] = mat(n_vocab, d)
    for i in range(t["n_layer"]):
        p = f"blk.{i}."
        tensors |= {
            p + "attn_norm.weight": 1 + 0.1 * rng.standard_normal(d),
            p + "attn_q.weight": mat(t["n_head"] * hd, d),
            p + "attn_k.weight": mat(t["n_head_kv"] * hd, d),
            p + "attn_v.weight": mat(t["n_head_kv"] * hd, d),
            p + "attn_output.weight": mat(d, t["n_head"] * hd),
            p + "ffn_norm.weight": 1 + 0.1 * rng.standard_normal(d),
            p + "ffn_gate.weight": mat(t["n_ff"], d),
            p + "ffn_up.weight": mat(t["n_ff"], d),
            p + "ffn_down.weight": mat(d, t["n_ff"]),
        }
    for name, a in tensors.items():
        if name == drop:
            continue
        a = np.asarray(a, np.float32)
        if a.ndim == 2 and qtype != gguf.GGMLQuantizationType.F32:
            w.add_tensor(name, gguf.quants.quantize(a, qtype), raw_dtype=qtype)
        else:
            w.add_tensor(name, a)
    return finish_gguf(w, path)


def finish_gguf(w: gguf.GGUFWriter, path: Path) -> Path:
    """Write a GGUFWriter's header, metadata and tensors to its file and close it."""
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.fixture(scope="session")
def tiny_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_gguf(tmp_path_factory.mktemp("tiny") / "tiny-llama.gguf")


@pytest.fixture(scope="session")
def smollm2_path() -> Path:
    """The real default model, pulled into TRACELM_HOME on first use."""
    return _pull("smollm2-135m-instruct")


@pytest.fixture(scope="session")
def smollm2(smollm2_path: Path):
    from tracelm.io.loader import load_model

    return load_model(str(smollm2_path), progress=False)


@pytest.fixture(scope="session")
def smollm2_reference(smollm2_path: Path):
    """The default model on `compute: reference`: f32 weights, numpy's products."""
    from tracelm.io.loader import load_model

    return load_model(str(smollm2_path), progress=False, compute="reference")


def in_ci() -> bool:
    """Whether the suite runs under CI: the environment variable CI set to true (.ci/run sets it, as CI services
    do)."""
    return os.environ.get("CI", "").strip().lower() in ("1", "true", "yes")


def unavailable(why: str) -> NoReturn:
    """A test's prerequisite is missing (a registry model that cannot be fetched, the transformers reference not
    installed): skipped on a developer's machine, say one without network; failed under CI, which installs the
    test extra and fetches the models, so that a broken fetch fails the run instead of quietly shortening it."""
    if in_ci():
        pytest.fail(f"{why} (CI=true: required here, not skipped)", pytrace=False)
    pytest.skip(why)


def require_reference() -> None:
    """transformers + torch (the `reference` extra, in the test extra): present, or `unavailable`.
    TRACELM_SKIP_REFERENCE=1 skips the reference tests on purpose, CI or not."""
    if os.environ.get("TRACELM_SKIP_REFERENCE") == "1":
        pytest.skip("TRACELM_SKIP_REFERENCE=1: the transformers reference is skipped on request")
    try:
        import torch  # noqa: F401
        import transformers  # noqa: F401
    except ImportError as e:
        unavailable(f"transformers + torch not installed (pip install -e '.[reference]'): {e}")


def _pull(name: str) -> Path:
    """A registry model, pulled into TRACELM_HOME on first use, or `unavailable`."""
    from tracelm import TracelmError
    from tracelm.io import registry

    try:
        return registry.pull(name, progress=False)
    except TracelmError as e:
        unavailable(f"model {name} not available: {e}")


def transformers_model(gguf_path: Path):
    """transformers' own model of a GGUF file, in f32: its reader and its dequantization of every block (gguf-py),
    the reference the kernels' logits are compared with, as `tracelm validate` does. Reading a GGUF costs
    transformers 20-70 s on 2 cores (it parses the vocabulary twice and dequantizes in numpy), so the model it read
    is kept, once per file and transformers version, as an f32 safetensors folder under
    TRACELM_HOME/fixtures/hf-models (the same tensors, bit for bit: 0.5 - 2.4 GB a model), read again in a second."""
    require_reference()
    import torch
    import transformers
    from transformers import AutoModelForCausalLM

    from tracelm.io import registry

    key = f"{gguf_path.stem}-{gguf_path.stat().st_size}-transformers-{transformers.__version__}"
    folder = registry.home() / "fixtures" / "hf-models" / key
    if not (folder / "config.json").is_file():
        read = AutoModelForCausalLM.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name,
                                                    dtype=torch.float32)
        cfg = read.config
        del cfg.quantization_config  # a plain (dequantized) model, so that save_pretrained writes it
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
        model.load_state_dict(read.state_dict())
        tmp = folder.with_name(f"{folder.name}.part{os.getpid()}")
        shutil.rmtree(tmp, ignore_errors=True)
        model.save_pretrained(str(tmp))
        try:
            tmp.rename(folder)
        except OSError:  # another process's copy got there first
            shutil.rmtree(tmp, ignore_errors=True)
    return AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()


@pytest.fixture(scope="session")
def gemma3_path() -> Path:
    """Gemma 3 270M (GGUF Q4_K_M), pulled into TRACELM_HOME on first use."""
    return _pull("gemma3-270m")


@pytest.fixture(scope="session")
def qwen_coder_path() -> Path:
    """Qwen2.5-Coder-0.5B-Instruct (GGUF Q4_K_M), pulled into TRACELM_HOME on first use."""
    return _pull("qwen2.5-coder-0.5b-instruct")


@pytest.fixture
def kernels_restored():
    """The kernels' path, thread count and prefetch hint, put back as they were after the test."""
    import tracelm.kernels as kernels

    path, threads, hint = kernels.path(), kernels.threads(), kernels.prefetch_hint()
    yield
    kernels.use_path(path)
    kernels.set_threads(threads)
    kernels.set_prefetch_hint(hint)
