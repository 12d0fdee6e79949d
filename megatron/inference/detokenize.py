"""WikiText-103 detokenization, as in the zero-shot evaluation of GPT-2 and Megatron-LM.

WikiText ships tokenized: words and punctuation apart (``word , word``), number separators
escaped (``1 @,@ 000``, ``state @-@ of``), headings spelled ``= = Title = =``. A model trained
on raw text scores that form badly, so the text is put back together first::

    " = = Early life = = \\n He was 1 @,@ 000 km ( far ) away ."
 -> " == Early life ==\\nHe was 1,000 km (far) away ."

The perplexity stays per token of the detokenized text; the word-level perplexity divides the
same total loss by the word count of the original (tokenized) text, so models with different
tokenizers compare.

The rules are applied in a fixed order, each over the whole text: later rules see the output of
earlier ones (``" . "`` is joined before the bracket rule trims the inside of ``( ... )``).
Megatron-LM's version also has a regex meant for ``' 90s``; as written it matches only the
literal text ``/' 9/`` and rewrites it to ``/'[0-9]/``, so it is left out here.
"""

from __future__ import annotations

import re

# WikiText's escaped separators inside numbers and compounds.
_NUMBER_SEPARATORS = [(f" @{c}@ ", c) for c in "-,."]
# A space before these marks is tokenization, not text.
_PUNCTUATION = [(f" {c} ", f"{c} ") for c in ":;.!?,"]
# Pairs whose inside is trimmed: "( far )" -> "(far)"; quotes pair up left to right.
_BRACKET_PAIRS = ["()", "[]", "{}", '""', "''"]
# Heading markers, longest first so "= = =" is not read as "= =" then "=".
_HEADINGS = [("= = = =", "===="), ("= = =", "==="), ("= =", "==")]
# Degrees, spaces at line ends and starts, PTB's number placeholder, the possessive 's.
_LAST = [(" ° ", "°"), (" \n", "\n"), ("\n ", "\n"), (" N ", " 1 "), (" 's", "'s")]


def _bracket_rule(pair: str) -> tuple[re.Pattern[str], str]:
    """One ``open  inside  close`` span, and its replacement: the inside without edge spaces."""
    open_, close = (re.escape(c) for c in pair)
    return re.compile(rf"{open_}\s*([^{close}]*?)\s*{close}"), pair[0] + r"\1" + pair[1]


_BRACKETS = [_bracket_rule(pair) for pair in _BRACKET_PAIRS]


def _replace_all(text: str, rules: list[tuple[str, str]]) -> str:
    for old, new in rules:
        text = text.replace(old, new)
    return text


def wikitext_detokenize(text: str) -> str:
    """WikiText-103's tokenized text back to running text (see the module docstring)."""
    text = text.replace("s '", "s'")  # plural possessive: "players ' union"
    text = _replace_all(text, _NUMBER_SEPARATORS)
    text = _replace_all(text, _PUNCTUATION)
    for pattern, replacement in _BRACKETS:
        text = pattern.sub(replacement, text)
    text = _replace_all(text, _HEADINGS)
    return _replace_all(text, _LAST)
