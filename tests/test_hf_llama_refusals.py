"""What the Llama-family conversion refuses, each in one line: a config.json we cannot compute
exactly (naming its HF key), and a GPT config that no exported class holds (naming our model.*
key); and which class each RoPE GPT exports as. No processes, no weights."""

from __future__ import annotations

import json

import pytest

from megatron.config.load import load_config
from megatron.errors import ConfigError
from megatron.interop.architectures import for_checkpoint, from_config_json
from tests.test_hf_llama import LLAMA3, ROPE, hf_config_json
from tools.import_hf import main as import_main

LLAMA3_NO_FACTOR = {k: v for k, v in LLAMA3.items() if k != "factor"}


@pytest.mark.parametrize(
    "name, changes, named",
    [
        ("MistralForCausalLM", {"sliding_window": 512}, "sliding_window=512"),
        ("Qwen2ForCausalLM", {"use_sliding_window": True}, "use_sliding_window=True"),
        ("Qwen3ForCausalLM", {"layer_types": ["full_attention", "sliding_attention"]},
         "layer_types"),
        ("LlamaForCausalLM", {"rope_parameters": {**ROPE, "rope_type": "yarn", "factor": 4.0}},
         "rope_parameters.rope_type='yarn'"),
        ("LlamaForCausalLM", {"rope_parameters": None, "rope_theta": 1e4,
                              "rope_scaling": {"type": "linear", "factor": 2.0}},
         "rope_scaling.rope_type='linear'"),
        ("LlamaForCausalLM", {"rope_parameters": {**LLAMA3, "attention_factor": 1.0}},
         "rope_parameters.attention_factor"),
        ("LlamaForCausalLM", {"rope_parameters": LLAMA3_NO_FACTOR}, "has no factor"),
        ("Qwen3ForCausalLM", {"partial_rotary_factor": 0.5}, "partial_rotary_factor=0.5"),
        ("Qwen2ForCausalLM", {"num_experts": 8}, "num_experts=8"),
        ("MistralForCausalLM", {"num_local_experts": 8}, "num_local_experts=8"),
        ("LlamaForCausalLM", {"n_routed_experts": 64}, "n_routed_experts=64"),
        ("LlamaForCausalLM", {"attention_bias": True}, "attention_bias=True"),
        ("LlamaForCausalLM", {"mlp_bias": True}, "mlp_bias=True"),
        ("Qwen3ForCausalLM", {"attention_bias": True}, "attention_bias=True"),
        ("LlamaForCausalLM", {"hidden_act": "gelu"}, "hidden_act='gelu'"),
        ("Qwen2ForCausalLM", {"quantization_config": {"quant_method": "awq"}},
         "quantization_config"),
        ("LlamaForCausalLM", {"architectures": ["GPTNeoXForCausalLM"]},
         "GPTNeoXForCausalLM is not supported"),
    ],
)  # fmt: skip
def test_a_config_we_cannot_compute_exactly_is_refused(name, changes, named):
    assert_refused(hf_config_json(name, **changes), named)


def assert_refused(hf: dict, named: str) -> None:
    """Reading config.json ``hf`` raises one line naming it and ``named``."""
    with pytest.raises(ConfigError) as e:
        from_config_json(hf, "hf/config.json").sections(hf, "hf/config.json")
    message = str(e.value)
    assert message.startswith("hf/config.json: ") and named in message and "\n" not in message


def assert_cli_refuses(directory, capsys, hf: dict, named: str) -> None:
    """tools/import_hf.py on a directory holding config.json ``hf`` exits 2 with one line
    naming ``named``, and writes nothing."""
    (directory / "hf").mkdir()
    (directory / "hf" / "config.json").write_text(json.dumps(hf))
    assert import_main(["--input", str(directory / "hf"), "--output", str(directory / "o")]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and named in err, err
    assert not (directory / "o").exists()


def test_the_cli_refuses_in_one_line(tmp_path, capsys):
    hf = hf_config_json("MistralForCausalLM", sliding_window=4096, max_position_embeddings=32768)
    assert_cli_refuses(tmp_path, capsys, hf, "sliding_window=4096")


LLAMA_TINY, GPT_TINY = "configs/llama_tiny.yaml", "configs/gpt_tiny.yaml"


@pytest.mark.parametrize(
    "overrides, imported, expected",
    [
        ([], None, "LlamaForCausalLM"),
        ([], "MistralForCausalLM", "MistralForCausalLM"),
        (["model.add_qkv_bias=true"], None, "Qwen2ForCausalLM"),
        (["model.qk_layernorm=true", "model.kv_channels=16"], None, "Qwen3ForCausalLM"),
        (["model.qk_layernorm=true"], "MistralForCausalLM", "Qwen3ForCausalLM"),
    ],
)
def test_a_rope_gpt_exports_as_the_class_that_holds_it(overrides, imported, expected):
    cfg = load_config([LLAMA_TINY], overrides)
    assert for_checkpoint("gpt", cfg, imported).name == expected


@pytest.mark.parametrize(
    "config, overrides, named",
    [
        (GPT_TINY, ["model.normalization=rmsnorm"], "model.normalization=rmsnorm"),
        (GPT_TINY, ["model.activation=swiglu"], "model.activation=swiglu"),
        (GPT_TINY, ["model.num_query_groups=2"], "model.num_query_groups=2"),
        (LLAMA_TINY, ["model.add_bias_linear=true"], "model.add_bias_linear=True"),
        (LLAMA_TINY, ["model.normalization=layernorm"], "model.normalization=layernorm"),
        (LLAMA_TINY, ["model.activation=gelu"], "model.activation=gelu"),
        (LLAMA_TINY, ["model.position_embedding_type=none"], "model.position_embedding_type=none"),
        (LLAMA_TINY, ["model.rotary_percent=0.5"], "model.rotary_percent=0.5"),
        (LLAMA_TINY, ["model.layernorm_position=post"], "model.layernorm_position=post"),
        (LLAMA_TINY, ["model.qk_layernorm=true", "model.add_qkv_bias=true"],
         "model.add_qkv_bias=True"),
    ],
)  # fmt: skip
def test_a_gpt_no_exported_class_holds_is_refused_in_one_line(config, overrides, named):
    with pytest.raises(ConfigError) as e:
        for_checkpoint("gpt", load_config([config], overrides))
    message = str(e.value)
    assert message.startswith(named) and "\n" not in message
