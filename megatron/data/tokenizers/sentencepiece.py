"""sentencepiece ``.model`` tokenizers, with megatron-core's special-token handling.

Megatron's ``SentencePieceTokenizer``, ``GPTSentencePieceTokenizer`` and ``Llama2Tokenizer`` all
build megatron-core's sentencepiece wrapper (0.16.1): the model's own ids, EOD its eos piece.
Its ``legacy`` mode (--tokenizer-sentencepiece-legacy) takes extra special tokens: each one the
model lacks gets the next id after the model's pieces, in the order given, and a special token
spelled in the text encodes as that one id. ``ignore_extra_whitespaces=False`` keeps runs of
spaces that a model trained to collapse them would drop (core's stand-in-character trick).
"""

from __future__ import annotations

import re

from megatron.data.tokenizers.base import Tokenizer, flagged, require_file
from megatron.errors import ConfigError

SPM_SEPARATOR = "▁"
# megatron-core's stand-in for a space to keep: a character unlikely to be in any vocabulary.
EXTRA_SPACE = "☯"
# Where core inserts the stand-in: between two spaces, and at a leading or trailing space.
_EXTRA_SPACES = re.compile(r"(?<= )(?= )|^ | $")


class SentencePieceTokenizer(Tokenizer):
    """A sentencepiece ``.model``; EOD is its eos piece, as in megatron-core.

    ``special_tokens`` (legacy mode only, as in core) are matched in the text before the model
    sees it: the earliest match wins, ties go to the token listed first, and a separator piece
    right after a special token is dropped (core trims it so "<s> word" does not gain a space).
    """

    def __init__(
        self,
        model_file: str | None,
        num_threads: int = 1,
        special_tokens: list[str] | tuple[str, ...] = (),
        legacy: bool = False,
        ignore_extra_whitespaces: bool = True,
    ) -> None:
        import sentencepiece

        path = require_file("tokenizer.model", model_file, "a sentencepiece .model")
        try:
            self._sp = sentencepiece.SentencePieceProcessor(model_file=path)
        except (OSError, RuntimeError) as e:
            raise ConfigError(
                f"tokenizer.model={path}: not a sentencepiece model ({str(e).strip()}); "
                "train one with tools/train_tokenizer.py"
            ) from None
        if special_tokens and not legacy:
            raise ConfigError(
                f"{flagged('tokenizer.special_tokens')} needs "
                f"{flagged('tokenizer.sentencepiece_legacy')}=true for a sentencepiece model, as "
                "in megatron-core; set it"
            )
        if self._sp.eos_id() < 0:
            raise ConfigError(
                f"tokenizer.model={path}: the model defines no eos piece for end of document; "
                "retrain it with tools/train_tokenizer.py (it defines eos)"
            )
        self.num_threads = num_threads
        self.files = (path,)
        self.vocab_size = self._sp.get_piece_size()
        self._model_size = self.vocab_size
        # core's add_special_tokens: a token the model maps to unk gets a new id, others keep
        # theirs; the dict's order is core's tie-break between matches at one position.
        self.specials: dict[str, int] = {}
        for token in special_tokens:
            piece = self._sp.piece_to_id(token)
            if piece != self._sp.unk_id():
                self.specials[token] = piece
            elif token not in self.specials:
                self.specials[token] = self.vocab_size
                self.vocab_size += 1
        self._special_ids = {i: t for t, i in self.specials.items()}
        self._separator = self._sp.piece_to_id(SPM_SEPARATOR)
        collapses = self._sp.encode_as_pieces("x  y") == self._sp.encode_as_pieces("x y")
        self._keep_spaces = collapses and not ignore_extra_whitespaces
        self.options = {}
        if self.specials:
            self.options["special_tokens"] = list(self.specials)
        if self._keep_spaces:
            self.options["keep_extra_whitespaces"] = True
        self.eod = self._sp.eos_id()
        self.pad = self._sp.pad_id() if self._sp.pad_id() >= 0 else None
        self.cls = self._piece_id("[CLS]", "<cls>", "<CLS>")
        self.sep = self._piece_id("[SEP]", "<sep>", "<SEP>")
        self.mask = self._piece_id("[MASK]", "<mask>", "<MASK>")

    def _piece_id(self, *pieces: str) -> int | None:
        """The id of the first of ``pieces`` in the vocabulary (piece_to_id gives unk if absent)."""
        for piece in pieces:
            if piece in self.specials:
                return self.specials[piece]
            i = self._sp.piece_to_id(piece)
            if self._sp.id_to_piece(i) == piece:
                return i
        return None

    def encode(self, text: str) -> list[int]:
        """The ids of ``text``, special tokens and kept spaces handled as megatron-core does."""
        if self._keep_spaces:
            text = _EXTRA_SPACES.sub(f" {EXTRA_SPACE} ", text).rstrip()
        ids: list[int] = []
        start = 0
        while self.specials:
            found = {t: i for t in self.specials if (i := text.find(t, start)) >= 0}
            if not found:
                break
            token = min(found, key=found.get)
            piece = self._sp.encode(text[start : found[token]])
            if ids and ids[-1] in self._special_ids and piece and piece[0] == self._separator:
                piece.pop(0)
            ids += piece
            ids.append(self.specials[token])
            start = found[token] + len(token)
        return ids + self._encode_plain(text[start:])

    def _encode_plain(self, text: str) -> list[int]:
        if not self._keep_spaces:
            return self._sp.encode(text)
        ids = []
        for part in text.split(EXTRA_SPACE):
            if part:
                # The appended stand-in makes the model keep the part's trailing space.
                ids += self._sp.encode(part + EXTRA_SPACE)[:-1]
        return ids

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        """sentencepiece's batch encode on ``num_threads`` threads (per text with specials)."""
        if self.specials or self._keep_spaces:
            return [self.encode(t) for t in texts]
        return self._sp.encode(texts, num_threads=self.num_threads)

    def decode(self, ids: list[int]) -> str:
        """The text of ``ids``; control pieces decode to nothing, special tokens to themselves
        set off by spaces (as megatron-core's legacy wrapper writes them)."""
        if not self.specials:
            return self._sp.decode(ids)
        text, last = "", 0
        for i, token_id in enumerate(ids):
            if token_id in self._special_ids:
                text += self._sp.decode(ids[last:i]) + " " + self._special_ids[token_id] + " "
                last = i + 1
        return (text + self._sp.decode(ids[last:])).strip()
