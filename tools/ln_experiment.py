"""The paper's LayerNorm lesson in miniature: the same deep, narrow BERT, post-LN against pre-LN.

    python tools/ln_experiment.py                      # ~3 minutes on 2 cores
    python tools/ln_experiment.py --prepare-only --data-dir data

Shoeybi et al. (2019) found that BERT in its original arrangement (LayerNorm after each residual
sum, "post-LN") degrades beyond ~336M parameters, while LayerNorm before each sublayer ("pre-LN")
keeps improving with size. Here both arrangements train with ``pretrain_bert.py`` (the real
entrypoint, one process each, side by side) on identical data, seed, learning rate and schedule;
only ``model.layernorm_position`` differs. Depth stands in for size: the model is deep and
narrow so the run takes minutes on a CPU.

Data (prepared once under ``--data-dir``): the sample corpus of this machine's Python docstrings
(tools/make_sample_corpus.py), a lower-cased WordPiece vocabulary trained on it with HF
``tokenizers``, and the corpus split into sentences (tools/preprocess_data.py). Outputs under
``--out``: each arm's run directory (metrics.jsonl, log), ``losses.csv`` (per iteration, both
arms' MLM and sentence-order losses) and ``losses.png``.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from megatron.atomic_file import write_atomic  # noqa: E402
from tools.make_sample_corpus import write_corpus  # noqa: E402
from tools.preprocess_data import main as preprocess  # noqa: E402

ARMS = ("pre", "post")
LOSSES = ("lm_loss", "sop_loss")
SPECIAL_TOKENS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
# Iterations between progress lines (and the first): ~5 s apart on 2 cores at the default shape.
PROGRESS_EVERY = 10


def train_wordpiece(corpus: str, path: str, vocab_size: int) -> None:
    """A lower-cased BERT WordPiece vocabulary of the corpus's texts, written as vocab.txt."""
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, trainers

    def texts():
        with open(corpus, encoding="utf-8") as f:
            for line in f:
                yield json.loads(line)["text"]

    tok = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    trainer = trainers.WordPieceTrainer(
        vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS, show_progress=False
    )
    tok.train_from_iterator(texts(), trainer)
    vocab = tok.get_vocab()
    tokens = sorted(vocab, key=vocab.get)

    def write(tmp: str) -> None:
        with open(tmp, "w", encoding="utf-8") as f:
            f.writelines(f"{t}\n" for t in tokens)

    write_atomic(path, write)


def prepare_data(data_dir: str, size_mb: float, vocab_size: int) -> tuple[str, str]:
    """Corpus, vocabulary and sentence-split data in ``data_dir`` (steps already done are kept).

    Returns (vocab file, data prefix).
    """
    os.makedirs(data_dir, exist_ok=True)
    corpus = os.path.join(data_dir, "corpus.jsonl")
    vocab = os.path.join(data_dir, "vocab.txt")
    prefix = os.path.join(data_dir, "bert")
    if not os.path.exists(corpus):
        print(f"data: writing a {size_mb:g} MB sample corpus to {corpus}", flush=True)
        write_corpus(corpus, size_mb)
    if not os.path.exists(vocab):
        print(f"data: training a {vocab_size}-piece WordPiece vocabulary", flush=True)
        train_wordpiece(corpus, vocab, vocab_size)
    if not os.path.exists(f"{prefix}_text_sentence.idx"):
        print("data: splitting the corpus into sentences and tokenizing it", flush=True)
        argv = ["--input", corpus, "--output-prefix", prefix, "--split-sentences",
                "--tokenizer-type", "BertWordPieceLowerCase", "--vocab-file", vocab]  # fmt: skip
        if preprocess(argv) != 0:
            raise SystemExit(f"preprocessing {corpus} failed")
    return vocab, f"{prefix}_text_sentence"


def arm_overrides(args: argparse.Namespace, arm: str, vocab: str, data: str) -> list[str]:
    """configs/bert_tiny.yaml made deep and narrow, one process; only the LayerNorm differs."""
    run = os.path.join(args.out, arm)
    keys = {
        "model.num_layers": args.layers,
        "model.hidden_size": args.hidden,
        "model.num_attention_heads": args.heads,
        "model.seq_length": args.seq_length,
        "model.max_position_embeddings": args.seq_length,
        "model.hidden_dropout": 0.0,  # a short run: dropout would only blur the comparison
        "model.attention_dropout": 0.0,
        "model.layernorm_position": arm,
        "parallel.tensor_parallel_size": 1,
        "tokenizer.vocab_file": vocab,
        "tokenizer.lower_case": "true",
        "data.paths": f"[{data}]",
        "data.cache_dir": os.path.join(args.out, "index-cache"),
        "training.micro_batch_size": args.batch,
        "training.global_batch_size": args.batch,
        "training.train_iters": args.iters,
        "training.seed": args.seed,
        "training.eval_interval": args.iters,
        "training.eval_iters": 10,
        "optimizer.lr": args.lr,
        "optimizer.min_lr": args.lr / 10,
        "optimizer.lr_warmup_iters": args.warmup,
        "optimizer.lr_decay_style": "linear",
        "logging.log_interval": 1,
        "logging.metrics_file": os.path.join(run, "metrics.jsonl"),
        "logging.tensorboard_dir": "null",
        "checkpoint.save": "null",
    }
    return [f"{k}={v}" for k, v in keys.items()]


def _metrics(path: str) -> list[dict]:
    """The complete lines of a metrics file (the last may still be being written)."""
    if not os.path.exists(path):
        return []
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f.read().split("\n")[:-1]]


def run_arms(args: argparse.Namespace, vocab: str, data: str) -> dict[str, list[dict]]:
    """Both arms at once, one process and one thread each; their training metrics lines. After
    each arm's first iteration and every PROGRESS_EVERY, one line with its losses."""
    procs = {}
    for arm in ARMS:
        run = os.path.join(args.out, arm)
        os.makedirs(run, exist_ok=True)
        metrics = os.path.join(run, "metrics.jsonl")
        if os.path.exists(metrics):
            os.remove(metrics)  # the loop appends; a rerun starts a fresh curve
        cmd = [sys.executable, os.path.join(ROOT, "pretrain_bert.py"),
               "--config", os.path.join(ROOT, "configs", "bert_tiny.yaml"),
               *arm_overrides(args, arm, vocab, data)]  # fmt: skip
        log = open(os.path.join(run, "log.txt"), "w")  # noqa: SIM115 (closed below)
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        procs[arm] = (subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env), log)
        print(f"{arm}-LN: started, {args.iters} iterations; log {log.name}", flush=True)
    shown = dict.fromkeys(ARMS, 0)  # metrics lines of each arm already looked at
    while any(proc.poll() is None for proc, _ in procs.values()):
        time.sleep(1)
        for arm in ARMS:
            lines = _metrics(os.path.join(args.out, arm, "metrics.jsonl"))
            for e in lines[shown[arm] :]:
                if "lm_loss" in e and (e["iteration"] % PROGRESS_EVERY == 0 or e["iteration"] == 1):
                    losses = f"lm_loss {e['lm_loss']:.3f}, sop_loss {e['sop_loss']:.3f}"
                    print(
                        f"{arm}-LN: iteration {e['iteration']}/{args.iters}, {losses}", flush=True
                    )
            shown[arm] = len(lines)
    curves = {}
    for arm, (proc, log) in procs.items():
        log.close()
        if proc.returncode != 0:
            print(f"{arm}-LN run exited with {proc.returncode}; see {log.name}")
        curves[arm] = _metrics(os.path.join(args.out, arm, "metrics.jsonl"))
    return curves


def write_csv(path: str, curves: dict[str, list[dict]]) -> None:
    """One row per iteration: both arms' training losses (empty where an arm has none)."""
    by_iter = {
        arm: {e["iteration"]: e for e in lines if "lm_loss" in e} for arm, lines in curves.items()
    }
    iterations = sorted(set().union(*by_iter.values()))
    header = ["iteration"] + [f"{arm}_ln_{loss}" for arm in ARMS for loss in LOSSES]

    def write(tmp: str) -> None:
        with open(tmp, "w", newline="", encoding="utf-8") as f:
            w = csv.writer(f)
            w.writerow(header)
            for it in iterations:
                row = [it]
                for arm in ARMS:
                    entry = by_iter[arm].get(it, {})
                    row += [repr(entry[k]) if k in entry else "" for k in LOSSES]
                w.writerow(row)

    write_atomic(path, write)


def _smooth(values: list[float], window: int) -> list[float]:
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v - (values[i - window] if i >= window else 0.0)
        out.append(total / min(i + 1, window))
    return out


def plot(path: str, curves: dict[str, list[dict]], title: str) -> None:
    """Both arms' MLM and sentence-order losses (raw, faint; moving average of 20, solid)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4), constrained_layout=True)
    for ax, loss in zip(axes, LOSSES, strict=True):
        for arm, color in zip(ARMS, ("tab:blue", "tab:red"), strict=True):
            points = [(e["iteration"], e[loss]) for e in curves[arm] if loss in e]
            if not points:
                continue
            xs, ys = zip(*points, strict=True)
            ax.plot(xs, ys, color=color, alpha=0.25, linewidth=0.8)
            ax.plot(xs, _smooth(list(ys), 20), color=color, label=f"{arm}-LN")
        ax.set_xlabel("iteration")
        ax.set_ylabel(loss.replace("_", " "))
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle(title)
    write_atomic(path, lambda tmp: fig.savefig(tmp, dpi=120, format="png"))
    plt.close(fig)


def summary(curves: dict[str, list[dict]], tail: int) -> list[str]:
    """Per arm: the mean of the first and last ``tail`` iterations' losses, and validation."""
    lines = []
    for arm in ARMS:
        train = [e for e in curves[arm] if "lm_loss" in e]
        valid = [e for e in curves[arm] if "lm_loss_validation" in e]
        if not train:
            lines.append(f"{arm}-LN: no training metrics")
            continue
        parts = []
        for loss in LOSSES:
            first = sum(e[loss] for e in train[:tail]) / len(train[:tail])
            last = sum(e[loss] for e in train[-tail:]) / len(train[-tail:])
            parts.append(f"{loss} {first:.3f} -> {last:.3f}")
        if valid:
            v = valid[-1]
            parts.append(
                f"validation lm {v['lm_loss_validation']:.3f} sop {v['sop_loss_validation']:.3f}"
            )
        lines.append(f"{arm}-LN ({len(train)} iterations): " + "; ".join(parts))
    return lines


def main(argv: list[str] | None = None) -> int:
    """Prepare the data, train both arms, write the CSV and the plot, print a summary."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default=os.path.join(ROOT, "runs", "ln_experiment"))
    p.add_argument("--data-dir", default=None, help="default: OUT/data")
    p.add_argument("--prepare-only", action="store_true", help="prepare the data, train nothing")
    p.add_argument("--corpus-mb", type=float, default=2.0)
    p.add_argument("--vocab-size", type=int, default=4000)
    p.add_argument("--layers", type=int, default=24)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--seq-length", type=int, default=64)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--iters", type=int, default=300)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--warmup", type=int, default=30)
    p.add_argument("--seed", type=int, default=1234)
    args = p.parse_args(argv)
    data_dir = args.data_dir or os.path.join(args.out, "data")
    vocab, data = prepare_data(data_dir, args.corpus_mb, args.vocab_size)
    print(f"data: {data} (vocabulary {vocab})")
    if args.prepare_only:
        return 0
    start = time.perf_counter()
    curves = run_arms(args, vocab, data)
    elapsed = time.perf_counter() - start
    csv_path, png_path = os.path.join(args.out, "losses.csv"), os.path.join(args.out, "losses.png")
    write_csv(csv_path, curves)
    title = (
        f"BERT {args.layers} layers x {args.hidden} hidden, seq {args.seq_length}, batch "
        f"{args.batch}, lr {args.lr:g} (warmup {args.warmup}, linear decay), seed {args.seed}"
    )
    plot(png_path, curves, title)
    for line in summary(curves, tail=20):
        print(line)
    print(f"trained both arms in {elapsed:.0f} s; wrote {csv_path} and {png_path}")
    return 0 if all(curves[arm] for arm in ARMS) else 1


if __name__ == "__main__":
    sys.exit(main())
