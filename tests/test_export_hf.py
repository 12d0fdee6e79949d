"""tools/export_hf.py against transformers: trained checkpoints at TP=1, 2 and 4 and at
TP=2 x PP=2, and BERTs of both LayerNorm placements, give HF models whose logits equal ours.

Our reference is the checkpoint loaded at TP=1 by the training's own load path (a world of one,
no process group). The limit 1e-4 (fp32) leaves room for summation order and the two spellings
of tanh-GeLU (~1e-6 measured); a mapping mistake moves logits by ~1e-1.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from dataclasses import asdict
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from torch import nn

from megatron.checkpoint import find_checkpoint, load_checkpoint
from megatron.checkpoint.train_state import TrainState
from megatron.config.load import config_from_dict
from megatron.config.schema import padded_vocab_size
from megatron.inference.loading import model_type
from megatron.interop.export import export_hf
from megatron.interop.hf_tokenizer import tokenizer_note
from megatron.interop.verify import TOLERANCE, sample_inputs
from megatron.models.build import build_model
from megatron.parallel.random import RNGTracker
from megatron.parallel.state import ParallelState
from tests.gpt_run import ROOT, run_pretrain, tiny_overrides
from tests.test_pretrain_bert import bert_data, bert_overrides  # noqa: F401 (a fixture)
from tools.checkpoint_util import main as checkpoint_util

transformers = pytest.importorskip("transformers")


def load_ours(save_dir: str) -> nn.Module:
    """The newest checkpoint of ``save_dir`` in our model at TP=1, loaded as training loads it."""
    path, meta = find_checkpoint(save_dir)
    cfg = config_from_dict(meta["config"], path)
    vocab = meta["vocab_size"]
    padded = padded_vocab_size(vocab, cfg.model.make_vocab_size_divisible_by, 1)
    state = ParallelState.serial(torch.device("cpu"))
    tracker = RNGTracker(state.device)
    tracker.seed(cfg.training.seed, 0)
    model = build_model(model_type(meta), cfg, vocab, padded, state, tracker)
    load_checkpoint(save_dir, TrainState(model), state, vocab, finetune=True)
    return model.eval()


@torch.no_grad()
def logit_difference(ours: nn.Module, hf: nn.Module, vocab: int, bert: bool) -> float:
    """max |ours - HF| over the real vocabulary's logits (and BERT's sentence-order logits) on
    fixed ids; BERT's carry a padding mask, and token types where the model has them."""
    x = sample_inputs(vocab, 32, token_types=bert and ours.embedding.tokentype is not None)
    if not bert:
        return (ours(x["ids"])[..., :vocab] - hf(input_ids=x["ids"]).logits).abs().max().item()
    lm, binary = ours(x["ids"], x["types"], x["mask"])
    out = hf(input_ids=x["ids"], token_type_ids=x["types"], attention_mask=x["mask"])
    hf_lm = out.prediction_logits if binary is not None else out.logits
    diff = (lm[..., :vocab] - hf_lm).abs().max()
    if binary is not None:
        diff = max(diff, (binary - out.seq_relationship_logits).abs().max())
    return float(diff)


def hf_model(hf_dir: str) -> nn.Module:
    """The exported model as transformers' Auto class for its task loads it, in fp32."""
    config = json.loads(Path(hf_dir, "config.json").read_text())
    auto = (
        transformers.AutoModelForCausalLM
        if config["model_type"] == "gpt2"
        else transformers.AutoModelForPreTraining
    )
    return auto.from_pretrained(hf_dir, dtype=torch.float32).eval()


def run_tool(*args: str) -> subprocess.CompletedProcess:
    """A tool as a user runs it."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run(
        [sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120
    )


def run_without_transformers(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    """A tool as a user runs it where transformers is not installed: a package of that name
    first on the path raises what a missing one does."""
    stub = tmp_path / "no_transformers" / "transformers"
    stub.mkdir(parents=True)
    (stub / "__init__.py").write_text(
        "raise ModuleNotFoundError(\"No module named 'transformers'\")\n"
    )
    path = os.pathsep.join(p for p in (str(stub.parent), os.environ.get("PYTHONPATH")) if p)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": path}
    return subprocess.run(
        [sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120
    )


def assert_verify_refused(proc: subprocess.CompletedProcess, output: Path) -> None:
    """Exit 2 and one line with the install command, no traceback, and nothing written: no
    output, and no staging directory beside it."""
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert proc.stderr.splitlines() == [
        "error: --verify needs transformers (No module named 'transformers'): "
        f"{sys.executable} -m pip install transformers"
    ]
    assert not output.exists() and not list(output.parent.glob(f".{output.name}.tmp-*"))


@pytest.fixture(scope="module")
def gpt_layouts(trained_gpt, tmp_path_factory) -> dict[int, str]:
    """The trained TP=2 GPT's save directory, and its reshards to TP=1 and TP=4."""
    root = tmp_path_factory.mktemp("gpt_layouts")
    dirs = {2: trained_gpt["ckpt"]}
    for tp in (1, 4):
        dirs[tp] = str(root / f"tp{tp}")
        args = ["--input", trained_gpt["ckpt"], "--output", dirs[tp], "--target-tp", str(tp)]
        assert checkpoint_util(args) == 0
    return dirs


@pytest.mark.slow
def test_gpt_exports_at_every_tp_size_match_ours(gpt_layouts, trained_gpt, tmp_path):
    ours = load_ours(trained_gpt["ckpt"])
    exported = {}
    for tp, save_dir in gpt_layouts.items():
        out = export_hf(save_dir, str(tmp_path / f"hf_tp{tp}"))
        model = hf_model(out)
        assert type(model).__name__ == "GPT2LMHeadModel"
        assert logit_difference(ours, model, ours.vocab_size, bert=False) < TOLERANCE
        exported[tp] = load_file(f"{out}/model.safetensors")
    # Merging is concatenation and slicing: every TP size exports the same numbers.
    for tp in (1, 4):
        assert exported[tp].keys() == exported[2].keys()
        assert all(torch.equal(exported[tp][k], exported[2][k]) for k in exported[2])
    weights = exported[2]
    assert weights["transformer.wte.weight"].shape == (512, 64)  # padding rows cut off
    assert "lm_head.weight" not in weights  # tied: from_pretrained ties it again
    config = json.loads((tmp_path / "hf_tp2" / "config.json").read_text())
    assert config["tie_word_embeddings"] and config["activation_function"] == "gelu"

    # sentencepiece: copied as it is, with a note on how to load it.
    out = str(tmp_path / "hf_tp2")
    assert Path(out, "tokenizer.model").read_bytes() == Path(trained_gpt["tokenizer"]).read_bytes()
    assert "sentencepiece.SentencePieceProcessor" in tokenizer_note(out)


@pytest.mark.slow
def test_a_tp2_pp2_checkpoint_exports_like_its_merged_copy(gpt_data, tmp_path):
    """Saved at TP=2 x PP=2 (4 layers, one file per (TP, PP) rank, the tied word table on both
    end stages), the export matches our model loaded at TP=1 x PP=1 and equals, tensor for
    tensor, the export of the checkpoint merged into one file by tools/checkpoint_util.py."""
    run = tmp_path / "run"
    extra = {
        "model.num_layers": 4,
        "parallel.tensor_parallel_size": 2,
        "parallel.pipeline_parallel_size": 2,
        "training.train_iters": 2,
        "training.eval_iters": 0,
        "optimizer.lr_warmup_iters": 1,
        "logging.tensorboard_dir": None,
        "checkpoint.save": run / "ckpt",
    }
    run_pretrain(
        "pretrain_gpt.py", "configs/gpt_tiny.yaml", tiny_overrides(gpt_data, run, **extra), 4
    )
    save_dir = str(run / "ckpt")
    merged = str(tmp_path / "merged")
    assert checkpoint_util(["--input", save_dir, "--output", merged, "--merge"]) == 0
    ours = load_ours(save_dir)
    out = export_hf(save_dir, str(tmp_path / "hf_pp2"))
    assert logit_difference(ours, hf_model(out), ours.vocab_size, bert=False) < TOLERANCE
    exported = load_file(f"{out}/model.safetensors")
    from_merged = load_file(f"{export_hf(merged, str(tmp_path / 'hf_merged'))}/model.safetensors")
    assert exported.keys() == from_merged.keys()
    assert all(torch.equal(exported[k], from_merged[k]) for k in exported)
    assert sum(k.startswith("transformer.h.") and k.endswith(".ln_1.weight") for k in exported) == 4


def test_cli_exports_bf16_and_verifies(gpt_layouts, tmp_path, capsys):
    from tools.export_hf import main

    out = tmp_path / "hf_bf16"
    args = ["--load", gpt_layouts[1], "--output", str(out), "--dtype", "bf16", "--verify"]
    assert main(args) == 0
    lines = capsys.readouterr().out.splitlines()
    verdicts = [line for line in lines if line.startswith("verify:")]
    assert len(verdicts) == 1 and verdicts[0].endswith("ok"), lines
    assert any("SentencePieceProcessor" in line for line in lines)  # the one-line note
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    assert {t.dtype for t in load_file(str(out / "model.safetensors")).values()} == {torch.bfloat16}


@pytest.fixture(scope="module")
def trained_berts(bert_data, tmp_path_factory) -> dict[str, str]:  # noqa: F811 (the fixture)
    """Tiny BERTs trained a few steps by pretrain_bert.py: pre-LN at TP=2, post-LN at TP=1."""
    root = tmp_path_factory.mktemp("trained_berts")
    dirs = {}
    for position, tp in (("pre", 2), ("post", 1)):
        run, dirs[position] = root / position, str(root / position / "ckpt")
        overrides = bert_overrides(
            bert_data,
            run,
            **{
                "model.layernorm_position": position,
                "parallel.tensor_parallel_size": tp,
                "training.train_iters": 2,
                "training.eval_iters": 0,
                "optimizer.lr_warmup_iters": 1,
                "checkpoint.save": dirs[position],
            },
        )
        run_pretrain("pretrain_bert.py", "configs/bert_tiny.yaml", overrides, nproc=tp)
    return dirs


@pytest.mark.slow
@pytest.mark.parametrize(
    "position, architecture",
    [("pre", "MegatronBertForPreTraining"), ("post", "BertForPreTraining")],
)
def test_bert_exports_match_ours(trained_berts, tmp_path, position, architecture):
    out = export_hf(trained_berts[position], str(tmp_path / "hf"))
    model = hf_model(out)
    assert type(model).__name__ == architecture
    ours = load_ours(trained_berts[position])
    vocab = ours.vocab_size
    assert logit_difference(ours, model, vocab, bert=True) < TOLERANCE

    # WordPiece: AutoTokenizer gives the ids of the checkpoint's tokenizer (ours adds no special
    # tokens), lower-casing included.
    from megatron.data.tokenizers.factory import build_tokenizer

    path, meta = find_checkpoint(trained_berts[position])
    ours_tok = build_tokenizer(**asdict(config_from_dict(meta["config"], path).tokenizer))
    tok = transformers.AutoTokenizer.from_pretrained(out)
    text = "Kari tomo enarex, quith strings!"
    assert tok(text, add_special_tokens=False)["input_ids"] == ours_tok.encode(text)


def test_post_ln_gpt_is_refused_in_one_line(gpt_layouts, tmp_path):
    post = tmp_path / "post"
    shutil.copytree(gpt_layouts[1], post)
    meta_path = post / "iter_0000020" / "meta.json"
    meta = json.loads(meta_path.read_text())
    meta["config"]["model"]["layernorm_position"] = "post"
    meta_path.write_text(json.dumps(meta))
    proc = run_tool("tools/export_hf.py", "--load", str(post), "--output", str(tmp_path / "o"))
    assert proc.returncode == 2 and "post-LN" in proc.stderr, proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1 and "Traceback" not in proc.stderr
    assert not (tmp_path / "o").exists()


def test_missing_or_damaged_checkpoint_and_occupied_output_are_refused(
    gpt_layouts, tmp_path, capsys
):
    from tools.export_hf import main

    damaged = tmp_path / "damaged"
    shutil.copytree(gpt_layouts[1], damaged)
    shard = damaged / "iter_0000020" / "model_optim_tp00.safetensors"
    data = bytearray(shard.read_bytes())
    data[-1] ^= 0xFF
    shard.write_bytes(bytes(data))
    occupied = tmp_path / "occupied"
    occupied.mkdir()
    (occupied / "mine.txt").write_text("keep me")
    cases = [
        (str(tmp_path / "nowhere"), str(tmp_path / "o"), "no such directory"),
        (str(damaged), str(tmp_path / "o"), "does not match its xxh3_128 checksum"),
        (gpt_layouts[1], str(occupied), "not empty"),
    ]
    for load, output, expected in cases:
        assert main(["--load", load, "--output", output]) == 2
        err = capsys.readouterr().err
        assert expected in err and len(err.strip().splitlines()) == 1, err
    assert (occupied / "mine.txt").read_text() == "keep me"
    assert not (tmp_path / "o").exists()


def test_verify_without_transformers_is_refused_before_writing(wide_gpt, tmp_path):
    out = tmp_path / "hf"
    proc = run_without_transformers(
        tmp_path, "tools/export_hf.py", "--load", wide_gpt["ckpt"], "--output", str(out), "--verify"
    )
    assert_verify_refused(proc, out)


def test_a_gpt_without_an_exported_class_is_refused_in_one_line():
    """A GPT with learned positions exports as GPT-2, a Llama-style one as a Llama-family class
    (tests/test_hf_llama.py); SwiGLU with learned positions has neither form and must not be
    written as GPT-2."""
    from megatron.config.load import load_config
    from megatron.errors import ConfigError
    from megatron.interop.architectures import for_checkpoint

    assert for_checkpoint("gpt", load_config(["configs/gpt_tiny.yaml"])).name == "GPT2LMHeadModel"
    llama = load_config(["configs/llama_tiny.yaml"])
    assert for_checkpoint("gpt", llama).name == "LlamaForCausalLM"
    swiglu = load_config(["configs/gpt_tiny.yaml"], ["model.activation=swiglu"])
    with pytest.raises(ConfigError, match=r"^model\.activation=swiglu: "):
        for_checkpoint("gpt", swiglu)
