"""Predicted seconds per training iteration of a config, layout and cluster, and what follows
from it (tokens/s, TFLOP/s per GPU, MFU, exposed communication, bubble, weak scaling).

One iteration on one GPU (docs/performance_model.md has every term and its source):
- each micro-batch's forward and backward through the stage's layers (megatron/estimate/
  layer_time.py), recomputation adding one more forward to every backward, the embedding on the
  first virtual stage and the LM head with its loss on the last, and a point-to-point send of the
  [T, h] activations (or gradients) per unit between stages;
- those units replayed in the schedule's order (megatron/parallel/pipeline/replay.py on
  timeline.py's unit order): the makespan, and the bubble it leaves;
- the data-parallel gradient reduction of fp32 buckets (all-reduce, or reduce-scatter with the
  distributed optimizer) over DP x CP, overlapping the last micro-batch's backward except for the
  last bucket (megatron/parallel/data_parallel.py), then the optimizer streaming its state, then
  the parameter all-gather (hidden behind the first forward with ``overlap_param_gather``).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from megatron.config.schema import Config
from megatron.estimate.cluster import Cluster
from megatron.estimate.collectives import Links, all_gather, all_reduce, reduce_scatter, send
from megatron.estimate.flops import flops_per_iteration
from megatron.estimate.layer_time import Kernels, Pass, layer_passes
from megatron.estimate.memory import DTYPE_BYTES
from megatron.estimate.parameters import ModelType, stage_layers, stage_parameters
from megatron.parallel.pipeline.replay import replay, schedule_events

ADAM_BYTES = 4 * 8  # fp32 main param, grad, two moments read; param and moments written


@dataclass(frozen=True)
class StepTime:
    seconds: float
    comm: float  # communication seconds on the busiest GPU, hidden or not
    exposed_comm: float  # the part no compute hides
    bubble_fraction: float  # pipeline idle time over busy time, from the replay
    tokens_per_s: float
    tflops_per_gpu: float
    mfu: float
    crosses_nodes: dict[str, bool]  # which groups' collectives leave the node

    @property
    def exposed_comm_fraction(self) -> float:
        return self.exposed_comm / self.seconds


def _head(cfg: Config, kernels: Kernels, links: Links, padded_vocab: int) -> tuple[Pass, Pass]:
    """The LM head and its cross-entropy for one micro-batch: logits [T, V/t] in the model dtype
    and the loss's fp32 copy, written and read; the vocab-parallel loss's three all-reduces of
    [T] fp32 forward (the logits' max, the target's logit, the sum of exponentials:
    megatron/parallel/cross_entropy.py); its input's TP reduce in backward (sequence parallel:
    its input's all-gather forward, and a reduce-scatter backward)."""
    m, p = cfg.model, cfg.parallel
    t, e = p.tensor_parallel_size, DTYPE_BYTES[cfg.precision.dtype]
    tokens = cfg.training.micro_batch_size * m.seq_length // p.context_parallel_size
    gemm = kernels.gemm(2 * tokens * m.hidden_size * padded_vocab / t)
    logits = kernels.stream(2 * (e + 4) * tokens * padded_vocab / t)
    activation = tokens * m.hidden_size * e
    gather, reduce = 0.0, all_reduce(activation, t, links.tp)
    if p.sequence_parallel:
        gather, reduce = (
            all_gather(activation, t, links.tp),
            reduce_scatter(activation, t, links.tp),
        )
    enter = gather + 3 * all_reduce(4 * tokens, t, links.tp)
    return Pass(gemm + logits, enter, enter), Pass(2 * (gemm + logits), reduce, reduce)


def _embedding(cfg: Config, kernels: Kernels, links: Links) -> tuple[Pass, Pass]:
    """Lookup, position add and dropout (three [T, h] passes each way); the vocab-parallel
    table's all-reduce forward (sequence parallel: then split, its gradient all-gathered back)."""
    m, p = cfg.model, cfg.parallel
    t, e = p.tensor_parallel_size, DTYPE_BYTES[cfg.precision.dtype]
    tokens = cfg.training.micro_batch_size * m.seq_length // p.context_parallel_size
    stream = kernels.stream(3 * tokens * m.hidden_size * e)
    reduce = all_reduce(tokens * m.hidden_size * e, t, links.tp)
    gather = all_gather(tokens * m.hidden_size * e, t, links.tp) if p.sequence_parallel else 0.0
    return Pass(stream, reduce, reduce), Pass(stream, gather, gather)


def unit_passes(
    cfg: Config, padded_vocab: int, world: int, cluster: Cluster
) -> dict[tuple[str, int, int], Pass]:
    """(kind, stage, chunk) -> one micro-batch's forward ("F") or backward ("B") through that
    model chunk: its layers, the embedding or the head where the chunk holds them, its send."""
    m, p = cfg.model, cfg.parallel
    derived = cfg.derived(world)
    t, cp, pp = p.tensor_parallel_size, p.context_parallel_size, derived.pp_size
    chunks, e = p.virtual_pipeline_size or 1, DTYPE_BYTES[cfg.precision.dtype]
    links = Links.of(cluster, t, cp, pp, derived.dp_size, p.expert_parallel_size)
    kernels, cuda = Kernels(cluster, cfg.precision.dtype), cluster.device == "cuda"
    layer = {moe: layer_passes(cfg, kernels, links, moe, cuda) for moe in set(m.moe_layers)}
    head, embedding = _head(cfg, kernels, links, padded_vocab), _embedding(cfg, kernels, links)
    tokens = cfg.training.micro_batch_size * m.seq_length // cp
    hop = send(tokens * m.hidden_size * e / (t if p.sequence_parallel else 1), links.pp)
    per_chunk = m.num_layers // (pp * chunks)
    recompute = m.recompute == "full"
    units: dict[tuple[str, int, int], Pass] = {}
    for stage in range(pp):
        layers = stage_layers(m.num_layers, pp, chunks, stage)
        for c in range(chunks):
            forward, backward = Pass(), Pass()
            for index in layers[c * per_chunk : (c + 1) * per_chunk]:
                f, b = layer[m.moe_layers[index]]
                forward, backward = forward + f, backward + b + (f if recompute else Pass())
            virtual = c * pp + stage
            if virtual == 0:
                forward, backward = forward + embedding[0], backward + embedding[1]
            if virtual == pp * chunks - 1:
                forward, backward = forward + head[0], backward + head[1]
            if pp > 1:  # a send to the next virtual stage, or of the gradient to the previous
                sent = Pass(0.0, hop, hop)
                forward += sent if virtual < pp * chunks - 1 else Pass()
                backward += sent if virtual > 0 else Pass()
            units["F", stage, c], units["B", stage, c] = forward, backward
    return units


def step_time(
    cfg: Config, padded_vocab: int, model_type: ModelType, world: int, cluster: Cluster
) -> StepTime:
    """The predicted iteration of ``cfg`` on ``world`` GPUs of ``cluster``."""
    m, p = cfg.model, cfg.parallel
    derived = cfg.derived(world)
    t, cp, pp = p.tensor_parallel_size, p.context_parallel_size, derived.pp_size
    ep, dp, micro = p.expert_parallel_size, derived.dp_size, derived.num_micro_batches
    chunks, e = p.virtual_pipeline_size or 1, DTYPE_BYTES[cfg.precision.dtype]
    kernels, links = Kernels(cluster, cfg.precision.dtype), Links.of(cluster, t, cp, pp, dp, ep)
    units = unit_passes(cfg, padded_vocab, world, cluster)
    events = schedule_events(pp, chunks, micro, lambda k, s, c: units[k, s, c].time)
    makespan, busy = replay(events, [[0.0] * len(stage) for stage in events])

    tails, comms, exposed = [], [], []
    for stage in range(pp):
        params = stage_parameters(
            m,
            padded_vocab,
            t,
            pp,
            stage,
            model_type,
            cfg.bert.num_tokentypes,
            cfg.bert.binary_head != "none",
            chunks,
            ep,
        )
        dense, experts = params.dense_per_gpu, params.experts_per_gpu
        replicas, expert_replicas = dp * cp, dp * cp // ep
        if p.distributed_optimizer:
            reduce = reduce_scatter(4 * dense, replicas, links.dp)
            reduce += reduce_scatter(4 * experts, expert_replicas, links.dp)
            gather = all_gather(e * dense, replicas, links.dp)
            gather += all_gather(e * experts, expert_replicas, links.dp)
            owned = dense / replicas + experts / expert_replicas
        else:
            reduce = all_reduce(4 * dense, replicas, links.dp)
            reduce += all_reduce(4 * experts, expert_replicas, links.dp)
            gather, owned = 0.0, dense + experts
        grad_bytes = 4 * (dense + experts)
        last_bucket = reduce * min(1.0, p.ddp_bucket_size_mb * 2**20 / max(grad_bytes, 1))
        last_backward = sum(units["B", stage, c].time for c in range(chunks))
        reduce_exposed = max(reduce - last_backward, last_bucket)
        first_forward = sum(units["F", stage, c].time for c in range(chunks))
        gather_exposed = max(0.0, gather - first_forward) if p.overlap_param_gather else gather
        # Adam over the owned shard, the model-dtype copy written, the grad buffer zeroed
        optimizer = kernels.stream(owned * (ADAM_BYTES + e) + grad_bytes)
        tails.append(reduce_exposed + gather_exposed + optimizer)
        per_step = [units[k, stage, c] * micro for k in "FB" for c in range(chunks)]
        comms.append(sum(u.comm for u in per_step) + reduce + gather)
        exposed.append(sum(u.exposed for u in per_step) + reduce_exposed + gather_exposed)
    worst = max(range(pp), key=lambda s: tails[s])
    seconds = makespan + tails[worst]
    flops = flops_per_iteration(m, padded_vocab, cfg.training.global_batch_size)
    tflops = flops / world / seconds / 1e12
    return StepTime(
        seconds=seconds,
        comm=max(comms),
        exposed_comm=max(exposed),
        bubble_fraction=(pp * makespan - busy) / busy,
        tokens_per_s=cfg.training.global_batch_size * m.seq_length / seconds,
        tflops_per_gpu=tflops,
        mfu=tflops * 1e12 / kernels.peak,
        crosses_nodes=links.crosses_nodes,
    )


def weak_scaling_efficiency(
    cfg: Config, padded_vocab: int, model_type: ModelType, world: int, cluster: Cluster
) -> float:
    """Per-GPU throughput at ``world`` over the same model and layout on one node (or on one
    replica, when a replica needs more than a node), each DP replica keeping its batch."""
    p = cfg.parallel
    replica = p.tensor_parallel_size * p.context_parallel_size * p.pipeline_parallel_size
    base = max(replica, cluster.gpus_per_node // replica * replica)
    if base >= world:
        return 1.0
    per_replica = cfg.training.global_batch_size // cfg.derived(world).dp_size
    small = replace(
        cfg, training=replace(cfg.training, global_batch_size=per_replica * base // replica)
    )
    at_base = step_time(small, padded_vocab, model_type, base, cluster).tflops_per_gpu
    return step_time(cfg, padded_vocab, model_type, world, cluster).tflops_per_gpu / at_base
