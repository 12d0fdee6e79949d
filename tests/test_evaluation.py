"""tools/evaluate.py on real checkpoints: TP=2 x DP=2 against TP=1, the exported HF model as
the oracle of the perplexity and of LAMBADA, the JSON line, and one-line errors for bad input.

Perplexity runs on ``trained_gpt`` (saved at TP=2); LAMBADA also on ``wide_gpt`` (TP=1, one
step from a wide initialisation), because the barely trained fixture predicts the same piece
almost everywhere, which makes every last word wrong. On ``wide_gpt`` some examples are built to
be answerable: their last word is the HF model's greedy next piece.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from collections import defaultdict

import pytest
import torch
import torch.nn.functional as F

from megatron.errors import ConfigError
from megatron.inference.detokenize import wikitext_detokenize
from tests.distributed import run_distributed
from tests.gpt_run import ROOT
from tests.test_generation import load_forms

SEQ, STRIDE = 32, 16  # the fixtures' seq_length, and a stride that makes windows overlap

# WikiText-103's tokenized form: spaced punctuation, @-@ separators, = = headings; each line
# starts and ends with a space, blank lines are a lone space.
WIKI_LINES = [
    "= Harrow Mill =",
    "",
    "Harrow Mill is a 19th @-@ century water mill on the River Wend , about 3 @.@ 5 km "
    "( 2 @.@ 2 mi ) south of Lower Harrow . It was built in 1842 by the Harrow family , "
    "and it ground 1 @,@ 500 tons of corn a year until 1911 .",
    "",
    "= = History = =",
    "",
    "The mill 's first owner , Thomas Harrow , paid £ 1 @,@ 200 for the site . His sons ' "
    'accounts record a " great flood " in 1852 ; the wheel was rebuilt the next year '
    "[ note 1 ] .",
    "",
    "= = = Restoration = = =",
    "",
    "A trust restored the mill between 1978 and 1984 . It grinds flour for 12 @,@ 000 visitors "
    ": on summer days the wheel turns at 6 @.@ 5 revolutions per minute ! The water is 12 ° C "
    "even in August .",
]
WIKI = "".join(f" {line} \n" if line else " \n" for line in WIKI_LINES)


def test_wikitext_sample_detokenizes():
    text = wikitext_detokenize(WIKI)
    assert "19th-century" in text and "12,000 visitors" in text and "(2.2 mi)" in text
    assert "\n== History ==\n" in text and "\n=== Restoration ===\n" in text
    assert "@" not in text and " , " not in text


def corpus_texts(data: dict[str, str]) -> list[str]:
    """The documents of the sample corpus the fixtures were trained on."""
    path = os.path.join(os.path.dirname(data["tokenizer"]), "corpus.jsonl")
    with open(path, encoding="utf-8") as f:
        return [json.loads(line)["text"] for line in f]


def write_lines(path: str, texts: list[str]) -> str:
    """``texts`` as LAMBADA JSONL; returns ``path``."""
    with open(path, "w", encoding="utf-8") as f:
        f.writelines(json.dumps({"text": t}) + "\n" for t in texts)
    return path


@pytest.fixture(scope="module")
def inputs(gpt_data, tmp_path_factory) -> dict[str, str]:
    """WIKI, a few corpus documents as raw text, LAMBADA lines cut from the corpus (6 to 15
    words, so that some contexts are cut on the left), and an empty file."""
    out = tmp_path_factory.mktemp("eval_inputs")
    docs = corpus_texts(gpt_data)
    words = [d.split() for d in docs if len(d.split()) >= 16][:40]
    paths = {name: str(out / name) for name in ("wiki.txt", "text.txt", "empty.txt")}
    (out / "wiki.txt").write_text(WIKI, encoding="utf-8")
    (out / "text.txt").write_text("\n\n".join(docs[:4]), encoding="utf-8")
    (out / "empty.txt").write_text("\n \n", encoding="utf-8")
    cut = [" ".join(w[: 6 + i % 10]) for i, w in enumerate(words)]
    paths["lambada.jsonl"] = write_lines(str(out / "lambada.jsonl"), cut)
    return paths


def export(load_dir: str, out: str) -> str:
    """The exported HF model directory of a checkpoint (written by the other engineer's export)."""
    from megatron.interop.export import export_hf

    return export_hf(load_dir, out)


@pytest.fixture(scope="module")
def hf_models(trained_gpt, wide_gpt, tmp_path_factory) -> dict[str, torch.nn.Module]:
    """Both checkpoints exported and loaded as GPT2LMHeadModel (fp32, eval mode)."""
    from transformers import GPT2LMHeadModel

    out = tmp_path_factory.mktemp("hf")
    dirs = {
        "trained": export(trained_gpt["ckpt"], str(out / "trained")),
        "wide": export(wide_gpt["ckpt"], str(out / "wide")),
    }
    return {k: GPT2LMHeadModel.from_pretrained(d).eval() for k, d in dirs.items()}


@pytest.fixture(scope="module")
def spm(gpt_data):
    """The fixtures' sentencepiece model, used directly (not through our Tokenizer)."""
    import sentencepiece

    return sentencepiece.SentencePieceProcessor(model_file=gpt_data["tokenizer"])


@torch.no_grad()
def hf_greedy_piece(model: torch.nn.Module, spm, text: str) -> str:
    """The piece the HF model predicts after ``text``."""
    ids = spm.encode(text)[-SEQ:]
    return spm.id_to_piece(
        int(model(torch.tensor([ids])).logits[0, -1, : spm.vocab_size()].argmax())
    )


@pytest.fixture(scope="module")
def wide_lambada(inputs, hf_models, spm) -> str:
    """The corpus lines, and beside each whose predicted next piece is a word ("▁the"), the
    same context ending in that word: answerable by construction, if our scoring is right."""
    with open(inputs["lambada.jsonl"], encoding="utf-8") as f:
        natural = [json.loads(line)["text"] for line in f]
    answerable = []
    for text in natural:
        context = text.rsplit(maxsplit=1)[0]
        piece = hf_greedy_piece(hf_models["wide"], spm, context)
        if piece.startswith("\u2581") and piece[1:].isalpha():
            answerable.append(f"{context} {piece[1:]}")
    assert 3 <= len(answerable) < len(natural)
    return write_lines(
        os.path.join(os.path.dirname(inputs["empty.txt"]), "wide.jsonl"), natural + answerable
    )


def flags(load: str, task: str, **values: object) -> list[str]:
    """A tools/evaluate.py command line: ``flags(d, "text", input=f)`` -> --load d --task text
    --input f; a list value gives several arguments to one flag."""
    argv = ["--load", load, "--task", task]
    for key, value in values.items():
        argv.append("--" + key.replace("_", "-"))
        argv += [str(v) for v in value] if isinstance(value, list) else [str(value)]
    return argv


def cases(trained_gpt: dict[str, str], wide: str, files: dict[str, str]) -> dict[str, list[str]]:
    """The command lines run serial and parallel, by name."""
    ckpt, data = trained_gpt["ckpt"], trained_gpt["data"]
    wiki = files["wiki.txt"]
    return {
        "text": flags(ckpt, "text", input=files["text.txt"], stride=STRIDE),
        "wikitext": flags(ckpt, "wikitext", input=wiki, stride=STRIDE),
        "wikitext_short": flags(ckpt, "wikitext", input=wiki, seq_length=12, stride=5),
        "lambada": flags(ckpt, "lambada", input=files["lambada.jsonl"]),
        "lambada_wide": flags(wide, "lambada", input=files["wide.jsonl"]),
        "lm": flags(ckpt, "lm", split_weights="996,2,2", data_path=[data, data]),
        "lm_default": flags(ckpt, "lm"),
        "too_long": flags(ckpt, "text", input=wiki, seq_length=SEQ + 1),
    }


def evaluate_all(
    argvs: dict[str, list[str]], extra: list[str], cli: list[str]
) -> tuple[dict[str, dict], int]:
    """tools/evaluate.py's ``run`` on each command line plus ``extra`` in this process group (a
    user mistake comes back as {"error": message}), then its ``main`` on ``cli``."""
    from tools.evaluate import build_parser, main, run

    results = {}
    for name, argv in argvs.items():
        try:
            results[name] = run(build_parser().parse_args(argv + extra))
        except ConfigError as err:
            results[name] = {"error": str(err)}
    return results, main(cli + extra)


@pytest.fixture(scope="module")
def runs(trained_gpt, wide_gpt, inputs, wide_lambada, tmp_path_factory) -> dict[str, dict]:
    """Every case at TP=1 in one process ("serial", 3 windows or examples per micro-batch) and at
    TP=2 x DP=2 in four ("parallel", 16 per micro-batch); each also runs ``main`` on the
    wikitext case with --output (under "cli": the lines written)."""
    files = {**inputs, "wide.jsonl": wide_lambada}
    argvs = cases(trained_gpt, wide_gpt["ckpt"], files)
    out = tmp_path_factory.mktemp("eval_runs")
    got = {}
    for name, world, extra in (
        ("serial", 1, ["--micro-batch-size", "3"]),
        ("parallel", 4, ["--micro-batch-size", "16", "--tensor-parallel-size", "2"]),
    ):
        cli = [*argvs["wikitext"], "--output", str(out / f"{name}.jsonl")]
        ranks = run_distributed(evaluate_all, world, argvs, extra, cli)
        assert all(r == ranks[0] for r in ranks)  # every rank returns the reduced result
        results, code = ranks[0]
        assert code == 0
        lines = (out / f"{name}.jsonl").read_text().splitlines()
        got[name] = {**results, "cli": [json.loads(line) for line in lines]}
    return got


def rel(a: float, b: float) -> float:
    return abs(a - b) / abs(b)


def test_parallel_equals_serial(runs):
    """TP=2 x DP=2 gives TP=1's totals: the same targets and counts, and losses within 1e-6
    relative (each token's fp32 loss differs by reduction order, ~1e-7; the sums are float64)."""
    serial, parallel = runs["serial"], runs["parallel"]
    for name in (
        "text",
        "wikitext",
        "wikitext_short",
        "lambada",
        "lambada_wide",
        "lm",
        "lm_default",
    ):
        s, p = serial[name], parallel[name]
        assert (p["tensor_parallel_size"], p["data_parallel_size"]) == (2, 2), name
        assert s["tokens"] == p["tokens"] and rel(p["loss"], s["loss"]) < 1e-6, name
        if name.startswith("lambada"):
            assert (s["n"], s["correct"]) == (p["n"], p["correct"]), name
    assert serial["lm"]["datasets"][0]["tokens"] * 2 == serial["lm"]["tokens"]
    default = serial["lm_default"]  # the checkpoint's data.paths and split, its test split
    assert (default["split"], default["split_weights"]) == ("test", "949,50,1")
    assert (
        "exceeds the checkpoint's model.max_position_embeddings=32" in serial["too_long"]["error"]
    )


@torch.no_grad()
def hf_window_loss(
    model: torch.nn.Module, ids: list[int], seq_length: int, stride: int, vocab: int
) -> tuple[float, int]:
    """Sum of losses over targets 1 .. N-1, each from the first window [kS, kS+L) holding it
    (smallest k with kS + L >= t), by the HF model; and the number of targets."""
    by_window = defaultdict(list)
    for t in range(1, len(ids)):
        by_window[max(0, math.ceil((t - seq_length) / stride))].append(t)
    total = 0.0
    for k, targets in by_window.items():
        start = k * stride
        window = torch.tensor([ids[start : start + seq_length]])
        logits = model(window).logits[0, :, :vocab].double()  # [s, vocab]
        rows = torch.tensor(targets) - 1 - start  # the position predicting each target
        total += F.cross_entropy(
            logits[rows], torch.tensor([ids[t] for t in targets]), reduction="sum"
        ).item()
    return total, len(ids) - 1


def test_wikitext_perplexity_matches_hf(runs, hf_models, spm):
    """Overlapping windows (S=16 of L=32, and S=5 of L=12) over the detokenized sample: the
    exported HF model, windowed independently here, gives the same loss within 1e-5 relative."""
    ids = spm.encode(wikitext_detokenize(WIKI))
    for name, (seq_length, stride) in {
        "wikitext": (SEQ, STRIDE),
        "wikitext_short": (12, 5),
    }.items():
        ours = runs["serial"][name]
        total, count = hf_window_loss(
            hf_models["trained"], ids, seq_length, stride, spm.vocab_size()
        )
        assert ours["tokens"] == count == len(ids) - 1
        assert (
            rel(ours["loss"], total / count) < 1e-5
            and rel(ours["ppl"], math.exp(total / count)) < 1e-5
        )
        words = len(WIKI.split())  # of the original, tokenized text
        assert ours["words"] == words and rel(ours["word_ppl"], math.exp(total / words)) < 1e-5


@torch.no_grad()
def hf_lambada(model: torch.nn.Module, spm, path: str) -> tuple[int, int, float]:
    """(n, correct, summed target loss) by the HF model: the last word is the text after its
    last whitespace, its ids the whole text's after the context's; inputs cut to SEQ."""
    n = correct = 0
    loss = 0.0
    with open(path, encoding="utf-8") as f:
        for line in f:
            context, last = json.loads(line)["text"].strip().rsplit(maxsplit=1)
            c, whole = spm.encode(context), spm.encode(f"{context} {last}")
            assert whole[: len(c)] == c
            target = whole[len(c) :]
            ids = (c + target)[-(SEQ + 1) :]
            logits = model(torch.tensor([ids[:-1]])).logits[0, -len(target) :, : spm.vocab_size()]
            n += 1
            correct += logits.argmax(-1).tolist() == target
            loss += F.cross_entropy(logits.double(), torch.tensor(target), reduction="sum").item()
    return n, correct, loss


def test_lambada_matches_hf(runs, hf_models, spm, inputs, wide_lambada):
    """The same n and correct as the HF model, and the last words' loss within 1e-5; on
    ``wide_gpt`` some but not all examples are right."""
    for name, model, path in (
        ("lambada", "trained", inputs["lambada.jsonl"]),
        ("lambada_wide", "wide", wide_lambada),
    ):
        ours = runs["serial"][name]
        n, correct, loss = hf_lambada(hf_models[model], spm, path)
        assert (ours["n"], ours["correct"]) == (n, correct), name
        assert rel(ours["loss"] * ours["tokens"], loss) < 1e-5, name
    wide = runs["serial"]["lambada_wide"]
    assert 0 < wide["correct"] < wide["n"] and wide["accuracy"] == wide["correct"] / wide["n"]


def evaluate_cli(argv: list[str]) -> subprocess.CompletedProcess:
    """tools/evaluate.py as a user runs it, in a process of its own."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run(
        [sys.executable, "tools/evaluate.py", *argv],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_main_appends_one_line_on_rank_0(runs):
    """At TP=2 x DP=2, ``main`` writes one line (rank 0's), with run's numbers."""
    for name in ("serial", "parallel"):
        (line,) = runs[name]["cli"]
        want = runs[name]["wikitext"]
        assert {k: line[k] for k in want} == want


def test_cli_prints_one_json_line(trained_gpt, inputs, runs):
    """python tools/evaluate.py: one JSON line on stdout, nothing else, the serial numbers."""
    proc = evaluate_cli(flags(trained_gpt["ckpt"], "lambada", input=inputs["lambada.jsonl"]))
    assert proc.returncode == 0, proc.stderr[-3000:]
    (line,) = proc.stdout.splitlines()
    got, want = json.loads(line), runs["serial"]["lambada"]
    assert {k: got[k] for k in ("task", "n", "correct", "tokens")} == {
        k: want[k] for k in ("task", "n", "correct", "tokens")
    }
    assert rel(got["loss"], want["loss"]) < 1e-6


def test_cli_reads_every_form_of_load(wide_gpt, inputs, tmp_path):
    """--load as the run's save directory, one iter_* directory of it, or the merged copy of
    tools/checkpoint_util.py: the same JSON line, each naming the checkpoint it read."""
    forms = load_forms(wide_gpt["ckpt"], tmp_path)
    got = {}
    for form, load in forms.items():
        proc = evaluate_cli(flags(load, "text", input=inputs["text.txt"], stride=STRIDE))
        assert proc.returncode == 0, proc.stderr[-3000:]
        (line,) = proc.stdout.splitlines()
        got[form] = json.loads(line)
    assert got["save dir"]["checkpoint"] == got["iter dir"]["checkpoint"] == forms["iter dir"]
    assert got["merged"]["checkpoint"] == os.path.join(forms["merged"], "iter_0000001")
    for result in got.values():
        del result["checkpoint"]
    assert got["save dir"]["tokens"] > 0
    assert got["save dir"] == got["iter dir"] == got["merged"]


@pytest.mark.parametrize("problem", ["empty input", "missing checkpoint", "run directory"])
def test_bad_input_is_one_line(trained_gpt, inputs, tmp_path, problem):
    """exit 2 and one line on stderr, no traceback."""
    load, path = trained_gpt["ckpt"], inputs["wiki.txt"]
    if problem == "empty input":
        path, message = inputs["empty.txt"], "holds no text"
    elif problem == "missing checkpoint":
        load, message = str(tmp_path / "nowhere"), "no such directory"
    else:  # the run's directory, which holds its save directory ckpt/
        load, message = trained_gpt["run"], "holds no checkpoint (it holds "
    proc = evaluate_cli(flags(load, "wikitext", input=path))
    assert proc.returncode == 2 and proc.stdout == ""
    assert len(proc.stderr.splitlines()) == 1 and proc.stderr.startswith("error: ")
    assert message in proc.stderr


def test_input_mistakes_stop_before_loading(trained_gpt, inputs, tmp_path, capsys):
    """Found before the model loads (no process group in this process): one line each."""
    from tools.evaluate import main

    no_text = tmp_path / "no_text.jsonl"
    no_text.write_text('{"sentence": "a b"}\n')
    ckpt, missing = trained_gpt["ckpt"], str(tmp_path / "moved.model")
    for argv, message in [
        (flags(ckpt, "text", input=tmp_path / "missing.txt"), "no such file"),
        (flags(ckpt, "lambada", input=no_text), 'no "text" string'),
        (flags(ckpt, "lambada", input=inputs["empty.txt"]), "holds no examples"),
        (flags(ckpt, "wikitext"), "--task wikitext needs --input"),
        (flags(ckpt, "text", input=inputs["wiki.txt"], stride=0), "--stride 0: must be >= 1"),
        # the tokenizer flags reach the checkpoint's config
        (flags(ckpt, "text", input=inputs["wiki.txt"], tokenizer_model=missing), missing),
    ]:
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert len(err.splitlines()) == 1 and message in err, err
