"""Per-GPU training memory of a config, from formulas (no model is built).

Parameters come from megatron/estimate/parameters.py, activations per layer from
megatron/estimate/activations.py (notation there: e bytes per element of the model dtype).

**Memory** of our implementation, per parameter held by this GPU: e bytes of weights, 4 of
fp32 ``main_grad`` (megatron/parallel/data_parallel.py keeps it for every parameter), 4 of fp32
main copy when the dtype is bf16/fp16 (fp32 parameters are their own main copy), and 8 of Adam
moments: 16 bytes in fp32, 18 in bf16/fp16. The **distributed optimizer**
(``parallel.distributed_optimizer``) keeps the fp32 main copy and the moments of 1/d of the
parameters on each of the d DP ranks, ceil(N/d) of N (its buckets' padding to a multiple of d
adds under d elements per bucket): (4 + 8)/d bytes per parameter, the main copy in fp32 too (a
flat copy of the owned elements); weights and the whole fp32 gradient buffer stay on every rank,
as in Megatron's. With context parallelism d is DP x CP (the CP ranks hold replicas too).

**Mixture of experts**: the experts' weights, gradients and optimizer state are per parameter as
the dense ones (every TP rank holds its f_e/t slice of every expert it holds). With **expert
parallelism** (``parallel.expert_parallel_size`` ep) a GPU holds E/ep of each MoE layer's routed
experts: their weights, their fp32 ``main_grad`` and their optimizer state count those only; the
distributed optimizer shards them over their own replicas, the DP x CP / ep expert-data-parallel
ranks (the dense parameters over DP x CP as before). The
router's ``expert_bias`` buffers (``moe_router_enable_expert_bias``), fp32 [E] per MoE layer of
the stage, stay for the run; one MoE layer's dispatch buffers (``moe_dispatch_bytes``) are
transient and counted once, as ring attention's are.

**Pipeline parallelism** (``parallel.pipeline_parallel_size`` p, ``virtual_pipeline_size`` v) gives
stage s of p its L/p layers (interleaved: v chunks of L/(p*v), chunk c being virtual stage c*p + s);
the first stage also holds the embeddings (word, position, BERT's token types and post-LN
LayerNorm), the last the final LayerNorm and the heads and, when p > 1, its own copy of the word
embedding for the tied LM head (as Megatron does, all-reducing the two copies' gradients). Weights,
gradients and optimizer state follow the stage's parameters. Activations are held per micro-batch
chunk in flight, from its forward to its backward, in the schedule's order
(megatron/parallel/pipeline/timeline.py: min(p - s, m) micro-batches with 1F1B, the first stage the
peak at p; interleaved min(2(p-s-1) + (v-1)p + 1, m*v) chunks, Megatron's p*(1 + (p-1)/(p*v))
stages' worth on the first stage). Each unit holds its chunk's layers' activations (or, with full
recomputation, their inputs), the first chunk's embedding-side terms, the last chunk's head-side
terms, and every other chunk its output (e*s*b*h, the tensor sent on), which the schedule keeps
until the backward. The logits are the last stage's, the tied embedding's ``.grad`` the first's and
the last's. m micro-batches per step, p > 1: the bubble is (p - 1)/(m*v) of the busy time.

**Head tokens**: GPT's LM head sees all b*s tokens; BERT's runs on the masked ones only,
b*n with n = masked_count(s - 3) (every token but [CLS] and two [SEP] maskable: the most a
sample masks), so its head terms and its logits scale with b*n instead.

**Logits and loss**: the LM head's [tokens, V/t] logits in the model dtype and the vocab-parallel
cross entropy's fp32 copy (reused for the softmax and the gradient) are alive together:
(e + 4)*tokens*V/t. The tied embedding's ``.grad`` (e*V*h/t) lives from the LM head's backward
until the embedding's, before the hook moves it into ``main_grad``; an untied output layer's
moves there as soon as it is made.

FLOPs come from megatron/estimate/flops.py.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

from megatron.config.schema import Config
from megatron.data.bert_dataset import masked_count
from megatron.estimate.activations import (
    layer_activation_bytes,
    moe_dispatch_bytes,
    norm_stats,
    ring_attention_bytes,
)
from megatron.estimate.parameters import ModelType, ParamCount, stage_layers, stage_parameters
from megatron.parallel.pipeline.timeline import peak_held, schedule_units

DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}
GIB = 2**30
# Memory the estimate leaves unclaimed: CUDA context and kernels, NCCL buffers, allocator
# fragmentation and short-lived temporaries the formulas do not list.
RESERVED_FRACTION = 0.10


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes on one GPU at the peak of a training step (the backward of a micro-batch)."""

    weights: int
    main_grads: int  # fp32 main_grad buffer of the data-parallel wrapper
    main_params: int  # fp32 copies (bf16/fp16, or this rank's shard with the distributed optimizer)
    adam_moments: int  # exp_avg and exp_avg_sq, fp32 (this rank's shard with the distributed one)
    embedding_grad: int  # the tied word embedding's .grad in the model dtype during backward
    activations_no_recompute: int
    activations_recompute: int
    unfused_attention_extra: int  # what materialised attention probabilities would add, per layer
    logits: int  # logits and cross-entropy buffers of one micro-batch
    recompute: bool  # whether the config recomputes (which activation figure counts)
    params: ParamCount  # the parameters of the stage, which its weights and states follow
    stage: int = 0  # the pipeline stage these bytes are for
    in_flight: int = 1  # micro-batch chunks whose activations the stage holds at its peak
    # CP > 1: ring attention's K/V messages, dK/dV accumulators and kernel buffers (one
    # layer's, transient)
    ring_attention: int = 0
    expert_bias: int = 0  # MoE: the routers' fp32 expert_bias buffers [E] of the stage's layers
    moe_dispatch: int = 0  # MoE: one layer's dispatch buffers (two [T*k, h]), transient

    @property
    def states(self) -> int:
        """Weights, gradients, optimizer state and buffers: the bytes that stay for the run."""
        optimizer = self.main_params + self.adam_moments
        return self.weights + self.main_grads + optimizer + self.expert_bias

    def total_with(self, recompute: bool) -> int:
        """Peak bytes with or without full activation recomputation."""
        activations = self.activations_recompute if recompute else self.activations_no_recompute
        transient = self.ring_attention + self.moe_dispatch
        return self.states + self.embedding_grad + activations + self.logits + transient

    @property
    def total(self) -> int:
        """Peak bytes as configured."""
        return self.total_with(self.recompute)

    def figures_gib(self) -> dict[str, float]:
        """The peak by kind in GiB (activations: with the logits and transient buffers)."""
        kinds = ("weights", "main_grads", "main_params", "adam_moments", "embedding_grad")
        figures = {kind: getattr(self, kind) / GIB for kind in kinds}
        activations = self.total - self.states - self.embedding_grad
        return figures | {"activations": activations / GIB, "total": self.total / GIB}


def estimate_memory(
    cfg: Config,
    padded_vocab_size: int,
    model_type: ModelType = "gpt",
    dp_size: int = 1,
    stage: int = 0,
) -> MemoryEstimate:
    """Per-GPU memory of training ``cfg`` on ``dp_size`` DP replicas (which the distributed
    optimizer's shards and the pipeline's micro-batch count depend on), on pipeline stage
    ``stage``, at the config's ``parallel.context_parallel_size`` (``Derived.dp_size`` already
    leaves it out of the DP size); see the module docstring for every term."""
    m, tp, sp = cfg.model, cfg.parallel.tensor_parallel_size, cfg.parallel.sequence_parallel
    cp = cfg.parallel.context_parallel_size
    pp, chunks = cfg.parallel.pipeline_parallel_size, cfg.parallel.virtual_pipeline_size or 1
    first, last = stage == 0, stage == pp - 1
    e = DTYPE_BYTES[cfg.precision.dtype]
    binary_head = model_type == "bert" and cfg.bert.binary_head != "none"
    heads = (model_type, cfg.bert.num_tokentypes, cfg.bert.binary_head != "none")
    ep = cfg.parallel.expert_parallel_size
    stage_params = stage_parameters(m, padded_vocab_size, tp, pp, stage, *heads, chunks, ep)
    params = stage_params.per_gpu
    # The parameters whose fp32 main copy and moments this rank holds: the dense ones sharded
    # over DP x CP, the routed experts over their DP x CP / ep replicas.
    owned = params
    if cfg.parallel.distributed_optimizer:
        dense, experts = stage_params.dense_per_gpu, stage_params.experts_per_gpu
        owned = -(-dense // (dp_size * cp)) + -(-experts // (dp_size * cp // ep))
    b = cfg.training.micro_batch_size
    tokens = m.seq_length // cp * b  # this rank's: two of each sample's 2*cp chunks
    sbh = tokens * m.hidden_size
    head_tokens = tokens
    if model_type == "bert":  # every CP rank's head runs on all b*n slots (others' as dummies)
        head_tokens = b * masked_count(m.seq_length - 3, cfg.bert.masked_lm_prob)

    def seq_split(n: int) -> int:  # what sequence parallelism splits over TP
        return -(-n // tp) if sp else n

    # Outside the layers (the module docstring's terms): the first stage's, then the last's; what
    # sequence parallelism splits first, then the final hidden states, whole, and BERT's heads.
    stats = norm_stats(m)
    layernorm = e * sbh + stats * tokens
    embedding_side = (1 if m.hidden_dropout > 0 else 0) * sbh
    if model_type == "bert" and m.layernorm_position == "post":
        embedding_side += layernorm
    head_side = seq_split(layernorm) if m.layernorm_position == "pre" else 0
    if model_type == "gpt" or binary_head:
        head_side += e * sbh
    if model_type == "bert":
        # MLM head: the dense, GeLU, norm and logit-matmul inputs, the norm statistics
        head_side += 4 * e * head_tokens * m.hidden_size + stats * head_tokens
    if binary_head:
        head_side += e * b * m.hidden_size  # the pooled [CLS], the classifier's input
    # One layer's activations, dense or MoE (``model.moe_layers`` says which layer is which).
    layer = {
        moe: layer_activation_bytes(
            m, b, tp, e, sequence_parallel=sp, context_parallel=cp, moe=moe, expert_parallel=ep
        )
        for moe in set(m.moe_layers) | {False}
    }
    # Ring attention (CP > 1) never materialises the probabilities.
    unfused = layer_activation_bytes(m, b, tp, e, False, sp) if cp == 1 else layer[False]
    layer_input = seq_split(e * sbh)  # what full recomputation keeps
    is_moe = m.moe_layers
    chunk_layers = m.num_layers // (pp * chunks)
    mine = stage_layers(m.num_layers, pp, chunks, stage)  # chunk c: mine[c*n:(c+1)*n]
    moe_layers_held = sum(is_moe[i] for i in mine)
    # RoPE's cos and sin, made once per chunk's forward for its layers
    rope = 2 * e * tokens * int(m.head_dim * m.rotary_percent)
    rope *= m.position_embedding_type == "rope"

    def held(per_layer: dict[bool, int]) -> list[int]:
        """Bytes one micro-batch holds on each of this stage's chunks until its backward, with
        ``per_layer`` bytes in each dense (False) and MoE (True) layer."""
        out = []
        for c in range(chunks):
            indices = mine[c * chunk_layers : (c + 1) * chunk_layers]
            n = sum(per_layer[is_moe[i]] for i in indices) + rope
            n += seq_split(embedding_side) if first and c == 0 else 0
            # The loss chunk ends the micro-batch; every other chunk's schedule keeps its output
            # (the tensor sent on, [s, b, h]) until its backward.
            n += head_side if last and c == chunks - 1 else layer_input
            out.append(n)
        return out

    tied = not m.untie_embeddings_and_output_weights
    units = schedule_units(pp, chunks, cfg.training.global_batch_size // (b * dp_size), stage)
    vocab_local = padded_vocab_size // tp
    return MemoryEstimate(
        weights=e * params,
        main_grads=4 * params,
        main_params=0 if e == 4 else 4 * owned,  # fp32 parameters are their own main copy
        adam_moments=8 * owned,
        embedding_grad=e * vocab_local * m.hidden_size if (first or last) and tied else 0,
        activations_no_recompute=peak_held(units, held(layer)),
        # the inputs, then the working set of the stage's largest layer, rebuilt in backward
        activations_recompute=peak_held(units, held(dict.fromkeys(layer, layer_input)))
        + max(layer[is_moe[i]] for i in mine),
        unfused_attention_extra=unfused - layer[False],
        logits=(e + 4) * head_tokens * vocab_local if last else 0,
        recompute=m.recompute == "full",
        params=stage_params,
        stage=stage,
        in_flight=peak_held(units, [1] * chunks),
        ring_attention=ring_attention_bytes(m, b, tp, e, cp).total,
        expert_bias=4 * m.num_experts * moe_layers_held if m.moe_router_enable_expert_bias else 0,
        moe_dispatch=moe_dispatch_bytes(m, b, e, cp) if moe_layers_held else 0,
    )


def estimate_stages(
    cfg: Config, padded_vocab_size: int, model_type: ModelType = "gpt", dp_size: int = 1
) -> list[MemoryEstimate]:
    """``estimate_memory`` for every pipeline stage, first to last."""
    stages = range(cfg.parallel.pipeline_parallel_size)
    return [estimate_memory(cfg, padded_vocab_size, model_type, dp_size, s) for s in stages]


def worst_stage(
    cfg: Config, padded_vocab_size: int, model_type: ModelType = "gpt", dp_size: int = 1
) -> MemoryEstimate:
    """The stage that needs the most memory as configured (the first, with 1F1B and p > 1)."""
    return max(estimate_stages(cfg, padded_vocab_size, model_type, dp_size), key=lambda e: e.total)


def usable_bytes(gpu_memory_gb: float) -> int:
    """What the estimate may claim of a GPU of ``gpu_memory_gb`` GiB (see RESERVED_FRACTION)."""
    return int(gpu_memory_gb * GIB * (1 - RESERVED_FRACTION))


def fits(total_bytes: int, gpu_memory_gb: float) -> bool:
    """True when ``total_bytes`` leaves the reserved fraction of the GPU free."""
    return total_bytes <= usable_bytes(gpu_memory_gb)


def memory_table(
    cfg: Config, vocab_size: int, world_size: int, gpu_memory_gb: float, tp_sizes: Sequence[int]
) -> str:
    """A Markdown table of the GPT ``cfg``'s per-GPU GiB at each TP size (and the DP size that
    leaves), with and without full recomputation: as is, with the distributed optimizer, with
    sequence parallelism (TP > 1 only) and with both. Bold figures fit a ``gpu_memory_gb`` GPU
    (see ``fits``)."""
    options = {
        "plain": (False, False),
        "distributed optimizer": (True, False),
        "sequence parallel": (False, True),
        "both": (True, True),
    }
    lines = [
        f"| TP x DP | recompute | {' | '.join(options)} |",
        "|---|---|" + "---:|" * len(options),
    ]
    for tp in tp_sizes:
        at_tp = replace(cfg, parallel=replace(cfg.parallel, tensor_parallel_size=tp))
        derived = at_tp.derived(world_size)
        dp, padded = derived.dp_size, derived.padded_vocab_size(vocab_size)
        for recompute in ("full", "none"):
            cells = []
            for distributed, sequence in options.values():
                if sequence and tp == 1:
                    cells.append("-")
                    continue
                parallel = replace(
                    at_tp.parallel, distributed_optimizer=distributed, sequence_parallel=sequence
                )
                changed = replace(
                    cfg, model=replace(cfg.model, recompute=recompute), parallel=parallel
                )
                total = estimate_memory(changed, padded, "gpt", dp).total
                text = f"{total / GIB:.2f}"
                cells.append(f"**{text}**" if fits(total, gpu_memory_gb) else text)
            lines.append(f"| {tp} x {dp} | {recompute} | {' | '.join(cells)} |")
    return "\n".join(lines)
