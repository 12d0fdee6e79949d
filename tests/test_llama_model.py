"""Llama/Mistral/Qwen-style decoders (the ``model.*`` options) at the model level.

- Against transformers at TP=1, on copied weights: LlamaForCausalLM (RoPE theta 500000 with
  Llama 3.1's scaling, RMSNorm, SwiGLU, 4 heads in 2 query groups, no biases, untied),
  Qwen2ForCausalLM (QKV bias) and Qwen3ForCausalLM (QK norms, head_dim 16 != 32 / 4): logits
  and loss within 1e-5 relative (fp32; the same ops in another association order). RoPE's
  frequencies and RMSNorm are transformers' own bit for bit.
- TP=2 and 4 (with and without sequence parallelism) against TP=1, on packed documents (RoPE
  positions restarting per document, the document mask): logits and loss within 1e-5, every
  gradient within 1e-4, as tests/test_gpt_model.py allows (float reduction order only). The
  gradients are summed over TP as the loop sums them (QK norms see their rank's heads alone).
- A layer still does two all-reduces each way (SP: two all-gathers and two reduce-scatters).
- KV-cached greedy generation at TP=2 (the cache holds query groups) picks the uncached
  forward's argmax at every step, with its logits.
- BERT takes the same options (but the untied head) and matches TP=1 at TP=2 alike.
- The estimates count each TP rank's share (the whole-model counts and the refused options:
  tests/test_llama_estimates.py).
"""

from __future__ import annotations

import dataclasses
import functools

import pytest
import torch
import torch._dynamo

from megatron.config.schema import padded_vocab_size
from megatron.estimate.activations import layer_activation_bytes
from megatron.estimate.parameters import count_parameters, stage_parameters
from megatron.inference.generation import generate
from megatron.models import document_mask, gpt
from megatron.models.bert import BertModel
from megatron.models.gpt import GPTModel
from megatron.models.rope import RotaryEmbedding, inverse_frequencies
from megatron.models.transformer import TransformerLayer
from megatron.parallel.random import RNGTracker
from megatron.parallel.sequence_parallel import allreduce_sequence_parallel_grads
from megatron.parallel.state import ParallelState, initialize
from tests.distributed import run_distributed
from tests.model_config import tiny_model_config
from tests.test_bert_model import batch as bert_batch
from tests.test_bert_model import losses as bert_losses
from tests.test_document_mask import packed_batch
from tests.test_estimate import saved_bytes
from tests.test_layers import close, gather_param
from tests.test_sequence_parallel import recorded_collectives

VOCAB = 250
CPU = ParallelState.serial(torch.device("cpu"))
LLAMA_TINY = "configs/llama_tiny.yaml"
# original_max_position_embeddings 512 puts head_dim 8's wavelengths in all three bands.
ROPE_SCALING = dict(
    factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=512.0
)
LLAMA = dict(
    position_embedding_type="rope",
    rotary_base=500000.0,
    rope_scaling=ROPE_SCALING,
    normalization="rmsnorm",
    activation="swiglu",
    num_query_groups=2,
    add_bias_linear=False,
    untie_embeddings_and_output_weights=True,
    max_position_embeddings=64,
)
VARIANTS = {
    "llama": LLAMA,
    "qwen2": {**LLAMA, "rope_scaling": None, "rotary_base": 1e6, "add_qkv_bias": True},
    "qwen3": {**LLAMA, "rope_scaling": None, "qk_layernorm": True, "kv_channels": 16},
    # 8 heads of 8 channels (64 != hidden 32) in 4 groups, so TP=4 holds a group per rank;
    # half of each head rotated.
    "wide": {**LLAMA, "num_attention_heads": 8, "num_query_groups": 4, "kv_channels": 8,
             "rotary_percent": 0.5, "qk_layernorm": True},
}  # fmt: skip
TP_VARIANTS = {2: ["llama", "qwen2", "qwen3", "wide"], 4: ["wide"]}
# BERT takes every decoder option but the untied head (its MLM head is the word table's).
BERT = {k: v for k, v in VARIANTS["qwen3"].items() if k != "untie_embeddings_and_output_weights"}


def build(variant: str, st: ParallelState, sp: bool = False, **extra) -> GPTModel:
    cfg = tiny_model_config(**VARIANTS[variant], **extra)
    tracker = RNGTracker(st.device)
    tracker.seed(1234, st.tp_rank)
    return GPTModel(cfg, VOCAB, padded_vocab_size(VOCAB, 128, st.tp_size), st, tracker, sp)


def gathered(t: torch.Tensor, dim: int | None, st: ParallelState) -> torch.Tensor:
    return t if st.tp_size == 1 else gather_param(t, dim, st.tp_group)


def gathered_grads(model: torch.nn.Module, st: ParallelState) -> dict[str, torch.Tensor]:
    """Every gradient, summed over TP as the loop sums them, whole (vocabulary rows unpadded)."""
    allreduce_sequence_parallel_grads(model, st.tp_group)
    grads = {}
    for name, p in model.named_parameters():
        g = gathered(p.grad, getattr(p, "tp_split_dim", None), st)
        grads[name] = g[:VOCAB] if getattr(p, "vocab_padded", False) else g
    return grads


def forward_backward(model: GPTModel, st: ParallelState) -> tuple:
    """Gathered logits (unpadded), the mean loss and ``gathered_grads``, on packed documents."""
    tokens, labels, positions, documents = packed_batch(n=4)
    logits = gathered(model(tokens, positions, documents).detach(), -1, st)[..., :VOCAB]
    loss = model(tokens, positions, documents, labels=labels).mean()
    loss.backward()
    return logits, loss.detach(), gathered_grads(model, st)


def bert_forward_backward(st: ParallelState, sp: bool = False) -> tuple:
    """BERT's two losses and ``gathered_grads``."""
    tracker = RNGTracker(st.device)
    tracker.seed(1234, st.tp_rank)
    padded = padded_vocab_size(VOCAB, 128, st.tp_size)
    model = BertModel(tiny_model_config(**BERT), VOCAB, padded, st, tracker, 2, "sop", sp)
    lm, binary = bert_losses(model, bert_batch())
    (lm + binary).backward()
    return torch.stack([lm, binary]).detach(), gathered_grads(model, st)


@functools.cache
def serial(variant: str) -> tuple:
    if variant == "bert":
        return bert_forward_backward(CPU)
    return forward_backward(build(variant, CPU), CPU)


def _tp_child(tp: int) -> dict:
    st = initialize(tp)
    out = {}
    for variant in TP_VARIANTS[tp]:
        for sp in (False, True):
            out[variant, sp] = forward_backward(build(variant, st, sp), st)
        tokens, _, positions, _ = packed_batch(n=2)
        model, one_layer = build(variant, st).train(), build(variant, st, num_layers=1).train()
        out[variant, "held"] = (
            sum(p.numel() for p in model.parameters()),
            saved_bytes(model, tokens, positions, labels=tokens)
            - saved_bytes(one_layer, tokens, positions, labels=tokens),
        )
    if tp == 2:
        out["bert"] = [bert_forward_backward(st, sp) for sp in (False, True)]
        out["collectives"] = {v: _layer_collectives(st, v) for v in ("llama", "qwen3")}
        out["generation"] = _generation(st)
    return out


@functools.cache
def tp_results(tp: int) -> list[dict]:
    """Every rank's results of one spawn per TP size."""
    return run_distributed(_tp_child, tp, tp)


@pytest.mark.slow
@pytest.mark.parametrize("tp", [2, 4])
def test_tp_and_sequence_parallel_match_serial(tp):
    """Every variant at TP=2 (and 'wide' at TP=4, a group per rank), SP off and on."""
    for rank in tp_results(tp):
        for variant in TP_VARIANTS[tp]:
            ref_logits, ref_loss, ref_grads = serial(variant)
            for sp in (False, True):
                logits, loss, grads = rank[variant, sp]
                close(logits, ref_logits, 1e-5)
                close(loss, ref_loss, 1e-5)
                assert grads.keys() == ref_grads.keys()
                for name, g in grads.items():
                    close(g, ref_grads[name], 1e-4)


@pytest.mark.slow
def test_bert_takes_the_decoder_options():
    """BERT with RoPE, RMSNorm, SwiGLU, query groups, QK norms and no biases: both losses and
    every gradient at TP=2, with and without SP, against TP=1."""
    ref_losses, ref_grads = serial("bert")
    for rank in tp_results(2):
        for losses, grads in rank["bert"]:
            close(losses, ref_losses, 1e-5)
            assert grads.keys() == ref_grads.keys()
            for name, g in grads.items():
                close(g, ref_grads[name], 1e-4)


@pytest.mark.slow
@pytest.mark.parametrize("tp", [2, 4])
def test_estimates_count_each_tp_rank(tp):
    """A rank's parameters; its layer's saved bytes (the grouped q's copy depends on the groups
    a rank holds), up to the CPU RMSNorm's copies (``test_estimates_count_the_model``)."""
    for rank in tp_results(tp):
        for variant in TP_VARIANTS[tp]:
            cfg = tiny_model_config(**VARIANTS[variant])
            params = count_parameters(cfg, padded_vocab_size(VOCAB, 128, tp), tp)
            held, layer_bytes = rank[variant, "held"]
            assert held == params.per_gpu, variant
            expected = layer_activation_bytes(cfg, 2, tp, 4) + _composite_rms_bytes(cfg, tp)
            assert layer_bytes == expected, variant


def _layer_collectives(st: ParallelState, variant: str) -> dict:
    """One layer's collectives (name, full size) forward and backward, plain TP and SP."""
    tracker = RNGTracker(st.device)
    tracker.seed(0, st.tp_rank)
    cfg = tiny_model_config(**VARIANTS[variant])
    rotary = RotaryEmbedding(cfg, st.device)(torch.arange(8)[None], torch.float32)
    out = {}
    for sp in (False, True):
        layer = TransformerLayer(cfg, st, tracker, 0, sequence_parallel=sp)
        x = torch.randn(2, 4 if sp else 8, 32, requires_grad=True)  # [b, s or s / tp, h]
        with recorded_collectives() as calls:
            y = layer(x, None, rotary)
            forward = list(calls)
            calls.clear()
            y.sum().backward()
            out[sp] = forward, list(calls)
    return out


@pytest.mark.slow
def test_one_layer_keeps_its_collectives():
    full = 2 * 8 * 32  # [b, s, h]
    # On gloo the reduce-scatter is an all-to-all of the parts and a local sum (gloo's own
    # reduce-scatter all-reduces the whole): the same full-size tensor goes out.
    ag, rs = ("all_gather_single", full), ("all_to_all_single", full)
    for rank in tp_results(2):
        for variant, out in rank["collectives"].items():
            assert out[False] == ([("all_reduce", full)] * 2,) * 2, variant
            assert out[True] == ([ag, rs, ag, rs],) * 2, variant


PROMPTS = [[5, 17, 42], [9, 8, 7, 6, 5, 4, 3], [100, 200, 30, 40, 50]]
NEW = 8


def _generation(st: ParallelState) -> list[tuple[list[int], torch.Tensor, torch.Tensor]]:
    """Per prompt: greedy tokens through the KV cache, their logits, and the uncached forward's
    logits at the same positions (gathered, unpadded)."""
    model = build("llama", st, init_method_std=0.3).eval()  # wide init: varied predictions
    generated = generate(model, PROMPTS, NEW, VOCAB - 1, stop_at_eod=False, return_logits=True)
    out = []
    for prompt, gen in zip(PROMPTS, generated):
        with torch.no_grad():
            full = model(torch.tensor([prompt + gen.tokens]))
        full = gather_param(full, -1, st.tp_group)[0, len(prompt) - 1 : -1, :VOCAB]
        out.append((gen.tokens, gen.logits[:, :VOCAB], full))
    return out


@pytest.mark.slow
def test_kv_cached_greedy_generation_is_the_uncached_argmax():
    for rank in tp_results(2):
        for tokens, cached, uncached in rank["generation"]:
            assert len(tokens) == NEW and len(set(tokens)) > 1
            assert tokens == uncached.argmax(-1).tolist()
            close(cached, uncached, 1e-5)


@pytest.mark.skipif(document_mask.flex_attention is None, reason="this torch has no flex attention")
@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
def test_block_mask_with_query_groups_gives_the_additive_mask_logits(monkeypatch):
    """The CUDA path's BlockMask through eager flex attention on CPU (forward only: no CPU
    backward), its key/value groups unrepeated (``enable_gqa``), against the additive mask."""
    model = build("llama", CPU)
    tokens, labels, positions, documents = packed_batch()
    with torch.no_grad():
        ref = model(tokens, positions, documents)
        monkeypatch.setattr(gpt, "uses_flex", lambda device, dropout: True)
        close(model(tokens, positions, documents), ref, 1e-5)


@pytest.mark.parametrize("documents", [False, True])
def test_the_layer_has_no_graph_break(documents):
    """model.compile's unit, with RoPE, QK norms, grouped queries and SwiGLU: one graph."""
    tracker = RNGTracker(CPU.device)
    tracker.seed(0, 0)
    cfg = tiny_model_config(**VARIANTS["qwen3"])
    layer = TransformerLayer(cfg, CPU, tracker, 0).train()
    _, _, positions, docs = packed_batch()
    mask = document_mask.document_mask(docs, torch.float32, flex=False) if documents else None
    rotary = RotaryEmbedding(cfg, CPU.device)(positions, torch.float32)
    x = torch.randn(docs.shape[0], docs.shape[1], 32, requires_grad=True)
    explained = torch._dynamo.explain(layer)(x, mask, rotary)
    assert explained.graph_break_count == 0, explained.break_reasons
    assert explained.graph_count == 1


# --- Against transformers, on the same weights (TP=1) ---


def _hf_model(variant: str, cfg):
    """transformers' model of ``variant`` for our ModelConfig ``cfg``."""
    import transformers

    rope = {"rope_type": "default", "rope_theta": cfg.rotary_base}
    if cfg.rope_scaling is not None:
        rope = {**rope, **cfg.rope_scaling, "rope_type": "llama3"}
    kind = {"llama": "Llama", "qwen2": "Qwen2", "qwen3": "Qwen3"}[variant]
    config = getattr(transformers, f"{kind}Config")(
        vocab_size=VOCAB, hidden_size=cfg.hidden_size, intermediate_size=cfg.ffn_hidden_size,
        num_hidden_layers=cfg.num_layers, num_attention_heads=cfg.num_attention_heads,
        num_key_value_heads=cfg.num_query_groups, head_dim=cfg.head_dim,
        rms_norm_eps=cfg.layernorm_epsilon, max_position_embeddings=cfg.max_position_embeddings,
        rope_parameters=rope, tie_word_embeddings=False, attn_implementation="eager",
    )  # fmt: skip
    return getattr(transformers, f"{kind}ForCausalLM")(config).eval()


def _copy_weights(ours: GPTModel, hf, cfg) -> None:
    """Our fused layouts into HF's separate matrices: QKV rows [group, (q x heads / groups, k,
    v), head_dim]; fc1 rows [ffn, (gate, up)]."""
    heads, groups, d = cfg.num_attention_heads, cfg.query_groups, cfg.head_dim
    per = heads // groups

    def qkv(t: torch.Tensor) -> tuple[torch.Tensor, ...]:
        t = t.view(groups, per + 2, d, *t.shape[1:])
        return t[:, :per].flatten(0, 2), t[:, per].flatten(0, 1), t[:, per + 1].flatten(0, 1)

    ours_sd, hf_sd = ours.state_dict(), {}
    hf_sd["model.embed_tokens.weight"] = ours_sd["embedding.word.weight"][:VOCAB]
    hf_sd["lm_head.weight"] = ours_sd["output_layer.weight"][:VOCAB]
    hf_sd["model.norm.weight"] = ours_sd["transformer.final_ln.weight"]
    for i in range(cfg.num_layers):
        o, t = f"transformer.layers.{i}.", f"model.layers.{i}."
        hf_sd[t + "input_layernorm.weight"] = ours_sd[o + "ln1.weight"]
        hf_sd[t + "post_attention_layernorm.weight"] = ours_sd[o + "ln2.weight"]
        for kind in ("weight", "bias"):
            if o + f"attention.qkv.{kind}" in ours_sd:
                q, k, v = qkv(ours_sd[o + f"attention.qkv.{kind}"])
                for name, value in zip(("q", "k", "v"), (q, k, v)):
                    hf_sd[t + f"self_attn.{name}_proj.{kind}"] = value
        hf_sd[t + "self_attn.o_proj.weight"] = ours_sd[o + "attention.dense.weight"]
        for name in ("q_norm", "k_norm"):
            if o + f"attention.{name}.weight" in ours_sd:
                hf_sd[t + f"self_attn.{name}.weight"] = ours_sd[o + f"attention.{name}.weight"]
        fc1 = ours_sd[o + "mlp.fc1.weight"]
        hf_sd[t + "mlp.gate_proj.weight"], hf_sd[t + "mlp.up_proj.weight"] = fc1[0::2], fc1[1::2]
        hf_sd[t + "mlp.down_proj.weight"] = ours_sd[o + "mlp.fc2.weight"]
    missing, unexpected = hf.load_state_dict(hf_sd, strict=False)
    assert not unexpected and all("rotary" in k for k in missing), (missing, unexpected)


@pytest.mark.parametrize("variant", ["llama", "qwen2", "qwen3"])
def test_matches_transformers_on_copied_weights(variant):
    """Random weights (biases and norm weights too), positions restarting mid-sequence."""
    pytest.importorskip("transformers")
    cfg = tiny_model_config(**VARIANTS[variant])
    ours = build(variant, CPU)
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for p in ours.parameters():
            p.add_(torch.randn(p.shape, generator=g), alpha=0.1)
    hf = _hf_model(variant, cfg)
    _copy_weights(ours, hf, cfg)
    tokens, labels, positions, _ = packed_batch(n=3)
    with torch.no_grad():
        logits = ours(tokens, positions)[..., :VOCAB]
        loss = ours(tokens, positions, labels=labels).mean()
        out = hf(input_ids=tokens, position_ids=positions)
    close(logits, out.logits, 1e-5)
    hf_loss = torch.nn.functional.cross_entropy(out.logits.flatten(0, 1), labels.flatten())
    close(loss, hf_loss, 1e-5)


@pytest.mark.parametrize("percent", [1.0, 0.5])
@pytest.mark.parametrize("scaling", [None, ROPE_SCALING])
def test_rope_frequencies_and_rmsnorm_are_transformers_bit_for_bit(percent, scaling):
    pytest.importorskip("transformers")
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    from transformers.models.gpt_neox.modeling_gpt_neox import GPTNeoXRotaryEmbedding as neox
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    cfg = tiny_model_config(**{**LLAMA, "rope_scaling": scaling, "rotary_percent": percent})
    rope = {"rope_type": "llama3" if scaling else "default", "rope_theta": cfg.rotary_base,
            "partial_rotary_factor": percent, **(scaling or {})}  # fmt: skip
    hf_config = LlamaConfig(hidden_size=32, num_attention_heads=4, rope_parameters=rope)
    # transformers' default RoPE with partial rotation is GPT-NeoX's (Llama's rotates all).
    compute = ROPE_INIT_FUNCTIONS.get(rope["rope_type"], neox.compute_default_rope_parameters)
    assert torch.equal(inverse_frequencies(cfg), compute(hf_config)[0])
    x = torch.randn(4, 16, 32) * 3
    ours = build("llama", CPU).transformer.layers[0].ln1
    hf = LlamaRMSNorm(32, eps=cfg.layernorm_epsilon)
    with torch.no_grad():
        ours.weight.normal_()
        hf.weight.copy_(ours.weight)
        assert torch.equal(ours(x), hf(x))


def test_untied_pipeline_stages_hold_the_output_layer_and_nothing_tied():
    """PP=2: stage 0 the word table (no position table with RoPE), stage 1 the output layer and
    no word table; their tensors are the whole model's, and nothing is ``pipeline_tied`` (no
    first/last-stage embedding all-reduce). The estimate counts each stage's parameters."""
    whole = build("llama", CPU).state_dict()
    cfg = tiny_model_config(**LLAMA)
    seen = set()
    for stage in (0, 1):
        st = dataclasses.replace(CPU, pp_size=2, pp_rank=stage)
        model = build("llama", st)
        count = stage_parameters(cfg, 256, 1, 2, stage).total
        assert sum(p.numel() for p in model.parameters()) == count
        held = model.state_dict()
        ends = {k.split(".")[0] for k in held if not k.startswith("transformer.layers.")}
        assert ends == ({"embedding"} if stage == 0 else {"transformer", "output_layer"})
        assert all(torch.equal(v, whole[k]) for k, v in held.items())
        assert not any(getattr(p, "pipeline_tied", False) for p in model.parameters())
        seen |= set(held)
    assert seen == set(whole) and "embedding.position.weight" not in whole


# --- The estimates ---


def _composite_rms_bytes(cfg, tp: int = 1) -> int:
    """What torch's composite CPU RMSNorm saves in one layer beyond the fused kernel (CUDA's,
    which the estimate counts: the input and rstd): its x * rstd, fp32, for a batch of 2."""
    qk = (cfg.num_attention_heads + cfg.query_groups) * cfg.head_dim // tp * cfg.qk_layernorm
    return 4 * 2 * cfg.seq_length * (2 * cfg.hidden_size + qk) * (cfg.normalization == "rmsnorm")
