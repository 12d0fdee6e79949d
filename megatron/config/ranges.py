"""The numeric keys' ranges, in one table so every key is covered once; null is unchecked."""

from __future__ import annotations

from megatron.config.schema import Config

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
    checkpoint.save_interval checkpoint.keep_last logging.log_interval logging.straggler_threshold
    bert.max_ngram training.eval_tasks_limit training.spike_threshold
    training.spike_window training.spike_skip_batches""".split()
_NON_NEGATIVE = """model.init_method_std training.eval_iters training.test_iters data.num_workers
    training.eval_tasks_interval training.max_rollbacks
    optimizer.min_lr optimizer.weight_decay optimizer.clip_grad optimizer.lr_warmup_iters
    optimizer.lr_warmup_init bert.num_tokentypes""".split()
_FRACTION = """model.hidden_dropout model.attention_dropout optimizer.adam_beta1
    optimizer.adam_beta2 bert.masked_lm_prob bert.short_seq_prob""".split()  # in [0, 1)


def range_mistakes(cfg: Config) -> list[str]:
    """Every key out of its range, one line each."""
    found = []
    for key in _POSITIVE + _NON_NEGATIVE + _FRACTION:
        section, name = key.split(".")
        value = getattr(getattr(cfg, section), name)
        if value is None:
            continue
        if key in _POSITIVE and not value > 0:
            found.append(f"{key}={value} must be positive; fix the value")
        if key in _NON_NEGATIVE and not value >= 0:
            found.append(f"{key}={value} must be zero or positive; fix the value")
        if key in _FRACTION and not 0 <= value < 1:
            found.append(f"{key}={value} must be in [0, 1); fix the value")
    return found
