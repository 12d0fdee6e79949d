"""The run's configuration: documented dataclasses, YAML + ``section.key=value`` loading, checks.

``load_config`` merges YAML files (later wins) and overrides, rejects unknown keys with a
did-you-mean, type-checks every value against the annotations, then ``resolve`` fills the
defaults that depend on other keys (FFN size, position table, decay iterations, ...) so each part
of the program receives a complete section. ``validate`` runs every check that needs the world
size or the file system, before any process group or data work. World-size-dependent values
(DP size, micro-batches per step, padded vocabulary) come from ``Config.derived`` only.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import os
import types
from collections.abc import Sequence
from dataclasses import MISSING, dataclass, field
from typing import Any, Literal, Union, get_args, get_origin, get_type_hints

import numpy as np
import yaml

from megatron.errors import ConfigError


def _doc(doc: str, default: Any = MISSING, factory: Any = MISSING) -> Any:
    """A dataclass field whose help text lives in its metadata (read by ``config_reference``)."""
    return field(default=default, default_factory=factory, metadata={"doc": doc})


@dataclass
class ModelConfig:
    """Transformer shape and regularisation (shared by GPT and BERT)."""

    num_layers: int = _doc("Transformer layers.")
    hidden_size: int = _doc("Width of the residual stream.")
    num_attention_heads: int = _doc("Attention heads; divisible by the TP size.")
    seq_length: int = _doc("Tokens per training sample.")
    max_position_embeddings: int | None = _doc("Position table rows; null: seq_length.", None)
    ffn_hidden_size: int | None = _doc("MLP inner width; null: 4 * hidden_size.", None)
    hidden_dropout: float = _doc("Dropout on embeddings and sublayer outputs.", 0.1)
    attention_dropout: float = _doc("Dropout on attention probabilities.", 0.1)
    layernorm_position: Literal["pre", "post"] = _doc("LayerNorm before or after sublayers.", "pre")
    layernorm_epsilon: float = _doc("LayerNorm epsilon.", 1e-5)
    init_method_std: float = _doc("Std of the normal weight initialisation.", 0.02)
    make_vocab_size_divisible_by: int = _doc("Vocab padded to a multiple of this times TP.", 128)
    recompute: Literal["none", "full"] = _doc("Activation recomputation per layer.", "none")


@dataclass
class ParallelConfig:
    """How processes split the work; the DP size is world / tensor_parallel_size."""

    tensor_parallel_size: int = _doc("Ranks that split each layer (adjacent ranks).", 1)
    timeout_minutes: float = _doc("Collective timeout: a dead peer fails the run after this.", 10.0)
    ddp_bucket_size_mb: float = _doc("fp32 gradient bucket size for the DP all-reduce.", 25.0)


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


@dataclass
class TokenizerConfig:
    """Which tokenizer, and its files."""

    type: Literal["sentencepiece", "gpt2", "wordpiece", "hf"] = _doc("Tokenizer family.")
    model: str | None = _doc("sentencepiece .model, or hf tokenizer.json.", None)
    vocab_file: str | None = _doc("gpt2 vocab.json, or wordpiece vocab.txt.", None)
    merges_file: str | None = _doc("gpt2 merges.txt.", None)
    lower_case: bool = _doc("Lower-case text before wordpiece.", False)


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
    exit_interval: int | None = _doc("Save and exit when iteration % this == 0.", None)
    exit_duration_in_mins: float | None = _doc("Save and exit after this many minutes.", None)
    max_consecutive_nan: int = _doc("Stop after this many skipped steps in a row.", 10)
    exit_signal: Literal["SIGTERM", "SIGUSR1", "SIGUSR2"] = _doc(
        "Signal that asks every rank to save and exit.", "SIGTERM"
    )


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
    finetune: bool = _doc("Load weights only: fresh optimizer, schedule and data.", False)


@dataclass
class LoggingConfig:
    """Console, TensorBoard and the JSON-lines metrics file."""

    log_interval: int = _doc("Iterations between log lines.", 10)
    tensorboard_dir: str | None = _doc("TensorBoard event directory; null: off.", None)
    metrics_file: str | None = _doc("JSON-lines metrics file; null: off.", None)


@dataclass
class Derived:
    """Values that follow from the config and the world size; computed only in Config.derived."""

    world_size: int
    tp_size: int
    dp_size: int
    num_micro_batches: int  # micro-batches per step on each rank: gbs / (mbs * dp)
    head_dim: int  # hidden_size / num_attention_heads
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
        """DP size, micro-batches per step and vocab padding for ``world_size`` ranks."""
        _check_world(self, world_size)
        tp = self.parallel.tensor_parallel_size
        dp = world_size // tp
        t = self.training
        micro = t.global_batch_size // (t.micro_batch_size * dp)
        head_dim = self.model.hidden_size // self.model.num_attention_heads
        multiple = self.model.make_vocab_size_divisible_by * tp
        return Derived(world_size, tp, dp, micro, head_dim, multiple)


_SECTIONS: dict[str, type] = get_type_hints(Config)
_FIELDS = {name: {f.name: f for f in dataclasses.fields(cls)} for name, cls in _SECTIONS.items()}
_HINTS = {name: get_type_hints(cls) for name, cls in _SECTIONS.items()}
_ALL_KEYS = [f"{s}.{k}" for s, keys in _FIELDS.items() for k in keys]
_TOKENIZER_FILES = {
    "sentencepiece": "model",
    "gpt2": "vocab_file merges_file",
    "wordpiece": "vocab_file",
    "hf": "model",
}  # keys each tokenizer type reads
# Numeric ranges, one table so every key is covered once; null values are not checked.
_POSITIVE = """model.num_layers model.hidden_size model.num_attention_heads model.seq_length
    model.max_position_embeddings model.ffn_hidden_size model.make_vocab_size_divisible_by
    model.layernorm_epsilon parallel.tensor_parallel_size parallel.timeout_minutes
    parallel.ddp_bucket_size_mb training.micro_batch_size training.global_batch_size
    training.train_iters training.train_samples training.eval_interval training.exit_interval
    training.exit_duration_in_mins training.max_consecutive_nan optimizer.lr
    optimizer.lr_decay_iters optimizer.adam_eps precision.loss_scale precision.initial_loss_scale
    precision.loss_scale_window precision.hysteresis precision.min_loss_scale
    checkpoint.save_interval checkpoint.keep_last logging.log_interval bert.max_ngram""".split()
_NON_NEGATIVE = """model.init_method_std training.eval_iters data.num_workers optimizer.min_lr
    optimizer.weight_decay optimizer.clip_grad optimizer.lr_warmup_iters optimizer.lr_warmup_init
    bert.num_tokentypes""".split()
_FRACTION = """model.hidden_dropout model.attention_dropout optimizer.adam_beta1
    optimizer.adam_beta2 bert.masked_lm_prob bert.short_seq_prob""".split()  # in [0, 1)


def padded_vocab_size(vocab_size: int, divisible_by: int, tp_size: int) -> int:
    """Smallest multiple of ``divisible_by * tp_size`` holding ``vocab_size`` rows."""
    multiple = divisible_by * tp_size
    return -(-vocab_size // multiple) * multiple


def _number(x: str | float) -> float | None:
    try:
        return float(x)
    except ValueError:
        return None


def weighted_paths(paths: Sequence[str | float]) -> list[tuple[float, str]]:
    """``[a, b]`` -> equal weights; ``[0.7, a, 0.3, b]`` -> those weights, as (weight, prefix)."""
    if not paths:
        raise ConfigError("data.paths is empty; list prefixes, e.g. [data/corpus_text_document]")
    if _number(paths[0]) is None:
        pairs = [(1.0, p) for p in paths]
    else:
        pairs = [(_number(w), p) for w, p in zip(paths[::2], paths[1::2], strict=False)]
    if (len(paths) % 2 and _number(paths[0]) is not None) or any(
        w is None or w < 0 or _number(p) is not None for w, p in pairs
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
    parts = [_number(x) for x in split.replace("/", ",").split(",")]
    if not 1 <= len(parts) <= 3 or None in parts or min(parts) < 0 or sum(parts) <= 0:
        raise ConfigError(f"data.split={split!r} must be 1-3 non-negative numbers, e.g. 949,50,1")
    parts += [0.0] * (3 - len(parts))
    total = sum(parts)
    return parts[0] / total, parts[1] / total, parts[2] / total


def _suggest(name: str, section: str | None = None) -> str:
    """'; did you mean x.y?' for a misspelt or misplaced key, else the valid choices."""
    bare = name.rsplit(".", 1)[-1]
    same = [k for k in _ALL_KEYS if k.endswith("." + bare) and k != name]
    close = same or difflib.get_close_matches(name, _ALL_KEYS + list(_FIELDS), n=1, cutoff=0.6)
    if close:
        return f"; did you mean {close[0]}?"
    if section in _FIELDS:
        return f"; keys of {section}: {', '.join(_FIELDS[section])}"
    return f"; sections: {', '.join(_FIELDS)}"


def _check_key(section: str, key: str | None, where: str) -> None:
    if section not in _FIELDS:
        raise ConfigError(f"{where}: unknown section '{section}'{_suggest(section)}")
    if key is not None and key not in _FIELDS[section]:
        dotted = f"{section}.{key}"
        raise ConfigError(f"{where}: unknown key {dotted}{_suggest(dotted, section)}")


def _match(value: Any, ann: Any) -> tuple[bool, Any]:
    """(True, value converted to ``ann``) when it fits the annotation, else (False, None)."""
    origin = get_origin(ann)
    if origin in (Union, types.UnionType):
        fits = [_match(value, arm) for arm in get_args(ann)]
        return next(((True, v) for ok, v in fits if ok), (False, None))
    if origin is Literal:
        return isinstance(value, str) and value in get_args(ann), value
    if origin is list:
        items = [_match(v, get_args(ann)[0]) for v in value] if isinstance(value, list) else None
        return items is not None and all(ok for ok, _ in items), [v for _, v in items or ()]
    if ann is type(None) or ann is bool or ann is str:
        return isinstance(value, ann), value
    if isinstance(value, bool):  # bool is an int subclass, but `true` is never a number here
        return False, None
    if ann is int:
        return isinstance(value, int), value
    if isinstance(value, str):  # PyYAML reads 1e-4 (no dot in the mantissa) as a string
        return _number(value) is not None, _number(value)
    number = isinstance(value, int | float)
    return number, float(value) if number else None


def _read_yaml(path: str) -> tuple[dict, dict[str, int]]:
    """The file's mapping and the line of every ``section`` and ``section.key`` in it."""
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except OSError as e:
        raise ConfigError(f"{path}: cannot read config ({e.strerror}); check --config") from None
    try:
        node, data = yaml.compose(text, Loader=yaml.SafeLoader), yaml.safe_load(text)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        line = f":{mark.line + 1}" if mark else ""
        raise ConfigError(f"{path}{line}: invalid YAML ({getattr(e, 'problem', e)})") from None
    if data is None:
        return {}, {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: the top level must map sections (model:, training:, ...)")
    lines: dict[str, int] = {}
    for key_node, value_node in node.value:
        lines[str(key_node.value)] = key_node.start_mark.line + 1
        for sub_node, _ in value_node.value if isinstance(value_node, yaml.MappingNode) else ():
            lines[f"{key_node.value}.{sub_node.value}"] = sub_node.start_mark.line + 1
    return data, lines


def load_config(paths: Sequence[str], overrides: Sequence[str] = ()) -> Config:
    """Merge YAML files (later wins) and ``section.key=value`` overrides into a resolved Config."""
    raw: dict[str, dict[str, Any]] = {name: {} for name in _FIELDS}
    origin: dict[str, str] = {}  # dotted key -> where its final value came from
    for path in paths:
        data, lines = _read_yaml(path)
        for section, values in data.items():
            # Keys YAML reads as non-strings (true, 1.0) print differently: fall back to line 1.
            where = f"{path}:{lines.get(str(section), 1)}"
            _check_key(str(section), None, where)
            if not isinstance(values, dict | None):
                raise ConfigError(f"{where}: section '{section}' must map key: value")
            for key, value in (values or {}).items():
                dotted = f"{section}.{key}"
                origin[dotted] = f"{path}:{lines.get(dotted, 1)}"
                _check_key(section, str(key), origin[dotted])
                raw[section][str(key)] = value
    for item in overrides:
        dotted, sep, text = item.partition("=")
        where = f"override '{item}'"
        if not sep or dotted.count(".") != 1:
            raise ConfigError(f"{where}: expected section.key=value, e.g. training.train_iters=100")
        section, key = dotted.split(".")
        _check_key(section, key, where)
        try:
            raw[section][key] = yaml.safe_load(text)
        except yaml.YAMLError:
            raise ConfigError(f"{where}: the value is not valid YAML; quote it") from None
        origin[dotted] = where
    return resolve(_build(raw, origin))


def _build(raw: dict[str, dict[str, Any]], origin: dict[str, str]) -> Config:
    sections = {}
    for name, cls in _SECTIONS.items():
        kwargs = {}
        for key, f in _FIELDS[name].items():
            dotted = f"{name}.{key}"
            if key in raw[name]:
                ok, kwargs[key] = _match(raw[name][key], _HINTS[name][key])
                if not ok:
                    raise ConfigError(
                        f"{origin[dotted]}: {dotted}={raw[name][key]!r} is not of "
                        f"type {f.type}; fix the value"
                    )
            elif f.default is MISSING and f.default_factory is MISSING:
                raise ConfigError(
                    f"{dotted} is required and no config sets it; add it under "
                    f"'{name}:' or pass {dotted}=VALUE"
                )
        sections[name] = cls(**kwargs)
    return Config(**sections)


def resolve(cfg: Config) -> Config:
    """Fill the defaults that depend on other keys, so each section is complete on its own."""
    m, t, o, d = cfg.model, cfg.training, cfg.optimizer, cfg.data
    iters = t.train_iters
    if iters is None and t.train_samples is not None and t.global_batch_size > 0:
        iters = -(-t.train_samples // t.global_batch_size)
    first = next((p for p in d.paths if isinstance(p, str)), "")

    def default(value: Any, fallback: Any) -> Any:
        return fallback if value is None else value

    return dataclasses.replace(
        cfg,
        model=dataclasses.replace(
            m,
            ffn_hidden_size=default(m.ffn_hidden_size, 4 * m.hidden_size),
            max_position_embeddings=default(m.max_position_embeddings, m.seq_length),
        ),
        training=dataclasses.replace(t, train_iters=iters),
        optimizer=dataclasses.replace(o, lr_decay_iters=default(o.lr_decay_iters, iters)),
        data=dataclasses.replace(
            d, cache_dir=default(d.cache_dir, os.path.join(os.path.dirname(first), "index-cache"))
        ),
    )


def _divisors(n: int) -> str:
    ds = [str(d) for d in range(1, n + 1) if n % d == 0]
    return ds[0] if len(ds) == 1 else ", ".join(ds[:-1]) + " or " + ds[-1]


def _multiples(n: int, step: int) -> str:
    """The multiples of ``step`` either side of ``n``, as 'a or b'."""
    return " or ".join(str(x) for x in (n // step * step, (n // step + 1) * step) if x)


def _check_ranges(cfg: Config) -> None:
    for key in _POSITIVE + _NON_NEGATIVE + _FRACTION:
        section, name = key.split(".")
        value = getattr(getattr(cfg, section), name)
        if value is None:
            continue
        if key in _POSITIVE and not value > 0:
            raise ConfigError(f"{key}={value} must be positive; fix the value")
        if key in _NON_NEGATIVE and not value >= 0:
            raise ConfigError(f"{key}={value} must be zero or positive; fix the value")
        if key in _FRACTION and not 0 <= value < 1:
            raise ConfigError(f"{key}={value} must be in [0, 1); fix the value")


def _check_world(cfg: Config, world_size: int) -> None:
    """The checks that need the world size: tp | world, tp | heads, mbs * dp | gbs."""
    _check_ranges(cfg)
    tp, heads = cfg.parallel.tensor_parallel_size, cfg.model.num_attention_heads
    if world_size < 1:
        raise ConfigError(f"world size {world_size} must be at least 1; fix --world-size")
    if world_size % tp:
        raise ConfigError(
            f"parallel.tensor_parallel_size={tp} does not divide the world size "
            f"{world_size}; use {_divisors(world_size)} or launch a multiple of {tp}"
        )
    if heads % tp:
        raise ConfigError(
            f"parallel.tensor_parallel_size={tp} does not divide "
            f"model.num_attention_heads={heads}; use {_divisors(heads)}"
        )
    mbs, gbs, dp = cfg.training.micro_batch_size, cfg.training.global_batch_size, world_size // tp
    if gbs % (mbs * dp):
        raise ConfigError(
            f"training.global_batch_size={gbs} is not a multiple of training."
            f"micro_batch_size * DP = {mbs} * {dp}; use {_multiples(gbs, mbs * dp)}"
        )


def _check_config(cfg: Config) -> None:
    """The checks that need neither the world size nor the file system."""
    m, t, o, p = cfg.model, cfg.training, cfg.optimizer, cfg.precision
    if m.hidden_size % m.num_attention_heads:
        raise ConfigError(
            f"model.hidden_size={m.hidden_size} is not divisible by model."
            f"num_attention_heads={m.num_attention_heads}; use "
            f"{_multiples(m.hidden_size, m.num_attention_heads)}"
        )
    if m.ffn_hidden_size % cfg.parallel.tensor_parallel_size:
        raise ConfigError(
            f"model.ffn_hidden_size={m.ffn_hidden_size} is not divisible by parallel."
            f"tensor_parallel_size={cfg.parallel.tensor_parallel_size}; use "
            f"{_multiples(m.ffn_hidden_size, cfg.parallel.tensor_parallel_size)}"
        )
    if m.seq_length > m.max_position_embeddings:
        raise ConfigError(
            f"model.seq_length={m.seq_length} exceeds model.max_position_embeddings"
            f"={m.max_position_embeddings}; raise it to at least {m.seq_length}"
        )
    if p.min_loss_scale > p.initial_loss_scale:
        raise ConfigError(
            f"precision.min_loss_scale={p.min_loss_scale} exceeds precision."
            f"initial_loss_scale={p.initial_loss_scale}; lower it"
        )
    if t.train_iters is None:
        raise ConfigError("set training.train_iters or training.train_samples (how long to train)")
    if t.train_samples is not None and t.train_iters != -(-t.train_samples // t.global_batch_size):
        raise ConfigError(
            f"training.train_iters={t.train_iters} disagrees with training."
            f"train_samples={t.train_samples} / global_batch_size="
            f"{t.global_batch_size}; set only one of them"
        )
    if o.min_lr > o.lr or o.lr_warmup_init > o.lr:
        raise ConfigError(
            f"optimizer.min_lr={o.min_lr} and optimizer.lr_warmup_init="
            f"{o.lr_warmup_init} must not exceed optimizer.lr={o.lr}; lower them"
        )
    if o.lr_decay_style != "constant" and o.lr_warmup_iters >= o.lr_decay_iters:
        raise ConfigError(
            f"optimizer.lr_warmup_iters={o.lr_warmup_iters} must be below optimizer."
            f"lr_decay_iters={o.lr_decay_iters} (default: training.train_iters); "
            "shorten the warmup"
        )
    if cfg.checkpoint.finetune and not cfg.checkpoint.load:
        raise ConfigError("checkpoint.finetune=true needs checkpoint.load (the weights to tune)")
    weighted_paths(cfg.data.paths)
    split_fractions(cfg.data.split)
    for key in _TOKENIZER_FILES[cfg.tokenizer.type].split():
        if not getattr(cfg.tokenizer, key):
            raise ConfigError(f"tokenizer.type={cfg.tokenizer.type} needs tokenizer.{key}; set it")


def _check_files(cfg: Config) -> None:
    """Data, tokenizer and checkpoint paths exist, and the token dtype holds every token id."""
    tok = cfg.tokenizer
    for key in _TOKENIZER_FILES[tok.type].split():
        if not os.path.isfile(getattr(tok, key)):
            raise ConfigError(f"tokenizer.{key}: {getattr(tok, key)} not found; fix the path")
    if cfg.checkpoint.load and not os.path.isdir(cfg.checkpoint.load):
        raise ConfigError(
            f"checkpoint.load: {cfg.checkpoint.load} not found; fix the path or set "
            "checkpoint.load=null to start from scratch"
        )
    prefixes = [p for _, p in weighted_paths(cfg.data.paths)]
    if cfg.data.format == "hdf5":
        for path in prefixes:
            if not os.path.exists(path):
                raise ConfigError(f"data.paths: {path} not found; list hdf5 shard files or folders")
        return
    # Imported here: the checks above (shipped configs, dry runs without data) need neither.
    from megatron.data.indexed_dataset import IndexedDataset
    from megatron.data.tokenizers import build_tokenizer

    vocab_size = build_tokenizer(
        tok.type,
        model=tok.model,
        vocab_file=tok.vocab_file,
        merges_file=tok.merges_file,
        lower_case=tok.lower_case,
    ).vocab_size
    for prefix in prefixes:
        dtype = IndexedDataset(prefix).dtype  # raises ConfigError naming a missing/corrupt file
        if dtype.kind not in "iu" or np.iinfo(dtype).max < vocab_size - 1:
            raise ConfigError(
                f"{prefix}.idx: token dtype {dtype} cannot hold the tokenizer's "
                f"{vocab_size} ids; re-run tools/preprocess_data.py with it"
            )


def validate(cfg: Config, world_size: int, check_files: bool = True) -> None:
    """Every check, before any process group or data work; raises ConfigError naming key and fix.

    ``check_files=False`` skips the file-system checks (shipped configs, dry runs elsewhere).
    """
    _check_world(cfg, world_size)
    _check_config(cfg)
    if check_files:
        _check_files(cfg)


def to_dict(cfg: Config) -> dict[str, dict[str, Any]]:
    """Plain nested dict of the config, for YAML/JSON (checkpoints, TensorBoard, printing)."""
    return dataclasses.asdict(cfg)


def to_yaml(cfg: Config) -> str:
    """The resolved config as YAML that ``load_config`` reads back to an equal Config."""
    return yaml.safe_dump(to_dict(cfg), sort_keys=False)


def config_reference() -> str:
    """A Markdown table of every key: type, default and meaning (for the README)."""
    rows = ["| key | type | default | meaning |", "|---|---|---|---|"]
    for name, fields in _FIELDS.items():
        for key, f in fields.items():
            default = "required" if f.default is MISSING else yaml.safe_dump(f.default).split()[0]
            kind = f.type.replace("|", "\\|")  # a bare | would end the Markdown cell
            rows.append(f"| `{name}.{key}` | `{kind}` | `{default}` | {f.metadata['doc']} |")
    return "\n".join(rows)


def parse_args(argv: Sequence[str], description: str = "") -> tuple[Config, argparse.Namespace]:
    """``--config a.yaml [--config b.yaml] [section.key=value ...]`` plus the dry-run flags."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument(
        "--config",
        action="append",
        required=True,
        metavar="YAML",
        help="config file; repeat to layer files (later wins)",
    )
    parser.add_argument(
        "overrides",
        nargs="*",
        metavar="section.key=value",
        help="override one key; the value is YAML (e.g. optimizer.lr=3.0e-4)",
    )
    parser.add_argument(
        "--dry-run",
        action="store_true",
        help="validate and estimate memory and FLOPs; start nothing",
    )
    parser.add_argument("--world-size", type=int, help="dry run: the world size to check for")
    parser.add_argument("--gpu-memory-gb", type=float, help="dry run: memory of one GPU in GB")
    args = parser.parse_intermixed_args(list(argv))
    return load_config(args.config, args.overrides), args
