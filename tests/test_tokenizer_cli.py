"""`tracelm tokenize` and the tokenizers on bad input: llama.cpp's llama-spm vectors through the CLI (on a
vocabulary-only GGUF built from LLaMA's tokenizer.model, since the shared ggml-vocab-llama-spm.gguf is damaged),
inputs split by a separator line, --decode, invalid UTF-8, lone surrogates, empty and 10 MB strings, ids out
of range."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import finish_gguf
from tests.test_gpt2_vectors import SEPARATOR, read_vectors
from tests.test_tokenizer import small_meta
from tests.test_tokenizer_reference import SP_MODEL, write_llama_vocab_gguf
from tracelm import TracelmError
from tracelm.cli import main
from tracelm.io.loader import load_tokenizer
from tracelm.io.tokenizer import Tokenizer
from tracelm.io.tokenizer_formats import from_gguf_metadata
from tracelm.tools.tokenize import parse_ids, split_inputs

VOCAB = SP_MODEL.parents[1] / "vocab"
LLAMA_SPM = VOCAB / "ggml-vocab-llama-spm.gguf"


@pytest.fixture(scope="module")
def llama_gguf(tmp_path_factory) -> Path:
    if not SP_MODEL.is_file():
        pytest.skip(f"shared fixture {SP_MODEL} is absent")
    import sentencepiece

    sp = sentencepiece.SentencePieceProcessor(model_file=str(SP_MODEL))
    return write_llama_vocab_gguf(tmp_path_factory.mktemp("spm") / "llama-spm-vocab.gguf", sp)


def run_cli(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


def test_llama_spm_vectors_through_the_cli(llama_gguf, capsys):
    if not LLAMA_SPM.with_suffix(".gguf.inp").is_file():
        pytest.skip(f"{LLAMA_SPM}.inp is absent")
    vectors = read_vectors(LLAMA_SPM)
    code, out, _ = run_cli(capsys, "tokenize", "--model", str(llama_gguf), "--input-file", f"{LLAMA_SPM}.inp",
                           "--separator", SEPARATOR.strip())
    assert code == 0
    got = [json.loads(line) for line in out.splitlines()]
    want = [ids for _, ids in vectors]
    n_ok = sum(g == w for g, w in zip(got, want, strict=False))
    assert len(got) == len(want) == 46 and n_ok == len(want), f"{n_ok}/{len(want)} vectors pass"
    # and back: --decode of the expected ids gives the inputs (the prefix space is the tokenizer's, dropped)
    ids_file = Path(llama_gguf).with_name("ids.txt")
    ids_file.write_text("\n".join(json.dumps(w) for w in want) + "\n")
    code, out, _ = run_cli(capsys, "tokenize", "--model", str(llama_gguf), "--decode", "--input-file",
                           str(ids_file), "--separator", "__sep__")
    assert code == 0
    assert split_inputs(out, "__sep__") == [x for x, _ in vectors]
    print(f"\nggml-vocab-llama-spm vectors via `tracelm tokenize --input-file`: {n_ok}/{len(want)}")


def test_damaged_llama_spm_fixture_fails_clearly():
    if not LLAMA_SPM.is_file():
        pytest.skip(f"{LLAMA_SPM} is absent")
    try:
        load_tokenizer(str(LLAMA_SPM))
    except TracelmError as e:
        assert LLAMA_SPM.name in str(e) and "\n" not in str(e)
    else:  # repaired: then it must pass the vectors too
        tok = load_tokenizer(str(LLAMA_SPM))
        assert all(tok.encode(x, add_bos=False) == w for x, w in read_vectors(LLAMA_SPM))


def test_cli_entry_point_runs(llama_gguf):
    r = subprocess.run([sys.executable, "-m", "tracelm.cli", "tokenize", "--model", str(llama_gguf), "--text",
                        "Hello world", "--add-special"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout) == [1, 15043, 3186]


def test_split_inputs_and_parse_ids():
    assert split_inputs("a\nb\n", None) == ["a", "b"]
    assert split_inputs("", None) == []
    assert split_inputs("a\nSEP\n\nSEP\nb\nc\nSEP\n", "SEP") == ["a", "", "b\nc"]
    assert split_inputs("\n\nSEP\n", "SEP") == ["\n"]
    assert split_inputs("x", "SEP") == ["x"]
    assert parse_ids("[1, 2,3]") == [1, 2, 3] == parse_ids("1 2 3") == parse_ids(" 1,2 , 3 ")
    assert parse_ids("[]") == [] == parse_ids("")
    for bad in ("[1, a]", "1.5", "hello", "[[1]]"):
        with pytest.raises(TracelmError, match="not a list of token ids"):
            parse_ids(bad)


# ---------------------------------------------------------------- bad input


@pytest.fixture(scope="module")
def small_gguf(tmp_path_factory) -> Path:
    import gguf

    meta = small_meta(extra=("ab",), merges=("a b",))
    path = tmp_path_factory.mktemp("small") / "small-vocab.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("gpt-2")
    w.add_token_list(meta["tokenizer.ggml.tokens"])
    w.add_token_types(meta["tokenizer.ggml.token_type"])
    w.add_token_merges(meta["tokenizer.ggml.merges"])
    w.add_eos_token_id(meta["tokenizer.ggml.eos_token_id"])
    w.add_bos_token_id(meta["tokenizer.ggml.bos_token_id"])
    return finish_gguf(w, path)


def test_invalid_utf8_input_file_is_a_clear_error(small_gguf, tmp_path, capsys):
    f = tmp_path / "bad.txt"
    f.write_bytes(b"fine\nbad \xff\xfe here\n")
    code, out, err = run_cli(capsys, "tokenize", "--model", str(small_gguf), "--input-file", str(f))
    assert code == 2 and out == ""
    assert "not UTF-8" in err and "offset 9" in err and err.count("\n") == 1


def test_lone_surrogates_are_a_clear_error(small_gguf, capsys):
    tok = load_tokenizer(str(small_gguf))
    with pytest.raises(TracelmError, match="lone surrogate U\\+D800 at character 1"):
        tok.encode("a\ud800b")
    # what the shell passes for bytes that are not UTF-8 (Python's surrogateescape): the same error
    code, _, err = run_cli(capsys, "tokenize", "--model", str(small_gguf), "--text", "x\udcff")
    assert code == 2 and "lone surrogate U+DCFF" in err


def test_empty_text(small_gguf, llama_gguf, capsys):
    small = load_tokenizer(str(small_gguf))
    assert small.encode("") == [] and small.decode([]) == ""
    llama = load_tokenizer(str(llama_gguf))
    assert llama.encode("", add_bos=False) == [] and llama.encode("") == [1]
    code, out, _ = run_cli(capsys, "tokenize", "--model", str(llama_gguf), "--text", "")
    assert code == 0 and out == "[]\n"


def test_ten_megabyte_string(llama_gguf):
    tok = load_tokenizer(str(llama_gguf))
    line = "The quick brown fox jumps over the lazy dog, 1234 times; naïve café 🦙.\n"
    text = (line * (10_000_000 // len(line) + 1))[:10_000_000]
    t0 = time.perf_counter()
    ids = tok.encode(text, add_bos=False)
    seconds = time.perf_counter() - t0
    print(f"\n10 MB of text: {len(ids)} tokens in {seconds:.1f} s")
    assert tok.decode(ids) == text
    assert ids[:20] == tok.encode(text[:60], add_bos=False)[:20]


def test_decode_ids_out_of_range(small_gguf, capsys):
    n = load_tokenizer(str(small_gguf)).n_vocab
    for bad in (str(n), "-1", "99999999999999999999"):
        code, out, err = run_cli(capsys, "tokenize", "--model", str(small_gguf), "--decode", "--text", f"[97, {bad}]")
        assert code == 2 and out == "" and f"token id {bad} is outside the vocabulary (0..{n - 1})" in err
    code, out, err = run_cli(capsys, "tokenize", "--model", str(small_gguf), "--decode", "--text", "97 x")
    assert code == 2 and "not a list of token ids" in err
    code, out, _ = run_cli(capsys, "tokenize", "--model", str(small_gguf), "--decode", "--text", "[104, 105]")
    assert code == 0 and out == "hi\n"


def test_tokenize_needs_one_input(small_gguf, capsys):
    code, _, err = run_cli(capsys, "tokenize", "--model", str(small_gguf))
    assert code == 2 and "exactly one of --text or --input-file" in err
    code, _, err = run_cli(capsys, "tokenize", "--model", "/nonexistent/tokenizer.json", "--text", "x")
    assert code == 2 and "nonexistent" in err


@pytest.mark.parametrize("name, content, message", [
    ("vocab.txt", b"hello", "vocab.txt: not a tokenizer"),
    ("tokenizer.bin", b"\x10\x00\x00\x00\x00\x00\x80\x3f\xff\x00\x00\x00ab", "truncated or corrupt llama2.c tokenizer"),
    ("tokenizer.json", b"{not json", "not a valid tokenizer.json"),
    ("x.model", b"\x00garbage", "not a readable SentencePiece model"),
])
def test_unknown_or_broken_tokenizer_files_are_named(tmp_path, name, content, message):
    f = tmp_path / name
    f.write_bytes(content)
    with pytest.raises(TracelmError, match=message):
        load_tokenizer(str(f))


def test_every_tokenizer_kind_has_one_interface(small_gguf, llama_gguf):
    kinds = [load_tokenizer(str(small_gguf)), load_tokenizer(str(llama_gguf))]
    if SP_MODEL.is_file():
        kinds += [load_tokenizer(str(SP_MODEL)), load_tokenizer(str(SP_MODEL.with_name("tokenizer.bin")))]
    for tok in kinds:
        assert isinstance(tok, Tokenizer)
        ids = tok.encode("hello 🦙", add_bos=True)
        assert ids[0] == tok.bos_id and tok.eos_id in tok.eog_ids
        stream = tok.stream_decoder()
        assert "".join(stream.push(i) for i in ids) + stream.flush() == tok.decode(ids)
        assert tok.decode(ids, skip_special=True).strip() == "hello 🦙"
        assert b"".join(tok.token_bytes(i) for i in ids[1:]).decode().strip() == "hello 🦙"
        assert all(isinstance(tok.piece(i), str) for i in ids) and tok.n_vocab > max(ids)


def test_stream_decoder_equals_decode_on_random_ids(llama_gguf, small_gguf):
    """Byte tokens, control tokens and the SentencePiece prefix space, in any order: streaming gives the text
    of a one-shot decode, piece by piece, and never a half character."""
    import random

    rng = random.Random(7)
    for path in (llama_gguf, small_gguf):
        tok = load_tokenizer(str(path))
        byte_ids = [i for i in range(tok.n_vocab) if tok.token_type(i) == 6] or list(range(256))
        for _ in range(300):
            ids = [rng.choice([rng.randrange(tok.n_vocab), rng.choice(byte_ids), tok.bos_id])
                   for _ in range(rng.randrange(10))]
            for skip in (False, True):
                stream = tok.stream_decoder(skip_special=skip)
                parts = [stream.push(i) for i in ids]
                assert "".join(parts) + stream.flush() == tok.decode(ids, skip_special=skip)
        text = "naïve 🦙 日本"
        ids = tok.encode(text, add_bos=False)
        stream = tok.stream_decoder()
        parts = [stream.push(i) for i in ids]
        assert "".join(parts) == text and not any("\ufffd" in p for p in parts)


def test_long_texts_encode_as_one(llama_gguf, small_gguf):
    """Long texts are cut at newlines and encoded in parallel; the ids are those of encoding them whole."""
    import tracelm.io.tokenizer as tokenizer_module

    line = "x\n\n  Hello <s>world</s>!\n\t1234\nend.\n\n=== head\n"
    text = line * 40
    newlines = from_gguf_metadata(small_meta(extra=("\u010a\u010a",), merges=("\u010a \u010a",)))
    for tok in (load_tokenizer(str(llama_gguf)), load_tokenizer(str(small_gguf)), newlines):
        parts = {}
        sizes = [*range(8, 90, 3), 10**9]
        for chunk in sizes:  # cut after a few characters each time (at the next newline that allows it), or never
            old = tokenizer_module._CHUNK
            tokenizer_module._CHUNK = chunk
            try:
                parts[chunk] = [tok.encode(text, add_bos=False, parse_special=p) for p in (False, True)]
            finally:
                tokenizer_module._CHUNK = old
        assert all(parts[size] == parts[10**9] for size in sizes)
