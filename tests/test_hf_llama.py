"""tools/import_hf.py and tools/export_hf.py on the Llama family against transformers (CPU, fp32).

LlamaForCausalLM (Llama 3.1's RoPE scaling), MistralForCausalLM (no sliding window),
Qwen2ForCausalLM (QKV bias) and Qwen3ForCausalLM (QK norms, head_dim 16 != 32 / 4), each tiny and
random with std 0.1 (norm weights and biases too, so a mapping mistake moves logits by ~1e-1),
4 heads in 2 key/value groups, RoPE theta 500000, untied; built and saved once per module.

- Imported at TP=1 (this process), TP=2 and PP=2 (one 2-process gloo launch for all four):
  logits within 1e-4 of transformers' (~1e-6 measured: summation order), and greedy decoding
  with our KV cache gives HF generate's 32 tokens (not at PP=2, where logits are checked: our
  generation runs without pipeline stages).
- TP=4: 2 groups do not split over 4 ranks, which import refuses in one line; an 8-head,
  4-group variant of each class is checked at TP=4 instead (one 4-process launch).
- export(import(x)) is x tensor for tensor, its config.json loads as x's, and --verify passes
  both ways; a tied model and the older rope_theta + rope_scaling spelling import too.
- The Llama import continues pretraining through pretrain_gpt.py; its first logged loss is
  transformers' on the same batch within 1e-5.
- The refusals (configs we cannot compute, GPTs no class holds): tests/test_hf_llama_refusals.py.
"""

from __future__ import annotations

import contextlib
import io
import json
import shutil
from dataclasses import asdict
from importlib.util import find_spec
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import yaml
from safetensors.torch import load_file

from megatron.checkpoint import find_checkpoint, load_checkpoint
from megatron.checkpoint.train_state import TrainState
from megatron.config.load import config_from_dict, load_config
from megatron.config.schema import padded_vocab_size
from megatron.data.splits import samples_per_split
from megatron.data.tokenizers.factory import build_tokenizer
from megatron.errors import ConfigError
from megatron.inference.generation import generate
from megatron.interop.architectures import ARCHITECTURES
from megatron.interop.importer import import_hf
from megatron.interop.verify import TOLERANCE, sample_inputs
from megatron.models.build import build_model
from megatron.parallel.mappings import gather_from_tp
from megatron.parallel.random import RNGTracker
from megatron.parallel.state import ParallelState, initialize
from tests.distributed import run_distributed
from tests.fixtures.llama3_tokenizer import EOS, write_llama3_style_tokenizer
from tests.gpt_run import _tool, read_metrics, run_pretrain
from tests.test_pretrain_bert import write_corpus
from tools.export_hf import main as export_main
from tools.import_hf import main as import_main

# transformers is imported where it is used: the gloo children import this module to find their
# functions, and would each spend seconds importing it for nothing.
pytestmark = pytest.mark.skipif(find_spec("transformers") is None, reason="needs transformers")
CLASSES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")
ROPE = {"rope_type": "default", "rope_theta": 500000.0}
# original_max_position_embeddings 512 puts head_dim 8's wavelengths in all three llama3 bands.
LLAMA3 = {**ROPE, "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
          "high_freq_factor": 4.0, "original_max_position_embeddings": 512}  # fmt: skip
OWN = {  # each class's own feature (Qwen2's QKV bias is always there)
    "LlamaForCausalLM": {"rope_parameters": LLAMA3},
    "MistralForCausalLM": {"sliding_window": None},
    "Qwen2ForCausalLM": {},
    "Qwen3ForCausalLM": {"head_dim": 16},
}
WIDE = {"num_attention_heads": 8, "num_key_value_heads": 4}  # whole groups at TP=4
PROMPTS = [[5, 17, 42, 9, 8, 7], [6, 5, 4, 3, 100, 200], [30, 40, 50, 60, 70, 80]]
NEW = 32


def hf_config_json(name: str, **changes) -> dict:
    """A tiny config.json of ``name`` as save_pretrained writes its keys, with ``changes``."""
    config = {
        "architectures": [name], "vocab_size": 1000, "hidden_size": 32, "intermediate_size": 64,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "max_position_embeddings": 1024, "initializer_range": 0.1, "rope_parameters": ROPE,
        "tie_word_embeddings": False, "bos_token_id": None, **OWN[name],
    }  # fmt: skip
    return {**config, **changes}


def write_tokenizer(directory: Path) -> tuple[int, int]:
    """Llama 3's tokenizer form plus Qwen's <|endoftext|>, which transformers' Qwen2Tokenizer
    (what AutoTokenizer makes of a qwen2 or qwen3 directory) adds where a file lacks it: so
    every class has the same ids. Returns (ids, the eos id)."""
    from tokenizers import Tokenizer

    write_llama3_style_tokenizer(str(directory), 1000)
    path = str(directory / "tokenizer.json")
    tok = Tokenizer.from_file(path)
    tok.add_special_tokens(["<|endoftext|>"])
    tok.save(path)
    return tok.get_vocab_size(), tok.token_to_id(EOS)


@torch.no_grad()
def hf_outputs(model, eos: int) -> dict:
    """transformers' logits on the sample ids, and NEW greedy tokens per prompt (past eos, told
    so per call as tests/test_generation.py does; the prompts' one length needs no padding)."""
    ids = sample_inputs(model.config.vocab_size, 16, token_types=False)["ids"]  # [2, 16]
    prompts = torch.tensor(PROMPTS)  # [3, 6]
    out = model.generate(
        prompts, max_new_tokens=NEW, do_sample=False, eos_token_id=None, pad_token_id=eos
    )  # [3, 6 + NEW]
    return {"logits": model(input_ids=ids).logits, "generated": out[:, 6:].tolist()}


@pytest.fixture(scope="module")
def llamas(tmp_path_factory) -> dict:
    """Per (class, "base" or "wide"): the saved HF model ("hf") with transformers' outputs; base
    models imported at TP=1 ("tp1") and, by the CLI with --verify, at TP=2 ("tp2", its output
    under "printed"); wide ones at TP=4 ("tp4")."""
    import transformers

    from tests.test_import_hf import random_model

    root = tmp_path_factory.mktemp("hf_llama")
    vocab, eos = write_tokenizer(root / "tokenizer")
    models = {}
    for name in CLASSES:
        for variant, extra in (("base", {}), ("wide", WIDE)):
            config = hf_config_json(name, vocab_size=vocab, eos_token_id=eos, **extra)
            config_class = getattr(transformers, name.replace("ForCausalLM", "Config"))
            config.pop("architectures")
            model = random_model(getattr(transformers, name), config_class(**config))
            hf_dir = root / f"{name}_{variant}"
            model.save_pretrained(hf_dir)
            for f in (root / "tokenizer").iterdir():
                shutil.copy(f, hf_dir)
            outputs = hf_outputs(model, eos)
            models[name, variant] = {"hf": hf_dir, "vocab": vocab, "eos": eos, **outputs}
        base, wide = models[name, "base"], models[name, "wide"]
        base["tp1"], base["tp2"], wide["tp4"] = (root / f"{name}_tp{n}" for n in (1, 2, 4))
        import_hf(str(base["hf"]), str(base["tp1"]), 1)
        import_hf(str(wide["hf"]), str(wide["tp4"]), 4)
        printed = io.StringIO()
        args = ["--input", str(base["hf"]), "--output", str(base["tp2"]), "--verify"]
        with contextlib.redirect_stdout(printed):
            base["exit"] = import_main([*args, "--tensor-parallel-size", "2"])
        base["printed"] = printed.getvalue()
    return models


def load(save_dir: str, st: ParallelState) -> tuple[torch.nn.Module, int, int]:
    """This rank's part of the checkpoint (resharded to ``st``'s TP and PP), its vocabulary and
    hidden size."""
    path, meta = find_checkpoint(save_dir)
    sizes = [
        f"parallel.tensor_parallel_size={st.tp_size}",
        f"parallel.pipeline_parallel_size={st.pp_size}",
    ]
    cfg = config_from_dict(meta["config"], path, sizes)
    vocab = meta["vocab_size"]
    padded = padded_vocab_size(vocab, cfg.model.make_vocab_size_divisible_by, st.tp_size)
    tracker = RNGTracker(st.device)
    tracker.seed(cfg.training.seed, st.tp_rank)
    model = build_model("gpt", cfg, vocab, padded, st, tracker)
    load_checkpoint(save_dir, TrainState(model), st, vocab, finetune=True)
    return model.eval(), vocab, cfg.model.hidden_size


@torch.no_grad()
def run_import(save_dir: str, st: ParallelState) -> dict:
    """Logits on the sample ids (gathered, unpadded) and NEW greedy tokens per prompt, the three
    in one batch through the KV cache (past any eod: the eod passed is never acted on)."""
    model, vocab, _ = load(save_dir, st)
    ids = sample_inputs(vocab, 16, token_types=False)["ids"]
    logits = gather_from_tp(model(ids), st.tp_group)[..., :vocab]
    generated = generate(model, PROMPTS, NEW, 0, stop_at_eod=False)
    return {"logits": logits, "generated": [g.tokens for g in generated]}


@torch.no_grad()
def pipeline_logits(save_dir: str, st: ParallelState) -> torch.Tensor | None:
    """At PP=2: stage 0 embeds and runs layer 0, stage 1 layer 1 and the head; its logits."""
    model, vocab, hidden_size = load(save_dir, st)
    ids = sample_inputs(vocab, 16, token_types=False)["ids"]
    if st.is_first_stage:
        dist.send(model(ids), st.pp_ranks[1])  # [b, s, h]
        return None
    hidden = torch.empty(*ids.shape, hidden_size)
    dist.recv(hidden, st.pp_ranks[0])
    return model(ids, hidden=hidden)[..., :vocab]


def _world_of_two(imports: dict[str, tuple[str, str]]) -> dict:
    """Every class's TP=2 import at TP=2, then its TP=1 import at PP=2 (resharded on load)."""
    out = {}
    st = initialize(2)
    for name, (_, tp2) in imports.items():
        out[name, "tp2"] = run_import(tp2, st)
    st = initialize(1, pp_size=2)
    for name, (tp1, _) in imports.items():
        out[name, "pp2"] = pipeline_logits(tp1, st)
    return out


def _world_of_four(imports: dict[str, str]) -> dict:
    st = initialize(4)
    return {name: run_import(path, st) for name, path in imports.items()}


def assert_matches(got: dict, hf: dict, what: str) -> None:
    assert (got["logits"] - hf["logits"]).abs().max() < TOLERANCE, what
    assert got["generated"] == hf["generated"], what


def test_tp1_imports_match_transformers(llamas):
    """Logits and generation; the imported config spells each class's options out."""
    st = ParallelState.serial(torch.device("cpu"))
    options = {
        "LlamaForCausalLM": ("rope_scaling", {k: float(v) for k, v in LLAMA3.items()
                                              if k not in ("rope_type", "rope_theta")}),
        "MistralForCausalLM": ("kv_channels", 8),
        "Qwen2ForCausalLM": ("add_qkv_bias", True),
        "Qwen3ForCausalLM": ("kv_channels", 16),
    }  # fmt: skip
    for name in CLASSES:
        m = llamas[name, "base"]
        assert_matches(run_import(str(m["tp1"]), st), m, name)
        for variant in ("base", "wide"):  # the continuations change token to token
            assert all(len(set(t)) > 2 for t in llamas[name, variant]["generated"]), name
        model = yaml.safe_load((m["tp1"] / "config.yaml").read_text())["model"]
        key, value = options[name]
        assert model[key] == value, name
        assert (model["num_query_groups"], model["rotary_base"], model["seq_length"]) == (
            2, 500000.0, 1024,
        )  # fmt: skip
        assert model["untie_embeddings_and_output_weights"] and model["hidden_dropout"] == 0.0


@pytest.mark.slow
def test_tp2_and_pp2_imports_match_transformers(llamas):
    imports = {n: (str(llamas[n, "base"]["tp1"]), str(llamas[n, "base"]["tp2"])) for n in CLASSES}
    ranks = run_distributed(_world_of_two, 2, imports)
    for name in CLASSES:
        hf = llamas[name, "base"]
        for rank in ranks:
            assert_matches(rank[name, "tp2"], hf, f"{name} at TP=2")
        assert ranks[0][name, "pp2"] is None
        assert (ranks[1][name, "pp2"] - hf["logits"]).abs().max() < TOLERANCE, name


@pytest.mark.slow
def test_tp4_imports_of_four_groups_match_transformers(llamas):
    ranks = run_distributed(_world_of_four, 4, {n: str(llamas[n, "wide"]["tp4"]) for n in CLASSES})
    for name in CLASSES:
        for rank in ranks:
            assert_matches(rank[name], llamas[name, "wide"], f"{name} at TP=4")


def test_two_groups_at_tp4_are_refused_in_one_line(llamas, tmp_path):
    with pytest.raises(ConfigError) as e:
        import_hf(str(llamas["LlamaForCausalLM", "base"]["hf"]), str(tmp_path / "o"), 4)
    message = str(e.value)
    assert "TP=4 does not divide the checkpoint's model.num_query_groups=2" in message
    assert "\n" not in message and not (tmp_path / "o").exists()


def test_weights_that_do_not_fit_their_config_are_refused_in_one_line(llamas, tmp_path):
    hf_dir = tmp_path / "hf"
    shutil.copytree(llamas["LlamaForCausalLM", "base"]["hf"], hf_dir)
    config = json.loads((hf_dir / "config.json").read_text())
    (hf_dir / "config.json").write_text(json.dumps({**config, "num_key_value_heads": 4}))
    with pytest.raises(ConfigError) as e:
        import_hf(str(hf_dir), str(tmp_path / "o"), 1)
    message = str(e.value)
    assert "self_attn.k_proj.weight [16, 32]" in message and "do not fit" in message, message
    assert "\n" not in message and not (tmp_path / "o").exists()


def test_export_of_an_import_gives_it_back(llamas, tmp_path, capsys):
    """From the TP=2 import (merged on export), with --verify (as the import had); the
    config.json loads in transformers as x's did (every key of x's; ours adds no other but
    Qwen2's head_dim)."""
    import transformers

    for name in CLASSES:
        m, back = llamas[name, "base"], tmp_path / name
        assert m["exit"] == 0 and m["printed"].rstrip().endswith("ok"), m["printed"]  # import's
        assert export_main(["--load", str(m["tp2"]), "--output", str(back), "--verify"]) == 0
        assert capsys.readouterr().out.rstrip().endswith("ok"), name
        original, exported = (
            load_file(m["hf"] / "model.safetensors"),
            load_file(back / "model.safetensors"),
        )
        assert original.keys() == exported.keys(), name
        assert all(torch.equal(original[k], exported[k]) for k in original), name
        want, got = (transformers.AutoConfig.from_pretrained(d).to_dict() for d in (m["hf"], back))
        want.pop("_name_or_path")  # the directory
        assert {k: got.get(k) for k in want} == want, name


def test_a_tied_model_imports_and_exports(llamas, tmp_path):
    """Qwen2.5-0.5B's form: tie_word_embeddings true, no lm_head.weight saved. (Random tied
    models repeat a token: a token's own embedding dominates its logits.)"""
    import transformers

    from tests.test_import_hf import random_model

    m = llamas["Qwen2ForCausalLM", "base"]
    config = hf_config_json("Qwen2ForCausalLM", vocab_size=m["vocab"], tie_word_embeddings=True)
    config.pop("architectures")
    model = random_model(transformers.Qwen2ForCausalLM, transformers.Qwen2Config(**config))
    hf_dir = tmp_path / "hf"
    model.save_pretrained(hf_dir)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(m["hf"] / name, hf_dir)
    assert "lm_head.weight" not in load_file(hf_dir / "model.safetensors")
    import_hf(str(hf_dir), str(tmp_path / "ours"), 1)
    got = run_import(str(tmp_path / "ours"), ParallelState.serial(torch.device("cpu")))
    assert_matches(got, hf_outputs(model, m["eos"]), "tied")
    assert export_main(["--load", str(tmp_path / "ours"), "--output", str(tmp_path / "back")]) == 0
    original, exported = (load_file(d / "model.safetensors") for d in (hf_dir, tmp_path / "back"))
    assert original.keys() == exported.keys()
    assert all(torch.equal(original[k], exported[k]) for k in original)
    assert json.loads((tmp_path / "back" / "config.json").read_text())["tie_word_embeddings"]


def test_both_rope_spellings_read_alike():
    """5.x's rope_parameters, and the older top-level rope_theta + rope_scaling (hub Llama 3.1),
    mean one model to us as to transformers; Llama 2's null scaling is plain RoPE."""
    import transformers

    new = hf_config_json("LlamaForCausalLM")
    old = {k: v for k, v in new.items() if k != "rope_parameters"}
    old.update(
        rope_theta=500000.0, rope_scaling={k: v for k, v in LLAMA3.items() if k != "rope_theta"}
    )
    llama = ARCHITECTURES["LlamaForCausalLM"]
    assert llama.sections(old, "old") == llama.sections(new, "new")
    read = [transformers.LlamaConfig.from_dict(c).rope_parameters for c in (old, new)]
    assert read[0] == read[1] == LLAMA3
    llama2 = {**old, "rope_theta": 10000.0, "rope_scaling": None}
    model = llama.sections(llama2, "llama2")["model"]
    assert (model["rotary_base"], model["rope_scaling"]) == (10000.0, None)


@pytest.mark.slow
def test_continued_pretraining_starts_from_the_imported_loss(llamas, tmp_path):
    """pretrain_gpt.py on the Llama import's config.yaml, 5 iterations on a corpus tokenized by
    the imported tokenizer; its first loss is HF's mean loss on the first global batch, rebuilt
    here by the entrypoint's own dataset builder."""
    import transformers

    import pretrain_gpt

    m = llamas["LlamaForCausalLM", "base"]
    config_yaml = str(m["tp1"] / "config.yaml")
    tokenizer = asdict(load_config([config_yaml], ["data.paths=[unused]"]).tokenizer)
    write_corpus(tmp_path / "corpus.jsonl", num_docs=100)
    _tool(
        "tools/preprocess_data.py", "--input", str(tmp_path / "corpus.jsonl"),
        "--output-prefix", str(tmp_path / "corpus"), "--tokenizer-type", tokenizer["type"],
        "--tokenizer-model", tokenizer["model"], "--append-eod", "--workers", "1",
    )  # fmt: skip
    metrics = tmp_path / "metrics.jsonl"
    overrides = [
        f"data.paths=[{tmp_path / 'corpus_text_document'}]", f"data.cache_dir={tmp_path / 'cache'}",
        "data.num_workers=0", "model.seq_length=32", "training.micro_batch_size=2",
        "training.global_batch_size=4", "training.train_iters=5", "training.eval_iters=0",
        "logging.log_interval=1", f"logging.metrics_file={metrics}",
        f"checkpoint.save={tmp_path / 'finetuned'}",
    ]  # fmt: skip
    run_pretrain("pretrain_gpt.py", config_yaml, overrides)
    logged = read_metrics(metrics)
    assert [e["iteration"] for e in logged] == [1, 2, 3, 4, 5]

    cfg = load_config([config_yaml], overrides)
    tok = build_tokenizer(**asdict(cfg.tokenizer))
    train, _, _ = pretrain_gpt.datasets_provider(cfg, tok, samples_per_split(cfg.training))
    batch = torch.utils.data.default_collate([train[i] for i in range(4)])  # [4, 32] each
    hf = transformers.LlamaForCausalLM.from_pretrained(m["hf"], dtype=torch.float32).eval()
    with torch.no_grad():
        logits = hf(input_ids=batch["tokens"], position_ids=batch["position_ids"]).logits
    losses = torch.nn.functional.cross_entropy(
        logits.flatten(0, 1), batch["labels"].flatten(), reduction="none"
    )
    mask = batch["loss_mask"].flatten()
    expected = float((losses * mask).sum() / mask.sum())
    assert abs(logged[0]["lm_loss"] - expected) < 1e-5, (logged[0]["lm_loss"], expected)
