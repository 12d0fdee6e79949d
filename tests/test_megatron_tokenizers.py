"""Every Megatron tokenizer type against megatron-core 0.16.1, the oracle, through the .bin.

For each case tools/preprocess_data.py (our tokenizers) writes a corpus, and megatron-core's
``build_tokenizer`` encodes the same documents in a clean interpreter (our package is also named
``megatron``). The .bin must be the bytes of core's ids plus core's EOD after each document, in
the dtype Megatron picks for core's vocabulary size; the sidecar must carry core's vocabulary
size and EOD.

Core builds GPT2BPETokenizer and BertWordPiece* as transformers tokenizers named by a Hugging Face
Hub id (``gpt2``, ``bert-large-cased`` ...) with our files; offline, the oracle points that id at
a local directory holding what the Hub has for it (tokenizer class and casing) and the same
files. Nothing else in core is changed.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import numpy as np
import pytest

from megatron.data.indexed_dataset import IndexedDataset, best_dtype
from megatron.data.tokenizers.factory import TOKENIZER_TYPES, extra_id_tokens
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
from tests.test_indexed_dataset import run_megatron_core
from tools.make_sample_corpus import documents
from tools.preprocess_data import main

TIKTOKEN_SPECIALS = ["<pad>", "<unk>", "<s>", "</s>", "<mask>", "<cls>", "<sep>", "<x>"]
# Special tokens and the edges tokenizers differ on, spelled inside documents.
EDGE_CASES = [
    "tabs\tand\n\nnewlines\r\n and  double  spaces   ",
    "don't I'll we're they've she'd it's DON'T",
    "numbers 1234567890 3.14159 -42 1e10",
    "unicode: café naïve Größe 東京 日本語 Ελλάδα москва Ñandú",
    "emoji 🙂🚀 and combining e\u0301 marks",
    "symbols !@#$%^&*()_+-=[]{}|;':\",./<>?`~",
    "a <extra_id_1> b<extra_id_0>c <extra_id_10> d",
    "<s> starts, </s> ends <pad> <mask> <sep> <cls> <unk> <SPECIAL_9>",
    "<x> and <y>: added <x>tokens<y>  twice, testing",
]
TEXT = [
    *synthetic_documents(60, seed=7),
    *EDGE_CASES,
    *[d["text"] for d in documents(json.__name__, json.__file__)][:20],
]
IDS = [" ".join(str((7 * i + 3 * j) % 500) for j in range(1 + i % 9)) for i in range(40)]
IDS += ["0", "499", "12 12 12"]


def _case(type, flags, core, corpus="text", eod=True) -> dict:
    return dict(type=type, flags=flags, core=core, corpus=corpus, eod=eod)


def _cases(tmp) -> dict[str, dict]:
    """Our flags and core's arguments for every tokenizer type (and its options)."""
    hf, hf_bos, bert_vocab = str(tmp / "hf"), str(tmp / "hf-bos"), str(tmp / "bert-vocab.txt")
    extra = extra_id_tokens(3)
    tik = ["--tokenizer-model", TIKTOKEN_VOCAB, "--vocab-size"]
    return {
        "sp-bpe": _case("SentencePieceTokenizer", ["--tokenizer-model", SP_BPE], {}),
        "sp-unigram": _case("GPTSentencePieceTokenizer", ["--tokenizer-model", SP_UNIGRAM], {}),
        "llama2": _case("Llama2Tokenizer", ["--tokenizer-model", SP_BPE], {}),
        # Core's legacy wrapper has no EOD (its eod raises), so no --append-eod here.
        "sp-legacy": _case(
            "SentencePieceTokenizer",
            [
                "--tokenizer-model",
                SP_BPE,
                "--tokenizer-sentencepiece-legacy",
                "--tokenizer-special-tokens",
                "<x>",
                "<s>",
                "--vocab-extra-ids",
                "3",
            ],
            {
                "tokenizer_sentencepiece_legacy": True,
                "tokenizer_special_tokens": ["<x>", "<s>", *extra],
            },
            eod=False,
        ),  # fmt: skip
        # A model that collapses runs of spaces, told to keep them (core's wrapper, direct: its
        # 0.16.1 build_tokenizer has no flag for it; Megatron-LM main passes this one).
        "sp-keep-spaces": _case(
            "SentencePieceTokenizer",
            [
                "--tokenizer-model",
                str(tmp / "sp-collapse.model"),
                "--no-tokenizer-sentencepiece-ignore-extra-whitespaces",
            ],
            {"library_kwargs": {"ignore_extra_whitespaces": False}},
        ),  # fmt: skip
        "tiktoken-v2": _case("TikTokenizer", [*tik, "2024"], {"vocab_size": 2024}),
        "tiktoken-v1-specials": _case(
            "TikTokenizer",
            [
                *tik,
                "1040",
                "--tiktoken-pattern",
                "v1",
                "--tiktoken-num-special-tokens",
                "16",
                "--tokenizer-special-tokens",
                *TIKTOKEN_SPECIALS,
            ],
            {
                "vocab_size": 1040,
                "tiktoken_pattern": "v1",
                "tiktoken_num_special_tokens": 16,
                "tokenizer_special_tokens": TIKTOKEN_SPECIALS,
            },
        ),  # fmt: skip
        "null": _case("NullTokenizer", ["--vocab-size", "500"], {"vocab_size": 500}, "ids"),
        "hf-dir": _case("HuggingFaceTokenizer", ["--tokenizer-model", hf], {}),
        "hf-json-specials": _case(
            "HuggingFaceTokenizer",
            [
                "--tokenizer-model",
                os.path.join(hf, "tokenizer.json"),
                "--tokenizer-special-tokens",
                "<x>",
                "ing",
                "--vocab-extra-ids",
                "3",
            ],
            {"tokenizer_model": hf, "tokenizer_special_tokens": ["<x>", "ing", *extra]},
        ),  # fmt: skip
        "hf-include-specials": _case(
            "HuggingFaceTokenizer",
            ["--tokenizer-model", hf_bos, "--tokenizer-hf-include-special-tokens"],
            {"tokenizer_hf_include_special_tokens": True},
        ),
        "gpt2": _case(
            "GPT2BPETokenizer",
            ["--vocab-file", GPT2_VOCAB, "--merge-file", GPT2_MERGES],
            {"vocab_file": GPT2_VOCAB, "merge_file": GPT2_MERGES},
        ),
        "bert-lower": _case(
            "BertWordPieceLowerCase", ["--vocab-file", bert_vocab], {"vocab_file": bert_vocab}
        ),
        "bert-cased": _case(
            "BertWordPieceCase", ["--vocab-file", bert_vocab], {"vocab_file": bert_vocab}
        ),
    }


def _core_model(case: dict) -> dict:
    """Core's tokenizer_model argument: the file or directory our flags name."""
    flags = case["flags"]
    if "--tokenizer-model" in flags and "tokenizer_model" not in case["core"]:
        return {"tokenizer_model": flags[flags.index("--tokenizer-model") + 1]}
    return {}


# Runs in a clean interpreter: our package is also `megatron`.
_MCORE_TOKENIZE = r"""
import argparse, json, logging, os, sys, warnings
os.environ["HF_HUB_OFFLINE"] = "1"
logging.disable(logging.WARNING)
warnings.filterwarnings("ignore")
from megatron.core.tokenizers.text.libraries import megatron_hf_tokenizer
from megatron.core.tokenizers.text.libraries.sentencepiece_tokenizer import SentencePieceTokenizer
from megatron.core.tokenizers.text.utils.build_tokenizer import build_tokenizer

spec = json.load(open(sys.argv[1]))
for name, directory in spec["hub"].items():
    megatron_hf_tokenizer.MEGATRON_CONFIG_MAP[name]["tokenizer_name"] = directory
defaults = dict(
    tokenizer_model=None, vocab_file=None, merge_file=None, tokenizer_special_tokens=None,
    tokenizer_sentencepiece_legacy=False, tiktoken_pattern=None, vocab_size=None,
    tiktoken_num_special_tokens=1000, tokenizer_hf_use_fast=False, trust_remote_code=False,
    tokenizer_hf_include_special_tokens=False, tokenizer_metadata=None,
)
out = {}
for name, case in spec["cases"].items():
    core = dict(case["core"])
    if "library_kwargs" in core:
        tok = SentencePieceTokenizer(core["tokenizer_model"], **core["library_kwargs"])
        tok.tokenize = tok.text_to_ids
    else:
        args = {**defaults, "tokenizer_type": case["type"], **core}
        tok = build_tokenizer(argparse.Namespace(**args))
    try:
        eod = tok.eod
    except AttributeError:
        eod = None
    ids = [tok.tokenize(text) for text in spec["corpora"][case["corpus"]]]
    out[name] = {"vocab_size": tok.vocab_size, "eod": eod, "ids": ids}
print(json.dumps(out))
"""


def _hub_directories(tmp) -> dict[str, str]:
    """What the Hub holds for core's BERT and GPT-2 names, as local directories."""
    hub = {}
    for name, config in {
        "BertWordPieceLowerCase": {"tokenizer_class": "BertTokenizer", "do_lower_case": True},
        "BertWordPieceCase": {"tokenizer_class": "BertTokenizer", "do_lower_case": False},
        "GPT2BPETokenizer": {"tokenizer_class": "GPT2Tokenizer"},
    }.items():
        directory = tmp / "hub" / name
        directory.mkdir(parents=True)
        (directory / "tokenizer_config.json").write_text(json.dumps(config))
        hub[name] = str(directory)
    # core passes the merges file as `merge_files`, which transformers ignores: it reads the
    # directory's own, as it would the Hub's.
    shutil.copy(GPT2_VOCAB, os.path.join(hub["GPT2BPETokenizer"], "vocab.json"))
    shutil.copy(GPT2_MERGES, os.path.join(hub["GPT2BPETokenizer"], "merges.txt"))
    return hub


def _tokenizer_files(tmp) -> None:
    """A HF directory, one whose post-processor adds a BOS, and a BERT vocab without repeats."""
    from tokenizers import Tokenizer, processors

    for name in ("hf", "hf-bos"):
        (tmp / name).mkdir()
        (tmp / name / "tokenizer_config.json").write_text('{"eos_token": "<|endoftext|>"}')
        tok = Tokenizer.from_file(HF_JSON)
        if name == "hf-bos":
            eos = tok.token_to_id("<|endoftext|>")
            tok.post_processor = processors.TemplateProcessing(
                single="<|endoftext|> $A", special_tokens=[("<|endoftext|>", eos)]
            )
        tok.save(str(tmp / name / "tokenizer.json"))
    import sentencepiece

    sentencepiece.SentencePieceTrainer.train(
        sentence_iterator=iter(synthetic_documents(200, seed=3)),
        model_prefix=str(tmp / "sp-collapse"),
        vocab_size=400,
        byte_fallback=True,
        remove_extra_whitespaces=True,
        num_threads=1,
        minloglevel=2,
    )
    # The fixture repeats four lines; transformers counts a repeated token once, we count lines.
    with open(BERT_VOCAB, encoding="utf-8") as f:
        lines = list(dict.fromkeys(f.read().splitlines()))
    (tmp / "bert-vocab.txt").write_text("".join(t + "\n" for t in lines), encoding="utf-8")


@pytest.fixture(scope="module")
def oracle(tmp_path_factory):
    """Every case's flags, and core's vocab size, EOD and ids for its corpus."""
    tmp = tmp_path_factory.mktemp("oracle")
    _tokenizer_files(tmp)
    cases = _cases(tmp)
    for case in cases.values():
        case["core"] = {**_core_model(case), **case["core"]}
    spec = {
        "hub": _hub_directories(tmp),
        "cases": cases,
        "corpora": {"text": TEXT, "ids": IDS},
    }
    (tmp / "spec.json").write_text(json.dumps(spec), encoding="utf-8")
    core = json.loads(run_megatron_core(_MCORE_TOKENIZE, str(tmp / "spec.json")).splitlines()[-1])
    for corpus, docs in spec["corpora"].items():
        with open(tmp / f"{corpus}.jsonl", "w", encoding="utf-8") as f:
            f.writelines(json.dumps({"text": d}) + "\n" for d in docs)
    return tmp, cases, core


CASE_NAMES = list(_cases(Path("unused")))  # the names only: no file is touched


def test_every_megatron_type_has_a_case(tmp_path):
    megatron_types = {t for t in TOKENIZER_TYPES if t[0].isupper()}
    assert {c["type"] for c in _cases(tmp_path).values()} == megatron_types


@pytest.mark.parametrize("name", CASE_NAMES)
def test_bin_equals_megatron_core(oracle, name):
    """Our .bin holds core's ids and EOD byte for byte; the sidecar core's vocab size and EOD."""
    tmp, cases, core = oracle
    case, expected = cases[name], core[name]
    prefix = tmp / name
    eod = ["--append-eod"] if case["eod"] else []
    corpus = str(tmp / f"{case['corpus']}.jsonl")
    argv = ["--input", corpus, "--output-prefix", str(prefix), "--tokenizer-type", case["type"]]
    assert main([*argv, *case["flags"], *eod]) == 0
    docs = [ids + ([expected["eod"]] if case["eod"] else []) for ids in expected["ids"]]
    dtype = best_dtype(expected["vocab_size"])
    data = prefix.parent / f"{prefix.name}_text_document"
    assert (data.with_suffix(".bin")).read_bytes() == np.array(
        [i for doc in docs for i in doc], dtype=dtype
    ).tobytes()
    ds = IndexedDataset(str(data))
    assert ds.dtype == dtype and ds.sequence_lengths.tolist() == [len(d) for d in docs]
    sidecar = json.loads(data.with_suffix(".json").read_text())["tokenizer"]
    assert sidecar["vocab_size"] == expected["vocab_size"]
    if expected["eod"] is not None:
        assert sidecar["eod"] == expected["eod"]
