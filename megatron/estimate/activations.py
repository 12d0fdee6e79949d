"""Activations a transformer layer keeps for backward, per micro-batch, from formulas.

Notation as in megatron/estimate/parameters.py, plus s sequence, b micro-batch, e bytes per
element of the model dtype, and for a mixture of experts T = b*s tokens (s/c under context
parallelism) and k = ``moe_router_topk``.

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


**Mixture of experts.** An MoE layer (``model.moe_layers``) keeps, instead of the dense MLP's
fc1 output and activation (its input, the norm's output, is counted as fc1's above: the router
and the shared expert read it, gathered whole as fc1's is), per routed token (T/t tokens under
sequence parallelism, which routes each rank's own): the router's fp32 scores (E; the logits, E
more, with the z-loss), the top-k choices (int64, k) and, when the weights are renormalised, the
top-k scores and their sum (k + 1, fp32; sigmoid scores with the auxiliary loss: their sum
over the experts too; under SP the router's input h and the shared gate's sigmoid, whose
gathered copies the shared expert keeps); and
for the T tokens of the whole sequence, on every TP rank (each routes the same tokens; the
experts are split along f_e): the routing weights [T, k] in fp32 (and, with a 16-bit dtype, the
cast copy the combination multiplies by), the int64 permutation and its token rows (2*8*T*k),
the permuted token rows (fc1's input), fc2's output rows and their unpermuted copy (which the
weights multiply), 3*e*T*k*h, and the experts' SwiGLU terms as the dense MLP's, T*k*4f_e/t
elements (2f_e/t with GeLU). The shared expert keeps what a dense MLP of width fs keeps
(T*4fs/t), and with its gate the sigmoid [T, 1] and its own output [T, h], which the gate
multiplies. Dropless routing sends T*k rows through the experts (a capacity factor bounds it by
the sum of the experts' capacities: the estimate counts T*k, the most). ``moe_dispatch_bytes``
gives the transient buffers of one layer's dispatch (two [T*k, h] tensors at once), counted once
in the total.

With **expert parallelism** (ep > 1, megatron/parallel/experts.py) a rank sends its T*k rows to
the EP ranks holding their experts and gets back the rows of its E/ep experts from every EP rank.
The estimate assumes balanced routing: each rank receives T*k rows (the expert-side terms are
linear in the rows received, so summed over an EP group they are exact whatever the balance).
The all-to-alls save nothing, so the permuted rows are no longer kept; the layer keeps instead
the received rows regrouped by local expert (fc1's input), fc2's output rows (the source of the
copy back into arrival order), the rows returned and their unpermuted copy: 4*e*T*k*h; the
experts' SwiGLU terms over the T*k received rows as above; one more int64 permutation [T*k] (the
regrouping) and the grouped GEMMs' offsets of E/ep experts. The dispatch's transient peak is two
[T*k, h] tensors as without EP (the rows sent beside the rows received, and back).

**Sequence parallelism** (``parallel.sequence_parallel``) splits along the sequence over the t TP
ranks the LayerNorm, dropout and residual activations: in each layer both LayerNorms' inputs,
the dropout masks and the statistics, s*b*h*(2e + masks) + 16*s*b bytes; the layer input that
full recomputation keeps; and outside the layers the embedding dropout mask and the LayerNorm
input and statistics. The inputs of QKV and fc1 (2e*s*b*h) stay whole: the column-parallel
layer all-gathers its input and keeps the gathered copy for its weight gradient (Korthikanti et
al.'s s*b*h*(34/t + 5as/(ht)) assumes it is gathered again in backward instead). So do the
final hidden states: the loss path gathers them for the LM head (and BERT's pooler).


**Context parallelism** (``parallel.context_parallel_size`` c > 1) cuts each sample's s tokens
into 2c chunks and gives each CP rank two of them (chunks i and 2c - 1 - i, for causal balance):
s/c tokens. Every term above that counts tokens counts those s/c (with sequence parallelism,
s/(c*t) where it splits): the layers' activations, the layer inputs recomputation keeps, RoPE's
cos and sin, the embedding- and head-side terms, the tensors the pipeline sends and GPT's
logits (BERT's head runs on all b*n masked slots on every CP rank, the other ranks' as dummies).
Ring attention saves what the fused kernel saves (q, k, v, its output and the fp32
log-sum-exp, of the local tokens), so the per-layer count is the fused one at s/c: its output
is laid out [b, s/c, a/t, d] in memory, so the dense layer's input is a view of it. It never
materialises the probabilities or any score block (each pair of chunks runs a fused kernel).
Its transient buffers, one layer's at a time and counted once in the total
(``ring_attention_bytes``): two K/V messages [2, b, g/t, s/c, d] in flight, fp32 dK/dV
accumulators of that shape, the fp32 dq [b, a/t, s/c, d] and row statistics, and one pair's
kernel outputs (and CUDA's fp32 per-head k/v copies): all linear in s/c.
Weights, gradients and (but for the distributed
optimizer's shards) optimizer state are replicated over CP.
"""

from __future__ import annotations

from typing import NamedTuple

from megatron.config.model import ModelConfig
from megatron.estimate.parameters import fc1_width, projections


def norm_stats(model: ModelConfig) -> int:
    """Bytes a norm keeps per normalised vector: fp32 mean and rstd (LayerNorm), or rstd."""
    return 8 if model.normalization == "layernorm" else 4


def layer_activation_bytes(
    model: ModelConfig,
    micro_batch_size: int,
    tp_size: int,
    elem_bytes: int,
    fused_attention: bool = True,
    sequence_parallel: bool = False,
    context_parallel: int = 1,
    moe: bool = False,
    expert_parallel: int = 1,
) -> int:
    """Bytes one transformer layer stores for backward (see the module docstring).

    ``fused_attention=False`` gives Korthikanti et al.'s count, with attention probabilities
    (of this rank's queries against the whole sequence); ``sequence_parallel`` splits the
    LayerNorm inputs, dropout masks and statistics over the TP ranks; ``context_parallel`` (c)
    leaves each rank s/c tokens of every sample, so every term counts those; ``moe``: a layer
    whose MLP is the mixture of experts (``moe_activation_bytes`` in place of the dense MLP's),
    its experts split over ``expert_parallel`` EP ranks.
    """
    s, b, h = model.seq_length // context_parallel, micro_batch_size, model.hidden_size
    f, d = model.ffn_hidden_size, model.head_dim
    a, g = model.num_attention_heads, model.query_groups
    hidden_masks = 2 if model.hidden_dropout > 0 else 0
    stats = norm_stats(model)
    # The norms' inputs (the residual stream), the dropout masks and the statistics; then
    # the inputs of QKV and fc1, which the column-parallel layers keep whole (gathered).
    sequence_split = s * b * h * (2 * elem_bytes + hidden_masks) + 2 * stats * s * b
    # An MoE layer under SP keeps its router's input, the norm's output, where the tokens are;
    # the gathered copy only a shared expert reads (the token rows' permutation keeps none).
    fc1_input = not (moe and sequence_parallel) or model.moe_shared_expert_intermediate_size
    column_inputs = (1 + bool(fc1_input)) * s * b * h * elem_bytes
    qkv, attn, _ = projections(model)
    rope = model.position_embedding_type == "rope"
    # q reshaped from several groups is a copy, kept by what reads it unless that is RoPE.
    copied_q = g // tp_size > 1 and a > g and (model.qk_layernorm or not rope)
    kept = qkv + attn + (a + g) * d * (rope or model.qk_layernorm) + a * d * copied_q
    kept += 0 if moe else mlp_kept(model, f)
    split = s * b * kept * elem_bytes
    if model.qk_layernorm:
        split += stats * s * b * (a + g)  # per head of q and k
    if fused_attention:
        split += 4 * a * s * b  # the log-sum-exp; the output is the dense input, counted above
    else:
        dropped = (1 + elem_bytes) if model.attention_dropout > 0 else 0  # mask, dropped copy
        split += a * s * model.seq_length * b * (elem_bytes + dropped)
    whole = 0
    if moe:
        routed, experts, whole = moe_activation_bytes(
            model, s * b, elem_bytes, expert_parallel, b, sequence_parallel
        )
        sequence_split, split = sequence_split + routed, split + experts
    if sequence_parallel:
        sequence_split = -(-sequence_split // tp_size)
    return sequence_split + column_inputs + whole + -(-split // tp_size)


def mlp_kept(model: ModelConfig, width: int) -> int:
    """Elements per token an MLP of inner ``width`` keeps past its input, split over TP: fc1's
    output, SiLU's and the product (SwiGLU: 2w + w + w), or fc1's and GeLU's (w + w)."""
    return fc1_width(model, width) + 2 * width if model.activation == "swiglu" else 2 * width


def moe_activation_bytes(
    model: ModelConfig,
    tokens: int,
    elem_bytes: int,
    expert_parallel: int = 1,
    sequences: int = 1,
    sequence_parallel: bool = False,
) -> tuple[int, int, int]:
    """(routed where the tokens are, split over TP, whole) bytes one MoE layer keeps for backward
    in place of the dense MLP's, for ``tokens`` T (this rank's b*s/c of ``sequences`` b), its
    experts split over ``expert_parallel`` EP ranks (balanced: T*k rows received): see the module
    docstring.

    The first term is what sequence parallelism splits (each rank routes its T/t tokens); the
    experts' and the shared expert's inner activations are split along their widths; the token
    rows, the routing weights the combination multiplies by and the indices are whole on every
    TP rank (gathered under sequence parallelism).
    """
    h, e, k, experts = model.hidden_size, elem_bytes, model.moe_router_topk, model.num_experts
    rows = tokens * k  # dropless: every token's k choices (with EP, balanced: as many received)
    # fp32 scores [T, E] (softmax or sigmoid output), with the z-loss the logits [T, E] and
    # their logsumexp [T] too;
    # the top-k choices [T, k] (int64); renormalised: the top-k scores [T, k] and their sum;
    # sigmoid with the auxiliary loss: the scores' sum [T, 1] (without it the probabilities
    # feed no loss, so autograd drops the division).
    routed = 4 * experts + 8 * k + (4 * experts + 4 if model.moe_z_loss_coeff > 0 else 0)
    softmax = model.moe_router_score_function == "softmax"
    if (not model.moe_router_pre_softmax) if softmax else k > 1:
        routed += 4 * k + 4
    if not softmax and model.moe_aux_loss_coeff > 0:
        routed += 4  # the sum of the sigmoid scores, which divides them into probabilities
    split = rows * mlp_kept(model, model.expert_ffn_hidden_size) * e
    # the permuted rows, fc2's output rows and their unpermuted copy [T*k, h] (the index_copy
    # keeps its source); the weights [T, k] in fp32 and, 16-bit, the copy the product keeps;
    # int64 [T*k]: the permutation and its token rows; int32 [E]: the grouped GEMMs' offsets
    whole = (
        3 * rows * h * e + 4 * rows + (e * rows if e != 4 else 0) + 2 * 8 * rows + 2 * 4 * experts
    )
    if expert_parallel > 1:
        # the permuted rows go into the all-to-all, which keeps nothing: fc1's input is instead
        # the received rows regrouped by local expert, and the rows returned [T*k, h] are kept
        # too (the unpermute's source); int64 [T*k]: the regrouping; offsets of E/ep experts
        local = experts // expert_parallel
        whole += rows * h * e + 8 * rows - 2 * 4 * (experts - local)
    if sequence_parallel:
        # the router's input [T/t, h] (the column-parallel inputs count the gathered one), and
        # with the gate its sigmoid [T/t, 1] beside the gathered one the product keeps
        routed += e * (h + int(model.moe_shared_expert_gate))
    if model.moe_aux_loss_coeff > 0:
        # the fp32 expert counts the loss multiplies the probabilities by: [E], per sequence
        # [b, E]; that one under SP a view of the all-reduced [b*E probability sums, z, counts]
        per_sequence = model.moe_router_load_balancing_type == "seq_aux_loss"
        counts = 4 * experts * (sequences if per_sequence else 1)
        whole += 2 * counts + 4 if per_sequence and sequence_parallel else counts
    shared = model.moe_shared_expert_intermediate_size
    if shared is not None:
        split += tokens * mlp_kept(model, shared) * e
        if model.moe_shared_expert_gate:
            whole += e * tokens * (h + 1)  # the shared output and the sigmoid, multiplied
    return tokens * routed, split, whole


def moe_dispatch_bytes(
    model: ModelConfig,
    micro_batch_size: int,
    elem_bytes: int,
    context_parallel: int = 1,
) -> int:
    """Transient bytes of one MoE layer's dispatch at its peak (0 for a dense model): two
    [T*k, h] tensors in the model dtype at once (forward: the weighted outputs before the sum
    over k beside the unpermuted ones; backward: the gradients of the unpermuted and of the
    permuted rows), T = b*s/c tokens, whole on every TP rank. With expert parallelism the same
    two at balanced routing (the rows sent beside the T*k received, and their way back)."""
    if not any(model.moe_layers):
        return 0
    tokens = micro_batch_size * model.seq_length // context_parallel
    return 2 * tokens * model.moe_router_topk * model.hidden_size * elem_bytes


class RingBuffers(NamedTuple):
    """Transient bytes of one layer's ring attention at its peak, in backward."""

    kv: int  # 2 K/V messages [2, b, g/t, s/c, d], model dtype: the one in hand, the one arriving
    dkv: int  # fp32 dK/dV accumulators of that shape: 2 at CP 2, else 4
    working: int  # fp32 dq [b, a/t, s/c, d] and fp32 row statistics [b, a/t, s/2c]
    pair: int  # one pair's kernel call: its dq, dk, dv (model dtype), CUDA's per-head k/v copies
    kernel: int = 0  # the backward kernel's private workspace, where measured (CPU)

    @property
    def total(self) -> int:
        return self.kv + self.dkv + self.working + self.pair + self.kernel


# The CPU flash kernel's backward workspace beyond a q-sized block in the model dtype: per-thread
# tiles, measured (resident set, one thread) at 1.0 MiB in fp32 and 1.6 MiB in bf16, for pairs
# of 1024 to 4096 rows, 4 to 8 heads, head_dim 64 and 128.
CPU_KERNEL_TILES = {4: 1 << 20, 2: 1677722}


def ring_attention_bytes(
    model: ModelConfig,
    micro_batch_size: int,
    tp_size: int,
    elem_bytes: int,
    context_parallel: int,
    device: str = "cuda",
) -> RingBuffers:
    """What one layer's ring attention (megatron/parallel/context_parallel.py) holds besides its
    saved tensors, at its peak, the backward, at CP c > 1 (nothing at c = 1), on ``device``'s
    kernel (megatron/parallel/attention_kernels.py). No term grows as (s/c)^2: every pair runs a
    fused kernel that tiles its scores.

    A message packs k and v, [2, b, g/t, s/c, d] in the model dtype; two are alive (the block
    computed on and the one arriving). Each block's dK/dV accumulator is fp32 of that shape: the
    rank's own, the one being filled, and from CP 3 on the one being sent and the one being
    received. Working: the fp32 dq accumulator [b, a/t, s/c, d] and fp32 row statistics [b,
    a/t, s/2c] (the lse rows handed to the kernel and the kernel's own: two measured on CPU in
    fp32, four with a 16-bit dtype; CUDA's padded lse counted as four). One pair's call: its dq
    [b, a/t, s/2c, d] and its dk, dv [b, g/t, s/2c, d] in the model dtype; on CUDA in fp32,
    where the memory-efficient kernel reads k and v per head, the per-head copies of k and v and
    the per-head dk, dv before they are summed to groups, four [b, s/2c, a/t, d] (unless g = a;
    CUDA's flash kernel, for 16-bit dtypes, reads the groups as they are).
    The backward kernel's private workspace, which no tensor shows: on CPU, measured, a block
    of the pair's q size [b, a/t, s/2c, d] in the model dtype plus ``CPU_KERNEL_TILES`` (one
    thread); on CUDA not measured here and not counted.
    """
    if context_parallel == 1:
        return RingBuffers(0, 0, 0, 0)
    s, b, d = model.seq_length // context_parallel, micro_batch_size, model.head_dim
    heads, groups = model.num_attention_heads // tp_size, model.query_groups // tp_size
    message = 2 * b * groups * s * d
    accumulators = 2 if context_parallel == 2 else 4
    rows = 2 if elem_bytes == 4 and device == "cpu" else 4
    working = 4 * b * heads * (s * d + rows * (s // 2))
    per_head = 4 * heads if device == "cuda" and elem_bytes == 4 and groups != heads else 0
    pair = elem_bytes * b * (s // 2) * d * (heads + 2 * groups + per_head)
    kernel = 0
    if device == "cpu":
        kernel = elem_bytes * b * heads * (s // 2) * d + CPU_KERNEL_TILES.get(elem_bytes, 1 << 20)
    return RingBuffers(2 * message * elem_bytes, accumulators * message * 4, working, pair, kernel)
