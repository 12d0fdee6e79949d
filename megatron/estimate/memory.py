"""Parameter count and per-GPU training memory of a config, from formulas (no model is built).

Notation: L layers, h hidden, f ffn hidden, a heads, g query groups (``num_query_groups``,
default a), d head dim (``kv_channels``, default h/a), s sequence, b micro-batch, V padded vocab,
P position rows, t tensor-parallel size, e bytes per element of the model dtype; f' = 2f with
SwiGLU (fc1 holds the gate and up projections), else f; n(x) = 2x for a LayerNorm over x, x for
an RMSNorm. With the defaults (g = a, d = h/a, f' = f, LayerNorm) the formulas are GPT-2's.

**Parameters** (biases, in brackets, with ``add_bias_linear``; QKV's also with ``add_qkv_bias``):

    per layer   split over t:  qkv (a + 2g)d*h [+ (a + 2g)d], dense h*a*d, fc1 f'*h [+ f'], fc2 h*f
                replicated:    dense and fc2 biases [2h], two norms 2n(h), QK norms 2n(d)
    embeddings  word V*h (split by vocab, and the tied LM head), position P*h (learned only,
                replicated)
    final norm  n(h) (pre-LN only; post-LN ends in a layer's own norm)
    output      V*h (split by vocab), with ``untie_embeddings_and_output_weights``
    BERT adds   token types T*h, LM head dense h*h + h, norm n(h), output bias V (split),
                with post-LN the embedding norm n(h) (original BERT's; pre-LN has none),
                and with a binary head (sop/nsp) the pooler h*h + h and the classifier 2h + 2

**Memory** of our implementation, per parameter held by this GPU: e bytes of weights, 4 of
fp32 ``main_grad`` (megatron/parallel/data_parallel.py keeps it for every parameter), 4 of fp32
main copy when the dtype is bf16/fp16 (fp32 parameters are their own main copy), and 8 of Adam
moments: 16 bytes in fp32, 18 in bf16/fp16. The **distributed optimizer**
(``parallel.distributed_optimizer``) keeps the fp32 main copy and the moments of 1/d of the
parameters on each of the d DP ranks, ceil(N/d) of N (its buckets' padding to a multiple of d
adds under d elements per bucket): (4 + 8)/d bytes per parameter, the main copy in fp32 too (a
flat copy of the owned elements); weights and the whole fp32 gradient buffer stay on every rank,
as in Megatron's. With context parallelism d is DP x CP (the CP ranks hold replicas too).

**Activations** per micro-batch start from Korthikanti et al. 2022, "Reducing Activation
Recomputation in Large Transformer Models", eq. 2: with 16-bit activations, 1-byte dropout masks
and f = 4h, one layer stores ``s*b*h*(10 + 24/t + 5*a*s/(h*t))`` bytes (34 + 5as/h at t = 1).
The 10 are replicated (the inputs of both LayerNorms, of QKV and of fc1: 4 tensors; 2 dropout
masks), the 24/t are split by head or by ffn column (q, k, v, the dense input, fc1's output and
GeLU's output: s*b*(4h + 2f) elements), and 5as/(ht) are the attention probabilities, their
dropout mask and the dropped probabilities. Here elements are scaled by e, masks are dropped when
their dropout is 0, and each LayerNorm adds its fp32 mean and rstd (8*s*b). Our attention calls
``scaled_dot_product_attention``, whose fused CUDA kernels (flash on sm80+, memory-efficient
elsewhere) store no probabilities: they keep their output (the dense layer's input, counted
above) and the fp32 log-sum-exp (4*a*s*b/t), and recompute the rest in backward. That is the
figure the fit uses; the 5as/h term (what unfused attention, e.g. the CPU math path with
dropout, would add) is reported apart.
The decoder options change the split terms: q, k, v and the dense input are (a + 2g)d + a*d
elements (the fused QKV output, which v keeps alive, and the dense input), RoPE and QK norms
make q and k new tensors ((a + g)d more; where a rank holds several groups of several heads, q
is a copy, a*d, kept unless RoPE alone reads it), QK norms add their statistics per head, and
SwiGLU keeps fc1's 2f outputs, SiLU's f and the product's f (4f where GeLU keeps 2f). An RMSNorm
keeps its input and an fp32 rstd (4*s*b: the fused kernel torch runs on CUDA). RoPE's cos and
sin (2*e*s*b*rot, rot = d * rotary_percent) are shared by a chunk's layers.
With full recomputation a layer keeps only its input (e*s*b*h, replicated) and backward rebuilds
one layer's working set at a time: L*e*s*b*h + one layer. Outside the layers: the embedding
dropout mask, the final hidden states (the LM head's input; BERT's pooler keeps them through
its [CLS] view, so BERT without a binary head frees them), with pre-LN the final LayerNorm's
input and statistics; for BERT with post-LN the embedding LayerNorm's input and statistics
instead, its MLM head's dense, GeLU, LayerNorm and logit-matmul inputs and LayerNorm statistics,
and the pooled [CLS] (e*b*h).

**Sequence parallelism** (``parallel.sequence_parallel``) splits along the sequence over the t TP
ranks the LayerNorm, dropout and residual activations: in each layer both LayerNorms' inputs,
the dropout masks and the statistics, s*b*h*(2e + masks) + 16*s*b bytes; the layer input that
full recomputation keeps; and outside the layers the embedding dropout mask and the LayerNorm
input and statistics. The inputs of QKV and fc1 (2e*s*b*h) stay whole: the column-parallel
layer all-gathers its input and keeps the gathered copy for its weight gradient (Korthikanti et
al.'s s*b*h*(34/t + 5as/(ht)) assumes it is gathered again in backward instead). So do the
final hidden states: the loss path gathers them for the LM head (and BERT's pooler).

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

**Context parallelism** (``parallel.context_parallel_size`` c > 1) cuts each sample's s tokens
into 2c chunks and gives each CP rank two of them (chunks i and 2c - 1 - i, for causal balance):
s/c tokens. Every term above that counts tokens counts those s/c (with sequence parallelism,
s/(c*t) where it splits): the layers' activations, the layer inputs recomputation keeps, RoPE's
cos and sin, the embedding- and head-side terms, the tensors the pipeline sends and GPT's
logits (BERT's head runs on all b*n masked slots on every CP rank, the other ranks' as dummies).
Ring attention saves what the fused kernel saves (q, k, v, its output and the fp32
log-sum-exp, of the local tokens), so the per-layer count is the fused one at s/c: its output
is laid out [b, s/c, a/t, d] in memory, so the dense layer's input is a view of it. It never
materialises the probabilities (no unfused extra). Its transient buffers, one layer's at a
time and counted once in the total (``ring_attention_bytes``): two K/V messages
[2, b, g/t, s/c, d] in flight, fp32 dK/dV accumulators of that shape, fp32 query-sized buffers
(dq and others) and ``RING_SCORE_BLOCKS`` fp32 score blocks [b, a/t, s/2c, s/2c], which grow as
(s/c)^2 and dominate at long sequences. Weights, gradients and (but for the distributed
optimizer's shards) optimizer state are replicated over CP.

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
from typing import Literal, NamedTuple

from megatron.config.model import ModelConfig
from megatron.config.schema import Config
from megatron.data.bert_dataset import masked_count
from megatron.parallel.pipeline.timeline import peak_held, schedule_units

DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}
GIB = 2**30
# Memory the estimate leaves unclaimed: CUDA context and kernels, NCCL buffers, allocator
# fragmentation and short-lived temporaries the formulas do not list.
RESERVED_FRACTION = 0.10

ModelType = Literal["gpt", "bert"]
# fp32 score blocks [b, a/t, s/2c, s/2c] ring attention's backward holds at its peak: it works
# pair by pair (dropping each pair's before the next), and a pair holds its probabilities p,
# their gradient dp, dp - delta and the scores' gradient ds.
RING_SCORE_BLOCKS = 4


@dataclass(frozen=True)
class ParamCount:
    """Parameters of the whole model at one TP size: split across TP ranks, or whole on each."""

    tp_size: int
    split: int  # held in 1/tp slices, one per TP rank (word embedding padded for this tp)
    replicated: int  # held whole by every TP rank (LayerNorms, row-parallel biases, positions)

    @property
    def total(self) -> int:
        """Every parameter of the model, counted once."""
        return self.split + self.replicated

    @property
    def per_gpu(self) -> int:
        """Parameters one GPU holds: its slice of the split ones and all replicated ones."""
        return self.split // self.tp_size + self.replicated


def _norm(model: ModelConfig, dim: int) -> int:
    """Parameters of one norm over ``dim``: weight and bias (LayerNorm), or weight (RMSNorm)."""
    return 2 * dim if model.normalization == "layernorm" else dim


def _norm_stats(model: ModelConfig) -> int:
    """Bytes a norm keeps per normalised vector: fp32 mean and rstd (LayerNorm), or rstd."""
    return 8 if model.normalization == "layernorm" else 4


def _projections(model: ModelConfig) -> tuple[int, int, int]:
    """Output widths of QKV ((a + 2g)d), of the attention (a*d, the dense input) and of fc1."""
    heads, d = model.num_attention_heads, model.head_dim
    fc1 = 2 * model.ffn_hidden_size if model.activation == "swiglu" else model.ffn_hidden_size
    return (heads + 2 * model.query_groups) * d, heads * d, fc1


def layer_parameters(model: ModelConfig) -> tuple[int, int]:
    """(split over TP, replicated) parameters of one transformer layer."""
    h, f = model.hidden_size, model.ffn_hidden_size
    qkv, attn, fc1 = _projections(model)
    bias = model.add_bias_linear
    split = qkv * h + h * attn + fc1 * h + h * f
    split += (qkv if bias or model.add_qkv_bias else 0) + (fc1 if bias else 0)
    replicated = (2 * h if bias else 0) + 2 * _norm(model, h)
    if model.qk_layernorm:
        replicated += 2 * _norm(model, model.head_dim)
    return split, replicated


def count_parameters(
    model: ModelConfig,
    padded_vocab_size: int,
    tp_size: int,
    model_type: ModelType = "gpt",
    num_tokentypes: int = 2,
    binary_head: bool = True,
) -> ParamCount:
    """The parameters of GPT (or BERT) with this shape; ``model`` must be resolved (ffn set)."""
    return stage_parameters(
        model, padded_vocab_size, tp_size, 1, 0, model_type, num_tokentypes, binary_head
    )


def stage_parameters(
    model: ModelConfig,
    padded_vocab_size: int,
    tp_size: int,
    pp_size: int,
    stage: int,
    model_type: ModelType = "gpt",
    num_tokentypes: int = 2,
    binary_head: bool = True,
) -> ParamCount:
    """The parameters pipeline stage ``stage`` of ``pp_size`` holds (see the module docstring):
    its num_layers / pp layers, the embeddings on the first stage, the final LayerNorm and heads
    on the last, which with pp > 1 holds its own copy of the word embedding for the tied head
    (or the untied output layer, at any pp)."""
    h, v = model.hidden_size, padded_vocab_size
    layers = model.num_layers // pp_size
    first, last = stage == 0, stage == pp_size - 1
    layer_split, layer_replicated = layer_parameters(model)
    split, replicated = layers * layer_split, layers * layer_replicated
    if first:
        split += v * h
        if model.position_embedding_type == "learned":
            replicated += model.max_position_embeddings * h
        if model_type == "bert":
            replicated += num_tokentypes * h
            if model.layernorm_position == "post":
                replicated += _norm(model, h)  # the embedding norm
    if last:
        if pp_size > 1 or model.untie_embeddings_and_output_weights:
            split += v * h  # the tied LM head's own copy of the word embedding, or the untied one
        if model.layernorm_position == "pre":
            replicated += _norm(model, h)
        if model_type == "bert":
            split += v  # the LM head's output bias, split by vocabulary like the logits
            replicated += (h * h + h) + _norm(model, h)
            if binary_head:
                replicated += (h * h + h) + (2 * h + 2)
    return ParamCount(tp_size, split, replicated)


def layer_activation_bytes(
    model: ModelConfig,
    micro_batch_size: int,
    tp_size: int,
    elem_bytes: int,
    fused_attention: bool = True,
    sequence_parallel: bool = False,
    context_parallel: int = 1,
) -> int:
    """Bytes one transformer layer stores for backward (see the module docstring).

    ``fused_attention=False`` gives Korthikanti et al.'s count, with attention probabilities
    (of this rank's queries against the whole sequence); ``sequence_parallel`` splits the
    LayerNorm inputs, dropout masks and statistics over the TP ranks; ``context_parallel`` (c)
    leaves each rank s/c tokens of every sample, so every term counts those.
    """
    s, b, h = model.seq_length // context_parallel, micro_batch_size, model.hidden_size
    f, d = model.ffn_hidden_size, model.head_dim
    a, g = model.num_attention_heads, model.query_groups
    hidden_masks = 2 if model.hidden_dropout > 0 else 0
    stats = _norm_stats(model)
    # The norms' inputs (the residual stream), the dropout masks and the statistics; then
    # the inputs of QKV and fc1, which the column-parallel layers keep whole (gathered).
    sequence_split = s * b * h * (2 * elem_bytes + hidden_masks) + 2 * stats * s * b
    column_inputs = 2 * s * b * h * elem_bytes
    qkv, attn, _ = _projections(model)
    rope = model.position_embedding_type == "rope"
    # q reshaped from several groups is a copy, kept by what reads it unless that is RoPE.
    copied_q = g // tp_size > 1 and a > g and (model.qk_layernorm or not rope)
    kept = qkv + attn + (a + g) * d * (rope or model.qk_layernorm) + a * d * copied_q
    kept += (4 if model.activation == "swiglu" else 2) * f
    split = s * b * kept * elem_bytes
    if model.qk_layernorm:
        split += stats * s * b * (a + g)  # per head of q and k
    if fused_attention:
        split += 4 * a * s * b  # the log-sum-exp; the output is the dense input, counted above
    else:
        dropped = (1 + elem_bytes) if model.attention_dropout > 0 else 0  # mask, dropped copy
        split += a * s * model.seq_length * b * (elem_bytes + dropped)
    if sequence_parallel:
        sequence_split = -(-sequence_split // tp_size)
    return sequence_split + column_inputs + -(-split // tp_size)


class RingBuffers(NamedTuple):
    """Transient bytes of one layer's ring attention at its peak, in backward."""

    kv: int  # 2 K/V messages [2, b, g/t, s/c, d], model dtype: the one in hand, the one arriving
    dkv: int  # fp32 dK/dV accumulators of that shape: 2 at CP 2, else 4
    working: int  # fp32 [b, a/t, s/c, d] buffers (dq, a pair's products, 16-bit q/dout copies)
    scores: int  # RING_SCORE_BLOCKS fp32 blocks [b, a/t, s/2c, s/2c]

    @property
    def total(self) -> int:
        return self.kv + self.dkv + self.working + self.scores


def ring_attention_bytes(
    model: ModelConfig, micro_batch_size: int, tp_size: int, elem_bytes: int, context_parallel: int
) -> RingBuffers:
    """What one layer's ring attention (megatron/parallel/context_parallel.py) holds besides its
    saved tensors, at its peak, the backward, at CP c > 1 (nothing at c = 1).

    A message packs k and v, [2, b, g/t, s/c, d] in the model dtype; two are alive (the block
    computed on and the one arriving). Each block's dK/dV accumulator is fp32 of that shape: the
    rank's own, the one being filled, and from CP 3 on the one being sent and the one being
    received. The fp32 [b, a/t, s/c, d] buffers: dq, one pair's two matmul products (one in all)
    and, with a 16-bit dtype, q's and dout's fp32 copies; plus delta, fp32 [b, a/t, s/c]. The
    scores: ``RING_SCORE_BLOCKS`` fp32 blocks [b, a/t, s/2c, s/2c].
    """
    if context_parallel == 1:
        return RingBuffers(0, 0, 0, 0)
    s, b, d = model.seq_length // context_parallel, micro_batch_size, model.head_dim
    heads = model.num_attention_heads // tp_size
    message = 2 * b * (model.query_groups // tp_size) * s * d
    accumulators = 2 if context_parallel == 2 else 4
    queries = 2 + 2 * (elem_bytes != 4)
    working = 4 * b * heads * s * (queries * d + 1)
    scores = RING_SCORE_BLOCKS * 4 * b * heads * (s // 2) ** 2
    return RingBuffers(2 * message * elem_bytes, accumulators * message * 4, working, scores)


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
    # CP > 1: ring attention's K/V messages, dK/dV accumulators and scores, one layer's, transient
    ring_attention: int = 0

    @property
    def states(self) -> int:
        """Weights, gradients and optimizer state: the bytes that stay for the whole run."""
        return self.weights + self.main_grads + self.main_params + self.adam_moments

    def total_with(self, recompute: bool) -> int:
        """Peak bytes with or without full activation recomputation."""
        activations = self.activations_recompute if recompute else self.activations_no_recompute
        return self.states + self.embedding_grad + activations + self.logits + self.ring_attention

    @property
    def total(self) -> int:
        """Peak bytes as configured."""
        return self.total_with(self.recompute)


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
    stage_params = stage_parameters(m, padded_vocab_size, tp, pp, stage, *heads)
    params = stage_params.per_gpu
    # The parameters whose fp32 main copy and moments this rank holds (sharded over DP x CP).
    owned = -(-params // (dp_size * cp)) if cfg.parallel.distributed_optimizer else params
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
    stats = _norm_stats(m)
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
    layer = layer_activation_bytes(m, b, tp, e, sequence_parallel=sp, context_parallel=cp)
    # Ring attention (CP > 1) never materialises the probabilities.
    unfused = layer_activation_bytes(m, b, tp, e, False, sp) if cp == 1 else layer
    layer_input = seq_split(e * sbh)  # what full recomputation keeps
    chunk_layers = m.num_layers // (pp * chunks)
    # RoPE's cos and sin, made once per chunk's forward for its layers
    rope = 2 * e * tokens * int(m.head_dim * m.rotary_percent)
    rope *= m.position_embedding_type == "rope"

    def held(per_layer: int) -> list[int]:
        """Bytes one micro-batch holds on each of this stage's chunks until its backward."""
        out = []
        for c in range(chunks):
            n = chunk_layers * per_layer + rope
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
        activations_recompute=peak_held(units, held(layer_input)) + layer,
        unfused_attention_extra=unfused - layer,
        logits=(e + 4) * head_tokens * vocab_local if last else 0,
        recompute=m.recompute == "full",
        params=stage_params,
        stage=stage,
        in_flight=peak_held(units, [1] * chunks),
        ring_attention=ring_attention_bytes(m, b, tp, e, cp).total,
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
