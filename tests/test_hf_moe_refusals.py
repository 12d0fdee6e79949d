"""What the mixture-of-experts conversion refuses, each in one line: a config.json we cannot
compute exactly (naming its HF key), and an MoE GPT that no exported class holds (naming our
model.* key); and which class each MoE GPT exports as. No processes, no weights."""

from __future__ import annotations

import pytest

from megatron.config.load import load_config
from megatron.errors import ConfigError
from megatron.interop.architectures import for_checkpoint, from_config_json
from megatron.interop.moe import sparse_pattern
from tests.test_hf_llama import ROPE
from tests.test_hf_llama_refusals import assert_cli_refuses, assert_refused
from tests.test_hf_moe import hf_config_json


@pytest.mark.parametrize(
    "name, changes, named",
    [
        ("MixtralForCausalLM", {"sliding_window": 512}, "sliding_window=512"),
        ("MixtralForCausalLM", {"router_jitter_noise": 0.1}, "router_jitter_noise=0.1"),
        ("MixtralForCausalLM", {"rope_parameters": {**ROPE, "rope_type": "yarn", "factor": 4.0}},
         "rope_parameters.rope_type='yarn'"),
        ("Qwen2MoeForCausalLM", {"use_sliding_window": True}, "use_sliding_window=True"),
        ("Qwen2MoeForCausalLM", {"num_experts": 0}, "num_experts=0"),
        ("Qwen2MoeForCausalLM", {"decoder_sparse_step": 0}, "decoder_sparse_step=0"),
        ("Qwen2MoeForCausalLM", {"hidden_act": "gelu"}, "hidden_act='gelu'"),
        ("Qwen3MoeForCausalLM", {"attention_bias": True}, "attention_bias=True"),
        ("Qwen3MoeForCausalLM", {"layer_types": ["full_attention", "sliding_attention"]},
         "layer_types"),
        ("Qwen3MoeForCausalLM", {"quantization_config": {"quant_method": "awq"}},
         "quantization_config"),
    ],
)  # fmt: skip
def test_a_config_we_cannot_compute_exactly_is_refused(name, changes, named):
    assert_refused(hf_config_json(name, **changes), named)


def test_the_cli_refuses_in_one_line(tmp_path, capsys):
    hf = hf_config_json("MixtralForCausalLM", router_jitter_noise=0.01)
    assert_cli_refuses(tmp_path, capsys, hf, "router_jitter_noise=0.01")


def test_the_model_type_alone_names_the_class():
    hf = hf_config_json("Qwen3MoeForCausalLM", model_type="qwen3_moe")
    hf.pop("architectures")
    assert from_config_json(hf, "hf").name == "Qwen3MoeForCausalLM"


@pytest.mark.parametrize(
    "layers, pattern",
    [
        ([1, 1, 1, 1], (1, [])),
        ([1, 0, 1], (1, [1])),
        ([0, 1, 0, 1], (2, [])),
        ([0, 1, 0, 0], (2, [3])),
        ([0, 0, 0], (3, [2])),
    ],
)
def test_qwen_layer_patterns_come_back(layers, pattern):
    """export's (decoder_sparse_step, mlp_only_layers) gives the same layers on import."""
    assert sparse_pattern([bool(x) for x in layers]) == pattern
    step, dense = pattern
    hf = hf_config_json(
        "Qwen2MoeForCausalLM",
        num_hidden_layers=len(layers),
        decoder_sparse_step=step,
        mlp_only_layers=dense,
    )
    if not any(layers):  # refused by our config: every layer dense means no experts at all
        return
    freq = from_config_json(hf, "hf").sections(hf, "hf")["model"]["moe_layer_freq"]
    assert freq == (1 if all(layers) else layers)


LLAMA_TINY = "configs/llama_tiny.yaml"  # 4 layers
MOE = ["model.num_experts=4", "model.moe_ffn_hidden_size=64"]
SHARED = [*MOE, "model.moe_shared_expert_intermediate_size=128"]


@pytest.mark.parametrize(
    "overrides, expected",
    [
        (MOE, "MixtralForCausalLM"),
        ([*SHARED, "model.moe_shared_expert_gate=true"], "Qwen2MoeForCausalLM"),
        ([*SHARED, "model.moe_shared_expert_gate=true", "model.moe_router_pre_softmax=true",
          "model.add_qkv_bias=true", "model.moe_layer_freq=[0,1,1,1]"], "Qwen2MoeForCausalLM"),
        ([*MOE, "model.qk_layernorm=true", "model.moe_router_pre_softmax=true",
          "model.moe_layer_freq=[1,0,1,0]"], "Qwen3MoeForCausalLM"),
    ],
)  # fmt: skip
def test_an_moe_gpt_exports_as_the_class_that_holds_it(overrides, expected):
    cfg = load_config([LLAMA_TINY], overrides)
    assert for_checkpoint("gpt", cfg).name == expected


@pytest.mark.parametrize(
    "overrides, named",
    [
        (["model.moe_router_enable_expert_bias=true"], "model.moe_router_enable_expert_bias=True"),
        (["model.moe_router_score_function=sigmoid"], "model.moe_router_score_function=sigmoid"),
        (["model.moe_router_topk_scaling_factor=2.5"], "model.moe_router_topk_scaling_factor=2.5"),
        (["model.moe_expert_capacity_factor=1.0"], "model.moe_expert_capacity_factor=1.0"),
        (["model.moe_shared_expert_intermediate_size=128"], "model.moe_shared_expert_gate=False"),
        (["model.moe_shared_expert_intermediate_size=128", "model.moe_shared_expert_gate=true",
          "model.qk_layernorm=true"], "model.qk_layernorm=True"),
        (["model.qk_layernorm=true", "model.add_qkv_bias=true"], "model.add_qkv_bias=True"),
        (["model.add_qkv_bias=true"], "model.add_qkv_bias=True"),
        (["model.moe_router_pre_softmax=true"], "model.moe_router_pre_softmax=True"),
        (["model.moe_layer_freq=[0,1,1,1]"], "model.moe_layer_freq=[0, 1, 1, 1]"),
        (["model.normalization=layernorm"], "model.normalization=layernorm"),
    ],
)  # fmt: skip
def test_an_moe_gpt_no_exported_class_holds_is_refused_in_one_line(overrides, named):
    with pytest.raises(ConfigError) as e:
        for_checkpoint("gpt", load_config([LLAMA_TINY], [*MOE, *overrides]))
    message = str(e.value)
    assert message.startswith(named) and "\n" not in message, message
