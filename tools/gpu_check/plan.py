"""The shapes each step runs at: the real ones on a GPU, tiny ones for the CPU rehearsal."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Plan:
    """What the steps run; ``--dry`` swaps the GPU plan for the tiny one, step for step."""

    dry: bool
    vocab_size: int  # NullTokenizer ids in the data; EOD is one more
    data_tokens: int  # synthetic tokens written, enough for every run below
    test_device: str  # MEGATRON_TEST_DEVICE for the CUDA subset of the tests
    gpt_config: str
    gpt_overrides: dict[str, object]
    warmup_iters: int  # logged windows up to here are dropped (compilation, allocator, cuDNN)
    fp16_config: str
    fp16_overrides: dict[str, object]
    sdpa_shape: dict[str, int]  # batch, heads, seq, head_dim of the attention probes
    ring_shape: dict[str, int]  # batch, heads, groups, seq, head_dim of one CP 2 rank's share


# GPT 1.2B of the paper's Table 1 (40 layers, hidden 1536, seq 1024, full recomputation) on one
# GPU: 4 micro-batches of 8 per step, so the optimizer step is amortised as in real training.
# 10 iterations of warm-up, then 3 logged windows of 10: the 30 measured iterations.
GPU = Plan(
    dry=False,
    vocab_size=50256,  # + EOD = GPT-2's 50257, padded to 50304: the paper's FLOPs
    data_tokens=3_000_000,
    test_device="cuda",
    gpt_config="configs/gpt_1.2b.yaml",
    gpt_overrides={
        "training.micro_batch_size": 8,
        "training.global_batch_size": 32,
        "training.train_iters": 40,
        "logging.log_interval": 10,
    },
    warmup_iters=10,
    # fp16 on the 345M shape: 50 iterations from the default scale 2^32, which overflows until
    # it has halved enough; a window of 10 clean steps lets the scale grow back within the run.
    fp16_config="configs/gpt_345m.yaml",
    fp16_overrides={
        "precision.dtype": "fp16",
        "precision.loss_scale_window": 10,
        "training.micro_batch_size": 8,
        "training.global_batch_size": 16,
        "training.train_iters": 50,
        "logging.log_interval": 1,
    },
    sdpa_shape={"batch": 8, "heads": 16, "seq": 1024, "head_dim": 96},
    # Llama 3 8B's attention at TP 1 (32 heads in 8 groups of 128) at 64K tokens: rank 0 of CP 2
    # holds 32K of them, in pairs of 16K-token chunks.
    ring_shape={"batch": 1, "heads": 32, "groups": 8, "seq": 65536, "head_dim": 128},
)

_TINY = {
    "model.num_layers": 2,
    "model.hidden_size": 64,
    "model.num_attention_heads": 4,
    "model.seq_length": 64,
    "model.max_position_embeddings": 64,
    "training.micro_batch_size": 2,
    "training.global_batch_size": 4,
    "data.num_workers": 0,
}
DRY = Plan(
    dry=True,
    vocab_size=1000,
    data_tokens=60_000,
    test_device="cpu",
    gpt_config="configs/gpt_1.2b.yaml",
    gpt_overrides={**_TINY, "training.train_iters": 10, "logging.log_interval": 5},
    warmup_iters=5,
    fp16_config="configs/gpt_345m.yaml",
    fp16_overrides={
        **_TINY,
        "precision.dtype": "fp16",
        # 10 iterations cannot walk down from 2^32: start where tiny gradients fit in fp16.
        "precision.initial_loss_scale": 2.0**16,
        "precision.loss_scale_window": 3,
        "training.train_iters": 6,
        "logging.log_interval": 1,
    },
    sdpa_shape={"batch": 2, "heads": 4, "seq": 64, "head_dim": 16},
    ring_shape={"batch": 2, "heads": 4, "groups": 2, "seq": 256, "head_dim": 16},
)
