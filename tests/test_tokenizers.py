"""Tokenizers: round trips, GPT-2 ids equal to the HF reference, specials, aliases, errors."""

from __future__ import annotations

import json
import os
import random
import shutil

import numpy as np
import pytest

from megatron.data.gpt2_bpe import GPT2_EOD, GPT2BPETokenizer
from megatron.data.tokenizers import (
    TOKENIZER_TYPES,
    HFTokenizer,
    SentencePieceTokenizer,
    WordPieceTokenizer,
    build_tokenizer,
)
from megatron.errors import ConfigError
from tests.fixtures.make_tokenizer_fixtures import synthetic_documents
from tools.make_sample_corpus import documents
from tools.train_tokenizer import main as train_main

FIXTURES = os.path.join(os.path.dirname(__file__), "fixtures", "tokenizers")
VOCAB_JSON = os.path.join(FIXTURES, "gpt2-vocab.json")
MERGES = os.path.join(FIXTURES, "gpt2-merges.txt")
BERT_VOCAB = os.path.join(FIXTURES, "bert-vocab.txt")
EDGE_CASES = [
    "",
    " ",
    "a",
    "   leading and trailing   ",
    "tabs\tand\n\nnewlines\r\n and  double  spaces",
    "don't I'll we're they've she'd it's DON'T",
    "numbers 1234567890 3.14159 -42 1e10",
    "unicode: café naïve Größe 東京 日本語 Ελλάδα москва Ñandú",
    "emoji 🙂🚀 and combining e\u0301 marks",
    "literal <|endoftext|> in the text",
    "symbols !@#$%^&*()_+-=[]{}|;':\",./<>?`~",
    "\x00\x01 control\x7f chars",
]


def _stdlib_texts() -> list[str]:
    """Real English prose: docstrings of two standard-library modules."""
    texts = []
    for module in (json, shutil):
        texts += [d["text"] for d in documents(module.__name__, module.__file__)]
    return texts


TEXTS = synthetic_documents(150, seed=11) + EDGE_CASES + _stdlib_texts()


def _gpt2() -> GPT2BPETokenizer:
    return build_tokenizer("gpt2", vocab_file=VOCAB_JSON, merges_file=MERGES)


def _hf_reference(vocab_file: str, merges_file: str):
    """GPT-2 byte-level BPE as the HF ``tokenizers`` library runs it: the reference ids."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    ref = Tokenizer(models.BPE.from_file(vocab_file, merges_file))
    ref.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    return ref


BUILDERS = {
    "gpt2": _gpt2,
    "sentencepiece-bpe": lambda: build_tokenizer(
        "sentencepiece", model=os.path.join(FIXTURES, "sp-bpe.model")
    ),
    "sentencepiece-unigram": lambda: build_tokenizer(
        "sentencepiece", model=os.path.join(FIXTURES, "sp-unigram.model")
    ),
    "hf": lambda: build_tokenizer("hf", model=os.path.join(FIXTURES, "hf-tokenizer.json")),
}


@pytest.mark.parametrize("name", sorted(BUILDERS))
def test_byte_exact_round_trip(name):
    """Byte-level BPE and byte-fallback sentencepiece give every text back exactly."""
    tok = BUILDERS[name]()
    for text in TEXTS:
        ids = tok.encode(text)
        assert all(0 <= i < tok.vocab_size for i in ids)
        assert tok.decode(ids) == text
        assert np.array_equal(tok.encode_np(text), ids)
    assert tok.encode_batch(TEXTS[:20]) == [tok.encode(t) for t in TEXTS[:20]]


@pytest.mark.parametrize("name", [*sorted(BUILDERS), "wordpiece"])
def test_encode_packed_equals_encode(name):
    """One batch call: every text's ids back to back and each length, as encode gives them."""
    if name == "wordpiece":
        tok = build_tokenizer("wordpiece", vocab_file=BERT_VOCAB, lower_case=True)
    else:
        tok = BUILDERS[name]()
    texts = [*TEXTS[:40], "", " "]
    ids, lengths = tok.encode_packed(texts)
    assert lengths.dtype == np.int64 and ids.ndim == 1
    assert lengths.tolist() == [len(tok.encode(t)) for t in texts]
    assert ids.tolist() == [i for t in texts for i in tok.encode(t)]
    ids, lengths = tok.encode_packed([])
    assert ids.size == lengths.size == 0


@pytest.mark.parametrize("lower_case", [False, True])
def test_wordpiece_round_trip(lower_case):
    """WordPiece loses whitespace and (lower-case) case and accents; the ids survive decoding."""
    tok = build_tokenizer("wordpiece", vocab_file=BERT_VOCAB, lower_case=lower_case)
    known = 0
    for text in TEXTS:
        ids = tok.encode(text)
        if tok.unk not in ids:  # [UNK] decodes to the text "[UNK]"
            assert tok.encode(tok.decode(ids)) == ids, text[:80]
            known += 1
    assert known > 0.9 * len(TEXTS)
    plain = "Al kaaronal baoto, aler alexlual!"
    assert tok.decode(tok.encode(plain)) == (plain.lower() if lower_case else plain)
    if lower_case:
        assert tok.encode("NAÏVE Café") == tok.encode("naive cafe")


def test_wordpiece_has_no_unknown_pieces_on_its_training_distribution():
    tok = build_tokenizer("BertWordPieceCase", vocab_file=BERT_VOCAB)
    for text in synthetic_documents(50, seed=3):
        assert tok.unk not in tok.encode(text)


def test_gpt2_ids_equal_hf_tokenizers():
    """tiktoken (our GPT-2 path) and HF tokenizers agree on every id."""
    tok, ref = _gpt2(), _hf_reference(VOCAB_JSON, MERGES)
    assert tok._rank_to_id is None  # GPT-2 layout: ids are tiktoken's ranks
    for text in TEXTS:
        assert tok.encode(text) == ref.encode(text, add_special_tokens=False).ids, text[:80]


def test_gpt2_ids_equal_hf_with_shuffled_ids(tmp_path):
    """Ids that do not follow merge order go through tiktoken's ranks and a lookup table."""
    with open(VOCAB_JSON, encoding="utf-8") as f:
        vocab = json.load(f)
    tokens = list(vocab)
    ids = list(range(len(tokens)))
    random.Random(0).shuffle(ids)
    shuffled = tmp_path / "vocab.json"
    shuffled.write_text(json.dumps(dict(zip(tokens, ids))), encoding="utf-8")
    tok = build_tokenizer("GPT2BPETokenizer", vocab_file=str(shuffled), merges_file=MERGES)
    ref = _hf_reference(str(shuffled), MERGES)
    assert tok._rank_to_id is not None
    assert tok.eod == dict(zip(tokens, ids))[GPT2_EOD]
    for text in TEXTS:
        expected = ref.encode(text, add_special_tokens=False).ids
        assert tok.encode(text) == expected
        assert tok.encode_np(text).tolist() == expected
        assert tok.decode(expected) == text
    ids, lengths = tok.encode_packed(TEXTS)
    assert ids.tolist() == [i for t in TEXTS for i in tok.encode(t)]


def test_gpt2_batch_on_threads_matches():
    tok = build_tokenizer("gpt2", vocab_file=VOCAB_JSON, merges_file=MERGES, num_threads=2)
    assert tok.encode_batch(TEXTS) == [tok.encode(t) for t in TEXTS]


def test_special_tokens():
    gpt2 = _gpt2()
    with open(VOCAB_JSON, encoding="utf-8") as f:
        assert gpt2.eod == json.load(f)[GPT2_EOD] == gpt2.vocab_size - 1
    assert gpt2.eod not in gpt2.encode("a <|endoftext|> b")
    assert gpt2.decode([gpt2.eod]) == GPT2_EOD

    sp = BUILDERS["sentencepiece-bpe"]()
    assert (sp.eod, sp.pad, sp.cls, sp.mask) == (3, 0, None, None)

    wp = build_tokenizer("wordpiece", vocab_file=BERT_VOCAB)
    with open(BERT_VOCAB, encoding="utf-8") as f:
        lines = f.read().split("\n")
    assert wp.eod == wp.sep == lines.index("[SEP]")
    assert (wp.pad, wp.cls, wp.mask) == tuple(lines.index(t) for t in ("[PAD]", "[CLS]", "[MASK]"))
    assert wp.vocab_size == len(lines) - 1

    hf = BUILDERS["hf"]()
    assert hf.eod == gpt2.eod and hf.encode("x y") == gpt2.encode("x y")


def test_hf_special_tokens_from_tokenizer_config(tmp_path):
    shutil.copy(os.path.join(FIXTURES, "hf-tokenizer.json"), tmp_path / "tokenizer.json")
    with open(VOCAB_JSON, encoding="utf-8") as f:
        vocab = json.load(f)
    (tmp_path / "tokenizer_config.json").write_text(
        json.dumps({"eos_token": {"content": "ing"}, "pad_token": "al"}), encoding="utf-8"
    )
    tok = build_tokenizer("HuggingFaceTokenizer", model=str(tmp_path))  # a directory works too
    assert isinstance(tok, HFTokenizer)
    assert (tok.eod, tok.pad) == (vocab["ing"], vocab["al"])


def test_wordpiece_continuations():
    tok = build_tokenizer("wordpiece", vocab_file=BERT_VOCAB)
    ids = tok.encode("kaaronal alexlual")
    pieces = [tok.id_to_token(i) for i in ids]
    assert [tok.is_continuation(i) for i in ids] == [p.startswith("##") for p in pieces]
    assert tok.continuation_mask.shape == (tok.vocab_size,)
    assert tok.continuation_mask.sum() == sum(t.startswith("##") for t in tok.inv_vocab.values())
    assert any(tok.is_continuation(i) for i in ids)


def test_megatron_aliases():
    kinds = {
        "gpt2": GPT2BPETokenizer,
        "sentencepiece": SentencePieceTokenizer,
        "wordpiece": WordPieceTokenizer,
        "hf": HFTokenizer,
    }
    files = dict(
        vocab_file=VOCAB_JSON, merges_file=MERGES, model=os.path.join(FIXTURES, "sp-bpe.model")
    )
    for alias, kind in TOKENIZER_TYPES.items():
        if kind == "wordpiece":
            tok = build_tokenizer(alias, vocab_file=BERT_VOCAB)
            assert tok.lower_case == (alias == "BertWordPieceLowerCase")
        elif kind == "hf":
            tok = build_tokenizer(alias, model=os.path.join(FIXTURES, "hf-tokenizer.json"))
        else:
            tok = build_tokenizer(alias, **files)
        assert isinstance(tok, kinds[kind])
    with pytest.raises(ConfigError, match="contradicts tokenizer.type=BertWordPieceCase"):
        build_tokenizer("BertWordPieceCase", vocab_file=BERT_VOCAB, lower_case=True)


def _one_line_error(match: str, **kwargs) -> str:
    with pytest.raises(ConfigError, match=match) as info:
        build_tokenizer(**kwargs)
    message = str(info.value)
    assert "\n" not in message
    return message


def test_config_errors(tmp_path):
    garbage = tmp_path / "garbage"
    garbage.write_bytes(b"\x00\x01 not a model")
    missing = str(tmp_path / "nope.json")
    _one_line_error("tokenizer.type=bogus is unknown", type="bogus")
    _one_line_error("tokenizer.vocab_file .* is not set", type="gpt2", merges_file=MERGES)
    msg = _one_line_error(
        "tokenizer.vocab_file=.*nope.json: file not found",
        type="gpt2",
        vocab_file=missing,
        merges_file=MERGES,
    )
    assert "--vocab-file" in msg
    _one_line_error(
        "tokenizer.merges_file=.*nope.json: file not found",
        type="gpt2",
        vocab_file=VOCAB_JSON,
        merges_file=missing,
    )
    _one_line_error(
        "tokenizer.vocab_file=.*garbage: not a JSON vocabulary",
        type="gpt2",
        vocab_file=str(garbage),
        merges_file=MERGES,
    )
    _one_line_error(
        "tokenizer.model=.*garbage: not a sentencepiece model",
        type="sentencepiece",
        model=str(garbage),
    )
    _one_line_error(
        "tokenizer.model=.*garbage: not a HF tokenizer.json", type="hf", model=str(garbage)
    )
    _one_line_error("tokenizer.model .* is not set", type="SentencePieceTokenizer")
    _one_line_error(
        "tokenizer.vocab_file=.*garbage: no \\[UNK\\] token",
        type="wordpiece",
        vocab_file=str(garbage),
    )

    bad_merges = tmp_path / "merges.txt"
    bad_merges.write_text("#version: 0.2\nk a\nzz qq\n", encoding="utf-8")
    _one_line_error(
        "merges.txt:3: token 'zz' is not in",
        type="gpt2",
        vocab_file=VOCAB_JSON,
        merges_file=str(bad_merges),
    )
    with open(VOCAB_JSON, encoding="utf-8") as f:
        vocab = json.load(f)
    del vocab[GPT2_EOD]
    no_eod = tmp_path / "vocab.json"
    no_eod.write_text(json.dumps(vocab), encoding="utf-8")
    _one_line_error(
        "no <\\|endoftext\\|> token", type="gpt2", vocab_file=str(no_eod), merges_file=MERGES
    )


def _train(tmp_path, kind: str) -> str:
    corpus = tmp_path / "corpus.jsonl"
    with open(corpus, "w", encoding="utf-8") as f:
        for doc in synthetic_documents(400, seed=5):
            f.write(json.dumps({"text": doc}) + "\n")
    prefix = str(tmp_path / kind)
    argv = [
        "--input",
        str(corpus),
        "--model-prefix",
        prefix,
        "--vocab-size",
        "600",
        "--model-type",
        kind,
        "--threads",
        "1",
    ]
    assert train_main(argv) == 0
    return prefix + ".model"


@pytest.mark.parametrize("kind", ["bpe", "unigram"])
def test_train_tokenizer(tmp_path, kind):
    """tools/train_tokenizer.py: eos is EOD, byte fallback round-trips anything, reruns agree."""
    model = _train(tmp_path, kind)
    tok = build_tokenizer("sentencepiece", model=model)
    assert (tok.eod, tok.pad) == (3, 0)
    assert tok.vocab_size <= 600
    for text in TEXTS:
        assert tok.decode(tok.encode(text)) == text
    first = open(model, "rb").read()
    os.rename(model, model + ".first")
    assert open(_train(tmp_path, kind), "rb").read() == first
    assert sorted(os.listdir(tmp_path)) == sorted(
        ["corpus.jsonl", f"{kind}.model", f"{kind}.model.first", f"{kind}.vocab"]
    )
