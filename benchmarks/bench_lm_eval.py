"""lm-eval-harness requests/s on a local multiple-choice task: our checkpoint as lm-eval's LM
(megatron/inference/lm_eval_adapter.py: requests sorted and batched, the LM head at the
continuation positions only) against lm-eval's own ``hf`` model on the same checkpoint exported
to Hugging Face, at the same batch size.

Same process, same threads, same task (--docs documents, 4 choices each: a context of
--context-words words from the sample corpus, continuations of 2 to 4 words); the two alternate
(ours, hf, ours, ...) so a busy neighbour slows both alike, and each round is a whole
``simple_evaluate``. Without --load the checkpoint is one training step of bench_pretrain's
4-layer, hidden-256 GPT over the sample corpus with a byte-level BPE of --vocab pieces trained
here (a tokenizer.json, which the export hands to AutoTokenizer as it is). Prints one JSON line:
{ours_req_s, hf_req_s, ratio, requests, ours_acc, hf_acc, batch_size, shape, threads, loadavg};
the rates are medians of loglikelihood requests per second.

    .venv/bin/python benchmarks/bench_lm_eval.py
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.bench_pretrain import SHAPE  # noqa: E402
from megatron.inference.loading import load_for_inference  # noqa: E402
from megatron.interop.export import export_hf  # noqa: E402
from megatron.parallel.state import shutdown  # noqa: E402
from tests.gpt_run import _tool, run_pretrain, tiny_overrides  # noqa: E402

TASK_YAML = """task: bench_choice
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{label}}}}"
metric_list:
  - {{metric: acc, aggregation: mean, higher_is_better: true}}
"""


def corpus_texts(path: Path) -> list[str]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line)["text"] for line in f]


def train_bpe(texts: list[str], vocab: int, path: Path) -> None:
    """A byte-level BPE with ``<|endoftext|>`` (our end of document), saved as tokenizer.json."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer)
    tok.save(str(path))


def scratch_checkpoint(work: Path, vocab: int) -> str:
    """One training step of bench_pretrain's model over a 2 MB sample corpus tokenized by a
    freshly trained ``vocab``-piece BPE (the real tools and entrypoint)."""
    corpus, tokenizer, prefix = work / "corpus.jsonl", work / "tokenizer.json", work / "corpus"
    _tool("tools/make_sample_corpus.py", "--output", str(corpus), "--size-mb", "2")
    train_bpe(corpus_texts(corpus), vocab, tokenizer)
    _tool("tools/preprocess_data.py", "--input", str(corpus), "--output-prefix", str(prefix),
          "--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", str(tokenizer),
          "--append-eod")  # fmt: skip
    extra = {
        **SHAPE,
        "tokenizer.type": "hf",
        "checkpoint.save": work / "ckpt",
        "parallel.tensor_parallel_size": 1,
        "training.train_iters": 1,
        "optimizer.lr_warmup_iters": 0,
    }
    data = {"tokenizer": str(tokenizer), "data": f"{prefix}_text_document"}
    run_pretrain("pretrain_gpt.py", "configs/gpt_tiny.yaml", tiny_overrides(data, work, **extra))
    return str(work / "ckpt")


def write_task(work: Path, texts: list[str], docs: int, context_words: int) -> Path:
    """The multiple-choice task's YAML and data under ``work/tasks``; its include path."""
    out = work / "tasks"
    out.mkdir()
    words = [t.split() for t in texts if len(t.split()) >= context_words + 16][:docs]
    records = [
        {
            "question": " ".join(w[:context_words]),
            "choices": [
                " " + " ".join(w[context_words + 4 * k : context_words + 4 * k + 2 + (i + k) % 3])
                for k in range(4)
            ],
            "label": i % 4,
        }
        for i, w in enumerate(words)
    ]
    (out / "choice.json").write_text(json.dumps(records))
    (out / "choice.yaml").write_text(TASK_YAML.format(data=out / "choice.json"))
    return out


def measure(load: str, include: Path, batch_size: int, repeats: int, hf_dir: str) -> dict:
    """Both sides' median requests/s (after one warm-up round) and accuracy."""
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    from megatron.inference.lm_eval_adapter import MegatronLM

    loaded = load_for_inference(load, [])
    ours = MegatronLM(loaded.model, loaded.tokenizer, loaded.state, batch_size)
    hf_args = {"pretrained": export_hf(load, hf_dir), "device": "cpu", "dtype": "float32"}
    manager = TaskManager(include_path=str(include), include_defaults=False)
    common = {"tasks": ["bench_choice"], "task_manager": manager, "bootstrap_iters": 0}
    runs = {
        "ours": lambda: simple_evaluate(model=ours, **common),
        "hf": lambda: simple_evaluate(
            model="hf", model_args=hf_args, batch_size=batch_size, **common
        ),
    }
    seconds: dict[str, list[float]] = {name: [] for name in runs}
    acc: dict[str, float] = {}
    for i in range(1 + repeats):  # one warm-up round, then interleaved timed rounds
        for name, run in runs.items():
            start = time.perf_counter()
            results = run()
            if i:
                seconds[name].append(time.perf_counter() - start)
            acc[name] = results["results"]["bench_choice"]["acc,none"]
            docs = results["n-samples"]["bench_choice"]["effective"]
    shutdown()
    requests = 4 * docs
    ours_req_s = requests / statistics.median(seconds["ours"])
    hf_req_s = requests / statistics.median(seconds["hf"])
    m = loaded.cfg.model
    return {
        "ours_req_s": round(ours_req_s, 1),
        "hf_req_s": round(hf_req_s, 1),
        "ratio": round(ours_req_s / hf_req_s, 3),
        "requests": requests,
        "ours_acc": acc["ours"],
        "hf_acc": acc["hf"],
        "batch_size": batch_size,
        "shape": {
            "layers": m.num_layers,
            "hidden": m.hidden_size,
            "vocab": loaded.tokenizer.vocab_size,
        },
    }


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--load", help="checkpoint to use (default: a scratch one)")
    parser.add_argument("--vocab", type=int, default=32768, help="the scratch BPE's pieces")
    parser.add_argument("--docs", type=int, default=100, help="documents of the task")
    parser.add_argument("--context-words", type=int, default=48, help="words per context")
    parser.add_argument("--batch-size", type=int, default=16, help="requests per forward pass")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per side")
    parser.add_argument("--threads", type=int, default=2, help="torch intra-op threads")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        # lm-eval reads the task's JSON through datasets, before which nothing imports it
        os.environ.update(HF_DATASETS_CACHE=str(work / "cache"), HF_DATASETS_OFFLINE="1")
        load = args.load or scratch_checkpoint(work, args.vocab)
        _tool("tools/make_sample_corpus.py", "--output", str(work / "task.jsonl"), "--size-mb", "1")
        include = write_task(work, corpus_texts(work / "task.jsonl"), args.docs, args.context_words)
        result = measure(load, include, args.batch_size, args.repeats, f"{tmp}/hf")
    result |= {
        "threads": torch.get_num_threads(),
        "loadavg": [round(x, 2) for x in os.getloadavg()],
    }
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
