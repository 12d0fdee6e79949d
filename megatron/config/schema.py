"""The run's configuration schema: documented dataclasses, and the config as plain data.

Loading lives in ``megatron.config.load``, checking in ``megatron.config.checks``: both import
this module and it imports neither, so any of the three can be a program's first import.
World-size-dependent values (DP size, micro-batches per step, padded vocabulary) come from
``Config.derived`` only.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import MISSING, dataclass
from typing import Any, Literal, get_type_hints

import yaml

from megatron.config.fields import documented as _doc
from megatron.config.model import ModelConfig
from megatron.config.tokenizer import TokenizerConfig
from megatron.errors import ConfigError


@dataclass
class ParallelConfig:
    """How processes split the work; the DP size is world / (tensor_parallel_size *
    context_parallel_size * pipeline_parallel_size)."""

    tensor_parallel_size: int = _doc("Ranks that split each layer (adjacent ranks).", 1)
    pipeline_parallel_size: int = _doc(
        "Pipeline stages, each holding num_layers / stages consecutive layers (across nodes).", 1
    )
    context_parallel_size: int = _doc(
        "Ranks that split each sample's sequence (ring attention; next to TP in the grid).", 1
    )
    expert_parallel_size: int = _doc(
        "Ranks over which each MoE layer's experts are split, carved from the DP x CP ranks "
        "(tokens travel to their experts by all-to-all); divides num_experts and DP x CP.",
        1,
    )
    virtual_pipeline_size: int | None = _doc(
        "Model chunks per stage (interleaved 1F1B); null: one chunk, plain 1F1B.", None
    )
    timeout_minutes: float = _doc("Collective timeout: a dead peer fails the run after this.", 10.0)
    ddp_bucket_size_mb: float = _doc("fp32 gradient bucket size for the DP all-reduce.", 25.0)
    distributed_optimizer: bool = _doc(
        "Shard fp32 main params and Adam moments over DP (ZeRO-1): reduce-scatter, all-gather.",
        False,
    )
    sequence_parallel: bool = _doc(
        "Split LayerNorm/dropout/residual activations along the sequence over TP (needs TP > 1).",
        False,
    )
    overlap_param_gather: bool = _doc(
        "Distributed optimizer: each bucket's parameter all-gather is waited for by the next "
        "forward's first use, not by the step.",
        False,
    )
    heartbeat_grace_s: float = _doc(
        "A peer (or the launcher) silent this long is lost: the run names it and exits 1.", 60.0
    )


@dataclass
class DataConfig:
    """Where samples come from and how GPT samples are shaped."""

    paths: list[str | float] = _doc("Dataset prefixes, or alternating weight, prefix pairs.")
    split: str = _doc("Train,valid,test proportions over documents, e.g. 949,50,1.", "949,50,1")
    cache_dir: str | None = _doc("Sample-index cache; null: index-cache/ by the data.", None)
    format: Literal["indexed", "hdf5"] = _doc(
        "indexed: .bin/.idx prefixes; hdf5: pre-masked BERT shards (files or folders).", "indexed"
    )
    num_workers: int = _doc("DataLoader worker processes per rank.", 2)
    reset_position_ids: bool = _doc("Restart position ids after each end-of-document.", False)
    reset_attention_mask: bool = _doc("Stop attention across end-of-document tokens.", False)
    eod_mask_loss: bool = _doc("No loss on end-of-document tokens.", False)
    skip_batches: list[int | list[int]] = _doc(
        "Global batches never trained on: numbers from 1, or [first, last] ranges.", factory=list
    )


@dataclass
class BertConfig:
    """BERT-only sample construction and heads (ignored by GPT)."""

    masked_lm_prob: float = _doc("Fraction of tokens chosen for masking.", 0.15)
    short_seq_prob: float = _doc("Probability of a shorter random target length.", 0.1)
    max_ngram: int = _doc("Longest whole-word n-gram masked at once.", 3)
    binary_head: Literal["sop", "nsp", "none"] = _doc("Sentence order, next sentence.", "sop")
    num_tokentypes: int = _doc("Token-type (segment) embeddings.", 2)


@dataclass
class TrainingConfig:
    """Batch sizes, length of the run, evaluation and stopping."""

    micro_batch_size: int = _doc("Samples per forward/backward on one rank.")
    global_batch_size: int = _doc("Samples per optimizer step over all DP ranks.")
    train_iters: int | None = _doc("Optimizer steps; null: from train_samples.", None)
    train_samples: int | None = _doc("Samples to train on; stops the run when reached.", None)
    seed: int = _doc("Seed of weights, dropout and data order.", 1234)
    eval_interval: int = _doc("Iterations between evaluations.", 1000)
    eval_iters: int = _doc("Validation batches per evaluation (0: none).", 10)
    test_iters: int = _doc(
        "Test-split batches evaluated once when training ends (0: none, no test split built).", 0
    )
    eval_tasks: list[str] = _doc("lm-eval tasks scored in the loop (needs lm-eval).", factory=list)
    eval_tasks_include_path: str | None = _doc("A directory of your lm-eval task YAMLs.", None)
    eval_tasks_interval: int = _doc("Iterations between eval_tasks runs; 0: eval_interval.", 0)
    eval_tasks_limit: int | None = _doc("Documents per task per run; null: all.", None)
    exit_interval: int | None = _doc("Save and exit when iteration % this == 0.", None)
    exit_duration_in_mins: float | None = _doc("Save and exit after this many minutes.", None)
    max_consecutive_nan: int = _doc("Stop after this many skipped steps in a row.", 10)
    exit_signal: Literal["SIGTERM", "SIGUSR1", "SIGUSR2"] = _doc(
        "Signal that asks every rank to save and exit.", "SIGTERM"
    )
    spike_threshold: float | None = _doc(
        "Roll back when the loss exceeds this times its recent median; null: off.", None
    )
    spike_window: int = _doc("Iterations whose median loss a spike is judged against.", 50)
    spike_skip_batches: int | None = _doc(
        "Batches skipped per spike, ending at it; null: all since the checkpoint.", None
    )
    max_rollbacks: int = _doc("Spikes rolled back before the run saves and exits 5.", 3)


@dataclass
class OptimizerConfig:
    """AdamW, gradient clipping and the learning-rate schedule."""

    lr: float = _doc("Peak learning rate.")
    min_lr: float = _doc("Learning rate at the end of decay.", 0.0)
    weight_decay: float = _doc("Decoupled weight decay (not on biases and 1-D parameters).", 0.01)
    clip_grad: float = _doc("Global L2 gradient-norm limit; 0 disables clipping.", 1.0)
    lr_warmup_iters: int = _doc("Linear warmup steps from lr_warmup_init to lr.", 0)
    lr_warmup_init: float = _doc("Learning rate at step 0 of warmup.", 0.0)
    lr_decay_style: Literal["cosine", "linear", "constant"] = _doc("Decay after warmup.", "cosine")
    lr_decay_iters: int | None = _doc("Step where decay reaches min_lr; null: train_iters.", None)
    adam_beta1: float = _doc("Adam first-moment decay.", 0.9)
    adam_beta2: float = _doc("Adam second-moment decay.", 0.999)
    adam_eps: float = _doc("Adam denominator epsilon.", 1e-8)


@dataclass
class PrecisionConfig:
    """Model dtype and the fp16 loss scaler (bf16 and fp32 need none)."""

    dtype: Literal["fp32", "bf16", "fp16"] = _doc("Parameter/activation dtype.", "fp32")
    tf32: bool = _doc(
        "fp32 on CUDA: matmuls and convolutions on TF32 tensor cores (10-bit mantissa inputs).",
        True,
    )
    loss_scale: float | None = _doc("fp16: constant loss scale; null: dynamic.", None)
    initial_loss_scale: float = _doc("fp16 dynamic scale at start.", 2.0**32)
    loss_scale_window: int = _doc("Clean steps before the scale doubles.", 1000)
    hysteresis: int = _doc("Overflows tolerated before the scale halves.", 2)
    min_loss_scale: float = _doc("The scale never drops below this.", 1.0)


@dataclass
class CheckpointConfig:
    """Saving and resuming."""

    save: str | None = _doc("Directory for checkpoints; null: never save.", None)
    load: str | None = _doc("Checkpoint directory to resume from; null: save's, if any.", None)
    save_interval: int | None = _doc("Iterations between saves; null: only at exit.", None)
    keep_last: int | None = _doc("Checkpoints kept; null: all.", None)
    async_save: bool = _doc(
        "Copy the state to CPU, go on training, and write the checkpoint in the background.",
        False,
    )
    finetune: bool = _doc(
        "Start from load's weights alone (new optimizer, schedule, data); restarts resume save's.",
        False,
    )


@dataclass
class LoggingConfig:
    """Console, TensorBoard and the JSON-lines metrics file."""

    log_interval: int = _doc("Iterations between log lines.", 10)
    tensorboard_dir: str | None = _doc("TensorBoard event directory; null: off.", None)
    metrics_file: str | None = _doc("JSON-lines metrics file; null: off.", None)
    profile_steps: list[int] | None = _doc(
        "[start, end]: torch.profiler trace of iterations start..end (CPU, and CUDA on GPUs), "
        "one rank<N>.*.pt.trace.json.gz per rank (Chrome trace and TensorBoard plugin) in "
        "<tensorboard_dir>/profile, else <checkpoint.save>/profile; null: off.",
        None,
    )
    memory_snapshot_steps: list[int] | None = _doc(
        "[start, end]: CUDA allocator history over iterations start..end, dumped as "
        "rank<N>.memory_snapshot.pickle per rank (pytorch.org/memory_viz) where profile_steps "
        "writes; CUDA only, refused on CPU; null: off.",
        None,
    )
    straggler_threshold: float | None = _doc(
        "On log steps, name (rank, host, phase) each rank whose data or compute time per "
        "iteration is at least this many times its pipeline stage's median rank's (of two, the "
        "faster's), e.g. 2; null: off. Every rank's phase times go to the metrics file and "
        "TensorBoard either way.",
        None,
    )
    wandb_project: str | None = _doc(
        "Weights & Biases project (pip install wandb): rank 0 logs TensorBoard's scalars and the "
        "config there, the run's files under checkpoint.save/wandb (else tensorboard_dir/wandb, "
        "else W&B's ./wandb); with checkpoint.save, its wandb_run_id names the run, so a resumed "
        "run continues it; null: off.",
        None,
    )
    wandb_run_name: str | None = _doc("Weights & Biases run name; null: W&B's own.", None)
    wandb_mode: Literal["online", "offline", "disabled"] = _doc(
        "Weights & Biases mode: online syncs as it goes, offline keeps the run on disk (wandb "
        "sync uploads it), disabled logs nothing and needs no wandb package.",
        "online",
    )

    @property
    def uses_wandb(self) -> bool:
        """Whether the run logs to W&B, and so needs the package."""
        return bool(self.wandb_project) and self.wandb_mode != "disabled"


@dataclass
class Derived:
    """Values that follow from the config and the world size; computed only in Config.derived."""

    world_size: int
    tp_size: int
    pp_size: int
    dp_size: int  # world / (tp * cp * pp): the grid is [dp, pp, cp, tp], TP innermost
    num_micro_batches: int  # micro-batches per step on each rank: gbs / (mbs * dp)
    head_dim: int  # ModelConfig.head_dim
    vocab_multiple: int  # make_vocab_size_divisible_by * tp

    def padded_vocab_size(self, vocab_size: int) -> int:
        """The embedding rows for a tokenizer of ``vocab_size`` at this TP size."""
        return padded_vocab_size(vocab_size, self.vocab_multiple, 1)


@dataclass
class Config:
    """The whole run. Each part of the program receives only its own section."""

    model: ModelConfig
    parallel: ParallelConfig
    data: DataConfig
    tokenizer: TokenizerConfig
    training: TrainingConfig
    optimizer: OptimizerConfig
    precision: PrecisionConfig
    checkpoint: CheckpointConfig
    logging: LoggingConfig
    bert: BertConfig

    def derived(self, world_size: int) -> Derived:
        """DP size, micro-batches per step and vocab padding for ``world_size`` ranks: the one
        place the DP size is computed (the rank grid's first axis is what tp * cp * pp leave).

        For a config that passed ``config.checks.check_world`` (or ``validate``) at that size, or,
        inside ``check_world``, once tp * cp * pp is known to divide ``world_size``.
        """
        p = self.parallel
        tp, pp, cp = p.tensor_parallel_size, p.pipeline_parallel_size, p.context_parallel_size
        dp = world_size // (tp * cp * pp)
        t = self.training
        micro = t.global_batch_size // (t.micro_batch_size * dp)
        multiple = self.model.make_vocab_size_divisible_by * tp
        return Derived(world_size, tp, pp, dp, micro, self.model.head_dim, multiple)


SECTIONS: dict[str, type] = get_type_hints(Config)
FIELDS = {name: {f.name: f for f in dataclasses.fields(cls)} for name, cls in SECTIONS.items()}
HINTS = {name: get_type_hints(cls) for name, cls in SECTIONS.items()}
ALL_KEYS = [f"{s}.{k}" for s, keys in FIELDS.items() for k in keys]
MODEL_SECTIONS = {"bert": "bert"}  # sections only one model type reads: section -> model.type


def padded_vocab_size(vocab_size: int, divisible_by: int, tp_size: int) -> int:
    """Smallest multiple of ``divisible_by * tp_size`` holding ``vocab_size`` rows."""
    multiple = divisible_by * tp_size
    return -(-vocab_size // multiple) * multiple


def as_number(x: str | float) -> float | None:
    try:
        return float(x)
    except ValueError:
        return None


def weighted_paths(paths: Sequence[str | float]) -> list[tuple[float, str]]:
    """``[a, b]`` -> equal weights; ``[0.7, a, 0.3, b]`` -> those weights, as (weight, prefix)."""
    if not paths:
        raise ConfigError("data.paths is empty; list prefixes, e.g. [data/corpus_text_document]")
    if as_number(paths[0]) is None:
        pairs = [(1.0, p) for p in paths]
    else:
        pairs = [(as_number(w), p) for w, p in zip(paths[::2], paths[1::2], strict=False)]
    if (len(paths) % 2 and as_number(paths[0]) is not None) or any(
        w is None or w < 0 or as_number(p) is not None for w, p in pairs
    ):
        raise ConfigError(
            f"data.paths={list(paths)!r} mixes prefixes and weights; write "
            "[a, b] or [0.7, a, 0.3, b] (non-negative weights)"
        )
    if sum(w for w, _ in pairs) <= 0:
        raise ConfigError("data.paths weights sum to 0; give a dataset a positive weight")
    return [(w, str(p)) for w, p in pairs]


def split_fractions(split: str) -> tuple[float, float, float]:
    """``"949,50,1"`` -> normalised (train, valid, test) fractions; missing parts are 0."""
    parts = [as_number(x) for x in split.replace("/", ",").split(",")]
    if not 1 <= len(parts) <= 3 or None in parts or min(parts) < 0 or sum(parts) <= 0:
        raise ConfigError(f"data.split={split!r} must be 1-3 non-negative numbers, e.g. 949,50,1")
    parts += [0.0] * (3 - len(parts))
    total = sum(parts)
    return parts[0] / total, parts[1] / total, parts[2] / total


def to_dict(cfg: Config) -> dict[str, dict[str, Any]]:
    """Plain nested dict of the config, for YAML/JSON (checkpoints, TensorBoard, printing).

    With ``model.type`` set, the sections only the other model reads are left out.
    """
    kind = cfg.model.type
    return {
        name: section
        for name, section in dataclasses.asdict(cfg).items()
        if kind is None or MODEL_SECTIONS.get(name, kind) == kind
    }


def to_yaml(cfg: Config) -> str:
    """The resolved config as YAML that ``load_config`` reads back to an equal Config (sections
    left out by ``to_dict`` read back at their defaults)."""
    return yaml.safe_dump(to_dict(cfg), sort_keys=False)


def config_reference() -> str:
    """A Markdown table of every key: type, default and meaning (for the README)."""
    rows = ["| key | type | default | meaning |", "|---|---|---|---|"]
    for name, fields in FIELDS.items():
        for key, f in fields.items():
            value = f.default if f.default_factory is MISSING else f.default_factory()
            default = "required" if value is MISSING else yaml.safe_dump(value).split()[0]
            kind = f.type.replace("|", "\\|")  # a bare | would end the Markdown cell
            rows.append(f"| `{name}.{key}` | `{kind}` | `{default}` | {f.metadata['doc']} |")
    return "\n".join(rows)
