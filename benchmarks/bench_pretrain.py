"""Iteration time of pretrain_gpt.py at TP=1 against a plain PyTorch GPT step, and TP=1 vs TP=2.

Shape: 4 layers, hidden 256, 8 heads, seq 256, batch 8, fp32, vocab 512 (a sentencepiece model
trained on the sample corpus). The plain step (forward, backward, AdamW, zero_grad on random
tokens) runs in this process on 2 threads; the entrypoint runs as a real subprocess, 1 process x
2 threads (TP=1) or 2 processes x 1 thread (TP=2); its per-iteration times come from its
metrics file (median after warm-up). Prints one JSON line.

    .venv/bin/python benchmarks/bench_pretrain.py
"""

from __future__ import annotations

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

from benchmarks.plain_gpt import PlainGPT  # noqa: E402
from tests.gpt_run import prepare_gpt_data, read_metrics, run_pretrain, tiny_overrides  # noqa: E402

SHAPE = {
    "model.num_layers": 4,
    "model.hidden_size": 256,
    "model.num_attention_heads": 8,
    "model.seq_length": 256,
    "model.max_position_embeddings": 256,
}
BATCH, ITERS, WARMUP = 8, 25, 5


def plain_step_ms(vocab: int) -> float:
    """Median ms of a plain PyTorch GPT step, on the GPU when there is one (timed to the end of its
    kernels, as the entrypoint's iteration clock is)."""
    torch.set_num_threads(2)
    torch.manual_seed(0)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model = PlainGPT(vocab, 256, 4, 256, 8).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    tokens = torch.randint(0, vocab, (BATCH, 257), device=device)
    times = []
    for _ in range(WARMUP + 10):
        if device.type == "cuda":
            torch.cuda.synchronize()  # the previous step's kernels are not this one's
        start = time.perf_counter()
        model(tokens[:, :-1], tokens[:, 1:]).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return 1000 * statistics.median(times[WARMUP:])


def entrypoint_ms(data: dict, run_dir: Path, tp: int) -> float:
    overrides = tiny_overrides(
        data,
        run_dir,
        **SHAPE,
        **{
            "parallel.tensor_parallel_size": tp,
            "training.micro_batch_size": BATCH,
            "training.global_batch_size": BATCH,
            "training.train_iters": ITERS,
            "training.eval_iters": 0,
        },
    )
    threads = "2" if tp == 1 else "1"
    run_pretrain(
        "pretrain_gpt.py",
        "configs/gpt_tiny.yaml",
        overrides,
        nproc=tp,
        timeout=900,
        env={"OMP_NUM_THREADS": threads},
    )
    times = [e["ms_per_iter"] for e in read_metrics(run_dir / "metrics.jsonl")]
    return statistics.median(times[WARMUP:])


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        data = prepare_gpt_data(Path(tmp))
        import sentencepiece

        vocab = sentencepiece.SentencePieceProcessor(model_file=data["tokenizer"]).vocab_size()
        plain = plain_step_ms(vocab)
        tp1 = entrypoint_ms(data, Path(tmp) / "tp1", 1)
        tp2 = entrypoint_ms(data, Path(tmp) / "tp2", 2)
    tokens = BATCH * 256
    print(
        json.dumps(
            {
                "plain_step_ms": round(plain, 1),
                "pretrain_tp1_ms": round(tp1, 1),
                "ratio_tp1_vs_plain": round(tp1 / plain, 3),
                "tokens_per_s_tp1": round(tokens / tp1 * 1000),
                "tokens_per_s_tp2": round(tokens / tp2 * 1000),
                "tp2_vs_tp1_throughput": round(tp1 / tp2, 3),
                "loadavg": os.getloadavg()[0],
            }
        )
    )


if __name__ == "__main__":
    main()
