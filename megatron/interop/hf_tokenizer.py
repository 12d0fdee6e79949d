"""Tokenizer files between our ``tokenizer`` config section and a HF model directory.

Export writes what ``AutoTokenizer`` loads as the same vocabulary: gpt2 -> vocab.json +
merges.txt (GPT2Tokenizer), wordpiece -> vocab.txt (BertTokenizer, ``do_lower_case``), hf ->
tokenizer.json (PreTrainedTokenizerFast, which loads it as it is), each with a
tokenizer_config.json naming the special tokens (an imported one's own, where it came with
one). A raw sentencepiece model has no exact AutoTokenizer form; it is copied as tokenizer.model
for ``sentencepiece`` itself. Either way our ids are those of ``encode`` with no special tokens
added.

Import takes GPT-2's and BERT's files as they are (our gpt2 and wordpiece tokenizers are their
classes). Any other architecture's tokenizer is what ``AutoTokenizer`` makes of the directory,
saved as a tokenizer.json: transformers' classes rebuild a tokenizer.json's normaliser and
pre-tokenizer (5.24's LlamaTokenizer marks spaces with a Metaspace step, where Llama 2's file
prepends "▁" in its normaliser: the two differ on a leading space and after a special token)
and convert a lone tokenizer.model, so the files alone would not give its ids. Tokenizer flags
(``--tokenizer-type`` ...) name files to take as they are instead.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from collections.abc import Sequence
from typing import Any

from megatron.config.tokenizer import TokenizerConfig
from megatron.data.tokenizers.base import Tokenizer
from megatron.data.tokenizers.factory import DEFAULT_EXTRA_IDS, family
from megatron.data.tokenizers.gpt2_bpe import GPT2_EOD
from megatron.errors import ConfigError

TOKENIZER_CONFIG = "tokenizer_config.json"
TOKENIZER_JSON = "tokenizer.json"
SENTENCEPIECE_MODEL = "tokenizer.model"
# Our files in a HF directory: tokenizer type -> {our config key: file name}.
FILES = {
    "gpt2": {"vocab_file": "vocab.json", "merges_file": "merges.txt"},
    "wordpiece": {"vocab_file": "vocab.txt"},
    "hf": {"model": TOKENIZER_JSON},
    "sentencepiece": {"model": SENTENCEPIECE_MODEL},
}
# Which files import looks for first: a BERT directory's vocab.txt is its WordPiece vocabulary
# (our BERT data needs one), GPT-2's vocab.json + merges.txt are read by our tiktoken path.
_IMPORT_ORDER = ("wordpiece", "gpt2", "hf", "sentencepiece")
# The files AutoTokenizer builds a Llama-family tokenizer from (it prefers tokenizer.json).
_AUTO_FILES = (TOKENIZER_JSON, SENTENCEPIECE_MODEL)
# The config keys naming tokenizer files (the others are settings).
_FILE_KEYS = ("model", "vocab_file", "merges_file")
# The class export names: it loads tokenizer.json as it is, whatever class the import named.
_VERBATIM_CLASS = "PreTrainedTokenizerFast"


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


def _read_config(path: str) -> dict[str, Any]:
    """A tokenizer_config.json as a dict; ConfigError (one line) for one that is not JSON."""
    try:
        with open(path, encoding="utf-8") as f:
            config = json.load(f)
    except (OSError, ValueError) as e:
        raise ConfigError(f"{path} is not valid JSON ({e}); fix or remove it") from None
    if not isinstance(config, dict):
        raise ConfigError(f"{path} holds no JSON object; fix or remove it")
    return config


def _write_config(path: str, config: dict[str, Any]) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(config, f, indent=2, ensure_ascii=False)
        f.write("\n")


def _content(value: Any) -> str | None:
    """A special token's spelling in tokenizer_config.json: a string or {"content": ...}."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def export_tokenizer(
    section: TokenizerConfig, tokenizer: Tokenizer, hf_dir: str, max_length: int
) -> None:
    """Write the tokenizer files of ``section`` into ``hf_dir`` (see the module docstring); a
    tokenizer HF cannot express has its files copied under their own names, and no
    tokenizer_config.json (``tokenizer_note`` then says so)."""
    if not _expressible(section):
        for key in _FILE_KEYS:
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
        names = _special_names(tokenizer, core.id_to_token)
        beside = os.path.join(os.path.dirname(section.model), TOKENIZER_CONFIG)
        if os.path.isfile(beside):
            # The model's own settings (bos, chat template, added tokens) go back with it; our
            # eod is its eos, unless it named none (then HFTokenizer found one: say which).
            config = _read_config(beside)
            if _content(config.get("eos_token")) is None:
                config["eos_token"] = names["eos_token"]
        else:
            config.update(names)
        # Whatever class the import named: LlamaTokenizer, Qwen2Tokenizer ... rebuild the
        # pre-tokenizer, and our ids are those of tokenizer.json as it is.
        config["tokenizer_class"] = _VERBATIM_CLASS
    _write_config(os.path.join(hf_dir, TOKENIZER_CONFIG), config)


def _lower_case(hf_dir: str) -> bool:
    """``do_lower_case`` of tokenizer_config.json; BertTokenizer's default (true) without it."""
    path = os.path.join(hf_dir, TOKENIZER_CONFIG)
    if not os.path.isfile(path):
        return True
    return bool(_read_config(path).get("do_lower_case", True))


def _no_tokenizer(hf_dir: str, files: str) -> ConfigError:
    return ConfigError(
        f"--input {hf_dir}: no tokenizer files ({files}); save the tokenizer into it "
        "(save_pretrained) or name one with --tokenizer-type and --tokenizer-model (or "
        "--vocab-file, --merge-file)"
    )


def _own_files(hf_dir: str) -> dict[str, Any]:
    """The section naming GPT-2's or BERT's tokenizer files in ``hf_dir``, as they are."""
    for kind in _IMPORT_ORDER:
        paths = {k: os.path.join(hf_dir, name) for k, name in FILES[kind].items()}
        if all(os.path.isfile(p) for p in paths.values()):
            section = {"type": kind, **paths}
            if kind == "wordpiece":
                section["lower_case"] = _lower_case(hf_dir)
            return section
    raise _no_tokenizer(
        hf_dir, "vocab.txt, vocab.json + merges.txt, tokenizer.json or tokenizer.model"
    )


def _auto_tokenizer(hf_dir: str, scratch: str) -> dict[str, Any]:
    """The section naming the tokenizer AutoTokenizer loads from ``hf_dir``, written into
    ``scratch`` as tokenizer.json, with the directory's tokenizer_config.json naming the
    bos and eos AutoTokenizer found (its class's defaults, or special_tokens_map.json's)."""
    if not any(os.path.isfile(os.path.join(hf_dir, name)) for name in _AUTO_FILES):
        # Without them AutoTokenizer would build a class's empty default vocabulary.
        raise _no_tokenizer(hf_dir, " or ".join(_AUTO_FILES))
    flags = "or name tokenizer files to take as they are with --tokenizer-type, --tokenizer-model"
    try:
        from transformers import AutoTokenizer
    except ImportError as e:
        raise ConfigError(
            f"--input {hf_dir}: its tokenizer is what AutoTokenizer loads, which needs "
            f"transformers ({e}): {sys.executable} -m pip install transformers; {flags}"
        ) from None
    try:
        auto = AutoTokenizer.from_pretrained(hf_dir, local_files_only=True)
    except Exception as e:  # transformers raises OSError, ValueError, KeyError ... for bad files
        why = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise ConfigError(
            f"--input {hf_dir}: AutoTokenizer cannot load it ({why}); {flags}"
        ) from None
    if not auto.is_fast:
        raise ConfigError(
            f"--input {hf_dir}: AutoTokenizer loads {type(auto).__name__}, which has no "
            f"tokenizer.json form; {flags}"
        )
    if auto.eos_token is None:
        raise ConfigError(
            f"--input {hf_dir}: its tokenizer names no eos_token (our end of document); name "
            f"the model's in {os.path.join(hf_dir, TOKENIZER_CONFIG)}"
        )
    backend = auto.backend_tokenizer
    # encode() without truncation or padding arguments applies neither, whatever the file says.
    backend.no_truncation()
    backend.no_padding()
    os.makedirs(scratch, exist_ok=True)
    model = os.path.join(scratch, TOKENIZER_JSON)
    backend.save(model)
    given = os.path.join(hf_dir, TOKENIZER_CONFIG)
    config = _read_config(given) if os.path.isfile(given) else {}
    for name in ("bos_token", "eos_token"):
        found = getattr(auto, name)
        if found is not None and _content(config.get(name)) != str(found):
            config[name] = str(found)
    _write_config(os.path.join(scratch, TOKENIZER_CONFIG), config)
    return {"type": "hf", "model": model}


def find_tokenizer(
    hf_dir: str, own_files: bool, overrides: Sequence[str], scratch: str
) -> dict[str, Any]:
    """The ``tokenizer`` section an import of ``hf_dir`` uses (see the module docstring).

    ``own_files``: GPT-2's or BERT's, whose files are taken as they are; else the tokenizer is
    AutoTokenizer's, written into ``scratch``. ``overrides`` (``tokenizer.key=value``, from the
    --tokenizer-* flags) name the whole tokenizer instead, files taken as they are; they need
    ``tokenizer.type``, since one file can be read as several types.
    """
    if overrides:
        given = dict(o.removeprefix("tokenizer.").split("=", 1) for o in overrides)
        if "type" not in given:
            raise ConfigError(
                "the tokenizer flags replace the whole tokenizer of --input: add "
                "--tokenizer-type (e.g. HuggingFaceTokenizer for a tokenizer.json)"
            )
        return given
    if own_files:
        return _own_files(hf_dir)
    return _auto_tokenizer(hf_dir, scratch)


def copy_tokenizer(section: dict[str, Any], dest_dir: str, final_dir: str) -> dict[str, Any]:
    """Copy the files ``section`` names (and a tokenizer_config.json beside them, which names
    special tokens) into ``dest_dir``, which will be renamed to ``final_dir``; returns the
    section naming the copies by their final absolute paths."""
    os.makedirs(dest_dir, exist_ok=True)
    copied = dict(section)
    sources: dict[str, str] = {}
    for key in _FILE_KEYS:
        path = section.get(key)
        if not path:
            continue
        if os.path.isdir(path):  # a HF tokenizer's directory: HFTokenizer reads its tokenizer.json
            path = os.path.join(path, TOKENIZER_JSON)
        name = os.path.basename(path)
        if sources.setdefault(name, path) != path:
            raise ConfigError(
                f"tokenizer.{key}={path} and {sources[name]} share the file name {name}, and "
                "the import's tokenizer/ holds both: rename one"
            )
        shutil.copyfile(path, os.path.join(dest_dir, name))
        copied[key] = os.path.join(os.path.abspath(final_dir), name)
    for path in sources.values():
        beside = os.path.join(os.path.dirname(path), TOKENIZER_CONFIG)
        if os.path.isfile(beside):
            shutil.copyfile(beside, os.path.join(dest_dir, TOKENIZER_CONFIG))
            break
    return copied
