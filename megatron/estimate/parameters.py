"""Parameter count of a config, whole and per pipeline stage, from formulas (no model is built).

Notation: L layers, h hidden, f ffn hidden, a heads, g query groups (``num_query_groups``,
default a), d head dim (``kv_channels``, default h/a), V padded vocab, P position rows, t
tensor-parallel size; f' = 2f with SwiGLU (fc1 holds the gate and up projections), else f;
n(x) = 2x for a LayerNorm over x, x for an RMSNorm. With the defaults (g = a, d = h/a, f' = f,
LayerNorm) the formulas are GPT-2's. Mixture of experts: E routed experts (``num_experts``) of
width f_e (``expert_ffn_hidden_size``), top k (``moe_router_topk``), a shared expert of width fs
(``moe_shared_expert_intermediate_size``), f_e' and fs' doubled with SwiGLU as f' is.

**Parameters** (biases, in brackets, with ``add_bias_linear``; QKV's also with ``add_qkv_bias``):

    per layer   split over t:  qkv (a + 2g)d*h [+ (a + 2g)d], dense h*a*d, fc1 f'*h [+ f'], fc2 h*f
                replicated:    dense and fc2 biases [2h], two norms 2n(h), QK norms 2n(d)
    MoE layer   (``model.moe_layers``) instead of fc1 and fc2: routed experts E*(f_e' + f_e)*h and
                the shared expert (fs' + fs)*h, split over t along f_e and fs (no biases);
                replicated: the router E*h and the shared expert's gate h
                (``moe_shared_expert_gate``)
    embeddings  word V*h (split by vocab, and the tied LM head), position P*h (learned only,
                replicated)
    final norm  n(h) (pre-LN only; post-LN ends in a layer's own norm)
    output      V*h (split by vocab), with ``untie_embeddings_and_output_weights``
    BERT adds   token types T*h, LM head dense h*h + h, norm n(h), output bias V (split),
                with post-LN the embedding norm n(h) (original BERT's; pre-LN has none),
                and with a binary head (sop/nsp) the pooler h*h + h and the classifier 2h + 2

**Active parameters** are those one token's forward multiplies: all of them but, in each MoE
layer, the E - k routed experts it is not sent to, (E - k)*(f_e' + f_e)*h. The router counts
whole (every token scores every expert), and so does the vocabulary (embedding and output
layer), as Mixtral's and Qwen's published "active" figures count them.

**Expert parallelism** (``parallel.expert_parallel_size`` ep) splits each MoE layer's routed
experts over ep of the DP x CP ranks: a GPU holds E/ep of them (and of those its 1/t TP slice),
everything else as without EP (router, shared expert, attention, norms, embeddings).

The router's ``expert_bias`` (``moe_router_enable_expert_bias``: fp32 [E] per MoE layer) is a
buffer, not a parameter: megatron/estimate/memory.py counts its bytes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from megatron.config.model import ModelConfig

ModelType = Literal["gpt", "bert"]


@dataclass(frozen=True)
class ParamCount:
    """Parameters of the whole model (or a stage) at one TP (and EP) size: split across TP
    ranks, or whole on each; ``inactive`` of them (routed experts) a token's forward skips;
    ``experts`` of the split ones (the routed experts) also split over the ``ep_size`` EP ranks."""

    tp_size: int
    split: int  # held in 1/tp slices, one per TP rank (word embedding padded for this tp)
    replicated: int  # held whole by every TP rank (norms, row-parallel biases, positions, router)
    inactive: int = 0  # per MoE layer, the E - k routed experts a token is not sent to
    experts: int = 0  # the routed experts' (part of ``split``): E*(f_e' + f_e)*h per MoE layer
    ep_size: int = 1  # EP ranks the routed experts are split over (E/ep each)

    @property
    def total(self) -> int:
        """Every parameter of the model, counted once."""
        return self.split + self.replicated

    @property
    def active(self) -> int:
        """The parameters one token's forward uses (``total`` for a dense model)."""
        return self.total - self.inactive

    @property
    def experts_per_gpu(self) -> int:
        """Routed-expert parameters one GPU holds: its TP slice of its E/ep experts."""
        return self.experts // (self.tp_size * self.ep_size)

    @property
    def per_gpu(self) -> int:
        """Parameters one GPU holds: its slice of the split ones (of the routed experts, of its
        E/ep) and all replicated ones."""
        dense_split = (self.split - self.experts) // self.tp_size
        return dense_split + self.experts_per_gpu + self.replicated

    @property
    def dense_per_gpu(self) -> int:
        """``per_gpu`` less the routed experts: the parameters replicated over all DP x CP."""
        return self.per_gpu - self.experts_per_gpu


def norm_parameters(model: ModelConfig, dim: int) -> int:
    """Parameters of one norm over ``dim``: weight and bias (LayerNorm), or weight (RMSNorm)."""
    return 2 * dim if model.normalization == "layernorm" else dim


def projections(model: ModelConfig) -> tuple[int, int, int]:
    """Output widths of QKV ((a + 2g)d), of the attention (a*d, the dense input) and of fc1."""
    heads, d = model.num_attention_heads, model.head_dim
    return (heads + 2 * model.query_groups) * d, heads * d, fc1_width(model, model.ffn_hidden_size)


def fc1_width(model: ModelConfig, width: int) -> int:
    """fc1's output width for an MLP of inner ``width``: 2*width with SwiGLU, else width."""
    return 2 * width if model.activation == "swiglu" else width


def expert_parameters(model: ModelConfig) -> int:
    """One routed expert's matrices: fc1 f_e'*h and fc2 h*f_e (no biases)."""
    f_e = model.expert_ffn_hidden_size
    return (fc1_width(model, f_e) + f_e) * model.hidden_size


def layer_parameters(model: ModelConfig, moe: bool = False) -> tuple[int, int]:
    """(split over TP, replicated) parameters of one transformer layer; ``moe``: one whose MLP
    is the mixture of experts (router, routed experts, shared expert and its gate)."""
    h, f = model.hidden_size, model.ffn_hidden_size
    qkv, attn, fc1 = projections(model)
    bias = model.add_bias_linear
    split = qkv * h + h * attn + (qkv if bias or model.add_qkv_bias else 0)
    replicated = (h if bias else 0) + 2 * norm_parameters(model, h)  # the dense layer's bias
    if moe:
        split += model.num_experts * expert_parameters(model)
        replicated += model.num_experts * h  # the router
        shared = model.moe_shared_expert_intermediate_size
        if shared is not None:
            split += (fc1_width(model, shared) + shared) * h
            replicated += h if model.moe_shared_expert_gate else 0
    else:
        split += fc1 * h + h * f + (fc1 if bias else 0)
        replicated += h if bias else 0  # fc2's bias
    if model.qk_layernorm:
        replicated += 2 * norm_parameters(model, model.head_dim)
    return split, replicated


def stage_layers(num_layers: int, pp_size: int, chunks: int, stage: int) -> list[int]:
    """The layer indices pipeline stage ``stage`` of ``pp_size`` holds: with ``chunks`` virtual
    stages each, chunk c is virtual stage c * pp + stage, of num_layers / (pp * chunks) layers."""
    n = num_layers // (pp_size * chunks)
    return [(c * pp_size + stage) * n + i for c in range(chunks) for i in range(n)]


def count_parameters(
    model: ModelConfig,
    padded_vocab_size: int,
    tp_size: int,
    model_type: ModelType = "gpt",
    num_tokentypes: int = 2,
    binary_head: bool = True,
    ep_size: int = 1,
) -> ParamCount:
    """The parameters of GPT (or BERT) with this shape; ``model`` must be resolved (ffn set)."""
    return stage_parameters(
        model,
        padded_vocab_size,
        tp_size,
        1,
        0,
        model_type,
        num_tokentypes,
        binary_head,
        ep_size=ep_size,
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
    chunks: int = 1,
    ep_size: int = 1,
) -> ParamCount:
    """The parameters pipeline stage ``stage`` of ``pp_size`` holds (see the module docstring):
    its layers (``stage_layers``, ``chunks`` virtual stages each), the embeddings on the first
    stage, the final LayerNorm and heads on the last, which with pp > 1 holds its own copy of the
    word embedding for the tied head (or the untied output layer, at any pp)."""
    h, v = model.hidden_size, padded_vocab_size
    first, last = stage == 0, stage == pp_size - 1
    moe_layers = model.moe_layers
    split = replicated = inactive = experts = 0
    for index in stage_layers(model.num_layers, pp_size, chunks, stage):
        layer_split, layer_replicated = layer_parameters(model, moe_layers[index])
        split, replicated = split + layer_split, replicated + layer_replicated
        if moe_layers[index]:
            experts += model.num_experts * expert_parameters(model)
            skipped = model.num_experts - model.moe_router_topk
            inactive += skipped * expert_parameters(model)
    if first:
        split += v * h
        if model.position_embedding_type == "learned":
            replicated += model.max_position_embeddings * h
        if model_type == "bert":
            replicated += num_tokentypes * h
            if model.layernorm_position == "post":
                replicated += norm_parameters(model, h)  # the embedding norm
    if last:
        if pp_size > 1 or model.untie_embeddings_and_output_weights:
            split += v * h  # the tied LM head's own copy of the word embedding, or the untied one
        if model.layernorm_position == "pre":
            replicated += norm_parameters(model, h)
        if model_type == "bert":
            split += v  # the LM head's output bias, split by vocabulary like the logits
            replicated += (h * h + h) + norm_parameters(model, h)
            if binary_head:
                replicated += (h * h + h) + (2 * h + 2)
    return ParamCount(tp_size, split, replicated, inactive, experts, ep_size)
