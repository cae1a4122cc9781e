"""Every tokenizer kind against its reference on the same 1,000+ line corpus (tests/test_tokenizer_corpus.py):

- LLaMA's SentencePiece vocabulary: the `sentencepiece` library on `tokenizer.model` is the reference for
  tracelm's three readers of it: the `.model` itself, a vocabulary-only GGUF built from it (as llama.cpp's
  converter writes one) and llama2.c's `tokenizer.bin`;
- SmolLM2, Gemma 3 270M and Qwen2.5-Coder-0.5B: the tokenizer Hugging Face transformers builds from the GGUF.

Building a transformers tokenizer from a GGUF takes 10-20 s (Gemma: 262k tokens), so the one it builds is saved
once as a `tokenizer.json` (by `save_pretrained`, exactly the `tokenizers` object it runs) under
TRACELM_HOME/fixtures, keyed by the GGUF's name and size and the transformers version, and loaded from there.
"""

from __future__ import annotations

import functools
import json
import shutil
from pathlib import Path

import gguf
import pytest

from tests.conftest import FIXTURES, _pull, finish_gguf, require_reference
from tests.test_tokenizer_corpus import corpus
from tracelm.io import registry
from tracelm.io.loader import load_tokenizer
from tracelm.io.tokenizer import BYTE, CONTROL, NORMAL, UNKNOWN, UNUSED, Tokenizer

LLAMA2C = FIXTURES / "llama2c"
SP_MODEL = LLAMA2C / "tokenizer.model"
LINES = corpus()


def disagreements(ours: Tokenizer, reference, lines: list[str], *, ref_decode=None) -> list[str]:
    """Lines whose ids differ from the reference's, or that do not decode back to themselves while the
    reference's ids do."""
    bad = []
    for line in lines:
        want = reference(line)
        got = ours.encode(line, add_bos=False)
        if got != want:
            bad.append(f"{line!r}: reference {want[:20]}, tracelm {got[:20]}")
        elif ref_decode is not None and ref_decode(want) == line and ours.decode(got) != line:
            bad.append(f"{line!r}: decodes back to {ours.decode(got)!r}")
    return bad


def report(name: str, bad: list[str], n: int) -> None:
    print(f"\n{name}: {n - len(bad)}/{n} lines identical to the reference")
    assert not bad, f"{name}: {len(bad)}/{n} lines differ:\n" + "\n".join(bad[:20])


# ---------------------------------------------------------------- LLaMA SentencePiece


@pytest.fixture(scope="module")
def sp():
    if not SP_MODEL.is_file():
        pytest.skip(f"shared fixture {SP_MODEL} is absent")
    import sentencepiece

    return sentencepiece.SentencePieceProcessor(model_file=str(SP_MODEL))


def write_llama_vocab_gguf(path: Path, sp) -> Path:
    """A vocabulary-only `llama` GGUF from a SentencePiece model, as llama.cpp's converter writes one:
    pieces, scores, types, add_space_prefix, BOS 1, EOS 2, UNK 0; no tensors."""
    n = sp.vocab_size()

    def kind(i: int) -> int:
        if sp.is_unknown(i):
            return UNKNOWN
        if sp.is_control(i):
            return CONTROL
        if sp.is_byte(i):
            return BYTE
        return UNUSED if sp.is_unused(i) else NORMAL

    w = gguf.GGUFWriter(str(path), "llama")
    w.add_name("llama-spm (vocabulary only, from tokenizer.model)")
    w.add_tokenizer_model("llama")
    w.add_tokenizer_pre("default")
    w.add_token_list([sp.id_to_piece(i) for i in range(n)])
    w.add_token_scores([sp.get_score(i) for i in range(n)])
    w.add_token_types([kind(i) for i in range(n)])
    w.add_add_space_prefix(True)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)
    w.add_add_bos_token(True)
    w.add_add_eos_token(False)
    return finish_gguf(w, path)


@pytest.fixture(scope="module")
def llama_vocab_gguf(sp, tmp_path_factory) -> Path:
    return write_llama_vocab_gguf(tmp_path_factory.mktemp("llama-spm") / "llama-spm-vocab.gguf", sp)


@pytest.mark.parametrize("kind", ["gguf", "model", "bin"])
def test_llama_sentencepiece_corpus(kind, sp, llama_vocab_gguf):
    path = {"gguf": llama_vocab_gguf, "model": SP_MODEL, "bin": LLAMA2C / "tokenizer.bin"}[kind]
    ours = load_tokenizer(str(path))
    assert (ours.n_vocab, ours.bos_id, ours.eos_id, ours.add_bos) == (32000, 1, 2, True)
    bad = disagreements(ours, sp.encode, LINES, ref_decode=sp.decode)
    report(f"llama {path.name} vs sentencepiece", bad, len(LINES))
    # decode matches sentencepiece's on every line, also where the text does not survive (none here)
    assert [ours.decode(sp.encode(x)) for x in LINES[:200]] == [sp.decode(sp.encode(x)) for x in LINES[:200]]


def test_llama_bos_eos_and_special(sp, llama_vocab_gguf):
    tok = load_tokenizer(str(llama_vocab_gguf))
    assert tok.encode("Hello") == [1, *sp.encode("Hello")]  # add_bos_token
    assert tok.encode("Hello", add_eos=True) == [1, *sp.encode("Hello"), 2]
    assert tok.encode("<s>Hello</s>", add_bos=False, parse_special=True) == [1, *sp.encode("Hello"), 2]
    assert 1 not in tok.encode("<s>Hello", add_bos=False)
    assert tok.decode(tok.encode(" Hello  world")) == "<s> Hello  world"
    assert tok.decode(tok.encode(" Hello  world"), skip_special=True) == " Hello  world"


def test_llama2c_tok512_reads(sp):
    path = LLAMA2C / "tok512.bin"
    if not path.is_file():
        pytest.skip(f"{path} is absent")
    tok = load_tokenizer(str(path))
    assert tok.n_vocab == 512 and tok.bos_id == 1 and tok.piece(1) == "<s>"
    text = "e4 e5 Nf3"
    assert tok.decode(tok.encode(text, add_bos=False)) == text


# ---------------------------------------------------------------- GGUF models against transformers


def hf_reference(gguf_path: Path) -> Path:
    """The tokenizer.json of the tokenizer transformers builds from `gguf_path` (built once, then cached)."""
    require_reference()
    import transformers

    key = f"{gguf_path.stem}-{gguf_path.stat().st_size}-transformers-{transformers.__version__}"
    folder = registry.home() / "fixtures" / "hf-tokenizers" / key
    if not (folder / "tokenizer.json").is_file():
        built = transformers.AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
        tmp = folder.with_name(folder.name + ".part")
        shutil.rmtree(tmp, ignore_errors=True)
        built.save_pretrained(str(tmp))
        shutil.rmtree(folder, ignore_errors=True)
        tmp.rename(folder)
    return folder / "tokenizer.json"


class Reference:
    """transformers' tokenizer for a GGUF, run through the `tokenizers` object it is built on."""

    def __init__(self, tokenizer_json: Path, fix=None):
        from tokenizers import Tokenizer as HFTokenizer

        self.hf = HFTokenizer.from_file(str(tokenizer_json))
        if fix is not None:
            fix(self.hf)

    def encode(self, text: str, parse_special: bool = False) -> list[int]:
        self.hf.encode_special_tokens = not parse_special  # plain text, as tracelm's default
        return self.hf.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int]) -> str:
        return self.hf.decode(ids, skip_special_tokens=False)


@functools.cache
def reference(path: Path, fix=None) -> Reference:
    return Reference(hf_reference(path), fix)


@functools.cache
def cached_tokenizer(path: Path) -> Tokenizer:
    return load_tokenizer(str(path))


def smollm_digits(ref) -> None:
    # transformers' GGUF loader has no entry for pre `smollm` and keeps plain GPT-2 splitting; SmolLM2's own
    # tokenizer.json (and llama.cpp) split off every digit first. Give the reference its real pre-tokenizer.
    from tokenizers import pre_tokenizers

    ref.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )


@pytest.mark.model
@pytest.mark.reference
@pytest.mark.parametrize(
    ("name", "fix"),
    [("smollm2-135m-instruct", smollm_digits), ("gemma3-270m", None), ("qwen2.5-coder-0.5b-instruct", None)],
)
def test_gguf_vocabulary_corpus_matches_transformers(name, fix):
    path = _pull(name)
    ours = cached_tokenizer(path)
    ref = reference(path, fix)
    bad = disagreements(ours, ref.encode, LINES, ref_decode=ref.decode)
    report(f"{name} vs transformers", bad, len(LINES))
    # control tokens spelled in the text: matched with parse_special, as transformers matches them
    spelled = [x for x in LINES if "<" in x][:50]
    assert [ours.encode(x, add_bos=False, parse_special=True) for x in spelled] == [
        ref.encode(x, parse_special=True) for x in spelled
    ]


@pytest.mark.model
@pytest.mark.reference
def test_tokenizer_json_reader_matches_gguf(tmp_path):
    """tracelm's tokenizer.json reader on transformers' own save of the Qwen and Gemma vocabularies."""
    for name in ("qwen2.5-coder-0.5b-instruct", "gemma3-270m"):
        path = _pull(name)
        src = hf_reference(path)
        folder = tmp_path / name
        folder.mkdir()
        for f in src.parent.iterdir():
            shutil.copy(f, folder / f.name)
        from_json = load_tokenizer(str(folder))
        from_gguf = cached_tokenizer(path)
        assert from_json.kind == "tokenizer.json"
        assert (from_json.bos_id, from_json.eos_id, from_json.add_bos) == (
            from_gguf.bos_id, from_gguf.eos_id, from_gguf.add_bos)
        sample = LINES[::5]
        for x in sample:
            ids = from_gguf.encode(x)
            assert from_json.encode(x) == ids, x
            assert from_json.decode(ids) == from_gguf.decode(ids), x
        config = json.loads((folder / "tokenizer_config.json").read_text())
        if config.get("chat_template") or (folder / "chat_template.jinja").is_file():
            assert from_json.chat_template == from_gguf.chat_template
