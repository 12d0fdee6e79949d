"""BERT WordPiece from a ``vocab.txt``, on the HF ``tokenizers`` library."""

from __future__ import annotations

import numpy as np

from megatron.data.tokenizers.base import require_file
from megatron.data.tokenizers.hf import HFBacked
from megatron.errors import ConfigError


class WordPieceTokenizer(HFBacked):
    """BERT WordPiece from ``vocab.txt`` (one token per line, id = line number); EOD is [SEP].

    Normalisation and pre-tokenisation follow the original BERT: clean control characters, space
    out CJK characters, split on whitespace and punctuation, and (``lower_case``) lower-case and
    strip accents. Whole-word masking reads ``is_continuation`` / ``continuation_mask``.
    ``extra_tokens`` become special tokens as transformers adds them in megatron-core: those not
    in the file get the ids after its last line, in order.
    """

    def __init__(
        self, vocab_file: str | None, lower_case: bool, extra_tokens: list[str] | tuple = ()
    ) -> None:
        from tokenizers import Tokenizer as HFTokenizerCore
        from tokenizers import decoders, models, normalizers, pre_tokenizers

        path = require_file("tokenizer.vocab_file", vocab_file, "a BERT vocab.txt")
        with open(path, encoding="utf-8") as f:
            tokens = [line.strip() for line in f]
        self.vocab = {t: i for i, t in enumerate(tokens)}
        for required in ("[UNK]", "[SEP]"):
            if required not in self.vocab:
                raise ConfigError(
                    f"tokenizer.vocab_file={path}: no {required} token; give a BERT vocab.txt"
                )
        # Ids picked here, not by the tokenizers library: it would count a file's duplicate
        # lines once and hand out ids that the file's last lines already hold.
        for token in extra_tokens:
            if token not in self.vocab:
                self.vocab[token] = len(tokens)
                tokens.append(token)
        tok = HFTokenizerCore(
            models.WordPiece(vocab=self.vocab, unk_token="[UNK]", max_input_chars_per_word=100)
        )
        tok.normalizer = normalizers.BertNormalizer(
            clean_text=True,
            handle_chinese_chars=True,
            strip_accents=lower_case,
            lowercase=lower_case,
        )
        tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
        tok.decoder = decoders.WordPiece(prefix="##")
        super().__init__(tok)
        if extra_tokens:
            self._add_specials(list(extra_tokens))
        self.files = (path,)
        self.options = {"lower_case": lower_case}
        if extra_tokens:
            self.options["special_tokens"] = list(extra_tokens)
        self.lower_case = lower_case
        self.vocab_size = len(tokens)
        self.inv_vocab = dict(enumerate(tokens))
        self.eod = self.sep = self.vocab["[SEP]"]
        self.cls = self.vocab.get("[CLS]")
        self.pad = self.vocab.get("[PAD]")
        self.mask = self.vocab.get("[MASK]")
        self.unk = self.vocab["[UNK]"]
        self.continuation_mask = np.array([t.startswith("##") for t in tokens], dtype=bool)

    def id_to_token(self, i: int) -> str:
        """The vocabulary entry of id ``i``."""
        return self.inv_vocab[i]

    def is_continuation(self, i: int) -> bool:
        """Whether id ``i`` continues the previous word (a ``##`` piece)."""
        return bool(self.continuation_mask[i])
