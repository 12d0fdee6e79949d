"""Our mixture-of-experts GPT as HF's MixtralForCausalLM, Qwen2MoeForCausalLM or
Qwen3MoeForCausalLM, and back: the Llama family's attention and norms, experts in the MLPs.

::

    ours, in an MoE layer i                 model.layers.{i}.mlp (Mixtral: .block_sparse_moe)
    mlp.router.weight [E, h]                  gate.weight
    mlp.experts.fc1 [E, 2f, h], each          experts.{e}.gate_proj.weight, up_proj [f, h] each
      expert's rows interleaved [f, (g, u)]     (Mixtral: experts.{e}.w1, w3)
    mlp.experts.fc2 [E, h, f]                 experts.{e}.down_proj.weight [h, f]  (Mixtral: w2)
    mlp.shared_expert.fc1, fc2                shared_expert.gate_proj, up_proj; down_proj (Qwen2)
    mlp.shared_expert_gate.weight [1, h]      shared_expert_gate.weight (Qwen2)
    a dense layer's mlp.fc1, fc2              mlp.gate_proj, up_proj; down_proj (Qwen's
                                              mlp_only_layers, off its decoder_sparse_step)

The tensors are the per-expert ones save_pretrained writes (transformers 5 fuses them into
``experts.gate_up_proj`` [E, 2f, h] only in memory). The router is transformers' arithmetic:
fp32 softmax over every expert, the top k, renormalised to sum to 1 (Mixtral; Qwen's
``norm_topk_prob`` true) or not (``moe_router_pre_softmax``). Qwen2-MoE's shared expert is
always there, always gated. A config.json that says anything else we cannot compute is refused
in one line naming its key; so is an export of a model no class holds (naming our model.* key).
"""

from __future__ import annotations

from typing import Any

from megatron.config.model import ModelConfig
from megatron.config.schema import Config
from megatron.data.tokenizers.base import Tokenizer
from megatron.errors import ConfigError
from megatron.interop.llama import LAYER, MLP, LlamaFamily
from megatron.interop.mapping import Rule, layer_rules

_QUANTIZED = {"quantization_config": "quantized weights (convert the unquantized model)"}
# Our routing options that none of the three classes has, with the value they all compute.
_ROUTING = {
    "moe_router_score_function": "softmax",
    "moe_router_topk_scaling_factor": None,
    "moe_router_num_groups": None,
    "moe_router_enable_expert_bias": False,
    "moe_expert_capacity_factor": None,
}
_NAMES = "MixtralForCausalLM, Qwen2MoeForCausalLM, Qwen3MoeForCausalLM"


def _refuse_export(key: str, value: object, why: str) -> ConfigError:
    return ConfigError(
        f"model.{key}={value}: {why}; no Hugging Face mixture-of-experts class we export "
        f"({_NAMES}) holds this GPT exactly"
    )


def sparse_pattern(layers: list[bool]) -> tuple[int, list[int]]:
    """Qwen's (decoder_sparse_step, mlp_only_layers) for per-layer MoE flags: the largest step
    whose layers ((i + 1) % step == 0) hold every MoE layer, and those of its layers that are
    dense; what a Qwen config.json said comes back as it was."""
    moe = [i for i, x in enumerate(layers) if x]
    steps = range(1, len(layers) + 1)
    step = max(s for s in steps if all((i + 1) % s == 0 for i in moe))
    return step, [i for i in range(len(layers)) if (i + 1) % step == 0 and not layers[i]]


class MoEFamily(LlamaFamily):
    """One of MixtralForCausalLM, Qwen2MoeForCausalLM, Qwen3MoeForCausalLM."""

    refused = _QUANTIZED  # the Llama family refuses expert keys; here they are ours to read

    def __init__(
        self,
        name: str,
        model_type: str,
        defaults: dict[str, Any],
        required: dict[str, Any],
        qk_norm: bool = False,
        shared: bool = False,
    ):
        """Mixtral (``model_type`` "mixtral") names its experts' block ``block_sparse_moe`` and
        its projections w1, w3, w2, and has experts in every layer; the Qwen classes name them
        as their dense MLP's, and ``shared``: Qwen2-MoE's gated shared expert."""
        super().__init__(name, defaults, required, qk_norm=qk_norm)
        self.model_type, self.shared = model_type, shared
        self.mixtral = model_type == "mixtral"
        self.block = "block_sparse_moe" if self.mixtral else "mlp"
        self.projections = (
            ("w1", "w3", "w2") if self.mixtral else ("gate_proj", "up_proj", "down_proj")
        )
        # config.json's key of an expert's width and of the expert count (5.24's Qwen3MoeConfig
        # writes num_local_experts, the hub's Qwen3-MoE configs num_experts).
        self.width_key = "intermediate_size" if self.mixtral else "moe_intermediate_size"
        self.count_keys = ("num_local_experts",) if self.mixtral else ("num_experts",)
        if model_type == "qwen3_moe":
            self.count_keys += ("num_local_experts",)

    def moe_pairs(self, m: ModelConfig) -> list[tuple[str, str, str]]:
        """(our suffix, HF suffixes, kind) of an MoE layer's MLP."""
        block, (gate, up, down) = self.block, self.projections
        experts = range(m.num_experts)
        gate_up = " ".join(f"{block}.experts.{e}.{p}.weight" for e in experts for p in (gate, up))
        pairs = [
            ("mlp.router.weight", f"{block}.gate.weight", "same"),
            ("mlp.experts.fc1", gate_up, "experts_swiglu"),
            ("mlp.experts.fc2", " ".join(f"{block}.experts.{e}.{down}.weight" for e in experts),
             "experts"),
        ]  # fmt: skip
        if self.shared:
            # The dense MLP's pairs, one module down: mlp.fc1 -> mlp.shared_expert.fc1.
            into = "mlp.shared_expert."
            pairs += [(o.replace("mlp.", into), h.replace("mlp.", into), k) for o, h, k in MLP]
            pairs.append(("mlp.shared_expert_gate.weight",) * 2 + ("same",))
        return pairs

    def mlp_rules(self, m: ModelConfig) -> list[Rule]:
        """MoE layers' experts; the dense layers' SwiGLU."""
        moe = m.moe_layers
        dense = [i for i, x in enumerate(moe) if not x]
        sparse = [i for i, x in enumerate(moe) if x]
        return layer_rules(dense, LAYER, MLP) + layer_rules(sparse, LAYER, self.moe_pairs(m))

    def _count(self, hf: dict[str, Any]) -> Any:
        """The expert count, by whichever spelling config.json uses."""
        given = [hf[k] for k in self.count_keys if k in hf]
        return given[0] if given else self.defaults[self.count_keys[0]]

    def _layers(self, hf: dict[str, Any], num_layers: int, where: str) -> int | list[int]:
        """Our moe_layer_freq for Qwen's decoder_sparse_step and mlp_only_layers."""
        if self.mixtral:
            return 1
        step = hf.get("decoder_sparse_step", 1)
        if not isinstance(step, int) or step < 1:
            raise ConfigError(f"{where}: decoder_sparse_step={step!r} must be a positive integer")
        dense = set(hf.get("mlp_only_layers") or [])
        layers = [int((i + 1) % step == 0 and i not in dense) for i in range(num_layers)]
        return 1 if all(layers) else layers

    def sections(self, hf: dict[str, Any], where: str) -> dict[str, dict[str, Any]]:
        """The Llama family's model.*, with the experts."""
        sections = super().sections(hf, where)
        model = sections["model"]
        experts = self._count(hf)
        if not experts:
            raise ConfigError(
                f"{where}: {self.count_keys[0]}={experts!r} means dense MLPs only; convert it as "
                "a dense model (Qwen2ForCausalLM or Qwen3ForCausalLM)"
            )
        d = self.defaults
        norm_topk = True if self.mixtral else hf.get("norm_topk_prob", d["norm_topk_prob"])
        model.update(
            num_experts=experts,
            moe_router_topk=hf.get("num_experts_per_tok", d["num_experts_per_tok"]),
            moe_ffn_hidden_size=hf.get(self.width_key, d[self.width_key]),
            moe_layer_freq=self._layers(hf, model["num_layers"], where),
            moe_router_pre_softmax=not norm_topk,
            moe_aux_loss_coeff=hf.get("router_aux_loss_coef", 0.001),
        )
        if self.shared:
            key = "shared_expert_intermediate_size"
            model.update(
                moe_shared_expert_intermediate_size=hf.get(key, d[key]),
                moe_shared_expert_gate=True,
                add_qkv_bias=hf.get("qkv_bias", True),  # Qwen2-MoE's switch
            )
        return sections

    def hf_config(self, cfg: Config, vocab_size: int, tokenizer: Tokenizer) -> dict[str, Any]:
        """The Llama family's keys and the experts', as 5.24's save_pretrained writes them."""
        m = cfg.model
        config = super().hf_config(cfg, vocab_size, tokenizer)
        config.update(
            {
                self.count_keys[0]: m.num_experts,
                "num_experts_per_tok": m.moe_router_topk,
                self.width_key: m.expert_ffn_hidden_size,
                "router_aux_loss_coef": m.moe_aux_loss_coeff,
                "output_router_logits": False,
            }
        )
        if self.mixtral:
            # Every layer is MoE: intermediate_size is the experts' width (set above); head_dim
            # null where ours is (MixtralConfig keeps it null: hidden / heads).
            return {**config, "head_dim": m.kv_channels}
        step, dense = sparse_pattern(m.moe_layers)
        config.update(
            norm_topk_prob=not m.moe_router_pre_softmax,
            decoder_sparse_step=step,
            mlp_only_layers=dense,
        )
        if self.shared:
            config.update(
                shared_expert_intermediate_size=m.moe_shared_expert_intermediate_size,
                qkv_bias=m.add_qkv_bias,
            )
        return config


def for_model(m: ModelConfig) -> MoEFamily:
    """The class an MoE GPT (RoPE, RMSNorm, SwiGLU) exports as: Qwen2-MoE with a shared
    expert, Qwen3-MoE with QK norms, else Mixtral. ConfigError (naming our model.* key) for one
    that none holds exactly."""
    for key, held in _ROUTING.items():
        if getattr(m, key) != held:
            why = f"the three classes' routers compute only {key}={held}"
            if key == "moe_router_enable_expert_bias":
                why = "none of the three classes has an expert bias"
            raise _refuse_export(key, getattr(m, key), why)
    if m.moe_shared_expert_intermediate_size is not None:
        if not m.moe_shared_expert_gate:
            why = "Qwen2MoeForCausalLM, the one class with a shared expert, always gates it"
            raise _refuse_export("moe_shared_expert_gate", False, why)
        if m.qk_layernorm:
            why = "Qwen2MoeForCausalLM, the one class with a shared expert, has no QK norms"
            raise _refuse_export("qk_layernorm", True, why)
        return ARCHITECTURES["Qwen2MoeForCausalLM"]
    if m.qk_layernorm:
        if m.add_qkv_bias:
            why = "Qwen3MoeForCausalLM's attention_bias also adds an output-projection bias"
            raise _refuse_export("add_qkv_bias", True, why)
        return ARCHITECTURES["Qwen3MoeForCausalLM"]
    if m.add_qkv_bias:
        why = "only Qwen2MoeForCausalLM has a QKV bias, and it needs a gated shared expert"
        raise _refuse_export("add_qkv_bias", True, why)
    if m.moe_router_pre_softmax:
        why = (
            "MixtralForCausalLM renormalises the top-k weights (Qwen's norm_topk_prob=false "
            "needs a gated shared expert or QK norms)"
        )
        raise _refuse_export("moe_router_pre_softmax", True, why)
    if not all(m.moe_layers):
        why = "MixtralForCausalLM has experts in every layer"
        raise _refuse_export("moe_layer_freq", m.moe_layer_freq, why)
    return ARCHITECTURES["MixtralForCausalLM"]


_QWEN = {
    "hidden_size": 2048,
    "num_hidden_layers": 24,
    "max_position_embeddings": 32768,
    "decoder_sparse_step": 1,
    "norm_topk_prob": False,
}
ARCHITECTURES = {
    a.name: a
    for a in [
        MoEFamily(
            "MixtralForCausalLM",
            "mixtral",
            {
                "intermediate_size": 14336,
                "max_position_embeddings": 131072,
                "num_key_value_heads": 8,
                "rms_norm_eps": 1e-5,
                "rope_theta": 1e6,
                "sliding_window": None,
                "num_local_experts": 8,
                "num_experts_per_tok": 2,
            },
            {"router_jitter_noise": 0.0},
        ),
        MoEFamily(
            "Qwen2MoeForCausalLM",
            "qwen2_moe",
            {
                **_QWEN,
                "num_attention_heads": 16,
                "num_key_value_heads": 16,
                "intermediate_size": 5632,
                "num_experts": 60,
                "num_experts_per_tok": 4,
                "moe_intermediate_size": 1408,
                "shared_expert_intermediate_size": 5632,
            },
            {"use_sliding_window": False},
            shared=True,
        ),
        MoEFamily(
            "Qwen3MoeForCausalLM",
            "qwen3_moe",
            {
                **_QWEN,
                "num_key_value_heads": 4,
                "intermediate_size": 6144,
                "num_experts": 128,
                "num_experts_per_tok": 8,
                "moe_intermediate_size": 768,
            },
            {"attention_bias": False, "use_sliding_window": False},
            qk_norm=True,
        ),
    ]
}
