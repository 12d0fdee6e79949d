"""The pieces of evaluation without a checkpoint: window arithmetic, the WikiText detokenizer,
the LAMBADA and indexed-split readers, and scoring with stand-in models whose output says which
targets were scored.
"""

from __future__ import annotations

import json
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from megatron.data.indexed_dataset import IndexedDataset
from megatron.errors import ConfigError
from megatron.inference.detokenize import wikitext_detokenize
from megatron.inference.evaluation import SlidingWindows, score_last_words, score_windows
from megatron.inference.tasks import lambada_examples, read_lambada, split_stream, word_count
from megatron.models.gpt import GPTModel
from megatron.parallel.random import RNGTracker
from megatron.parallel.state import ParallelState
from tests.model_config import tiny_model_config

DETOKENIZED = [
    ("a 19th @-@ century mill", "a 19th-century mill"),
    ("1 @,@ 842 and 3 @.@ 5 km", "1,842 and 3.5 km"),
    ("( 2 @.@ 2 mi ) south", "(2.2 mi) south"),
    ("the River Wend , about", "the River Wend, about"),
    ("visitors : on days ; the", "visitors: on days; the"),
    ("Harrow . It was . ", "Harrow. It was. "),
    ("per minute ! Really ? Yes", "per minute! Really? Yes"),
    (" = = History = = \n", " == History ==\n"),
    (" = = = Restoration = = = \n", " === Restoration ===\n"),
    (" = = = = Deep = = = = \n", " ==== Deep ====\n"),
    ("The mill 's owner", "The mill's owner"),
    ("His sons ' accounts", "His sons' accounts"),
    ('a " great flood " in', 'a "great flood" in'),
    ("rebuilt [ note 1 ] .", "rebuilt [note 1] ."),
    ("{ x }", "{x}"),
    ("is 12 ° C here", "is 12°C here"),
    ("line end . \n next", "line end.\nnext"),
    ("top N players", "top 1 players"),
]


@pytest.mark.parametrize("num_tokens", [1, 2, 3, 31, 32, 33, 34, 47, 48, 49, 100])
@pytest.mark.parametrize("seq_length,stride", [(32, 32), (32, 16), (32, 1), (32, 31), (4, 3)])
def test_windows_score_every_target_once(num_tokens, seq_length, stride):
    """Targets 1 .. N-1 each scored exactly once, by the first window holding it; window k
    starts at kS, holds at most L inputs inside the stream; the last is the first reaching N-1."""
    windows = SlidingWindows(num_tokens, seq_length, stride)
    scored = []
    for k, w in enumerate(windows):
        assert w.start == k * stride and 1 <= w.length <= seq_length
        assert w.start + w.length <= num_tokens - 1  # its last target is a real token
        targets = range(w.start + 1, w.start + w.length + 1)
        for t in targets[w.first_scored :]:
            first_holder = next(j for j in range(len(windows)) if j * stride + seq_length >= t)
            assert first_holder == k
        scored += targets[w.first_scored :]
    assert sorted(scored) == list(range(1, num_tokens))
    reaches = [w.start + w.length == num_tokens - 1 for w in windows]
    assert reaches == [False] * (len(windows) - 1) + [True] * (num_tokens > 1)


def test_windows_docstring_example_and_counts():
    """L=4, S=2, N=9: three windows scoring 1-4, 5-6, 7-8. Counts worked by hand: N=100, L=32
    starts 0, 16, .., 80 (the first whose targets reach 99) at S=16, and 0, 32, 64, 96 at S=32
    (the last cut to targets 97-99); N=33 fits one window of 32, N=34 needs a second."""
    got = [(w.start, w.length, w.first_scored) for w in SlidingWindows(9, 4, 2)]
    assert got == [(0, 4, 0), (2, 4, 2), (4, 4, 2)]
    with pytest.raises(IndexError):
        SlidingWindows(9, 4, 2)[3]
    counts = {(100, 16): 6, (100, 32): 4, (33, 32): 1, (34, 32): 2, (34, 16): 2, (2, 32): 1}
    for (n, stride), count in counts.items():
        assert len(SlidingWindows(n, 32, stride)) == count, (n, stride)
    last = SlidingWindows(100, 32, 32)[3]
    assert (last.start, last.length, last.first_scored) == (96, 3, 0)


@pytest.mark.parametrize("tokenized,text", DETOKENIZED)
def test_wikitext_detokenizer_known_cases(tokenized, text):
    assert wikitext_detokenize(tokenized) == text


def test_word_count_is_whitespace_separated():
    """The word-level perplexity's denominator counts the original's words, "@-@" included."""
    assert word_count(" = Title = \n \n a b , c @-@ d \n") == 9


class CharTokenizer:
    """One id per character: enough to see which characters go to context and last word."""

    vocab_size = 256

    def encode(self, text: str) -> list[int]:
        return [ord(c) for c in text]


def test_lambada_inputs(tmp_path):
    """The last word follows the last whitespace; errors name the file and line."""
    path = tmp_path / "lambada.jsonl"
    lines = [{"text": "the cat sat on the\nmat "}, {"text": "a b"}]
    path.write_text("\n".join(json.dumps(x) for x in lines) + "\n\n")
    texts = read_lambada(str(path))
    (ctx, last), (ctx2, last2) = lambada_examples(texts, CharTokenizer(), 8, str(path))
    assert "".join(map(chr, ctx)) == "the cat sat on the" and "".join(map(chr, last)) == " mat"
    assert (ctx2, last2) == ([ord("a")], [ord(" "), ord("b")])
    with pytest.raises(ConfigError, match="more than --seq-length 3"):
        lambada_examples(texts, CharTokenizer(), 3, str(path))
    bad = {
        "": "holds no examples",
        '{"text": "a b"}\n{"txt": "a b"}\n': r'lambada.jsonl:2: no "text" string',
        '{"text": "a b"}\nnot json\n': "lambada.jsonl:2: not JSON",
        '{"text": "  word  "}\n': "lambada.jsonl:1: under two words",
    }
    for content, message in bad.items():
        path.write_text(content)
        with pytest.raises(ConfigError, match=message):
            read_lambada(str(path))


def test_split_stream_is_the_training_split(gpt_data):
    """train + valid + test streams are the whole file in order; the test split holds the
    last sequences, as many as the training split arithmetic gives it (1 in 1000 here)."""
    indexed = IndexedDataset(gpt_data["data"])
    everything = np.concatenate([indexed[i] for i in range(len(indexed))], dtype=np.int64)
    parts = [
        split_stream(gpt_data["data"], "949,50,1", name) for name in ("train", "valid", "test")
    ]
    assert np.array_equal(np.concatenate(parts), everything)
    test_sequences = round(len(indexed) * 1.0) - round(len(indexed) * 0.999)
    assert len(parts[2]) == int(indexed.sequence_lengths[-test_sequences:].sum())
    with pytest.raises(ConfigError, match="--split test of .* 0 token"):
        split_stream(gpt_data["data"], "1,1,0", "test")


# ---- scoring with stand-in models -----------------------------------------------------------


ONE_RANK = SimpleNamespace(dp_rank=0, dp_size=1, tp_group=None, device=torch.device("cpu"))


class LossIsTarget(torch.nn.Module):
    """Per-token "loss" = the target id at the positions asked for, so the sum says which
    targets were scored."""

    def forward(self, tokens, labels, positions):
        return labels.gather(1, positions).float()


class CopyModel(torch.nn.Module):
    """Predicts that every token repeats (logits one-hot on the input token) among the 12 real
    ids; padded id 15 has the largest logit, so reading past the real vocabulary is never right."""

    def forward(self, tokens, positions):
        logits = F.one_hot(tokens.gather(1, positions), 16).float() * 10  # [b, p, padded vocab]
        logits[..., 15] = 100.0
        return logits


@pytest.mark.parametrize("micro_batch_size", [1, 3, 64])
def test_score_windows_counts_each_target_once(micro_batch_size):
    tokens = np.arange(1, 101, dtype=np.int64) % 7 + 1
    total = score_windows(
        LossIsTarget(), tokens, SlidingWindows(100, 8, 3), ONE_RANK, micro_batch_size
    )
    assert total.tokens == 99 and total.loss_sum == tokens[1:].sum()


def test_score_last_words_is_strict():
    """Correct only when every target piece is the argmax; long contexts cut on the left."""
    examples = [
        ([5, 7], [7]),  # right
        ([5, 7], [7, 7]),  # right twice
        ([5, 7], [7, 8]),  # second piece wrong
        ([5], [6]),  # wrong
        (list(range(1, 15)) * 3 + [9], [9]),  # 47 tokens, cut to the last 8 + 1: right
    ]
    counts = score_last_words(CopyModel(), examples, ONE_RANK, 2, 8, 12)
    assert (counts.n, counts.correct, counts.target.tokens) == (5, 3, 7)


# ---- the LM head at the scored positions only, on a real model ------------------------------


class FullHead(torch.nn.Module):
    """The model as evaluation called it before ``positions``: the LM head and the loss at every
    position, the scored ones picked afterwards."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, tokens, labels=None, positions=None):
        out = self.model(tokens, labels=labels)  # [b, s] losses or [b, s, v] logits
        index = (
            positions if labels is not None else positions[..., None].expand(-1, -1, out.shape[-1])
        )
        return out.gather(1, index)


def tiny_gpt(untied: bool) -> GPTModel:
    """A 2-layer GPT of vocabulary 100 (padded to 128) at TP=1, in eval mode."""
    state = ParallelState.serial(torch.device("cpu"))
    tracker = RNGTracker(state.device)
    tracker.seed(1234, 0)
    cfg = tiny_model_config(untie_embeddings_and_output_weights=untied)
    return GPTModel(cfg, 100, 128, state, tracker).eval()


@pytest.mark.parametrize("untied", [False, True])
def test_positions_pick_the_full_heads_rows(untied):
    """Logits and losses at ``positions`` (in any order, repeated) are the full head's there."""
    model = tiny_gpt(untied)
    g = torch.Generator().manual_seed(0)
    tokens, labels = torch.randint(0, 100, (2, 3, 16), generator=g)
    positions = torch.tensor([[15, 0, 7, 7], [3, 4, 5, 0], [1, 2, 3, 4]])
    with torch.no_grad():
        full = FullHead(model)
        torch.testing.assert_close(
            model(tokens, positions=positions), full(tokens, positions=positions),
            rtol=1e-6, atol=1e-6,
        )  # fmt: skip
        torch.testing.assert_close(
            model(tokens, labels=labels, positions=positions),
            full(tokens, labels=labels, positions=positions),
            rtol=1e-6, atol=0,
        )  # fmt: skip


@pytest.mark.parametrize("micro_batch_size", [1, 3, 64])
def test_scored_positions_match_the_full_head(micro_batch_size):
    """Perplexity and LAMBADA over ragged windows and targets: the model computing only the
    scored positions gives the full head's results within 1e-6 relative."""
    model = tiny_gpt(untied=False)
    tokens = np.random.default_rng(0).integers(0, 100, 83)
    windows = SlidingWindows(len(tokens), 16, 5)  # the first scores 16, the rest 5, the last 2
    new = score_windows(model, tokens, windows, ONE_RANK, micro_batch_size)
    old = score_windows(FullHead(model), tokens, windows, ONE_RANK, micro_batch_size)
    assert new.tokens == old.tokens == 82
    assert new.ppl == pytest.approx(old.ppl, rel=1e-6)
    examples = [(list(tokens[:k]), list(tokens[k : k + 1 + k % 3])) for k in range(3, 30, 2)]
    new = score_last_words(model, examples, ONE_RANK, micro_batch_size, 16, 100)
    old = score_last_words(FullHead(model), examples, ONE_RANK, micro_batch_size, 16, 100)
    assert (new.correct, new.target.tokens) == (old.correct, old.target.tokens)
    assert new.target.ppl == pytest.approx(old.target.ppl, rel=1e-6)
