"""Config checks: every user mistake named by key with its fix, before any process starts work.

``validate`` runs them all; ``check_world`` alone is what ``Config.derived`` needs.
"""

from __future__ import annotations

import os

from megatron.config.model import ModelConfig
from megatron.config.schema import TOKENIZER_FILES, Config, split_fractions, weighted_paths
from megatron.errors import ConfigError

# Numeric ranges, one table so every key is covered once; null values are not checked.
_POSITIVE = """model.num_layers model.hidden_size model.num_attention_heads model.seq_length
    model.max_position_embeddings model.ffn_hidden_size model.make_vocab_size_divisible_by
    model.layernorm_epsilon model.rotary_base model.num_query_groups model.kv_channels
    model.num_experts model.moe_ffn_hidden_size model.moe_shared_expert_intermediate_size
    parallel.tensor_parallel_size parallel.pipeline_parallel_size parallel.context_parallel_size
    parallel.expert_parallel_size
    parallel.virtual_pipeline_size parallel.timeout_minutes
    parallel.ddp_bucket_size_mb training.micro_batch_size training.global_batch_size
    training.train_iters training.train_samples training.eval_interval training.exit_interval
    training.exit_duration_in_mins training.max_consecutive_nan optimizer.lr
    optimizer.lr_decay_iters optimizer.adam_eps precision.loss_scale precision.initial_loss_scale
    precision.loss_scale_window precision.hysteresis precision.min_loss_scale
    checkpoint.save_interval checkpoint.keep_last logging.log_interval bert.max_ngram""".split()
_NON_NEGATIVE = """model.init_method_std training.eval_iters training.test_iters data.num_workers
    optimizer.min_lr optimizer.weight_decay optimizer.clip_grad optimizer.lr_warmup_iters
    optimizer.lr_warmup_init bert.num_tokentypes""".split()
_FRACTION = """model.hidden_dropout model.attention_dropout optimizer.adam_beta1
    optimizer.adam_beta2 bert.masked_lm_prob bert.short_seq_prob""".split()  # in [0, 1)


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


def check_world(cfg: Config, world_size: int) -> None:
    """The checks that need the world size: tp * cp * pp | world, tp | heads, mbs * dp | gbs,
    and the interleaved schedule's micro-batches a multiple of pp."""
    _check_ranges(cfg)
    tp, heads = cfg.parallel.tensor_parallel_size, cfg.model.num_attention_heads
    pp, virtual = cfg.parallel.pipeline_parallel_size, cfg.parallel.virtual_pipeline_size
    cp = cfg.parallel.context_parallel_size
    if world_size < 1:
        raise ConfigError(f"world size {world_size} must be at least 1; fix --world-size")
    if world_size % tp:
        raise ConfigError(
            f"parallel.tensor_parallel_size={tp} does not divide the world size "
            f"{world_size}; use {_divisors(world_size)} or launch a multiple of {tp}"
        )
    if world_size % (tp * pp):
        raise ConfigError(
            f"parallel.tensor_parallel_size={tp} x parallel.pipeline_parallel_size={pp} = "
            f"{tp * pp} does not divide the world size {world_size}; launch a multiple of "
            f"{tp * pp} GPUs or use a pipeline size of {_divisors(world_size // tp)}"
        )
    if world_size % (tp * cp * pp):
        raise ConfigError(
            f"parallel.tensor_parallel_size={tp} x parallel.context_parallel_size={cp} x "
            f"parallel.pipeline_parallel_size={pp} = {tp * cp * pp} does not divide the world "
            f"size {world_size}; launch a multiple of {tp * cp * pp} GPUs or use a context "
            f"parallel size of {_divisors(world_size // (tp * pp))}"
        )
    if heads % tp:
        raise ConfigError(
            f"parallel.tensor_parallel_size={tp} does not divide "
            f"model.num_attention_heads={heads}; use {_divisors(heads)}"
        )
    mbs, gbs = cfg.training.micro_batch_size, cfg.training.global_batch_size
    derived = cfg.derived(world_size)
    ep, replicas = cfg.parallel.expert_parallel_size, derived.dp_size * cp
    if replicas % ep:
        raise ConfigError(
            f"parallel.expert_parallel_size={ep} does not divide the DP x CP = {derived.dp_size}"
            f" x {cp} = {replicas} ranks it is carved from; use {_divisors(replicas)}"
        )
    dp, micro = derived.dp_size, derived.num_micro_batches
    if gbs % (mbs * dp):
        raise ConfigError(
            f"training.global_batch_size={gbs} is not a multiple of training."
            f"micro_batch_size * DP = {mbs} * {dp}; use {_multiples(gbs, mbs * dp)}"
        )
    if virtual is not None and virtual > 1 and micro % pp:
        # The interleaved schedule sends micro-batches through the chunks in groups of pp.
        raise ConfigError(
            f"parallel.virtual_pipeline_size={virtual} needs the micro-batches per step, "
            f"training.global_batch_size / (micro_batch_size * DP) = {gbs} / ({mbs} * {dp}) = "
            f"{micro}, to be a multiple of parallel.pipeline_parallel_size={pp}; "
            f"use a global_batch_size of {_multiples(gbs, mbs * dp * pp)}"
        )


def _check_pipeline(cfg: Config) -> None:
    """The layers divide into pp stages, and interleaved (v > 1, needing pp > 1) into pp * v
    chunks; a virtual_pipeline_size of 1 is one chunk per stage, as null is."""
    layers = cfg.model.num_layers
    pp, virtual = cfg.parallel.pipeline_parallel_size, cfg.parallel.virtual_pipeline_size
    if layers % pp:
        raise ConfigError(
            f"model.num_layers={layers} does not divide into parallel.pipeline_parallel_size={pp} "
            f"stages; use num_layers={_multiples(layers, pp)} or a pipeline size of "
            f"{_divisors(layers)}"
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
            f"num_layers={_multiples(layers, pp * virtual)} or a virtual_pipeline_size of "
            f"{_divisors(layers // pp)}"
        )


def _check_context_parallel(cfg: Config) -> None:
    """Each sample splits into 2 * cp equal chunks (two per rank, for causal balance); the ring
    has no attention dropout."""
    cp, m = cfg.parallel.context_parallel_size, cfg.model
    if cp == 1:
        return
    if m.seq_length % (2 * cp):
        raise ConfigError(
            f"parallel.context_parallel_size={cp} cuts model.seq_length={m.seq_length} into "
            f"2 x {cp} = {2 * cp} equal chunks; use a seq_length of "
            f"{_multiples(m.seq_length, 2 * cp)}"
        )
    if m.attention_dropout > 0:
        raise ConfigError(
            f"model.attention_dropout={m.attention_dropout}: ring attention "
            f"(parallel.context_parallel_size={cp}) has no attention dropout; set it to 0"
        )


_ROPE_SCALING = "factor low_freq_factor high_freq_factor original_max_position_embeddings".split()


def _check_decoder(cfg: Config) -> None:
    """Query groups against heads and TP; RoPE's options; what BERT's tied head cannot take."""
    m, tp = cfg.model, cfg.parallel.tensor_parallel_size
    heads, groups = m.num_attention_heads, m.query_groups
    if heads % groups:
        raise ConfigError(
            f"model.num_query_groups={groups} does not divide model.num_attention_heads={heads}; "
            f"use {_divisors(heads)}"
        )
    if groups % tp:
        raise ConfigError(
            f"model.num_query_groups={groups} is not divisible by parallel.tensor_parallel_size="
            f"{tp}: each TP rank holds whole key/value groups; use a TP size of {_divisors(groups)}"
        )
    rope = m.position_embedding_type == "rope"
    if not 0 < m.rotary_percent <= 1:
        raise ConfigError(f"model.rotary_percent={m.rotary_percent} must be in (0, 1]; fix it")
    rotated = int(m.head_dim * m.rotary_percent)
    if rope and (rotated == 0 or rotated % 2):
        raise ConfigError(
            f"model.rotary_percent={m.rotary_percent} of head_dim {m.head_dim} rotates {rotated} "
            "channels; RoPE rotates channel pairs: choose a percent that gives an even count"
        )
    scaling = m.rope_scaling
    if scaling is not None and not rope:
        raise ConfigError(
            "model.rope_scaling scales RoPE's frequencies and needs "
            "model.position_embedding_type=rope; set rope_scaling to null or use rope"
        )
    if scaling is not None and (
        sorted(scaling) != sorted(_ROPE_SCALING)
        or min(scaling.values()) <= 0
        or scaling["high_freq_factor"] <= scaling["low_freq_factor"]
    ):
        raise ConfigError(
            f"model.rope_scaling={scaling} must be Llama 3.1's {{{', '.join(_ROPE_SCALING)}}}, "
            "all positive, high_freq_factor above low_freq_factor (Llama 3.1: 8, 1, 4, 8192)"
        )
    if m.type == "bert" and m.untie_embeddings_and_output_weights:
        raise ConfigError(
            "model.untie_embeddings_and_output_weights=true is for GPT: BERT's MLM head is tied "
            "to the word embedding; set it to false"
        )


def _check_moe(cfg: Config) -> None:
    """Mixture-of-experts options: top-k within the experts, the layer pattern, capacity, groups,
    widths TP divides; ``moe_*`` keys only with experts to apply them to."""
    m, tp = cfg.model, cfg.parallel.tensor_parallel_size
    experts, ep = m.num_experts, cfg.parallel.expert_parallel_size
    if experts is None and ep > 1:
        raise ConfigError(
            f"parallel.expert_parallel_size={ep} splits experts, and model.num_experts is null "
            "(a dense model); set it to 1"
        )
    if experts is not None and experts % ep:
        raise ConfigError(
            f"parallel.expert_parallel_size={ep} does not divide model.num_experts={experts}; "
            f"use {_divisors(experts)}"
        )
    if experts is None:
        changed = [
            f"model.{name}"
            for name, value in vars(ModelConfig(1, 1, 1, 1)).items()
            if name.startswith("moe_") and getattr(m, name) != value
        ]
        if changed:
            raise ConfigError(
                f"{', '.join(changed)} set but model.num_experts is null (dense MLPs); set "
                "num_experts or remove them"
            )
        return
    if not 1 <= m.moe_router_topk <= experts:
        raise ConfigError(
            f"model.moe_router_topk={m.moe_router_topk} must be between 1 and model.num_experts"
            f"={experts}; fix it"
        )
    freq = m.moe_layer_freq
    if isinstance(freq, list) and (len(freq) != m.num_layers or set(freq) - {0, 1}):
        raise ConfigError(
            f"model.moe_layer_freq={freq} must hold one 0 or 1 per layer (model.num_layers="
            f"{m.num_layers}); give {m.num_layers} entries, or an integer k (every k-th layer)"
        )
    if isinstance(freq, int) and freq < 1:
        raise ConfigError(f"model.moe_layer_freq={freq} must be at least 1 (every k-th layer)")
    factor = m.moe_expert_capacity_factor
    if factor is not None and not factor > 0:
        raise ConfigError(
            f"model.moe_expert_capacity_factor={factor} must be positive; null is dropless"
        )
    groups, group_topk = m.moe_router_num_groups, m.moe_router_group_topk
    if (groups is None) != (group_topk is None):
        raise ConfigError(
            "group-limited routing needs both model.moe_router_num_groups and "
            "model.moe_router_group_topk (or neither); set the other"
        )
    if groups is not None:
        if groups < 1 or experts % groups:
            raise ConfigError(
                f"model.moe_router_num_groups={groups} does not divide model.num_experts="
                f"{experts} into equal groups; use {_divisors(experts)}"
            )
        if not 1 <= group_topk <= groups or m.moe_router_topk % group_topk:
            raise ConfigError(
                f"model.moe_router_group_topk={group_topk} must be between 1 and "
                f"moe_router_num_groups={groups} and divide moe_router_topk={m.moe_router_topk}"
            )
        if m.moe_router_topk // group_topk > experts // groups:
            raise ConfigError(
                f"model.moe_router_topk={m.moe_router_topk} over moe_router_group_topk="
                f"{group_topk} groups takes more experts per group than its {experts // groups}"
            )
    for key, width in (
        ("moe_ffn_hidden_size", m.expert_ffn_hidden_size),
        ("moe_shared_expert_intermediate_size", m.moe_shared_expert_intermediate_size),
    ):
        if width is not None and (width < 1 or width % tp):
            raise ConfigError(
                f"model.{key}={width} must be positive and divisible by "
                f"parallel.tensor_parallel_size={tp}; use {_multiples(width, tp)}"
            )
    if m.moe_shared_expert_gate and m.moe_shared_expert_intermediate_size is None:
        raise ConfigError(
            "model.moe_shared_expert_gate=true gates the shared expert; set "
            "model.moe_shared_expert_intermediate_size too"
        )
    for key in ("moe_aux_loss_coeff", "moe_z_loss_coeff", "moe_router_bias_update_rate"):
        if getattr(m, key) < 0:
            raise ConfigError(f"model.{key}={getattr(m, key)} must be zero or positive")
    if m.add_bias_linear:
        raise ConfigError(
            "model.add_bias_linear=true: experts carry no biases (as in Mixtral, Qwen-MoE and "
            "DeepSeek); set add_bias_linear=false with model.num_experts (add_qkv_bias stays)"
        )
    if m.type == "bert":
        raise ConfigError(
            "model.num_experts is for GPT-family decoders (pretrain_gpt.py); BERT trains dense"
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


def check_config(cfg: Config) -> None:
    """The checks that need neither the world size nor the file system."""
    m, t, o, p = cfg.model, cfg.training, cfg.optimizer, cfg.precision
    tp = cfg.parallel.tensor_parallel_size
    if m.kv_channels is None and m.hidden_size % m.num_attention_heads:
        raise ConfigError(
            f"model.hidden_size={m.hidden_size} is not divisible by model."
            f"num_attention_heads={m.num_attention_heads}; use "
            f"{_multiples(m.hidden_size, m.num_attention_heads)}"
        )
    if m.ffn_hidden_size % tp:
        raise ConfigError(
            f"model.ffn_hidden_size={m.ffn_hidden_size} is not divisible by parallel."
            f"tensor_parallel_size={tp}; use {_multiples(m.ffn_hidden_size, tp)}"
        )
    _check_decoder(cfg)
    _check_moe(cfg)
    _check_pipeline(cfg)
    if cfg.parallel.overlap_param_gather and not cfg.parallel.distributed_optimizer:
        raise ConfigError(
            "parallel.overlap_param_gather=true overlaps the distributed optimizer's parameter "
            "all-gather; set parallel.distributed_optimizer=true too, or set it to false"
        )
    if cfg.parallel.sequence_parallel and tp == 1:
        raise ConfigError(
            "parallel.sequence_parallel=true needs parallel.tensor_parallel_size > 1 (it splits "
            "activations over the TP group); set it to false or raise the TP size"
        )
    _check_context_parallel(cfg)
    _check_profiling(cfg)
    cp = cfg.parallel.context_parallel_size
    if cfg.parallel.sequence_parallel and m.seq_length % (tp * cp):
        raise ConfigError(
            f"parallel.sequence_parallel=true splits model.seq_length={m.seq_length} over "
            f"parallel.tensor_parallel_size={tp} (x parallel.context_parallel_size={cp}); use a "
            f"seq_length of {_multiples(m.seq_length, tp * cp)}, or set sequence_parallel=false"
        )
    if m.seq_length > m.max_position_embeddings:
        raise ConfigError(
            f"model.seq_length={m.seq_length} exceeds model.max_position_embeddings"
            f"={m.max_position_embeddings}; raise it to at least {m.seq_length}"
        )
    b = cfg.bert
    if m.type == "bert" and 0 < b.num_tokentypes < 2 and b.binary_head != "none":
        raise ConfigError(
            f"bert.num_tokentypes={b.num_tokentypes}: sentence pairs have token types 0 and 1; "
            "use 2 (or 0 for no token-type embedding)"
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
    weighted_paths(cfg.data.paths)
    split_fractions(cfg.data.split)
    for key in TOKENIZER_FILES[cfg.tokenizer.type].split():
        if not getattr(cfg.tokenizer, key):
            raise ConfigError(f"tokenizer.type={cfg.tokenizer.type} needs tokenizer.{key}; set it")
