"""tools/import_hf.py and tools/export_hf.py on the mixture-of-experts classes against
transformers (CPU, fp32).

MixtralForCausalLM (experts in every layer, renormalised top-k), Qwen2MoeForCausalLM (QKV bias,
a gated shared expert, weights not renormalised, layer 1 dense through mlp_only_layers) and
Qwen3MoeForCausalLM (QK norms, renormalised, decoder_sparse_step 2: layers 1 and 3 MoE; hidden
64, where 32 repeats one token), each
tiny and random with std 0.1 (norm weights too, so a mapping mistake moves logits by ~1e-1),
4 experts, top-2, 4 heads in 2 key/value groups, untied; built and saved once per module.

- Imported at TP=1 (this process) and, by the CLI with --verify, at TP=2 (one 2-process gloo
  launch for all three): logits within 1e-4 of transformers' (~1e-6 measured: summation
  order), and greedy decoding with our KV cache gives HF generate's 32 tokens.
- export(import(x)) is x tensor for tensor, its config.json loads as x's, and --verify passes
  both ways.
- The refusals: tests/test_hf_moe_refusals.py.
"""

from __future__ import annotations

import contextlib
import io
import shutil
from importlib.util import find_spec

import pytest
import torch
import yaml
from safetensors.torch import load_file

from megatron.interop.importer import import_hf
from megatron.parallel.state import ParallelState, initialize
from tests.distributed import run_distributed
from tests.test_hf_llama import ROPE, assert_matches, hf_outputs, run_import, write_tokenizer
from tools.export_hf import main as export_main
from tools.import_hf import main as import_main

pytestmark = pytest.mark.skipif(find_spec("transformers") is None, reason="needs transformers")
CLASSES = ("MixtralForCausalLM", "Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM")
OWN = {  # each class's own MoE form
    "MixtralForCausalLM": {"num_local_experts": 4, "intermediate_size": 48, "sliding_window": None},
    "Qwen2MoeForCausalLM": {
        "num_experts": 4, "num_hidden_layers": 3, "moe_intermediate_size": 24,
        "shared_expert_intermediate_size": 48, "mlp_only_layers": [1], "norm_topk_prob": False,
    },
    "Qwen3MoeForCausalLM": {
        "num_experts": 4, "num_hidden_layers": 4, "hidden_size": 64, "moe_intermediate_size": 24,
        "decoder_sparse_step": 2, "norm_topk_prob": True,
    },
}  # fmt: skip
# What each import's model section says of its experts.
EXPECTED = {
    "MixtralForCausalLM": {"moe_layer_freq": 1, "moe_ffn_hidden_size": 48,
                           "moe_router_pre_softmax": False},
    "Qwen2MoeForCausalLM": {"moe_layer_freq": [1, 0, 1], "moe_shared_expert_gate": True,
                            "moe_shared_expert_intermediate_size": 48, "add_qkv_bias": True,
                            "moe_router_pre_softmax": True},
    "Qwen3MoeForCausalLM": {"moe_layer_freq": [0, 1, 0, 1], "qk_layernorm": True,
                            "moe_router_pre_softmax": False},
}  # fmt: skip


def hf_config_json(name: str, **changes) -> dict:
    """A tiny config.json of ``name`` as save_pretrained writes its keys, with ``changes``."""
    config = {
        "architectures": [name], "vocab_size": 1000, "hidden_size": 32, "intermediate_size": 64,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "max_position_embeddings": 1024, "initializer_range": 0.1, "rope_parameters": ROPE,
        "tie_word_embeddings": False, "bos_token_id": None, "num_experts_per_tok": 2,
        "router_aux_loss_coef": 0.01, **OWN[name],
    }  # fmt: skip
    return {**config, **changes}


def random_moe(name: str, config: dict) -> torch.nn.Module:
    """``tests.test_import_hf.random_model``, every parameter checked to be drawn (a router
    left at zero would tie every expert and hide a swapped mapping)."""
    import transformers

    from tests.test_import_hf import random_model

    config_class = getattr(transformers, name.replace("ForCausalLM", "Config"))
    config = {k: v for k, v in config.items() if k != "architectures"}
    model = random_model(getattr(transformers, name), config_class(**config))
    assert all(p.std() > 0.05 for p in model.parameters() if p.numel() > 1), name
    return model


@pytest.fixture(scope="module")
def moes(tmp_path_factory) -> dict:
    """Per class: the saved HF model ("hf") with transformers' outputs; imported at TP=1
    ("tp1") and, by the CLI with --verify, at TP=2 ("tp2", its output under "printed")."""
    root = tmp_path_factory.mktemp("hf_moe")
    vocab, eos = write_tokenizer(root / "tokenizer")
    models = {}
    for name in CLASSES:
        model = random_moe(name, hf_config_json(name, vocab_size=vocab, eos_token_id=eos))
        hf_dir = root / name
        model.save_pretrained(hf_dir)
        for f in (root / "tokenizer").iterdir():
            shutil.copy(f, hf_dir)
        m = models[name] = {"hf": hf_dir, "vocab": vocab, "eos": eos, **hf_outputs(model, eos)}
        m["tp1"], m["tp2"] = root / f"{name}_tp1", root / f"{name}_tp2"
        import_hf(str(hf_dir), str(m["tp1"]), 1)
        printed = io.StringIO()
        args = ["--input", str(hf_dir), "--output", str(m["tp2"]), "--verify"]
        with contextlib.redirect_stdout(printed):
            m["exit"] = import_main([*args, "--tensor-parallel-size", "2"])
        m["printed"] = printed.getvalue()
    return models


def _world_of_two(imports: dict[str, str]) -> dict:
    st = initialize(2)
    return {name: run_import(path, st) for name, path in imports.items()}


def test_tp1_imports_match_transformers(moes):
    """Logits and generation; the imported config spells each class's experts out."""
    st = ParallelState.serial(torch.device("cpu"))
    for name in CLASSES:
        m = moes[name]
        got = run_import(str(m["tp1"]), st)
        print(f"{name} TP=1 max |logit diff| {(got['logits'] - m['logits']).abs().max():.3g}")
        assert_matches(got, m, name)
        assert all(len(set(t)) > 2 for t in m["generated"]), name  # continuations vary
        model = yaml.safe_load((m["tp1"] / "config.yaml").read_text())["model"]
        assert {k: model[k] for k in EXPECTED[name]} == EXPECTED[name], name
        assert (model["num_experts"], model["moe_router_topk"]) == (4, 2), name
        assert model["moe_aux_loss_coeff"] == 0.01, name


@pytest.mark.slow
def test_tp2_imports_match_transformers(moes):
    ranks = run_distributed(_world_of_two, 2, {n: str(moes[n]["tp2"]) for n in CLASSES})
    for name in CLASSES:
        for rank in ranks:
            diff = (rank[name]["logits"] - moes[name]["logits"]).abs().max()
            print(f"{name} TP=2 max |logit diff| {diff:.3g}")
            assert_matches(rank[name], moes[name], f"{name} at TP=2")


def test_export_of_an_import_gives_it_back(moes, tmp_path, capsys):
    """From the TP=2 import (merged on export), with --verify (as the import had); the
    config.json loads in transformers as x's did (every key of x's)."""
    import transformers

    for name in CLASSES:
        m, back = moes[name], tmp_path / name
        assert m["exit"] == 0 and m["printed"].rstrip().endswith("ok"), m["printed"]  # import's
        assert export_main(["--load", str(m["tp2"]), "--output", str(back), "--verify"]) == 0
        printed = capsys.readouterr().out
        print(printed)
        assert printed.rstrip().endswith("ok"), name
        original, exported = (load_file(d / "model.safetensors") for d in (m["hf"], back))
        assert original.keys() == exported.keys(), name
        assert all(torch.equal(original[k], exported[k]) for k in original), name
        want, got = (transformers.AutoConfig.from_pretrained(d).to_dict() for d in (m["hf"], back))
        want.pop("_name_or_path")  # the directory
        assert {k: got.get(k) for k in want} == want, name
