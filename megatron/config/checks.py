"""Config checks: every user mistake named by key with its fix, before any process starts work.

``check_all`` reports every mistake at once (what ``launch.preflight.validate`` runs);
``check_world`` alone is what ``Config.derived`` needs.
"""

from __future__ import annotations

import dataclasses
import os
import re

from megatron.config import skip_list
from megatron.config.fixes import divisor_list, divisors, either, multiple_list, multiples
from megatron.config.model_checks import check_decoder, check_moe
from megatron.config.ranges import range_mistakes
from megatron.config.schema import Config, split_fractions, weighted_paths
from megatron.config.tokenizer import TOKENIZER_FILES
from megatron.errors import ConfigError

# While a hint's values are tried, the checks they fail word their refusals without hints of
# their own (a search inside a search).
_TRYING = [False]


def _working(cfg: Config, key: str, values: list[int], world_size: int | None = None) -> list[int]:
    """Those of ``values`` that, set as ``key``, fix a mistake and make none (the world's checks
    too, at ``world_size``): a hint never suggests what the next check refuses, whatever other
    keys are wrong besides."""
    if _TRYING[0]:
        return values
    section, name = key.split(".")
    found = []
    _TRYING[0] = True
    try:
        others = set(_all_mistakes(cfg, world_size))
        for value in values:
            part = dataclasses.replace(getattr(cfg, section), **{name: value})
            tried = dataclasses.replace(cfg, **{section: part})
            if set(_all_mistakes(tried, world_size)) < others:
                found.append(value)
    finally:
        _TRYING[0] = False
    return found


def _use(
    cfg: Config,
    key: str,
    values: list[int],
    world_size: int | None,
    fallback: str,
    near: int | None = None,
) -> str:
    """'use key=a, b or c' of the ``values`` of ``key`` that work (the two nearest ``near``
    where given), else ``fallback``."""
    works = _working(cfg, key, values, world_size)
    if near is not None:
        works = sorted(sorted(works, key=lambda v: (abs(v - near), v))[:2])
    return f"use {key}={either(works)}" if works else fallback


def check_world(cfg: Config, world_size: int) -> None:
    """The checks that need the world size: tp * cp * pp | world, tp | heads, mbs * dp | gbs,
    and the interleaved schedule's micro-batches a multiple of pp."""
    if out_of_range := range_mistakes(cfg):
        raise ConfigError(out_of_range[0])
    tp, heads = cfg.parallel.tensor_parallel_size, cfg.model.num_attention_heads
    pp, virtual = cfg.parallel.pipeline_parallel_size, cfg.parallel.virtual_pipeline_size
    cp = cfg.parallel.context_parallel_size
    if world_size < 1:
        raise ConfigError(f"world size {world_size} must be at least 1; fix --world-size")
    if world_size % tp:
        launch = f"launch a multiple of {tp} processes"
        use = _use(cfg, "parallel.tensor_parallel_size", divisor_list(world_size), world_size, "")
        raise ConfigError(
            f"parallel.tensor_parallel_size={tp} does not divide the world size "
            f"{world_size}; {f'{use} or {launch}' if use else launch}"
        )
    if world_size % (tp * pp):
        raise ConfigError(
            f"parallel.tensor_parallel_size={tp} x parallel.pipeline_parallel_size={pp} = "
            f"{tp * pp} does not divide the world size {world_size}; launch a multiple of "
            f"{tp * pp} GPUs or use a pipeline size of {divisors(world_size // tp)}"
        )
    if world_size % (tp * cp * pp):
        launch = f"launch a multiple of {tp * cp * pp} processes"
        fixes = [
            _use(cfg, key, divisor_list(world_size), world_size, "")
            for key in ("parallel.context_parallel_size", "parallel.tensor_parallel_size")
        ]
        fixes = [f for f in fixes if f]
        raise ConfigError(
            f"parallel.tensor_parallel_size={tp} x parallel.context_parallel_size={cp} x "
            f"parallel.pipeline_parallel_size={pp} = {tp * cp * pp} does not divide the world "
            f"size {world_size}; {', or '.join([*fixes, launch])}"
        )
    if heads % tp:
        fallback = f"use a TP size that divides both {heads} and the world size {world_size}"
        tps = [t for t in divisor_list(heads) if world_size % t == 0]
        raise ConfigError(
            f"parallel.tensor_parallel_size={tp} does not divide "
            f"model.num_attention_heads={heads}; "
            + _use(cfg, "parallel.tensor_parallel_size", tps, world_size, fallback)
        )
    mbs, gbs = cfg.training.micro_batch_size, cfg.training.global_batch_size
    derived = cfg.derived(world_size)
    ep, replicas = cfg.parallel.expert_parallel_size, derived.dp_size * cp
    if replicas % ep:
        raise ConfigError(
            f"parallel.expert_parallel_size={ep} does not divide the DP x CP = {derived.dp_size}"
            f" x {cp} = {replicas} ranks it is carved from; use {divisors(replicas)}"
        )
    dp, micro = derived.dp_size, derived.num_micro_batches
    if gbs % (mbs * dp):
        sizes = multiple_list(gbs, mbs * dp)
        fallback = f"use a multiple of {mbs * dp}"
        raise ConfigError(
            f"training.global_batch_size={gbs} is not a multiple of training."
            f"micro_batch_size * DP = {mbs} * {dp}; "
            + _use(cfg, "training.global_batch_size", sizes, world_size, fallback, gbs)
        )
    if virtual is not None and virtual > 1 and micro % pp:
        # The interleaved schedule sends micro-batches through the chunks in groups of pp.
        raise ConfigError(
            f"parallel.virtual_pipeline_size={virtual} needs the micro-batches per step, "
            f"training.global_batch_size / (micro_batch_size * DP) = {gbs} / ({mbs} * {dp}) = "
            f"{micro}, to be a multiple of parallel.pipeline_parallel_size={pp}; "
            f"use a global_batch_size of {multiples(gbs, mbs * dp * pp)}"
        )


def _check_pipeline(cfg: Config) -> None:
    """The layers divide into pp stages, and interleaved (v > 1, needing pp > 1) into pp * v
    chunks; a virtual_pipeline_size of 1 is one chunk per stage, as null is."""
    layers = cfg.model.num_layers
    pp, virtual = cfg.parallel.pipeline_parallel_size, cfg.parallel.virtual_pipeline_size
    if layers % pp:
        raise ConfigError(
            f"model.num_layers={layers} does not divide into parallel.pipeline_parallel_size={pp} "
            f"stages; use num_layers={multiples(layers, pp)} or a pipeline size of "
            f"{divisors(layers)}"
        )
    if virtual is None or virtual == 1:
        return
    if pp < 2:
        raise ConfigError(
            f"parallel.virtual_pipeline_size={virtual} interleaves chunks across pipeline stages "
            "and needs parallel.pipeline_parallel_size >= 2; set it to null or add stages"
        )
    if layers % (pp * virtual):
        raise ConfigError(
            f"model.num_layers={layers} does not divide into parallel.pipeline_parallel_size={pp}"
            f" x parallel.virtual_pipeline_size={virtual} = {pp * virtual} chunks; use "
            f"num_layers={multiples(layers, pp * virtual)} or a virtual_pipeline_size of "
            f"{divisors(layers // pp)}"
        )


def _check_context_parallel(cfg: Config) -> None:
    """Each sample splits into 2 * cp equal chunks (two per rank, for causal balance); the ring
    has no attention dropout."""
    cp, m = cfg.parallel.context_parallel_size, cfg.model
    if cp == 1:
        return
    if m.seq_length % (2 * cp):
        lengths = multiple_list(m.seq_length, 2 * cp)
        raise ConfigError(
            f"parallel.context_parallel_size={cp} cuts model.seq_length={m.seq_length} into "
            f"2 x {cp} = {2 * cp} equal chunks; "
            + _use(
                cfg, "model.seq_length", lengths, None, f"use a multiple of {2 * cp}", m.seq_length
            )
        )
    if m.attention_dropout > 0:
        raise ConfigError(
            f"model.attention_dropout={m.attention_dropout}: ring attention "
            f"(parallel.context_parallel_size={cp}) has no attention dropout; set it to 0"
        )


def _check_profiling(cfg: Config) -> None:
    """Each window is [start, end] in 1-based iterations; its files go under
    logging.tensorboard_dir or checkpoint.save (``megatron.training.profiling``)."""
    for key in ("profile_steps", "memory_snapshot_steps"):
        steps = getattr(cfg.logging, key)
        if steps is None:
            continue
        if len(steps) != 2 or min(steps) < 1 or steps[0] > steps[1]:
            raise ConfigError(
                f"logging.{key}={steps} must be [start, end], two positive iterations with "
                "start <= end; e.g. [3, 4]"
            )
        if not (cfg.logging.tensorboard_dir or cfg.checkpoint.save):
            raise ConfigError(
                f"logging.{key} writes under <logging.tensorboard_dir>/profile, else "
                "<checkpoint.save>/profile; set one of them"
            )


def _check_widths(cfg: Config) -> None:
    m, tp = cfg.model, cfg.parallel.tensor_parallel_size
    if m.kv_channels is None and m.hidden_size % m.num_attention_heads:
        raise ConfigError(
            f"model.hidden_size={m.hidden_size} is not divisible by model."
            f"num_attention_heads={m.num_attention_heads}; use "
            f"{multiples(m.hidden_size, m.num_attention_heads)}"
        )
    if m.ffn_hidden_size % tp:
        raise ConfigError(
            f"model.ffn_hidden_size={m.ffn_hidden_size} is not divisible by parallel."
            f"tensor_parallel_size={tp}; use {multiples(m.ffn_hidden_size, tp)}"
        )


def _check_overlap(cfg: Config) -> None:
    if cfg.parallel.overlap_param_gather and not cfg.parallel.distributed_optimizer:
        raise ConfigError(
            "parallel.overlap_param_gather=true overlaps the distributed optimizer's parameter "
            "all-gather; set parallel.distributed_optimizer=true too, or set it to false"
        )


def _check_sequence_parallel(cfg: Config) -> None:
    m, tp = cfg.model, cfg.parallel.tensor_parallel_size
    if not cfg.parallel.sequence_parallel:
        return
    if tp == 1:
        raise ConfigError(
            "parallel.sequence_parallel=true needs parallel.tensor_parallel_size > 1 (it splits "
            "activations over the TP group); set it to false or raise the TP size"
        )
    cp = cfg.parallel.context_parallel_size
    if m.seq_length % (tp * cp):
        lengths = multiple_list(m.seq_length, tp * cp)
        fallback = f"use a multiple of {tp * cp}"
        fix = _use(cfg, "model.seq_length", lengths, None, fallback, m.seq_length)
        raise ConfigError(
            f"parallel.sequence_parallel=true splits model.seq_length={m.seq_length} over "
            f"parallel.tensor_parallel_size={tp} (x parallel.context_parallel_size={cp}); "
            f"{fix}, or set sequence_parallel=false"
        )


def _check_positions(cfg: Config) -> None:
    m = cfg.model
    if m.seq_length > m.max_position_embeddings:
        raise ConfigError(
            f"model.seq_length={m.seq_length} exceeds model.max_position_embeddings"
            f"={m.max_position_embeddings}; raise it to at least {m.seq_length}"
        )


def _check_bert(cfg: Config) -> None:
    b = cfg.bert
    if cfg.model.type == "bert" and 0 < b.num_tokentypes < 2 and b.binary_head != "none":
        raise ConfigError(
            f"bert.num_tokentypes={b.num_tokentypes}: sentence pairs have token types 0 and 1; "
            "use 2 (or 0 for no token-type embedding)"
        )


def _check_loss_scale(cfg: Config) -> None:
    p = cfg.precision
    if p.min_loss_scale > p.initial_loss_scale:
        raise ConfigError(
            f"precision.min_loss_scale={p.min_loss_scale} exceeds precision."
            f"initial_loss_scale={p.initial_loss_scale}; lower it"
        )


def _check_length(cfg: Config) -> None:
    t = cfg.training
    if t.train_iters is None:
        raise ConfigError("set training.train_iters or training.train_samples (how long to train)")
    if t.train_samples is not None and t.train_iters != -(-t.train_samples // t.global_batch_size):
        raise ConfigError(
            f"training.train_iters={t.train_iters} disagrees with training."
            f"train_samples={t.train_samples} / global_batch_size="
            f"{t.global_batch_size}; set only one of them"
        )


def _check_schedule(cfg: Config) -> None:
    o = cfg.optimizer
    if o.min_lr > o.lr or o.lr_warmup_init > o.lr:
        raise ConfigError(
            f"optimizer.min_lr={o.min_lr} and optimizer.lr_warmup_init="
            f"{o.lr_warmup_init} must not exceed optimizer.lr={o.lr}; lower them"
        )
    if o.lr_decay_style != "constant" and o.lr_decay_iters is not None:
        if o.lr_warmup_iters >= o.lr_decay_iters:
            warmups = sorted({0, o.lr_decay_iters // 10, o.lr_decay_iters - 1} - {-1})
            fix = _use(cfg, "optimizer.lr_warmup_iters", warmups, None, "shorten the warmup")
            raise ConfigError(
                f"optimizer.lr_warmup_iters={o.lr_warmup_iters} must be below optimizer."
                f"lr_decay_iters={o.lr_decay_iters} (default: training.train_iters); {fix}"
            )


def _check_finetune(cfg: Config) -> None:
    ckpt = cfg.checkpoint
    if ckpt.finetune and not ckpt.load:
        raise ConfigError("checkpoint.finetune=true needs checkpoint.load (the weights to tune)")
    if ckpt.finetune and ckpt.save and os.path.realpath(ckpt.save) == os.path.realpath(ckpt.load):
        # A restart resumes a fine-tune from checkpoint.save: there it could not tell the
        # fine-tune's own checkpoints from the pretrained ones (and keep_last would delete those).
        raise ConfigError(
            f"checkpoint.finetune=true saves into checkpoint.load={ckpt.load}, the pretrained "
            "checkpoint; set checkpoint.save to a directory of its own"
        )


def _check_data(cfg: Config) -> None:
    weighted_paths(cfg.data.paths)
    split_fractions(cfg.data.split)
    skip_list.parse(cfg.data.skip_batches)


def _check_spike_guard(cfg: Config) -> None:
    t, ckpt = cfg.training, cfg.checkpoint
    if t.spike_threshold is None:
        return
    if t.spike_threshold <= 1:
        raise ConfigError(
            f"training.spike_threshold={t.spike_threshold} must be above 1 (a factor over the "
            "median loss); fix the value, or null to turn the spike guard off"
        )
    if not ckpt.save or not ckpt.save_interval:
        raise ConfigError(
            "training.spike_threshold rolls back to a checkpoint: it needs checkpoint.save and "
            "checkpoint.save_interval; set both"
        )


def _check_tokenizer(cfg: Config) -> None:
    for key in TOKENIZER_FILES[cfg.tokenizer.type].split():
        if not getattr(cfg.tokenizer, key):
            raise ConfigError(f"tokenizer.type={cfg.tokenizer.type} needs tokenizer.{key}; set it")


# Independent of each other: each finds its own mistake whatever the others find.
_CONFIG_CHECKS = (_check_widths, check_decoder, check_moe, _check_pipeline, _check_overlap,
                  _check_context_parallel, _check_sequence_parallel, _check_profiling,
                  _check_positions, _check_bert, _check_loss_scale, _check_length,
                  _check_schedule, _check_finetune, _check_data, _check_tokenizer,
                  _check_spike_guard)  # fmt: skip


def _mistakes(cfg: Config, checks) -> list[str]:
    found = []
    for check in checks:
        try:
            check(cfg)
        except ConfigError as err:
            found.append(str(err))
    return found


def _all_mistakes(cfg: Config, world_size: int | None) -> list[str]:
    found = range_mistakes(cfg)
    if not found:
        if world_size is not None:
            found = _mistakes(cfg, [lambda c: check_world(c, world_size)])
        found += _mistakes(cfg, _CONFIG_CHECKS)
    return found


# A ``section.key=value`` a mistake's line names.
_SETTING = re.compile(r"\b[a-z_]+\.[a-z_]+=[^\s;:,()]+")


def check_all(cfg: Config, world_size: int | None) -> None:
    """Every mistake ``check_world`` (at ``world_size``, unless None) and ``_CONFIG_CHECKS``
    find, in one ConfigError of a line each: a user fixes them all in one pass. A value out of range
    is reported alone (every range at once), since the other checks divide by such values; a
    wrong value is reported once, by the first check that names it."""
    found: list[str] = []
    named: set[str] = set()
    for mistake in _all_mistakes(cfg, world_size):
        # One report per wrong value: a later check naming a key=value an earlier one named is
        # its echo (TP 3 divides neither the heads nor the query groups), fixed by one change.
        values = set(_SETTING.findall(mistake))
        if not values & named:
            found.append(mistake)
        named |= values
    if len(found) > 1:
        lines = "\n".join(f"  {i}. {message}" for i, message in enumerate(found, 1))
        raise ConfigError(f"{len(found)} config mistakes, each with its fix:\n{lines}")
    if found:
        raise ConfigError(found[0])
