"""tools/import_hf.py against transformers: random HF models become our checkpoints whose logits
equal HF's (GPT-2 at TP=2 in real gloo processes, BERTs at TP=1), that train through the real
entrypoint, and that export back to the very same tensors.

The GPT-2 has the real vocabulary size (50257 ids, padded to 50432 rows at TP=2) and a tokenizer
of exactly that many ids saved with it, so data preprocessed with that tokenizer trains it.
Weights are drawn with std 0.1 (not 0.02) so that a mapping mistake moves logits far past the
1e-4 limit; see tests/test_export_hf.py for the limit itself.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file

from megatron.config.load import load_config
from megatron.interop.export import export_hf
from megatron.interop.importer import import_hf
from megatron.interop.verify import TOLERANCE, sample_inputs
from megatron.launch.preflight import validate
from tests.distributed import run_distributed
from tests.gpt_run import _tool, read_metrics
from tests.test_export_hf import (
    assert_verify_refused,
    load_ours,
    logit_difference,
    run_tool,
    run_without_transformers,
)
from tests.test_pretrain_bert import VOCAB_FILE, write_corpus
from tools.import_hf import main as import_main

transformers = pytest.importorskip("transformers")
GPT2_VOCAB = 50257
EOD = "<|endoftext|>"


def word_level_tokenizer(corpus: Path, path: Path) -> None:
    """A whitespace WordLevel tokenizer.json of exactly GPT-2's 50257 ids: the corpus's words,
    fillers, and <|endoftext|> last (id 50256), as in GPT-2."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = {"[UNK]": 0}
    for line in corpus.read_text().splitlines():
        for word in json.loads(line)["text"].replace(".", " .").split():
            words.setdefault(word, len(words))
    for i in range(len(words), GPT2_VOCAB - 1):
        words[f"<unused{i}>"] = i
    words[EOD] = GPT2_VOCAB - 1
    tok = Tokenizer(models.WordLevel(vocab=words, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens([EOD])
    tok.save(str(path))


def random_model(cls, config) -> torch.nn.Module:
    """A transformers model with its own std-0.1 init, and random biases and LayerNorms (HF
    starts them at 0 and 1, where a bias put in the wrong place would go unnoticed)."""
    torch.manual_seed(0)
    model = cls(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1:
                p.normal_(1.0 if name.endswith("weight") else 0.0, 0.1)
    return model


@pytest.fixture(scope="module")
def gpt2(tmp_path_factory) -> dict[str, Path]:
    """A random GPT2LMHeadModel (real vocabulary size, tiny otherwise), its tokenizer and a
    corpus preprocessed with that tokenizer; imported at TP=2 by tools/import_hf.py, whose
    printed commands are under "hint"."""
    root = tmp_path_factory.mktemp("gpt2")
    hf_dir = root / "hf"
    config = transformers.GPT2Config(
        vocab_size=GPT2_VOCAB, n_embd=64, n_layer=2, n_head=4, n_positions=64,
        activation_function="gelu_new", initializer_range=0.1,
        bos_token_id=GPT2_VOCAB - 1, eos_token_id=GPT2_VOCAB - 1,
    )  # fmt: skip
    random_model(transformers.GPT2LMHeadModel, config).save_pretrained(hf_dir)
    write_corpus(root / "corpus.jsonl", num_docs=200)
    word_level_tokenizer(root / "corpus.jsonl", hf_dir / "tokenizer.json")
    ours = root / "ours"
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        assert (
            import_main(
                ["--input", str(hf_dir), "--output", str(ours), "--tensor-parallel-size", "2"]
            )
            == 0
        )
    hint = [line.strip() for line in printed.getvalue().splitlines() if line.startswith("  ")]
    _tool(
        "tools/preprocess_data.py",
        "--input", str(root / "corpus.jsonl"),
        "--output-prefix", str(root / "corpus"),
        "--tokenizer-type", "hf",
        "--tokenizer-model", str(ours / "tokenizer" / "tokenizer.json"),
        "--append-eod",
        "--workers", "1",
    )  # fmt: skip
    data = root / "corpus_text_document"
    return {"root": root, "hf": hf_dir, "ours": ours, "data": data, "hint": hint}


def _tp_logits(save_dir: str, ids: torch.Tensor) -> torch.Tensor:
    """This rank's vocabulary slice of the logits, with the checkpoint loaded at TP=2."""
    from megatron.inference.loading import load_for_inference

    loaded = load_for_inference(save_dir, [], tp_size=2)
    with torch.no_grad():
        return loaded.model(ids)


@pytest.mark.slow
def test_gpt2_import_at_tp2_matches_hf(gpt2):
    ids = sample_inputs(GPT2_VOCAB, 16, token_types=False)["ids"]
    shards = run_distributed(_tp_logits, 2, str(gpt2["ours"]), ids)
    ours = torch.cat(shards, dim=-1)  # [b, s, 50432]: the two vocabulary halves
    assert ours.shape[-1] == 50432
    hf = transformers.GPT2LMHeadModel.from_pretrained(gpt2["hf"], dtype=torch.float32).eval()
    with torch.no_grad():
        expected = hf(input_ids=ids).logits
    assert (ours[..., :GPT2_VOCAB] - expected).abs().max() < TOLERANCE

    meta = json.loads((gpt2["ours"] / "iter_0000000" / "meta.json").read_text())
    assert (meta["tp_size"], meta["vocab_size"], meta["rng"]) == (2, GPT2_VOCAB, False)
    assert meta["config"]["model"]["activation"] == "gelu_tanh"
    assert (gpt2["ours"] / "latest").read_text() == "0\n"


def run_printed(command: str, data: Path, *extra: str) -> subprocess.CompletedProcess:
    """A command import_hf.py printed, as printed but for its PREFIX (and ``extra`` after it);
    python and torchrun are this interpreter's."""
    argv = shlex.split(command.replace("[PREFIX]", f"[{data}]"))
    launch = {
        "python": [sys.executable],
        "torchrun": [sys.executable, "-m", "torch.distributed.run"],
    }
    return subprocess.run(
        [*launch[argv[0]], *argv[1:], *extra],
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        capture_output=True,
        text=True,
        timeout=600,
    )


@pytest.mark.slow
def test_the_printed_commands_continue_pretraining(gpt2):
    """The config pins no TP size (the checkpoint, saved at TP=2, reshards on load), starts from
    the import's weights without warmup, and saves apart from it. Its first command (one
    process) fine-tunes the import for 3 iterations, its second (torchrun at TP=2) resumes that
    fine-tune in full up to 5; the import is untouched."""
    ours = gpt2["ours"]
    config = yaml.safe_load((ours / "config.yaml").read_text())
    assert config["parallel"]["tensor_parallel_size"] == 1
    assert config["optimizer"]["lr_warmup_iters"] == 0
    assert config["checkpoint"] == {
        "load": "${config_dir}",
        "finetune": True,
        "save": "${config_dir}/finetuned",
        "save_interval": 500,
    }
    given = [f"data.paths=[{gpt2['data']}]"]
    finetuned = Path(load_config([str(ours / "config.yaml")], given).checkpoint.save)
    assert not finetuned.exists() and finetuned.parent == ours
    before = {p.name: p.read_bytes() for p in (ours / "iter_0000000").iterdir()}
    one, torchrun = gpt2["hint"]
    launcher = "python -m megatron.launch.torchrun --standalone --nproc-per-node 2 "
    assert torchrun.startswith(launcher)
    assert torchrun.endswith(" parallel.tensor_parallel_size=2")
    for command, iters, said in (
        (one, 3, "fine-tuning the weights of"),
        (torchrun, 5, "resumed from"),
    ):
        metrics = gpt2["root"] / f"metrics_{iters}.jsonl"
        extra = [f"training.train_iters={iters}", f"logging.metrics_file={metrics}"]
        proc = run_printed(command, gpt2["data"], *extra)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        assert said in proc.stdout + proc.stderr
        assert (finetuned / "latest").read_text().strip() == str(iters)
        logged = read_metrics(metrics)
        assert logged[-1]["iteration"] == iters and all(0 < e["lm_loss"] < 20 for e in logged)
    assert {p.name: p.read_bytes() for p in (ours / "iter_0000000").iterdir()} == before
    assert (ours / "latest").read_text() == "0\n"


def test_the_import_moves_as_one_directory(gpt2, tmp_path):
    """config.yaml names the checkpoint and the tokenizer by ``${config_dir}``: a copy of the
    import elsewhere loads its own files, and the entrypoint's checks pass there."""
    moved = tmp_path / "elsewhere"
    shutil.copytree(gpt2["ours"], moved)
    cfg = load_config([str(moved / "config.yaml")], [f"data.paths=[{gpt2['data']}]"])
    assert cfg.checkpoint.load == str(moved) and cfg.checkpoint.save == str(moved / "finetuned")
    assert cfg.tokenizer.model == str(moved / "tokenizer" / "tokenizer.json")
    validate(cfg, 1)


def test_export_of_import_gives_the_same_tensors(gpt2, tmp_path):
    back = export_hf(str(gpt2["ours"]), str(tmp_path / "back"))
    original = load_file(str(gpt2["hf"] / "model.safetensors"))
    exported = load_file(f"{back}/model.safetensors")
    tied = {"lm_head.weight"}
    assert set(original) - tied == set(exported) - tied
    for key in set(original) - tied:
        assert torch.equal(original[key], exported[key]), key
    assert json.loads(Path(back, "config.json").read_text())["activation_function"] == "gelu_new"
    tok = transformers.AutoTokenizer.from_pretrained(back)
    assert tok.eos_token_id == GPT2_VOCAB - 1 and len(tok) == GPT2_VOCAB


def _bert(tmp_path: Path, architecture: str, type_vocab_size: int) -> Path:
    """A random tiny BERT of ``architecture`` with the fixture WordPiece vocabulary (cased)."""
    family = "MegatronBert" if architecture.startswith("Megatron") else "Bert"
    config = getattr(transformers, f"{family}Config")(
        vocab_size=len(Path(VOCAB_FILE).read_text().splitlines()), hidden_size=64,
        num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
        max_position_embeddings=64, type_vocab_size=type_vocab_size, initializer_range=0.1,
    )  # fmt: skip
    hf_dir = tmp_path / "hf"
    random_model(getattr(transformers, architecture), config).save_pretrained(hf_dir)
    shutil.copy(VOCAB_FILE, hf_dir / "vocab.txt")
    (hf_dir / "tokenizer_config.json").write_text(json.dumps({"do_lower_case": False}))
    return hf_dir


@pytest.mark.parametrize(
    "architecture, type_vocab_size",
    [
        ("BertForPreTraining", 2),
        ("MegatronBertForPreTraining", 2),
        ("BertForMaskedLM", 1),  # no binary head; the one token-type row folds into positions
    ],
)
def test_bert_import_matches_hf(tmp_path, architecture, type_vocab_size):
    hf_dir = _bert(tmp_path, architecture, type_vocab_size)
    import_hf(str(hf_dir), str(tmp_path / "ours"), 2)
    ours = load_ours(str(tmp_path / "ours"))
    hf = getattr(transformers, architecture).from_pretrained(hf_dir, dtype=torch.float32).eval()
    assert logit_difference(ours, hf, ours.vocab_size, bert=True) < TOLERANCE
    cfg = json.loads((tmp_path / "ours" / "iter_0000000" / "meta.json").read_text())["config"]
    assert cfg["tokenizer"]["type"] == "wordpiece" and cfg["tokenizer"]["lower_case"] is False
    expected_head = "none" if architecture.endswith("MaskedLM") else "sop"
    assert cfg["bert"]["binary_head"] == expected_head


def test_cli_verifies_and_refuses_in_one_line(tmp_path, capsys):
    from tools.import_hf import main

    hf_dir = _bert(tmp_path, "MegatronBertForPreTraining", 2)
    args = ["--input", str(hf_dir), "--output", str(tmp_path / "ours"), "--verify"]
    assert main([*args, "--tensor-parallel-size", "2"]) == 0
    out = capsys.readouterr().out
    assert "pretrain_bert.py --config" in out and "verify:" in out and out.rstrip().endswith("ok")

    neox = tmp_path / "neox"
    neox.mkdir()
    (neox / "config.json").write_text(json.dumps({"architectures": ["GPTNeoXForCausalLM"]}))
    proc = run_tool("tools/import_hf.py", "--input", str(neox), "--output", str(tmp_path / "o"))
    assert proc.returncode == 2 and "GPTNeoXForCausalLM is not supported" in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1 and "Traceback" not in proc.stderr

    pickled = tmp_path / "pickled"
    shutil.copytree(hf_dir, pickled)
    (pickled / "model.safetensors").rename(pickled / "pytorch_model.bin")
    for argv, expected in (
        (["--input", str(pickled), "--output", str(tmp_path / "o")], "never loaded"),
        ([*args[:2], "--output", str(tmp_path / "o"), "--tensor-parallel-size", "3"], "TP=3"),
    ):
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert expected in err and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "o").exists()


def test_verify_without_transformers_is_refused_before_writing(tmp_path):
    hf_dir, out = _bert(tmp_path, "BertForPreTraining", 2), tmp_path / "ours"
    proc = run_without_transformers(
        tmp_path, "tools/import_hf.py", "--input", str(hf_dir), "--output", str(out), "--verify"
    )
    assert_verify_refused(proc, out)
