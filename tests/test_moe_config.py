"""MoE config: the layer pattern, and each bad value refused in one line naming its key before
any process group (``validate`` is what the entrypoints run first)."""

import os

import pytest

from megatron.config.load import load_config
from megatron.errors import ConfigError
from megatron.launch.preflight import validate

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MOE_TINY = os.path.join(ROOT, "configs", "moe_tiny.yaml")


def refusal(*overrides: str, world: int = 2) -> str:
    with pytest.raises(ConfigError) as info:
        validate(load_config([MOE_TINY], list(overrides)), world, check_files=False)
    message = str(info.value)
    assert "\n" not in message
    return message


def test_layer_pattern():
    cfg = load_config([MOE_TINY])
    assert cfg.model.moe_layers == [False, True, True, True]
    every_other = load_config([MOE_TINY], ["model.moe_layer_freq=2"]).model
    assert every_other.moe_layers == [True, False, True, False]
    assert every_other.expert_ffn_hidden_size == 128
    dense = load_config([MOE_TINY], ["model.num_experts=null", "model.moe_router_topk=2"])
    assert dense.model.moe_layers == [False] * 4


@pytest.mark.parametrize(
    "overrides, key",
    [
        (["model.moe_router_topk=9"], "model.moe_router_topk=9"),
        (["model.moe_router_topk=0"], "model.moe_router_topk=0"),
        (["model.moe_layer_freq=[0, 1, 1]"], "model.moe_layer_freq=[0, 1, 1]"),
        (["model.moe_layer_freq=[0, 1, 2, 1]"], "model.moe_layer_freq=[0, 1, 2, 1]"),
        (["model.moe_layer_freq=0"], "model.moe_layer_freq=0"),
        (["model.moe_expert_capacity_factor=0"], "model.moe_expert_capacity_factor=0"),
        (["model.moe_expert_capacity_factor=-1.5"], "model.moe_expert_capacity_factor=-1.5"),
        (
            ["model.moe_router_num_groups=3", "model.moe_router_group_topk=1"],
            "model.moe_router_num_groups=3",
        ),
        (["model.moe_router_num_groups=4"], "model.moe_router_group_topk"),
        (
            ["model.moe_router_num_groups=4", "model.moe_router_group_topk=5"],
            "model.moe_router_group_topk=5",
        ),
        (["model.moe_ffn_hidden_size=129"], "model.moe_ffn_hidden_size=129"),
        (["model.add_bias_linear=true"], "model.add_bias_linear=true"),
        (
            ["model.num_experts=null"],
            "model.moe_ffn_hidden_size, model.moe_layer_freq",
        ),  # moe_* keys with no experts
        (
            ["model.moe_shared_expert_intermediate_size=null", "model.moe_shared_expert_gate=true"],
            "model.moe_shared_expert_gate=true",
        ),
    ],
)
def test_bad_values_are_one_line_naming_the_key(overrides, key):
    assert key in refusal(*overrides)


@pytest.mark.parametrize(
    "overrides, world, key",
    [
        (
            [
                "parallel.expert_parallel_size=3",
                "parallel.tensor_parallel_size=1",
                "training.global_batch_size=12",
            ],
            3,
            "model.num_experts=8",
        ),  # fmt: skip
        (["parallel.expert_parallel_size=4"], 4, "DP x CP = 2 x 1 = 2"),  # TP2: DP is 2
        (["parallel.expert_parallel_size=2", "model.num_experts=null"], 4, "dense model"),
    ],
)
def test_bad_expert_parallel_sizes_are_one_line(overrides, world, key):
    no_ckpt = ["checkpoint.save=null", "model.moe_layer_freq=1"]
    if "model.num_experts=null" in overrides:  # the moe_* keys of moe_tiny would speak first
        no_ckpt += [
            f"model.{k}=null"
            for k in ("moe_ffn_hidden_size", "moe_shared_expert_intermediate_size")
        ]
        no_ckpt += ["model.moe_aux_loss_coeff=0", "model.moe_z_loss_coeff=0"]
    message = refusal(*no_ckpt, *overrides, world=world)
    assert "parallel.expert_parallel_size" in message and key in message
