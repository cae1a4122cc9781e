"""Byte-level BPE tokenizer: llama.cpp's test vectors, transformers on SmolLM2, a small vocabulary."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from tracelm import TracelmError
from tracelm.io.gguf_file import GGUFFile
from tracelm.io.tokenizer import Tokenizer
from tracelm.io.tokenizer_formats import PRE_TOKENIZERS, _byte_alphabet, from_gguf_metadata, from_scored_vocab

FIXTURES = Path(__file__).parents[2] / "shared" / "fixtures"




# ---------------------------------------------------------------- a small vocabulary built here

BYTE_CHARS = list(_byte_alphabet().values())  # token i (< 256) is byte i


def small_meta(pre: str = "gpt-2", extra: tuple[str, ...] = (), merges: tuple[str, ...] = (), **meta):
    """Every byte, then `extra` normal tokens, then <|im_end|> (control, eos) and <think> (user-defined)."""
    tokens = BYTE_CHARS + list(extra) + ["<|im_end|>", "<|endoftext|>", "<think>"]
    types = [1] * (len(tokens) - 3) + [3, 3, 4]
    return {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": pre,
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": types,
        "tokenizer.ggml.merges": list(merges),
        "tokenizer.ggml.eos_token_id": len(tokens) - 3,
        "tokenizer.ggml.bos_token_id": len(tokens) - 2,
        **meta,
    }


@pytest.fixture(scope="module")
def small():
    return from_gguf_metadata(small_meta(extra=("ab", "abc", "Ġab"), merges=("a b", "ab c", "Ġ ab")))


def ids_of(tok: Tokenizer, *pieces: str) -> list[int]:
    by_piece = {tok.piece(i): i for i in range(tok.n_vocab)}
    return [by_piece[p] for p in pieces]


def test_encode_applies_merges_within_pieces(small):
    assert small.encode("abc abd") == ids_of(small, "abc", "Ġab", "d")
    assert small.encode("") == []


def test_every_known_pre_tokenizer_builds():
    for pre in PRE_TOKENIZERS:
        tok = from_gguf_metadata(small_meta(pre))
        assert tok.decode(tok.encode("It's 2024!\n  ok", add_bos=False)) == "It's 2024!\n  ok"


@pytest.mark.parametrize(
    ("pre", "pieces"),
    [
        ("gpt-2", ["Ġ", "1212"]),  # GPT-2: a space and a run of digits stay together
        ("smollm", ["Ġ", "1", "2", "1", "2"]),  # every digit alone, then GPT-2's regex
        ("qwen2", ["Ġ", "1", "2", "1", "2"]),
        ("llama-bpe", ["Ġ", "12", "1", "2"]),  # runs of at most three digits: "121" + "2"
    ],
)
def test_pre_tokenizer_table_splits_digits_as_named(pre, pieces):
    tok = from_gguf_metadata(small_meta(pre, extra=("12", "1212"), merges=("1 2", "12 12")))
    assert tok.encode(" 1212", add_bos=False) == ids_of(tok, *pieces)


def test_llama3_takes_whole_vocabulary_pieces_without_merges():
    llama3 = from_gguf_metadata(small_meta("llama-bpe", extra=("xyz",)))
    assert llama3.encode("xyz", add_bos=False) == ids_of(llama3, "xyz")
    plain = from_gguf_metadata(small_meta("gpt-2", extra=("xyz",)))
    assert plain.encode("xyz") == ids_of(plain, "x", "y", "z")


def test_unknown_pre_tokenizer_is_named():
    with pytest.raises(TracelmError, match="'wizard-7'"):
        from_gguf_metadata(small_meta("wizard-7"), source="m.gguf")


def test_unsupported_or_incomplete_vocabulary_is_named():
    with pytest.raises(TracelmError, match="'bert' is not supported"):
        from_gguf_metadata({**small_meta(), "tokenizer.ggml.model": "bert"}, source="m.gguf")
    with pytest.raises(TracelmError, match="tokenizer.ggml.scores"):  # a `llama` vocabulary needs its scores
        from_gguf_metadata({**small_meta(), "tokenizer.ggml.model": "llama"})
    with pytest.raises(TracelmError, match="no vocabulary"):
        from_gguf_metadata({"tokenizer.ggml.model": "none"}, source="m.gguf")


def test_parse_special(small):
    (im_end,) = ids_of(small, "<|im_end|>")
    text = "hi<|im_end|>"
    assert small.encode(text, parse_special=True) == ids_of(small, "h", "i") + [im_end]
    plain = small.encode(text)
    assert im_end not in plain and len(plain) > 3
    assert small.decode(plain) == text == small.decode(small.encode(text, parse_special=True))
    # user-defined tokens are matched whole either way (as llama.cpp and transformers do)
    (think,) = ids_of(small, "<think>")
    assert small.encode("<think>a") == small.encode("<think>a", parse_special=True) == [think, ord("a")]


def test_decode_round_trips_any_text(small):
    text = "naïve café — 你好 😀 \x00\x7f\t\r\n Ġ"
    ids = small.encode(text)
    assert small.decode(ids) == text
    assert b"".join(small.token_bytes(i) for i in ids) == text.encode("utf-8")


def test_special_ids_and_bos(small):
    (im_end, eot) = ids_of(small, "<|im_end|>", "<|endoftext|>")
    assert small.eos_id == im_end and small.bos_id == eot
    assert small.eog_ids == {im_end, eot}
    assert small.add_bos is False and small.encode("a")[0] != eot
    assert small.encode("a", add_bos=True) == [eot, ord("a")]
    with_bos = from_gguf_metadata(small_meta(**{"tokenizer.ggml.add_bos_token": True}))
    assert with_bos.add_bos and with_bos.encode("a") == [with_bos.bos_id, ord("a")]
    assert with_bos.encode("a", add_bos=False) == [ord("a")]


def test_skip_special_in_decode(small):
    ids = small.encode("<|im_end|>x<think>", parse_special=True)
    assert small.decode(ids) == "<|im_end|>x<think>"
    assert small.decode(ids, skip_special=True) == "x<think>"


def test_stream_decoder_never_splits_a_character(small):
    ids = small.encode("a😀b")  # the emoji is four byte tokens here
    assert len(ids) == 6
    stream = small.stream_decoder()
    assert [stream.push(i) for i in ids] == ["a", "", "", "", "😀", "b"]
    assert stream.flush() == ""


def test_stream_decoder_equals_decode_on_any_ids(small):
    rng = random.Random(1234)
    for _ in range(300):
        ids = [
            rng.choice([rng.randrange(small.n_vocab), rng.randrange(0x80, 0x100)])
            for _ in range(rng.randrange(12))
        ]
        stream = small.stream_decoder()
        parts = [stream.push(i) for i in ids]
        assert "".join(parts) + stream.flush() == small.decode(ids)
    stream = small.stream_decoder()
    assert stream.push(0xF0) == "" and stream.flush() == "\ufffd"  # a cut-off character at the end


def test_out_of_range_ids_are_named(small):
    n = small.n_vocab
    for bad in (n, -1, 10**9):
        with pytest.raises(TracelmError, match=str(bad)):
            small.decode([1, bad])
        with pytest.raises(TracelmError, match=str(bad)):
            small.stream_decoder().push(bad)
        with pytest.raises(TracelmError, match=str(bad)):
            small.token_bytes(bad)


# ---------------------------------------------------------------- llama.cpp's gpt-2 test vectors


def read_vectors(name: str) -> list[tuple[str, list[int]]]:
    sep = "\n__ggml_vocab_test__\n"
    text = (FIXTURES / "vocab" / f"{name}.inp").read_text(encoding="utf-8")
    inputs = text.removesuffix(sep).split(sep)
    outputs = (FIXTURES / "vocab" / f"{name}.out").read_text(encoding="utf-8").split("\n")[: len(inputs)]
    assert len(outputs) == len(inputs)
    return [(x, [int(v) for v in out.split()]) for x, out in zip(inputs, outputs, strict=True)]


def test_gpt2_vocab_vectors():
    path = FIXTURES / "vocab" / "ggml-vocab-gpt-2.gguf"
    if not path.parent.is_dir():
        pytest.skip(f"fixtures folder {path.parent} is absent")
    try:
        meta = GGUFFile(path).metadata
    except TracelmError as e:
        pytest.skip(f"the shared fixture cannot be read: {e}")
    tok = from_gguf_metadata(meta, path.name)
    vectors = read_vectors(path.name)
    assert len(vectors) > 40
    wrong = [(x, tok.encode(x), want) for x, want in vectors if tok.encode(x) != want]
    assert wrong == []
    assert [tok.decode(want) for _, want in vectors] == [x for x, _ in vectors]


# ------------------------------------------------------------- SmolLM2 (vs transformers: test_tokenizer_reference.py)


@pytest.fixture(scope="module")
def smol(smollm2_path) -> Tokenizer:
    return from_gguf_metadata(GGUFFile(smollm2_path).metadata, smollm2_path.name)


@pytest.mark.model
def test_smollm2_vocabulary(smol):
    assert (smol.n_vocab, smol.bos_id, smol.eos_id, smol.add_bos) == (49152, 1, 2, False)
    assert smol.eog_ids == set(ids_of(smol, "<|endoftext|>", "<|im_end|>"))
    assert smol.encode(" ½") == smol.encode(" ") + smol.encode("½")  # `smollm` splits digits (\p{N}) first


@pytest.mark.model
def test_smollm2_parse_special(smol):
    (im_start, im_end) = ids_of(smol, "<|im_start|>", "<|im_end|>")
    text = "<|im_start|>user\nHi<|im_end|>"
    special = smol.encode(text, parse_special=True)
    assert special[0] == im_start and special[-1] == im_end
    assert smol.decode(special[1:-1]) == "user\nHi"
    plain = smol.encode(text)
    assert im_start not in plain and im_end not in plain and smol.decode(plain) == text


@pytest.mark.model
def test_smollm2_stream_decoder(smol):
    ids = smol.encode("Llamas 🦙 and 你好, café ❤️!")
    stream = smol.stream_decoder()
    parts = [stream.push(i) for i in ids]
    assert "".join(parts) + stream.flush() == smol.decode(ids)
    assert not any("\ufffd" in p for p in parts)
    assert any(p == "" for p in parts)  # some token ended mid-character and was held back


# ---------------------------------------------------------------- SentencePiece-style BPE on a toy vocabulary


def spm_reference(text: str, pieces: list[str], scores: list[float], add_space_prefix: bool = True) -> list[int]:
    """llama.cpp's SentencePiece BPE, plainly: characters, then repeatedly merge the adjacent pair whose
    concatenation is the best-scoring piece (leftmost on ties); what is left unknown becomes <0xHH> bytes."""
    index = {p: i for i, p in enumerate(pieces)}
    text = ((" " if add_space_prefix and text else "") + text).replace(" ", "\u2581")
    syms = list(text)
    while True:
        best = None
        for k in range(len(syms) - 1):
            i = index.get(syms[k] + syms[k + 1])
            if i is not None and (best is None or scores[i] > scores[best[1]]):
                best = (k, i)
        if best is None:
            break
        k = best[0]
        syms[k : k + 2] = [syms[k] + syms[k + 1]]
    out = []
    for s in syms:
        if s in index:
            out.append(index[s])
        else:
            out += [index[f"<0x{b:02X}>"] for b in s.encode("utf-8")]
    return out


def toy_spm(rng: random.Random, add_space_prefix: bool = True):
    from tracelm.io.tokenizer import BYTE, CONTROL, NORMAL, UNKNOWN

    alphabet = list("ab c\u2581") + ["é"]
    pieces = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    types = [UNKNOWN, CONTROL, CONTROL] + [BYTE] * 256
    singles = [c for c in alphabet if c != " "]
    multi = set()
    while len(multi) < 40:
        multi.add("".join(rng.choice(singles) for _ in range(rng.randint(2, 4))))
    pieces += singles + sorted(multi)
    types += [NORMAL] * (len(singles) + len(multi))
    scores = [0.0] * 259 + [-1000.0 - rng.random() for _ in singles] + [-rng.random() * 100 for _ in multi]
    tok = from_scored_vocab(pieces, scores, types, {"unknown_token_id": 0, "bos_token_id": 1,
                                                    "eos_token_id": 2}, add_space_prefix=add_space_prefix)
    return tok, pieces, scores


@pytest.mark.parametrize("add_space_prefix", [True, False])
def test_scored_bpe_matches_a_plain_reference(add_space_prefix):
    rng = random.Random(42 + add_space_prefix)
    for _ in range(5):  # five random vocabularies
        tok, pieces, scores = toy_spm(rng, add_space_prefix)
        for _ in range(200):
            text = "".join(rng.choice("ab c  é€x") for _ in range(rng.randint(0, 12)))
            want = spm_reference(text, pieces, scores, add_space_prefix)
            assert tok.encode(text, add_bos=False) == want, (text, [pieces[i] for i in want])
            assert tok.decode(want) == text  # the prefix space is dropped again


def test_scored_bpe_without_byte_tokens_uses_unk():
    from tracelm.io.tokenizer import CONTROL, NORMAL, UNKNOWN

    pieces, types = ["<unk>", "<s>", "</s>", "\u2581", "a", "\u2581a"], [UNKNOWN, CONTROL, CONTROL] + [NORMAL] * 3
    tok = from_scored_vocab(pieces, [0, 0, 0, -3, -2, -1], types,
                            {"unknown_token_id": 0, "bos_token_id": 1, "eos_token_id": 2})
    assert tok.encode("a a", add_bos=False) == [5, 5]
    assert tok.encode("aéa", add_bos=False) == [5, 0, 4]  # one <unk> for the unknown character
