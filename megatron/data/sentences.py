"""A sentence splitter for ``preprocess_data.py --split-sentences`` that needs no model or download.

A regex finds candidate ends (sentence punctuation before a word that does not start lower-case,
CJK full stops, blank lines); a short look back rejects periods that end abbreviations, initials
and list numbers. Megatron uses NLTK's punkt here, which needs a downloaded model.
"""

from __future__ import annotations

import re

# A sentence ends at . ! ? or an ellipsis (plus closing quotes/brackets) followed by whitespace and
# a word that does not start lower-case; at CJK full stops; or at a blank line.
_BOUNDARY = re.compile(
    r"(?P<stop>[.!?…]+)[\"'”’»)\]]*\s+(?=[\"'“‘«(\[]?(?P<next>\w))"
    r"|[。！？]+[」』”’）]*\s*"
    r"|\n[ \t]*\n\s*"
)
# Words whose trailing period is not a sentence end (compared lower-case, without the period).
_ABBREVIATIONS = frozenset(
    """
    mr mrs ms dr prof sr jr st mt vs fig figs eq eqs no nos vol vols pp ch sec approx dept est inc
    ltd co corp gen gov sen rep rev cf al jan feb mar apr jun jul aug sep sept oct nov dec
    """.split()
)
_WORD_BEFORE = re.compile(r"[\w.]+$")
_PARAGRAPH = re.compile(r"\n[ \t]*\n")


def split_sentences(text: str) -> list[str]:
    """Split ``text`` into sentences with a regex; no model or download needed.

    A period after an abbreviation (Dr., e.g., U.S.), an initial (J.) or a one- or two-digit list
    number (1.) does not end a sentence. Sentences come back stripped; empty ones are dropped.
    """
    sentences, start = [], 0
    for m in _BOUNDARY.finditer(text):
        # A paragraph break ends a sentence whatever precedes or follows it.
        if m.group("stop") is not None and not _PARAGRAPH.search(m.group()):
            if m.group("next").islower():
                continue
            if m.group("stop") == ".":
                # A bounded look back keeps long documents linear.
                before = _WORD_BEFORE.search(text, max(0, m.start() - 32), m.start())
                word = before.group().lower() if before else ""
                if (
                    word in _ABBREVIATIONS
                    or "." in word
                    or (len(word) == 1 and word.isalpha())
                    or (len(word) <= 2 and word.isdigit())
                ):
                    continue
        sentence = text[start : m.end()].strip()
        if sentence:
            sentences.append(sentence)
        start = m.end()
    tail = text[start:].strip()
    if tail:
        sentences.append(tail)
    return sentences
