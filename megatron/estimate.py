"""Parameter count and per-GPU training memory of a config, from formulas (no model is built).

Notation: L layers, h hidden, f ffn hidden, a heads, s sequence, b micro-batch, V padded vocab,
P position rows, t tensor-parallel size, e bytes per element of the model dtype.

**Parameters** (every matrix of ``megatron/models`` has a bias):

    per layer   split over t:  qkv 3h*h + 3h, dense h*h, fc1 f*h + f, fc2 h*f
                replicated:    dense bias h, fc2 bias h, two LayerNorms 4h        (= 6h)
    embeddings  word V*h (split by vocab, and the tied LM head), position P*h (replicated)
    final LN    2h (pre-LN only; post-LN ends in a layer's own LayerNorm)
    BERT adds   token types T*h, LM head dense h*h + h, LN 2h, output bias V (split),
                with post-LN the embedding LayerNorm 2h (original BERT's; pre-LN has none),
                and with a binary head (sop/nsp) the pooler h*h + h and the classifier 2h + 2

**Memory** of our implementation, per parameter held by this GPU: e bytes of weights, 4 of
fp32 ``main_grad`` (megatron/parallel/data_parallel.py keeps it for every parameter), 4 of fp32
main copy when the dtype is bf16/fp16 (fp32 parameters are their own main copy), and 8 of Adam
moments: 16 bytes in fp32, 18 in bf16/fp16.

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
With full recomputation a layer keeps only its input (e*s*b*h, replicated) and backward rebuilds
one layer's working set at a time: L*e*s*b*h + one layer. Outside the layers: the embedding
dropout mask, the final hidden states (the LM head's input; BERT's pooler keeps them through
its [CLS] view, so BERT without a binary head frees them), with pre-LN the final LayerNorm's
input and statistics; for BERT with post-LN the embedding LayerNorm's input and statistics
instead, its MLM head's dense, GeLU, LayerNorm and logit-matmul inputs and LayerNorm statistics,
and the pooled [CLS] (e*b*h).

**Head tokens**: GPT's LM head sees all b*s tokens; BERT's runs on the masked ones only,
b*n with n = masked_count(s - 3) (every token but [CLS] and two [SEP] maskable: the most a
sample masks), so its head terms and its logits scale with b*n instead.

**Logits and loss**: the LM head's [tokens, V/t] logits in the model dtype and the vocab-parallel
cross entropy's fp32 copy (reused for the softmax and the gradient) are alive together:
(e + 4)*tokens*V/t. The tied embedding's ``.grad`` (e*V*h/t) lives from the LM head's backward
until the embedding's, before the hook moves it into ``main_grad``.

FLOPs come from megatron/flops.py.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from megatron.config import Config, ModelConfig
from megatron.data.bert_dataset import masked_count

DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}
GIB = 2**30
# Memory the estimate leaves unclaimed: CUDA context and kernels, NCCL buffers, allocator
# fragmentation and short-lived temporaries the formulas do not list.
RESERVED_FRACTION = 0.10

ModelType = Literal["gpt", "bert"]


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


def count_parameters(
    model: ModelConfig,
    padded_vocab_size: int,
    tp_size: int,
    model_type: ModelType = "gpt",
    num_tokentypes: int = 2,
    binary_head: bool = True,
) -> ParamCount:
    """The parameters of GPT (or BERT) with this shape; ``model`` must be resolved (ffn set)."""
    h, f, v = model.hidden_size, model.ffn_hidden_size, padded_vocab_size
    layer_split = (3 * h * h + 3 * h) + h * h + (f * h + f) + h * f
    layer_replicated = 6 * h
    split = model.num_layers * layer_split + v * h
    replicated = model.num_layers * layer_replicated + model.max_position_embeddings * h
    if model.layernorm_position == "pre":
        replicated += 2 * h
    if model_type == "bert":
        split += v  # the LM head's output bias, split by vocabulary like the logits
        replicated += num_tokentypes * h + (h * h + h) + 2 * h
        if model.layernorm_position == "post":
            replicated += 2 * h  # the embedding LayerNorm
        if binary_head:
            replicated += (h * h + h) + (2 * h + 2)
    return ParamCount(tp_size, split, replicated)


def layer_activation_bytes(
    model: ModelConfig,
    micro_batch_size: int,
    tp_size: int,
    elem_bytes: int,
    fused_attention: bool = True,
) -> int:
    """Bytes one transformer layer stores for backward (see the module docstring).

    ``fused_attention=False`` gives Korthikanti et al.'s count, with attention probabilities.
    """
    s, b, h, f, a = (
        model.seq_length,
        micro_batch_size,
        model.hidden_size,
        model.ffn_hidden_size,
        model.num_attention_heads,
    )
    hidden_masks = 2 if model.hidden_dropout > 0 else 0
    layernorm_stats = 2 * 8 * s * b  # fp32 mean and rstd of two LayerNorms
    replicated = s * b * h * (4 * elem_bytes + hidden_masks) + layernorm_stats
    split = s * b * (4 * h + 2 * f) * elem_bytes
    if fused_attention:
        split += 4 * a * s * b  # the log-sum-exp; the output is the dense input, counted above
    else:
        dropped = (1 + elem_bytes) if model.attention_dropout > 0 else 0  # mask, dropped copy
        split += a * s * s * b * (elem_bytes + dropped)
    return replicated + -(-split // tp_size)


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes on one GPU at the peak of a training step (the backward of a micro-batch)."""

    weights: int
    main_grads: int  # fp32 main_grad buffer of the data-parallel wrapper
    main_params: int  # fp32 copies for bf16/fp16 parameters; 0 in fp32
    adam_moments: int  # exp_avg and exp_avg_sq, fp32
    embedding_grad: int  # the tied word embedding's .grad in the model dtype during backward
    activations_no_recompute: int
    activations_recompute: int
    unfused_attention_extra: int  # what materialised attention probabilities would add, per layer
    logits: int  # logits and cross-entropy buffers of one micro-batch
    recompute: bool  # whether the config recomputes (which activation figure counts)

    @property
    def states(self) -> int:
        """Weights, gradients and optimizer state: the bytes that stay for the whole run."""
        return self.weights + self.main_grads + self.main_params + self.adam_moments

    def total_with(self, recompute: bool) -> int:
        """Peak bytes with or without full activation recomputation."""
        activations = self.activations_recompute if recompute else self.activations_no_recompute
        return self.states + self.embedding_grad + activations + self.logits

    @property
    def total(self) -> int:
        """Peak bytes as configured."""
        return self.total_with(self.recompute)


def estimate_memory(
    cfg: Config, padded_vocab_size: int, model_type: ModelType = "gpt"
) -> MemoryEstimate:
    """Per-GPU memory of training ``cfg`` (see the module docstring for every term)."""
    m, tp = cfg.model, cfg.parallel.tensor_parallel_size
    e = DTYPE_BYTES[cfg.precision.dtype]
    params = count_parameters(
        m,
        padded_vocab_size,
        tp,
        model_type,
        cfg.bert.num_tokentypes,
        cfg.bert.binary_head != "none",
    ).per_gpu
    b = cfg.training.micro_batch_size
    sbh = m.seq_length * b * m.hidden_size
    tokens = m.seq_length * b
    head_tokens = tokens
    if model_type == "bert":
        head_tokens = b * masked_count(m.seq_length - 3, cfg.bert.masked_lm_prob)
    binary_head = model_type == "bert" and cfg.bert.binary_head != "none"
    # The embedding dropout mask and the final hidden states (GPT's LM head input; BERT's pooler
    # keeps them alive through its [CLS] view); pre-LN adds the final LayerNorm's input and
    # statistics (GPT's post-LN ends in a layer's own LayerNorm; BERT's post-LN starts with the
    # embedding LayerNorm, as big).
    outside_layers = (1 if m.hidden_dropout > 0 else 0) * sbh
    if model_type == "gpt" or binary_head:
        outside_layers += e * sbh
    if m.layernorm_position == "pre" or model_type == "bert":
        outside_layers += e * sbh + 8 * tokens
    if model_type == "bert":
        # MLM head: the dense, GeLU, LayerNorm and logit-matmul inputs, the LayerNorm statistics
        outside_layers += 4 * e * head_tokens * m.hidden_size + 8 * head_tokens
    if binary_head:
        outside_layers += e * b * m.hidden_size  # the pooled [CLS], the classifier's input
    layer = layer_activation_bytes(m, cfg.training.micro_batch_size, tp, e)
    unfused = layer_activation_bytes(m, cfg.training.micro_batch_size, tp, e, False)
    vocab_local = padded_vocab_size // tp
    return MemoryEstimate(
        weights=e * params,
        main_grads=4 * params,
        main_params=4 * params if e != 4 else 0,
        adam_moments=8 * params,
        embedding_grad=e * vocab_local * m.hidden_size,
        activations_no_recompute=m.num_layers * layer + outside_layers,
        activations_recompute=m.num_layers * e * sbh + layer + outside_layers,
        unfused_attention_extra=unfused - layer,
        logits=(e + 4) * head_tokens * vocab_local,
        recompute=m.recompute == "full",
    )


def usable_bytes(gpu_memory_gb: float) -> int:
    """What the estimate may claim of a GPU of ``gpu_memory_gb`` GiB (see RESERVED_FRACTION)."""
    return int(gpu_memory_gb * GIB * (1 - RESERVED_FRACTION))


def fits(total_bytes: int, gpu_memory_gb: float) -> bool:
    """True when ``total_bytes`` leaves the reserved fraction of the GPU free."""
    return total_bytes <= usable_bytes(gpu_memory_gb)
