"""Train a sentencepiece model (BPE or unigram) from JSONL for ``tokenizer.type=sentencepiece``.

    python tools/train_tokenizer.py --input data/corpus.jsonl --model-prefix data/sp \\
        --vocab-size 8000 --model-type bpe

writes ``data/sp.model`` and ``data/sp.vocab``. The model defines pad=0, unk=1, bos=2 and eos=3
(eos is the end-of-document id), falls back to bytes for unseen characters and keeps the text
unnormalised, so ``decode(encode(text)) == text`` for any text.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import sys
from collections.abc import Iterable, Iterator

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron.atomic_file import write_contents  # noqa: E402
from megatron.data.corpus_files import expand_inputs, is_parquet, open_binary  # noqa: E402
from megatron.errors import ConfigError  # noqa: E402

SPECIAL_IDS = {"pad_id": 0, "unk_id": 1, "bos_id": 2, "eos_id": 3}


def iter_lines(paths: list[str], keys: list[str]) -> Iterator[str]:
    """Non-empty text lines of each key of each JSON line; lines that do not parse are skipped.

    sentencepiece trains on sentences no longer than max_sentence_length, so documents are fed
    line by line.
    """
    for path in paths:
        with open_binary(path) as f:
            for raw in f:
                try:
                    record = json.loads(raw)
                except (json.JSONDecodeError, UnicodeDecodeError):
                    continue
                if not isinstance(record, dict):
                    continue
                for key in keys:
                    value = record.get(key)
                    if isinstance(value, str):
                        yield from (line for line in value.split("\n") if line.strip())


def train_sentencepiece(
    lines: Iterable[str],
    model_prefix: str,
    vocab_size: int,
    model_type: str = "bpe",
    character_coverage: float = 0.9995,
    max_sentences: int = 2_000_000,
    threads: int = 1,
    seed: int = 1234,
) -> str:
    """Train and write ``{model_prefix}.model``/``.vocab`` (atomically); return the .model path.

    Training samples at most ``max_sentences`` lines with a fixed seed, so the same input and
    settings give the same model.
    """
    import sentencepiece

    if model_type not in ("bpe", "unigram"):
        raise ConfigError(f"--model-type {model_type}: use bpe or unigram")
    sentencepiece.set_random_generator_seed(seed)
    proto = io.BytesIO()
    try:
        sentencepiece.SentencePieceTrainer.train(
            sentence_iterator=iter(lines),
            model_writer=proto,  # no files yet: they are written atomically below
            vocab_size=vocab_size,
            model_type=model_type,
            character_coverage=character_coverage,
            byte_fallback=True,
            # identity + kept whitespace: decode(encode(text)) gives the text back exactly
            normalization_rule_name="identity",
            remove_extra_whitespaces=False,
            split_digits=True,
            input_sentence_size=max_sentences,
            shuffle_input_sentence=True,
            # unigram: settle below vocab_size when the corpus is too small for it
            hard_vocab_limit=False,
            num_threads=threads,
            minloglevel=2,
            **SPECIAL_IDS,
        )
    except RuntimeError as e:
        raise ConfigError(f"{model_prefix}: sentencepiece training failed: {e}") from None
    sp = sentencepiece.SentencePieceProcessor(model_proto=proto.getvalue())
    pieces = "".join(f"{sp.id_to_piece(i)}\t{sp.get_score(i):g}\n" for i in range(sp.vocab_size()))
    os.makedirs(os.path.dirname(os.path.abspath(model_prefix)), exist_ok=True)
    write_contents(model_prefix + ".vocab", pieces)
    write_contents(model_prefix + ".model", proto.getvalue())
    return model_prefix + ".model"


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point."""
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--input", nargs="+", required=True, help="JSONL files or globs (.gz too)")
    p.add_argument("--json-keys", nargs="+", default=["text"], help="keys holding the text")
    p.add_argument("--model-prefix", required=True, help="writes PREFIX.model and PREFIX.vocab")
    p.add_argument("--vocab-size", type=int, default=8000)
    p.add_argument("--model-type", choices=["bpe", "unigram"], default="bpe")
    p.add_argument(
        "--character-coverage",
        type=float,
        default=0.9995,
        help="share of characters kept as pieces; the rest fall back to bytes",
    )
    p.add_argument(
        "--max-sentences", type=int, default=2_000_000, help="lines sampled for training"
    )
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    p.add_argument("--seed", type=int, default=1234)
    args = p.parse_args(argv)
    try:
        paths = expand_inputs(args.input)
        parquet = next(filter(is_parquet, paths), None)
        if parquet:
            raise ConfigError(
                f"--input {parquet}: train_tokenizer reads JSONL (plain, .gz, .zst); export a "
                "sample of the Parquet column to JSONL first"
            )
        model = train_sentencepiece(
            iter_lines(paths, args.json_keys),
            args.model_prefix,
            args.vocab_size,
            args.model_type,
            args.character_coverage,
            args.max_sentences,
            args.threads,
            args.seed,
        )
    except ConfigError as e:
        print(e, file=sys.stderr)
        return 1
    from megatron.data.tokenizers.factory import build_tokenizer

    tok = build_tokenizer("sentencepiece", model=model)
    print(f"wrote {model} ({tok.vocab_size} pieces, eod={tok.eod}, pad={tok.pad})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
