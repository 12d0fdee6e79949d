"""Tokenizer files between our ``tokenizer`` config section and a HF model directory.

Export writes what ``AutoTokenizer`` loads as the same vocabulary: gpt2 -> vocab.json +
merges.txt (GPT2Tokenizer), wordpiece -> vocab.txt (BertTokenizer, ``do_lower_case``), hf ->
tokenizer.json (PreTrainedTokenizerFast), each with a tokenizer_config.json naming the special
tokens. A raw sentencepiece model has no exact AutoTokenizer form; it is copied as
tokenizer.model for ``sentencepiece`` itself. Import finds those files and names them in a
``tokenizer`` section. Either way our ids are those of ``encode`` with no special tokens added.
"""

from __future__ import annotations

import json
import os
import shutil
from typing import Any

from megatron.config.schema import TokenizerConfig
from megatron.data.tokenizers.base import Tokenizer
from megatron.data.tokenizers.factory import DEFAULT_EXTRA_IDS, family
from megatron.data.tokenizers.gpt2_bpe import GPT2_EOD
from megatron.errors import ConfigError

TOKENIZER_CONFIG = "tokenizer_config.json"
SENTENCEPIECE_MODEL = "tokenizer.model"
# Our files in a HF directory: tokenizer type -> {our config key: file name}.
FILES = {
    "gpt2": {"vocab_file": "vocab.json", "merges_file": "merges.txt"},
    "wordpiece": {"vocab_file": "vocab.txt"},
    "hf": {"model": "tokenizer.json"},
    "sentencepiece": {"model": SENTENCEPIECE_MODEL},
}
# Which files import looks for first: a BERT directory's vocab.txt is its WordPiece vocabulary
# (our BERT data needs one), GPT-2's vocab.json + merges.txt are read by our tiktoken path.
_IMPORT_ORDER = ("wordpiece", "gpt2", "hf", "sentencepiece")
_SPECIALS = ("eos_token", "pad_token", "cls_token", "sep_token", "mask_token", "unk_token")


def tokenizer_note(hf_dir: str) -> str | None:
    """One line for the user when AutoTokenizer cannot load an export's tokenizer (a raw
    sentencepiece model, or a tokenizer with extra ids, tiktoken, null); None when it can."""
    if os.path.isfile(os.path.join(hf_dir, TOKENIZER_CONFIG)):
        return None
    path = os.path.join(hf_dir, SENTENCEPIECE_MODEL)
    if os.path.isfile(path):
        return (
            "note: AutoTokenizer cannot express our raw sentencepiece tokenizer exactly; load it "
            f"with sentencepiece.SentencePieceProcessor(model_file='{path}') (its ids are ours)"
        )
    return (
        "note: AutoTokenizer cannot express this checkpoint's tokenizer (extra special ids, "
        f"tiktoken or null); its files are copied into {hf_dir} as they are: load them with "
        "megatron.data.tokenizers.factory.build_tokenizer and the checkpoint's tokenizer settings"
    )


def _expressible(section: TokenizerConfig) -> bool:
    """Whether HF's own tokenizer classes give exactly our ids: one of the four plain families,
    with no special tokens or extra ids appended (Megatron's types may append them)."""
    extra_ids = section.vocab_extra_ids
    if extra_ids is None:
        extra_ids = DEFAULT_EXTRA_IDS.get(section.type, 0)
    plain = not (extra_ids or section.special_tokens or section.sentencepiece_legacy)
    return plain and family(section.type) in FILES


def _special_names(tokenizer: Tokenizer, id_to_token: Any) -> dict[str, str]:
    ids = {
        "eos_token": tokenizer.eod,
        "pad_token": tokenizer.pad,
        "cls_token": tokenizer.cls,
        "sep_token": tokenizer.sep,
        "mask_token": tokenizer.mask,
    }
    return {name: id_to_token(i) for name, i in ids.items() if i is not None}


def export_tokenizer(
    section: TokenizerConfig, tokenizer: Tokenizer, hf_dir: str, max_length: int
) -> None:
    """Write the tokenizer files of ``section`` into ``hf_dir`` (see the module docstring); a
    tokenizer HF cannot express has its files copied under their own names, and no
    tokenizer_config.json (``tokenizer_note`` then says so)."""
    if not _expressible(section):
        for key in ("model", "vocab_file", "merges_file"):
            path = getattr(section, key)
            if path and os.path.isfile(path):
                shutil.copyfile(path, os.path.join(hf_dir, os.path.basename(path)))
        return
    kind = family(section.type)
    for key, name in FILES[kind].items():
        shutil.copyfile(getattr(section, key), os.path.join(hf_dir, name))
    if kind == "sentencepiece":
        return
    config: dict[str, Any] = {"model_max_length": max_length}
    if kind == "gpt2":
        config.update(
            tokenizer_class="GPT2Tokenizer",
            add_prefix_space=False,
            bos_token=GPT2_EOD,
            eos_token=GPT2_EOD,
            unk_token=GPT2_EOD,
        )
    elif kind == "wordpiece":
        config.update(
            _special_names(tokenizer, tokenizer.id_to_token),
            tokenizer_class="BertTokenizer",
            do_lower_case=tokenizer.lower_case,
            unk_token=tokenizer.id_to_token(tokenizer.unk),
            tokenize_chinese_chars=True,
            strip_accents=None,  # follows do_lower_case, as our normaliser does
        )
        config.pop("eos_token")  # BERT's eod is [SEP]; BertTokenizer has no eos
    else:
        from tokenizers import Tokenizer as HFTokenizerCore

        core = HFTokenizerCore.from_file(section.model)
        config.update(_special_names(tokenizer, core.id_to_token))
        config["tokenizer_class"] = "PreTrainedTokenizerFast"
    with open(os.path.join(hf_dir, TOKENIZER_CONFIG), "w", encoding="utf-8") as f:
        json.dump(config, f, indent=2)
        f.write("\n")


def _lower_case(hf_dir: str) -> bool:
    """``do_lower_case`` of tokenizer_config.json; BertTokenizer's default (true) without it."""
    path = os.path.join(hf_dir, TOKENIZER_CONFIG)
    if not os.path.isfile(path):
        return True
    try:
        with open(path, encoding="utf-8") as f:
            return bool(json.load(f).get("do_lower_case", True))
    except (OSError, ValueError) as e:
        raise ConfigError(f"{path} is not valid JSON ({e}); fix or remove it") from None


def find_tokenizer(hf_dir: str) -> dict[str, Any]:
    """A ``tokenizer`` section naming the tokenizer files of ``hf_dir``."""
    for kind in _IMPORT_ORDER:
        paths = {k: os.path.join(hf_dir, name) for k, name in FILES[kind].items()}
        if all(os.path.isfile(p) for p in paths.values()):
            section = {"type": kind, **paths}
            if kind == "wordpiece":
                section["lower_case"] = _lower_case(hf_dir)
            return section
    raise ConfigError(
        f"--input {hf_dir}: no tokenizer files (vocab.txt, vocab.json + merges.txt, "
        "tokenizer.json or tokenizer.model); save the tokenizer into it (save_pretrained)"
    )


def copy_tokenizer(section: dict[str, Any], dest_dir: str, final_dir: str) -> dict[str, Any]:
    """Copy the files ``section`` names (and a tokenizer_config.json beside them, which names
    special tokens) into ``dest_dir``, which will be renamed to ``final_dir``; returns the
    section naming the copies by their final absolute paths."""
    os.makedirs(dest_dir, exist_ok=True)
    copied = dict(section)
    for key in FILES[section["type"]]:
        name = os.path.basename(section[key])
        shutil.copyfile(section[key], os.path.join(dest_dir, name))
        copied[key] = os.path.join(os.path.abspath(final_dir), name)
    source_dir = os.path.dirname(section[next(iter(FILES[section["type"]]))])
    beside = os.path.join(source_dir, TOKENIZER_CONFIG)
    if os.path.isfile(beside):
        shutil.copyfile(beside, os.path.join(dest_dir, TOKENIZER_CONFIG))
    return copied
