"""The Llama-family options (``model.*``) in the estimates and the config checks.

- The estimates: parameter counts equal the model's, one layer's activation bytes equal what
  autograd saves, FLOPs equal what torch's FLOP counter counts; the dry run reports llama_tiny.
- Each refused option is one ConfigError line naming the key, before any process group.

The per-TP-rank estimates run with the TP tests, in tests/test_llama_model.py.
"""

from __future__ import annotations

import io

import pytest
import torch
import torch.distributed as dist
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from megatron.config.load import load_config, parse_args
from megatron.estimate.activations import layer_activation_bytes
from megatron.estimate.flops import flops_per_iteration
from megatron.estimate.parameters import count_parameters
from megatron.launch.dry_run import dry_run
from megatron.launch.preflight import validate
from megatron.models.bert import BertModel
from megatron.models.gpt import GPTModel
from megatron.parallel.random import RNGTracker
from tests.model_config import tiny_model_config
from tests.test_config import error_of
from tests.test_document_mask import packed_batch
from tests.test_estimate import _check_model_bytes, saved_bytes
from tests.test_llama_model import (
    BERT,
    CPU,
    LLAMA,
    LLAMA_TINY,
    VARIANTS,
    VOCAB,
    _composite_rms_bytes,
)

ESTIMATE_CASES = {
    **VARIANTS,
    "mqa": {**LLAMA, "num_query_groups": 1},
    "gqa_layernorm_bias": {**LLAMA, "normalization": "layernorm", "add_bias_linear": True},
    "swiglu_only": {"activation": "swiglu", "ffn_hidden_size": 96},
    "no_positions": {"position_embedding_type": "none", "qk_layernorm": True},
}


@pytest.mark.parametrize("case", list(ESTIMATE_CASES))
def test_estimates_count_the_model(case):
    """Parameters exactly; one layer's saved bytes exactly, but for the copy x * rstd that
    torch's composite CPU RMSNorm saves besides the input and rstd of the fused CUDA kernel the
    estimate counts, and the whole model's as tests/test_estimate.py checks them (up to index
    tensors); FLOPs as torch's counter counts the forward's matmuls and attention (math SDPA,
    whose matmuls it sees) for one sample."""
    overrides = ESTIMATE_CASES[case]
    saved, models = {}, {}
    for layers in (1, 2):
        cfg = tiny_model_config(**{**overrides, "num_layers": layers})
        tracker = RNGTracker(CPU.device)
        tracker.seed(1, 0)
        models[layers] = model = GPTModel(cfg, VOCAB, 256, CPU, tracker).train()
        tokens = torch.randint(0, VOCAB, (2, cfg.seq_length))
        saved[layers] = saved_bytes(model, tokens, packed_batch(n=2)[2], labels=tokens)
    cfg, model = tiny_model_config(**overrides), models[2]
    params = count_parameters(cfg, 256, 1)
    assert sum(p.numel() for p in model.parameters()) == params.total
    assert saved[2] - saved[1] == layer_activation_bytes(cfg, 2, 1, 4) + _composite_rms_bytes(cfg)
    final_norm = 4 * 2 * cfg.seq_length * cfg.hidden_size * (cfg.normalization == "rmsnorm")
    _check_model_bytes(saved[2] - 2 * _composite_rms_bytes(cfg) - final_norm, overrides, VOCAB, 1)
    with FlopCounterMode(display=False) as counter, sdpa_kernel(SDPBackend.MATH):
        with torch.no_grad():
            model(torch.randint(0, VOCAB, (1, cfg.seq_length)))
    assert 3 * counter.get_total_flops() == flops_per_iteration(cfg, 256, 1)


@pytest.mark.parametrize("position", ["pre", "post"])
def test_estimate_counts_bert_with_the_decoder_options(position):
    cfg = tiny_model_config(**BERT, layernorm_position=position)
    tracker = RNGTracker(CPU.device)
    tracker.seed(1, 0)
    model = BertModel(cfg, VOCAB, 256, CPU, tracker, 2, "sop")
    count = count_parameters(cfg, 256, 1, "bert", 2, True).total
    assert sum(p.numel() for p in model.parameters()) == count


def test_dry_run_reports_llama_tiny_at_tp2_pp2():
    argv = ["--config", LLAMA_TINY, "--dry-run", "--world-size", "4",
            "parallel.pipeline_parallel_size=2",
            "tokenizer.model=tests/fixtures/tokenizers/sp-bpe.model"]  # fmt: skip
    cfg, args = parse_args(argv)
    out = io.StringIO()
    assert dry_run(cfg, args, out=out) == 0
    total, text = count_parameters(cfg.model, 1024, 2).total, out.getvalue()
    assert f"parameters: {total:,} total" in text and "FLOPs per iteration" in text


# --- Refused options ---


def llama_tiny(*overrides: str):
    return load_config([LLAMA_TINY], list(overrides))


REFUSED = [
    (("model.num_query_groups=3",), 2, "model.num_query_groups=3 does not divide"),
    (("model.num_query_groups=2", "parallel.tensor_parallel_size=4"), 4,
     "model.num_query_groups=2 is not divisible by parallel.tensor_parallel_size=4"),
    (("model.ffn_hidden_size=701",), 2, "model.ffn_hidden_size=701 is not divisible"),
    (("model.position_embedding_type=learned", "model.rope_scaling={factor: 8}"), 2,
     "model.rope_scaling scales RoPE's frequencies and needs model.position_embedding_type=rope"),
    (("model.rope_scaling={factor: 8}",), 2, "model.rope_scaling={'factor': 8.0} must be"),
    (("model.rope_scaling={factor: 8, low_freq_factor: 4, high_freq_factor: 1, "
      "original_max_position_embeddings: 8192}",), 2, "model.rope_scaling={'factor': 8.0"),
    (("model.rope_scaling=8",), 2, "model.rope_scaling=8 is not of type"),
    (("model.rotary_percent=0",), 2, "model.rotary_percent=0.0 must be in (0, 1]"),
    (("model.rotary_percent=1.5",), 2, "model.rotary_percent=1.5 must be in (0, 1]"),
    (("model.rotary_percent=0.3",), 2, "model.rotary_percent=0.3 of head_dim 64 rotates 19"),
    (("model.kv_channels=0",), 2, "model.kv_channels=0 must be positive"),
    (("model.type=bert",), 2, "model.untie_embeddings_and_output_weights=true is for GPT"),
]  # fmt: skip


@pytest.mark.parametrize(("overrides", "world", "message"), REFUSED)
def test_refused_options_name_the_key(overrides, world, message):
    """Loading (types) or validating (before any process group): one line naming the key."""
    assert message in error_of(lambda: validate(llama_tiny(*overrides), world, check_files=False))
    assert not dist.is_initialized()


def test_llama_tiny_validates_and_head_dim_needs_no_divisible_width():
    validate(llama_tiny(), 2, check_files=False)
    cfg = llama_tiny("model.hidden_size=250", "model.kv_channels=64")  # 250 / 4 heads: no
    validate(cfg, 2, check_files=False)
    assert cfg.model.head_dim == 64 and cfg.model.query_groups == 2
