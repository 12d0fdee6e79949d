"""``--dry-run``: check a config, its files and its memory for a world size, before a job queues.

Runs with no GPU and no process group (a login node will do). It validates the config for the world
size; opens every tokenizer and data file (headers, sizes, and that no token id reaches the
vocabulary: the check training runs before step 1, megatron/data/token_range.py, reading its cached
result, or sampling evenly spaced blocks when the data is huge and not yet cached; for hdf5 shards,
also that each split holds the samples the run draws from it) and the paths it writes; then
reports the parameters (total and, with experts, active), the per-GPU memory by kind (formulas in
megatron/estimate/memory.py, parameters.py and activations.py), the
FLOPs per iteration, a checkpoint's size (warning when checkpoint.save lacks room for two), and
whether the run fits in ``--gpu-memory-gb`` (and the longest ``model.seq_length`` that would at
this layout). A file that does not exist here (the data may live on the cluster only) is named
and skipped, and the written paths are then not checked either; a file that exists but is wrong
is an error. Exit code: 0 when it fits or no GPU size was given, 1 when it does not fit.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import signal
import sys
from dataclasses import replace
from typing import TextIO

from megatron.atomic_file import mib
from megatron.config.schema import Config, weighted_paths
from megatron.data.indexed_dataset import data_path, index_path
from megatron.data.sidecar import check_data_tokenizer
from megatron.errors import ConfigError
from megatron.estimate.activations import ring_attention_bytes
from megatron.estimate.checkpoint_size import checkpoint_bytes
from megatron.estimate.longest_sequence import longest_seq_length, seq_granularity
from megatron.estimate.memory import (
    DTYPE_BYTES,
    GIB,
    RESERVED_FRACTION,
    MemoryEstimate,
    estimate_stages,
    fits,
    usable_bytes,
    worst_stage,
)
from megatron.estimate.parameters import ModelType, count_parameters, stage_layers
from megatron.estimate.workload import Workload
from megatron.launch.data_checks import (
    check_hdf5,
    check_hdf5_splits,
    check_indexed,
    missing_files,
    vocab_size,
)
from megatron.launch.dry_run_time import cluster_and_world, report_time
from megatron.launch.preflight import check_load_path, validate
from megatron.parallel.pipeline.timeline import ideal_bubble


def _report_memory(
    cfg: Config, padded_vocab: int, model_type: ModelType, dp_size: int, out: TextIO
) -> MemoryEstimate:
    """Write the parameter and memory lines (of the worst pipeline stage); return its estimate."""
    m, tp, b = cfg.model, cfg.parallel.tensor_parallel_size, cfg.training.micro_batch_size
    pp, cp = cfg.parallel.pipeline_parallel_size, cfg.parallel.context_parallel_size
    heads = (model_type, cfg.bert.num_tokentypes, cfg.bert.binary_head != "none")
    stages = estimate_stages(cfg, padded_vocab, model_type, dp_size)
    mem = max(stages, key=lambda stage: stage.total)
    if pp > 1:
        _report_stages(cfg, stages, mem.stage, out)
    dtype, e = cfg.precision.dtype, DTYPE_BYTES[cfg.precision.dtype]
    moe, shared = any(m.moe_layers), m.moe_shared_expert_intermediate_size
    configured = {True: "   <- model.recompute=full", False: "   <- model.recompute=none"}
    ep = cfg.parallel.expert_parallel_size
    shards = f"DP {dp_size}" if cp == 1 else f"DPxCP {dp_size * cp}"
    if ep > 1:  # the routed experts' own replicas shard theirs
        shards += f" | EDP {dp_size * cp // ep}"
    if cfg.parallel.distributed_optimizer:
        main, moments = f"4 B/param / {shards}", f"8 B/param / {shards}"
    else:
        main, moments = "4 B/param; 0 when the weights are fp32, their own main", "8 B/param"
    sp = " (seq-parallel)" if cfg.parallel.sequence_parallel else ""
    rows = [
        (f"weights ({dtype}, {e} B/param)", mem.weights, ""),
        ("gradients (fp32 main_grad, 4 B/param)", mem.main_grads, ""),
        (f"fp32 main params ({main})", mem.main_params, ""),
        (f"Adam moments ({'fp32' if ep > 1 else '2 x fp32'}, {moments})", mem.adam_moments, ""),
        (f"word embedding .grad ({dtype}, in backward)", mem.embedding_grad, ""),
        (f"logits + loss buffers, (e+4)*b*s*V/{'t' if cp == 1 else '(t*cp)'}", mem.logits, ""),
        (f"activations, no recomputation{sp}", mem.activations_no_recompute, ""),
        (f"activations, full recomputation{sp}", mem.activations_recompute, ""),
        *([("ring attention buffers (one layer, transient)", mem.ring_attention, "")] * (cp > 1)),
        *([("MoE dispatch buffers (one layer, transient)", mem.moe_dispatch, "")] * moe),
        *([("router expert_bias buffers (fp32)", mem.expert_bias, "")] * (mem.expert_bias > 0)),
        ("total, no recomputation", mem.total_with(False), configured[False] * (not mem.recompute)),
        ("total, full recomputation", mem.total_with(True), configured[True] * mem.recompute),
    ]
    whole = count_parameters(m, padded_vocab, tp, *heads)
    where = f"on stage {mem.stage} (the worst) " if pp > 1 else ""
    local = f" ({m.seq_length // cp} tokens on each of CP {cp} ranks)" if cp > 1 else ""
    if moe:
        out.write(
            f"experts: {m.num_experts} routed of width {m.expert_ffn_hidden_size}, top "
            f"{m.moe_router_topk}, in {sum(m.moe_layers)} of {m.num_layers} layers"
            + (f", shared expert of width {shared}" if shared else "")
            + f"; {whole.active:,} parameters active per token of {whole.total:,}\n"
        )
    out.write(
        f"parameters: {whole.total:,} total; {mem.params.per_gpu:,} per GPU {where}at TP {tp} "
        f"({mem.params.split:,} split {tp} ways, {mem.params.replicated:,} replicated)\n"
    )
    if moe:
        held, held_params = m.num_experts // ep, mem.params.experts_per_gpu
        out.write(
            f"routed experts per GPU {where}at EP {ep}: {held_params:,} parameters ({held} of "
            f"{m.num_experts} experts per MoE layer, split {tp} ways)\n"
        )
    out.write(
        f"memory per GPU {where}for micro-batch {b}, seq {m.seq_length}{local}, e = {e} bytes per "
        "element:\n"
    )
    for label, n, note in rows:
        out.write(f"  {label:<46}{n / GIB:9.2f} GiB{note}\n")
    extra = mem.unfused_attention_extra
    held_layers = m.num_layers // (pp * (cfg.parallel.virtual_pipeline_size or 1)) * mem.in_flight
    out.write(
        "  activations per layer (GPT-2's shape; the other model.* options: see\n"
        "    megatron/estimate/memory.py): Korthikanti et al. 2022 (s*b*h*(10 + 24/t +\n"
        "    5*a*s/(h*t)) for e = 2, f = 4h) with fused attention: s*b*h*(4e + 2 masks) + 16*s*b\n"
        "    + [s*b*(4h + 2f)*e + 4*a*s*b] / t; full recomputation keeps L layer inputs\n"
        "    (e*s*b*h each) plus one layer's working set."
    )
    if cp == 1:
        held = held_layers * extra / GIB
        out.write(
            " Unfused attention (probabilities\n"
            f"    materialised, the 5*a*s/(h*t) term) would add {held:.2f} GiB\n"
            f"    without recomputation, {extra / GIB:.2f} GiB with it.\n"
        )
    else:
        ring = ring_attention_bytes(m, b, tp, e, cp)
        out.write(
            f"\n  context parallelism: each of the CP {cp} ranks holds 2 of a sample's {2 * cp}"
            f" chunks,\n    s/cp = {m.seq_length // cp} tokens; every activation above and the"
            " logits count those.\n    Ring attention saves what fused attention saves (its"
            " output [b, a/t, s/cp, d] is\n    copied for the dense layer: + e*a*d/t per token)."
            " Its buffers, one layer at a\n    time, in backward: K/V messages"
            f" [2, b, g/t, s/cp, d] {ring.kv / GIB:.2f} GiB, fp32 dK/dV\n    accumulators"
            f" {ring.dkv / GIB:.2f} GiB, fp32 dq and row statistics {ring.working / GIB:.2f}"
            f" GiB,\n    one pair's fused-kernel call {ring.pair / GIB:.2f} GiB (no score"
            " blocks; the CUDA kernel's own\n    workspace is not measured, not counted); the"
            " totals count them once.\n"
        )
    if moe:
        out.write(
            "  MoE layers (megatron/estimate/activations.py) keep, instead of the dense MLP's\n"
            "    fc1 and activation outputs, for T = b*s tokens: the fp32 router scores (and\n"
            "    logits with the z-loss; T/t tokens under sequence parallelism), the permuted\n"
            "    rows, fc2's output rows and their unpermuted copy (3*e*T*k*h, whole on every TP\n"
            "    rank), the experts' SwiGLU terms (e*T*k*4*f_e/t), the routing weights and int64\n"
            "    indices, and the shared expert as a dense MLP of its width; dropless: T*k rows\n"
            "    through the experts per layer.\n"
        )
    if ep > 1:
        edp = dp_size * cp // ep
        out.write(
            f"  expert parallelism: each GPU holds {m.num_experts // ep} of the {m.num_experts}"
            f" routed experts of every MoE\n    layer (weights, main_grad, optimizer state;"
            f" the distributed optimizer shards them over\n    DP x CP / EP = EDP {edp}"
            " ranks); activations assume balanced routing (T*k rows received\n    per layer),"
            " keeping the received rows regrouped, fc2's rows and the rows returned:\n"
            "    4*e*T*k*h whole on every TP rank.\n"
        )
    if pp > 1:
        out.write(
            f"  pipeline: this stage holds {mem.in_flight} micro-batch chunk(s) in flight (1F1B:\n"
            "    min(p - s, m) on stage s; interleaved: min(2(p-s-1) + (v-1)p + 1, m*v) chunks\n"
            "    of L/(p*v) layers), each but the last stage's last chunk also keeping its output\n"
            "    (e*s*b*h) until its backward. The first stage holds the embeddings; the last the\n"
            "    final norm, the LM head with its own word embedding copy (or the untied output\n"
            "    layer), and the logits.\n"
        )
    if cfg.parallel.sequence_parallel:
        out.write(
            "  sequence parallelism: the LayerNorm inputs, dropout masks and statistics\n"
            "    (s*b*h*(2e + masks) + 16*s*b per layer), the embedding's and final LayerNorm's,\n"
            f"    and the layer inputs recomputation keeps are split {tp} ways; QKV's and fc1's\n"
            "    gathered inputs (2e*s*b*h) and the LM head's input stay whole.\n"
        )
    return mem


def _stage_layers(num_layers: int, pp: int, chunks: int, stage: int) -> str:
    """The layers of ``stage``: chunk c is virtual stage c * pp + stage, e.g. '0-5, 12-17'."""
    n, layers = num_layers // (pp * chunks), stage_layers(num_layers, pp, chunks, stage)
    return ", ".join(f"{layers[c * n]}-{layers[c * n + n - 1]}" for c in range(chunks))


def _report_stages(cfg: Config, stages: list[MemoryEstimate], worst: int, out: TextIO) -> None:
    """One line per pipeline stage: its layers, parameters and memory as configured."""
    p, m = cfg.parallel, cfg.model
    chunks = p.virtual_pipeline_size or 1
    out.write(
        "  stage        params/GPU  states GiB  activations GiB  in flight  total GiB  layers\n"
    )
    for mem in stages:
        n = mem.params.per_gpu
        activations = mem.activations_recompute if mem.recompute else mem.activations_no_recompute
        layers = _stage_layers(m.num_layers, p.pipeline_parallel_size, chunks, mem.stage)
        out.write(
            f"  {mem.stage:<5} {n:>16,} {mem.states / GIB:11.2f} {activations / GIB:16.2f} "
            f"{mem.in_flight:10} {mem.total / GIB:10.2f}  {layers}"
            f"{'   <- worst' if mem.stage == worst else ''}\n"
        )


def dry_run(
    cfg: Config,
    args: argparse.Namespace,
    model_type: ModelType = "gpt",
    out: TextIO | None = None,
    facts: dict | None = None,
) -> int:
    """Validate, check the files, report memory and FLOPs; 0 if it fits (or no size), else 1.

    ``args`` carries ``world_size`` (default: one replica, TP x CP x PP GPUs, or ``nodes`` of the
    ``cluster``, whose predicted step time is then reported) and ``gpu_memory_gb`` (GiB, as
    vendors' "32 GB" means; default: the cluster's). ``facts``, when given, receives the report's
    figures (``--json``). Config and file errors raise ConfigError.
    """
    out, facts = out or sys.stdout, {} if facts is None else facts
    tp, pp = cfg.parallel.tensor_parallel_size, cfg.parallel.pipeline_parallel_size
    cp = cfg.parallel.context_parallel_size
    cluster, cluster_world = cluster_and_world(args)
    world = args.world_size or cluster_world or tp * cp * pp
    validate(cfg, world, check_files=False)
    check_load_path(cfg, missing_ok=True)  # a file where a directory belongs is an error here too
    missing = missing_files(cfg)
    warnings = [] if missing else validate(cfg, world, check_files=True)
    split_counts = check_hdf5_splits(cfg, missing)
    derived = cfg.derived(world)
    pp, chunks = derived.pp_size, cfg.parallel.virtual_pipeline_size or 1
    pipeline = f" x PP {pp}" if pp > 1 else ""
    pipeline += f" x CP {cp}" if cp > 1 else ""
    ep = cfg.parallel.expert_parallel_size
    experts = f" (EP {ep} over DP x CP)" if ep > 1 else ""
    out.write(
        f"dry run ({model_type}): world {world} = DP {derived.dp_size}{pipeline} x TP {tp}"
        f"{experts}; "
        f"{derived.num_micro_batches} micro-batches of {cfg.training.micro_batch_size} per step "
        f"on each rank; config valid\n"
    )
    if not args.world_size and not cluster_world:
        out.write(f"  (no --world-size: checked for one replica of {tp * cp * pp} GPU(s))\n")
    if pp > 1:
        schedule = f"interleaved 1F1B, {chunks} chunks per stage" if chunks > 1 else "1F1B"
        bubble = ideal_bubble(pp, chunks, derived.num_micro_batches)
        out.write(
            f"pipeline: {pp} stages of {cfg.model.num_layers // pp} layers, {schedule}; bubble "
            f"(p-1)/(m*v) = {pp - 1}/({derived.num_micro_batches}*{chunks}) = {bubble:.2%} of "
            "the busy time\n"
        )
    for path in missing:
        out.write(f"ABSENT here: {path} (not checked; the run fails at start if it is absent)\n")
    if split_counts:
        out.write(f"data: hdf5 splits (samples held >= needed): {split_counts}\n")
    vocab, source = vocab_size(cfg, missing)
    padded = derived.padded_vocab_size(vocab)
    out.write(f"tokenizer: {source}; vocab {vocab:,}, padded to {padded:,} at TP {tp}\n")
    if not missing:  # the data's sidecars against the tokenizer, as training checks them
        check_data_tokenizer(cfg.tokenizer, cfg.data, lambda msg: out.write(f"WARNING: {msg}\n"))
    for _, path in weighted_paths(cfg.data.paths):
        if cfg.data.format == "hdf5":
            if path in missing:
                continue
            summary = check_hdf5(path, cfg, vocab)
        elif index_path(path) in missing or data_path(path) in missing:
            continue
        else:
            summary = check_indexed(path, vocab, cache_dir=cfg.data.cache_dir)
        how = "sampled" if summary.sampled else "all scanned"
        out.write(
            f"data: {summary.path}: {summary.sequences:,} sequences, {summary.tokens:,} "
            f"{summary.dtype} tokens; max id {summary.max_id} < {vocab} ({how})\n"
        )
    mem = _report_memory(cfg, padded, model_type, derived.dp_size, out)
    flops = Workload.of(cfg, padded, world).flops_per_iter
    out.write(f"FLOPs per iteration: {flops:.3e} in all, {flops / world:.3e} per GPU\n")
    facts.update(world_size=world, flops_per_iter=flops)
    facts["memory_gib_per_gpu"] = mem.figures_gib()
    if cluster is not None:
        facts.update(report_time(cfg, padded, model_type, world, cluster, out))
    saved = mib(checkpoint_bytes(cfg, padded, model_type))
    out.write(f"checkpoint: about {saved} per save (weights and optimizer state of every rank)\n")
    for warning in warnings:
        out.write(f"WARNING: {warning}\n")
    gb = args.gpu_memory_gb or (cluster.gpu_memory_gb if cluster else None)
    facts["fits"] = None  # no GPU size given: not judged
    if gb is None:
        return 0
    ok = facts["fits"] = fits(mem.total, gb)
    out.write(
        f"fits in {gb:g} GB: {'yes' if ok else 'no'} ({mem.total / GIB:.2f} GiB of "
        f"{usable_bytes(gb) / GIB:.2f} GiB usable: {RESERVED_FRACTION:.0%} of the GPU is kept for "
        "the CUDA context, NCCL buffers and fragmentation; GB here is 2^30 bytes)\n"
    )
    out.write(f"{_longest(cfg, padded, model_type, derived.dp_size, gb)}\n")
    if not ok:
        out.write(f"  hint: {_hint(cfg, padded, model_type, derived.dp_size, gb)}\n")
    return 0 if ok else 1


def dry_run_to_stdout(cfg: Config, args: argparse.Namespace, model_type: ModelType) -> int:
    """``dry_run`` onto stdout, as every entrypoint's ``--dry-run`` runs it; its exit code, or
    141 without a traceback when the reader stops early (``--dry-run | head -3``)."""
    try:
        if args.plan:
            from megatron.launch.plan import plan_to

            code = plan_to(cfg, args, model_type, sys.stdout)
        elif args.json:  # the text report too, as lines, in the one object
            text, facts = io.StringIO(), {}
            code = dry_run(cfg, args, model_type, text, facts)
            json.dump(facts | {"report": text.getvalue().splitlines()}, sys.stdout)
            sys.stdout.write("\n")
        else:
            code = dry_run(cfg, args, model_type)
        sys.stdout.flush()  # a reader gone by the last lines fails this, not Python's exit
    except BrokenPipeError:
        # Python flushes stdout again at exit: onto /dev/null, where that cannot fail.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        # 128 + SIGPIPE, the status of `cat`, `grep` or `seq` cut off by `head` (CPython's own
        # json.tool exits nonzero too): never 0 or 1, the fits/does not fit of a report unread.
        return 128 + signal.SIGPIPE
    return code


def _longest(cfg: Config, padded_vocab: int, model_type: ModelType, dp_size: int, gb: float) -> str:
    """The line naming the longest model.seq_length that fits ``gb`` at this layout."""
    p = cfg.parallel
    step, cp = seq_granularity(cfg), p.context_parallel_size
    factors = (["2 x CP"] if cp > 1 else []) + (["CP x TP"] if p.sequence_parallel else [])
    multiple = f"a multiple of {' and '.join(factors)}: {step}; " if step > 1 else ""
    longest = longest_seq_length(cfg, padded_vocab, model_type, dp_size, gb)
    head = f"longest model.seq_length that fits in {gb:g} GB at this layout:"
    if not longest:
        return f"{head} none ({multiple}not even {step} token(s) fit)"
    positions = ""
    if longest > cfg.model.max_position_embeddings:
        positions = "; model.max_position_embeddings must be raised with it"
    return f"{head} {longest:,} ({multiple}all else as configured{positions})"


def _hint(cfg: Config, padded_vocab: int, model_type: ModelType, dp_size: int, gb: float) -> str:
    """The first memory-saving switch the config has off that makes it fit, tried one at a time."""
    m, p = cfg.model, cfg.parallel
    switches = [
        ("model.recompute=full", m.recompute != "full", {"model": replace(m, recompute="full")}),
        (
            "parallel.distributed_optimizer=true",
            dp_size > 1 and not p.distributed_optimizer,
            {"parallel": replace(p, distributed_optimizer=True)},
        ),
        (
            "parallel.sequence_parallel=true",
            p.tensor_parallel_size > 1 and not p.sequence_parallel,
            {"parallel": replace(p, sequence_parallel=True)},
        ),
    ]
    for name, applies, change in switches:
        changed = replace(cfg, **change)
        if applies and fits(worst_stage(changed, padded_vocab, model_type, dp_size).total, gb):
            return f"{name} fits"
    # Context parallelism divides the activations: the smallest larger CP size this world and
    # config allow (the DP size it leaves shards the optimizer and counts the micro-batches).
    model_parallel = p.tensor_parallel_size * p.pipeline_parallel_size
    cp, world = p.context_parallel_size, dp_size * p.context_parallel_size * model_parallel
    for larger in range(cp + 1, world // model_parallel + 1):
        if world % (larger * model_parallel):
            continue
        changed = replace(cfg, parallel=replace(p, context_parallel_size=larger))
        try:
            validate(changed, world, check_files=False)
        except ConfigError:
            continue
        dp = changed.derived(world).dp_size
        if fits(worst_stage(changed, padded_vocab, model_type, dp).total, gb):
            return f"parallel.context_parallel_size={larger} fits (DP {dp})"
    return (
        "raise parallel.tensor_parallel_size or parallel.pipeline_parallel_size (weights and "
        "optimizer state divide by them) or lower training.micro_batch_size (activations scale "
        "with it)"
    )
