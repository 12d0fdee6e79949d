"""Tokenizers: round trips, GPT-2 ids equal to the HF reference, specials, aliases, errors."""

from __future__ import annotations

import json
import os
import random
import shutil
from typing import get_args, get_type_hints

import numpy as np
import pytest

from megatron.config.tokenizer import TOKENIZER_FILES, TokenizerConfig
from megatron.data.tokenizers.factory import TOKENIZER_TYPES, build_tokenizer
from megatron.data.tokenizers.gpt2_bpe import GPT2_EOD, GPT2BPETokenizer
from megatron.data.tokenizers.hf import HFTokenizer
from megatron.data.tokenizers.null import NullTokenizer
from megatron.data.tokenizers.sentencepiece import SentencePieceTokenizer
from megatron.data.tokenizers.tiktoken import TikTokenizer
from megatron.data.tokenizers.wordpiece import WordPieceTokenizer
from megatron.errors import ConfigError
from tests.fixtures import (
    BERT_VOCAB,
    GPT2_MERGES,
    GPT2_VOCAB,
    HF_JSON,
    SP_BPE,
    SP_UNIGRAM,
    TIKTOKEN_VOCAB,
)
from tests.fixtures.make_tokenizer_fixtures import synthetic_documents
from tools.make_sample_corpus import documents
from tools.train_tokenizer import main as train_main

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
    return build_tokenizer("gpt2", vocab_file=GPT2_VOCAB, merges_file=GPT2_MERGES)


def _hf_reference(vocab_file: str, merges_file: str):
    """GPT-2 byte-level BPE as the HF ``tokenizers`` library runs it: the reference ids."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    ref = Tokenizer(models.BPE.from_file(vocab_file, merges_file))
    ref.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    return ref


BUILDERS = {
    "gpt2": _gpt2,
    "sentencepiece-bpe": lambda: build_tokenizer("sentencepiece", model=SP_BPE),
    "sentencepiece-unigram": lambda: build_tokenizer("sentencepiece", model=SP_UNIGRAM),
    "hf": lambda: build_tokenizer("hf", model=HF_JSON),
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
    tok, ref = _gpt2(), _hf_reference(GPT2_VOCAB, GPT2_MERGES)
    assert tok._rank_to_id is None  # GPT-2 layout: ids are tiktoken's ranks
    for text in TEXTS:
        assert tok.encode(text) == ref.encode(text, add_special_tokens=False).ids, text[:80]


def test_gpt2_ids_equal_hf_with_shuffled_ids(tmp_path):
    """Ids that do not follow merge order go through tiktoken's ranks and a lookup table."""
    with open(GPT2_VOCAB, encoding="utf-8") as f:
        vocab = json.load(f)
    tokens = list(vocab)
    ids = list(range(len(tokens)))
    random.Random(0).shuffle(ids)
    shuffled = tmp_path / "vocab.json"
    shuffled.write_text(json.dumps(dict(zip(tokens, ids))), encoding="utf-8")
    tok = build_tokenizer("GPT2BPETokenizer", vocab_file=str(shuffled), merges_file=GPT2_MERGES)
    ref = _hf_reference(str(shuffled), GPT2_MERGES)
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
    tok = build_tokenizer("gpt2", vocab_file=GPT2_VOCAB, merges_file=GPT2_MERGES, num_threads=2)
    assert tok.encode_batch(TEXTS) == [tok.encode(t) for t in TEXTS]


def test_special_tokens():
    gpt2 = _gpt2()
    with open(GPT2_VOCAB, encoding="utf-8") as f:
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
    shutil.copy(HF_JSON, tmp_path / "tokenizer.json")
    with open(GPT2_VOCAB, encoding="utf-8") as f:
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
        "tiktoken": TikTokenizer,
        "null": NullTokenizer,
    }
    files = {
        "gpt2": dict(vocab_file=GPT2_VOCAB, merges_file=GPT2_MERGES),
        "sentencepiece": dict(model=SP_BPE),
        "wordpiece": dict(vocab_file=BERT_VOCAB),
        "hf": dict(model=HF_JSON),
        "tiktoken": dict(model=TIKTOKEN_VOCAB, vocab_size=2024),
        "null": dict(vocab_size=100),
    }
    assert set(kinds) == set(TOKENIZER_TYPES.values())
    for alias, kind in TOKENIZER_TYPES.items():
        tok = build_tokenizer(alias, **files[kind])
        assert isinstance(tok, kinds[kind])
        if kind == "wordpiece":
            assert tok.lower_case == (alias == "BertWordPieceLowerCase")
    with pytest.raises(ConfigError, match="contradicts tokenizer.type=BertWordPieceCase"):
        build_tokenizer("BertWordPieceCase", vocab_file=BERT_VOCAB, lower_case=True)


def test_config_types_are_the_tokenizer_types():
    """The config schema, its file table and the builder list the same type names."""
    hint = get_type_hints(TokenizerConfig)["type"]
    assert set(get_args(hint)) == set(TOKENIZER_FILES) == set(TOKENIZER_TYPES)


def test_extra_ids_and_special_tokens_take_the_next_ids():
    """Megatron's extra ids and special tokens: new ones after the vocabulary, in order; spelled
    in the text they encode as one id."""
    wp = build_tokenizer("BertWordPieceLowerCase", vocab_file=BERT_VOCAB, vocab_extra_ids=2)
    size = len(open(BERT_VOCAB, encoding="utf-8").read().splitlines())
    assert wp.vocab_size == size + 2
    assert wp.encode("Ka <extra_id_1> ri")[1] == size + 1
    assert wp.id_to_token(size) == "<extra_id_0>"
    cased = build_tokenizer("BertWordPieceCase", vocab_file=BERT_VOCAB)
    assert cased.vocab_size == size + 100  # megatron-core's 100 sentinels for this type
    assert build_tokenizer("wordpiece", vocab_file=BERT_VOCAB).vocab_size == size
    sp = build_tokenizer("SentencePieceTokenizer", model=SP_BPE, vocab_extra_ids=3)
    assert (sp.vocab_size, sp.eod) == (1003, 3)
    ids = sp.encode("ka<extra_id_2>ri")
    assert 1002 in ids and sp.decode(ids) == "ka <extra_id_2> ri"
    hf = build_tokenizer("hf", model=HF_JSON, special_tokens=["<x>"], vocab_extra_ids=1)
    assert hf.vocab_size == 1027 and hf.encode("a<x>b")[1] == 1025
    assert hf.options == {"special_tokens": ["<x>", "<extra_id_0>"]}


def test_tiktokenizer_and_null_tokenizer():
    tik = build_tokenizer("TikTokenizer", model=TIKTOKEN_VOCAB, vocab_size=2024)
    assert (tik.vocab_size, tik.eod, tik.pad) == (2024, 2, 4)
    for text in TEXTS:
        ids = tik.encode(text)
        assert all(1000 <= i < 2024 for i in ids) or "<" in text
        assert tik.decode(ids) == text
    assert tik.encode("x</s>") == [*tik.encode("x"), 2]
    null = build_tokenizer("NullTokenizer", vocab_size=10)
    assert (null.vocab_size, null.eod, null.pad) == (11, 10, None)
    assert null.encode("3 1 4") == [3, 1, 4] and null.decode([3, 1]) == "3 1"
    assert null.bad_text("3 1 4") is None
    assert "not an integer id: 'x'" in null.bad_text("3 x")
    assert "id 11 is outside [0, 11)" in null.bad_text("11")
    assert "not an integer" in null.bad_text("1  2")  # a double space, as int('') fails there


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
    _one_line_error("tokenizer.vocab_file .* is not set", type="gpt2", merges_file=GPT2_MERGES)
    msg = _one_line_error(
        "tokenizer.vocab_file=.*nope.json: file not found",
        type="gpt2",
        vocab_file=missing,
        merges_file=GPT2_MERGES,
    )
    assert "--vocab-file" in msg
    _one_line_error(
        "tokenizer.merges_file=.*nope.json: file not found",
        type="gpt2",
        vocab_file=GPT2_VOCAB,
        merges_file=missing,
    )
    _one_line_error(
        "tokenizer.vocab_file=.*garbage: not a JSON vocabulary",
        type="gpt2",
        vocab_file=str(garbage),
        merges_file=GPT2_MERGES,
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
        vocab_file=GPT2_VOCAB,
        merges_file=str(bad_merges),
    )
    with open(GPT2_VOCAB, encoding="utf-8") as f:
        vocab = json.load(f)
    del vocab[GPT2_EOD]
    no_eod = tmp_path / "vocab.json"
    no_eod.write_text(json.dumps(vocab), encoding="utf-8")
    _one_line_error(
        "no <\\|endoftext\\|> token", type="gpt2", vocab_file=str(no_eod), merges_file=GPT2_MERGES
    )


def test_options_a_type_does_not_read_are_refused(tmp_path):
    """Each in one line naming the key and its preprocess_data.py flag."""
    gpt2 = dict(type="gpt2", vocab_file=GPT2_VOCAB, merges_file=GPT2_MERGES)
    msg = _one_line_error(
        "tokenizer.vocab_size \\(--vocab-size\\) does not apply", **gpt2, vocab_size=5
    )
    assert "tiktoken, null" in msg
    _one_line_error("--vocab-extra-ids", **gpt2, vocab_extra_ids=2)
    _one_line_error("--tiktoken-pattern", **gpt2, tiktoken_pattern="v1")
    _one_line_error("--lower-case", type="sentencepiece", model=SP_BPE, lower_case=True)
    _one_line_error(
        "needs tokenizer.sentencepiece_legacy", type="sentencepiece", model=SP_BPE,
        special_tokens=["<x>"],
    )  # fmt: skip
    _one_line_error(
        "megatron-core drops them", type="BertWordPieceCase", vocab_file=BERT_VOCAB,
        special_tokens=["<x>"],
    )  # fmt: skip
    _one_line_error(
        "needs 130072 ranks .* set it to 2024", type="TikTokenizer", model=TIKTOKEN_VOCAB
    )
    _one_line_error(
        "must be distinct and include", type="TikTokenizer", model=TIKTOKEN_VOCAB, vocab_size=2024,
        special_tokens=["<unk>"],
    )  # fmt: skip
    _one_line_error("reads a tiktoken vocabulary .json", type="TikTokenizer", model=SP_BPE)
    _one_line_error("NullTokenizer needs the number of ids", type="NullTokenizer")
    _one_line_error("MultimodalTokenizer is not supported here", type="MultimodalTokenizer")


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
