"""Checkpoints with real models and optimizers in real processes: layout, bit-exact restore at the
same world, keep_last, corruption fallback, refused pickles (kills mid-save: test_checkpoint_kill).

Restoring at the same TP/DP size copies every tensor and RNG state, so everything after a load
must be bit-identical to the run that saved (torch.equal, not a tolerance).
"""

import json
import logging
import os
import pickle
import shutil

import pytest
import torch

from megatron.checkpoint import candidates, find_latest, load_checkpoint, save_checkpoint
from megatron.checkpoint.format import (
    file_checksum,
    read_meta,
    sha256_file,
    shard_file,
    verify_checkpoint,
)
from megatron.checkpoint.train_state import Progress, TrainState
from megatron.config.load import load_config
from megatron.config.schema import Config, padded_vocab_size
from megatron.errors import ConfigError
from megatron.models.gpt import GPTModel
from megatron.optim.build import build_optimizer
from megatron.optim.lr_schedule import LRSchedule
from megatron.parallel.random import RNGTracker
from megatron.parallel.state import initialize
from tests.distributed import run_distributed
from tests.test_layers import gather_param

# 100 tokens pad to 128 rows at TP=1 and 256 at TP=2: resharding must fix the padding.
VOCAB = 100
TINY = """
model: {num_layers: 2, hidden_size: 32, num_attention_heads: 4, ffn_hidden_size: 64,
        seq_length: 16, hidden_dropout: 0.0, attention_dropout: 0.0}
tokenizer: {type: gpt2, vocab_file: vocab.json, merges_file: merges.txt}
data: {paths: [corpus]}
training: {micro_batch_size: 2, global_batch_size: 2, train_iters: 20, seed: 1234}
optimizer: {lr: 0.01, lr_warmup_iters: 2}
checkpoint: {keep_last: 2}
"""


def tiny_config(tmp_path, *overrides: str) -> Config:
    """A tiny GPT config (no data or tokenizer files needed: nothing is validated against disk)."""
    path = tmp_path / "tiny.yaml"
    path.write_text(TINY)
    return load_config([str(path)], list(overrides))


def build(cfg: Config, st, seed: int | None = None):
    """Model, optimizer, LR schedule and RNG tracker as the training loop makes them."""
    tracker = RNGTracker(st.device)
    tracker.seed(cfg.training.seed if seed is None else seed, st.tp_rank)
    padded = padded_vocab_size(VOCAB, cfg.model.make_vocab_size_divisible_by, st.tp_size)
    model = GPTModel(cfg.model, VOCAB, padded, st, tracker)
    if cfg.precision.dtype == "bf16":
        model.to(torch.bfloat16)
    optimizer = build_optimizer(model, cfg.optimizer, cfg.precision, st)
    return model, optimizer, LRSchedule.from_config(cfg.optimizer), tracker


def train(model, optimizer, schedule, n: int, seed: int) -> list[float]:
    """``n`` optimizer steps on fixed random batches; the losses."""
    model.train()
    losses = []
    for i in range(n):
        tokens = torch.randint(0, VOCAB, (2, 17), generator=torch.Generator().manual_seed(seed + i))
        loss = model(tokens[:, :-1], labels=tokens[:, 1:]).float().mean()
        optimizer.scale_loss(loss).backward()
        optimizer.set_lr(schedule.lr)
        if optimizer.step().updated:
            schedule.step()
        losses.append(loss.item())
    return losses


def gathered(model, optimizer, st) -> dict[str, torch.Tensor]:
    """Every weight and optimizer tensor, gathered over TP, vocabulary padding dropped."""
    params = dict(model.named_parameters())

    def full(name, t):
        g = gather_param(t.detach(), getattr(params[name], "tp_split_dim", None), st.tp_group)
        return g[:VOCAB] if name == "embedding.word.weight" else g

    out = {f"model/{name}": full(name, p) for name, p in params.items()}
    for name, entry in optimizer.state_dict()["params"].items():
        for field, value in entry.items():
            out[f"optim/{name}/{field}"] = value if field == "step" else full(name, value)
    return out


def logits(model, st) -> torch.Tensor:
    """Full logits (real vocabulary only) of a fixed batch, in eval mode."""
    model.eval()
    tokens = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        out = gather_param(model(tokens).float(), -1, st.tp_group)[..., :VOCAB]
    model.train()
    return out


def snapshot(model) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in model.state_dict().items()}


def same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(
        torch.equal(x, b[k]) if isinstance(x, torch.Tensor) else x == b[k] for k, x in a.items()
    )


class Records(logging.Handler):
    """Collects the checkpoint module's log messages inside a test process."""

    def __init__(self):
        super().__init__(logging.INFO)
        self.messages: list[str] = []
        logging.getLogger("megatron.checkpoint.save").addHandler(self)
        logging.getLogger("megatron.checkpoint.save").setLevel(logging.INFO)

    def emit(self, record):
        self.messages.append(record.getMessage())


def _resume_same_world(cfg, save_dir):
    st = initialize(2)
    model, optimizer, schedule, tracker = build(cfg, st)
    train(model, optimizer, schedule, 3, seed=0)
    progress = Progress(iteration=3, consumed_train_samples=6, skipped_iters=0)
    save_checkpoint(
        save_dir, TrainState(model, optimizer, schedule, tracker, progress), cfg, st, VOCAB
    )
    straight = train(model, optimizer, schedule, 3, seed=3)
    final = gathered(model, optimizer, st)
    scaler, steps = optimizer.scaler.state_dict(), schedule.num_steps

    model, optimizer, schedule, tracker = build(cfg, st, seed=99)
    loaded = TrainState(model, optimizer, schedule, tracker)
    load_checkpoint(save_dir, loaded, st, VOCAB)
    resumed = train(model, optimizer, schedule, 3, seed=3)
    assert same(gathered(model, optimizer, st), final)
    assert optimizer.scaler.state_dict() == scaler and schedule.num_steps == steps
    return straight, resumed, loaded.progress, scaler


@pytest.mark.slow
def test_resume_at_same_world_is_bit_exact(tmp_path):
    """TP=2 with dropout and a dynamic loss scale: save, go on; a fresh model that loads the
    checkpoint takes identical steps (RNG, tracker, moments, scaler and schedule restored)."""
    cfg = tiny_config(
        tmp_path,
        "model.hidden_dropout=0.1",
        "model.attention_dropout=0.1",
        "precision.dtype=fp16",
        "precision.initial_loss_scale=1024",
        "precision.loss_scale_window=2",
    )
    save_dir = str(tmp_path / "ckpt")
    for straight, resumed, loaded, scaler in run_distributed(_resume_same_world, 2, cfg, save_dir):
        assert straight == resumed
        assert loaded == Progress(iteration=3, consumed_train_samples=6, skipped_iters=0)
        assert scaler["scale"] > 1024  # the scale grew, so its restore was exercised
    ckpt = tmp_path / "ckpt" / "iter_0000003"
    assert sorted(os.listdir(tmp_path / "ckpt")) == ["iter_0000003", "latest"]
    names = ["model_optim_tp00", "model_optim_tp01", "rng_rank00000", "rng_rank00001"]
    assert sorted(os.listdir(ckpt)) == ["meta.json"] + [f"{n}.safetensors" for n in names]
    meta = json.loads((ckpt / "meta.json").read_text())
    assert (meta["tp_size"], meta["dp_size"], meta["iteration"]) == (2, 1, 3)
    assert (meta["vocab_size"], meta["padded_vocab_size"]) == (VOCAB, 256)
    assert meta["config"]["model"]["hidden_dropout"] == 0.1
    assert meta["lr_schedule"]["num_steps"] == 3 and meta["grad_scaler"]["scale"] >= 1024
    word = meta["tensors"]["model/embedding.word.weight"]
    assert word == {"split_dim": 0, "shape": [256, 32], "dtype": "float32", "vocab": True}
    layer = "transformer.layers.0"
    assert meta["tensors"][f"optim/{layer}.attention.dense.weight/exp_avg"]["split_dim"] == 1
    assert meta["tensors"][f"model/{layer}.ln1.weight"]["split_dim"] is None
    rng = "rng_rank00001.safetensors"
    assert meta["files"][rng] == file_checksum(str(ckpt / rng))
    assert verify_checkpoint(str(ckpt)) is None and find_latest(str(tmp_path / "ckpt")) == 3


def _keep_last_and_resave(cfg, save_dir):
    st = initialize(1)
    model, optimizer, schedule, tracker = build(cfg, st)
    listings = []
    for it in (1, 2, 3, 3):
        if it == 3:
            # Leftovers of killed saves: an unpublished directory and a pointer temp file.
            os.makedirs(os.path.join(save_dir, "iter_0000004.tmp-00ab"), exist_ok=True)
            open(os.path.join(save_dir, "latest.tmp-123"), "w").close()
        train(model, optimizer, schedule, 1, seed=it)
        progress = Progress(iteration=it)
        save_checkpoint(
            save_dir, TrainState(model, optimizer, schedule, tracker, progress), cfg, st, VOCAB
        )
        listings.append(sorted(os.listdir(save_dir)))
    final = snapshot(model)
    model, optimizer, schedule, tracker = build(cfg, st, seed=3)
    load_checkpoint(save_dir, TrainState(model, optimizer, schedule, tracker), st, VOCAB)
    assert same(snapshot(model), final)  # the second save of iteration 3 replaced the first
    return listings


@pytest.mark.slow
def test_keep_last_resave_and_leftovers(tmp_path):
    cfg = tiny_config(tmp_path)  # keep_last: 2
    save_dir = str(tmp_path / "ckpt")
    listings = run_distributed(_keep_last_and_resave, 1, cfg, save_dir)[0]
    assert listings[1] == ["iter_0000001", "iter_0000002", "latest"]
    assert listings[2] == listings[3] == ["iter_0000002", "iter_0000003", "latest"]
    assert find_latest(save_dir) == 3 and verify_checkpoint(f"{save_dir}/iter_0000003") is None


def save_two(cfg, st, save_dir):
    """Checkpoints of iterations 1 and 2, one training step apart; the model's state at each."""
    model, optimizer, schedule, tracker = build(cfg, st)
    states = {}
    for it in (1, 2):
        train(model, optimizer, schedule, 1, seed=it)
        states[it] = snapshot(model)
        progress = Progress(iteration=it)
        save_checkpoint(
            save_dir, TrainState(model, optimizer, schedule, tracker, progress), cfg, st, VOCAB
        )
    return states


def _fallback_and_finetune(cfg, save_dir):
    st = initialize(1)
    states = save_two(cfg, st, save_dir)
    log = Records()
    out = {}
    newest = os.path.join(save_dir, "iter_0000002")
    damage = {
        "flipped byte": lambda: _flip_byte(os.path.join(newest, shard_file(0))),
        "truncated meta": lambda: _truncate(os.path.join(newest, "meta.json")),
        "missing directory": lambda: shutil.rmtree(newest),
    }
    backup = os.path.join(save_dir, "..", "backup")
    shutil.copytree(newest, backup)
    for what, harm in damage.items():
        harm()
        model, optimizer, schedule, tracker = build(cfg, st, seed=5)
        log.messages.clear()
        loaded = TrainState(model, optimizer, schedule, tracker)
        load_checkpoint(save_dir, loaded, st, VOCAB)
        assert loaded.progress.iteration == 1 and same(snapshot(model), states[1]), what
        out[what] = list(log.messages)
        shutil.rmtree(newest, ignore_errors=True)
        shutil.copytree(backup, newest)
    # Finetune: the weights of the newest checkpoint, nothing else.
    model, optimizer, schedule, tracker = build(cfg, st, seed=5)
    finetuned = TrainState(model, optimizer, schedule, tracker)
    load_checkpoint(save_dir, finetuned, st, VOCAB, finetune=True)
    assert finetuned.progress == Progress()
    assert same(snapshot(model), states[2]) and schedule.num_steps == 0
    assert all(set(e) <= {"main"} for e in optimizer.state_dict()["params"].values())
    # Every checkpoint damaged: an error, never a silent fresh start.
    _flip_byte(os.path.join(save_dir, "iter_0000001", shard_file(0)))
    _flip_byte(os.path.join(newest, "rng_rank00000.safetensors"))
    with pytest.raises(ConfigError, match="checkpoint.load: no intact checkpoint"):
        load_checkpoint(save_dir, TrainState(model, optimizer, schedule, tracker), st, VOCAB)
    return out


def _flip_byte(path: str) -> None:
    with open(path, "r+b") as f:
        f.seek(os.path.getsize(path) // 2)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0xFF]))


def _truncate(path: str) -> None:
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) // 2)


@pytest.mark.slow
def test_damaged_newest_checkpoint_falls_back_with_a_warning(tmp_path):
    cfg = tiny_config(tmp_path)
    out = run_distributed(_fallback_and_finetune, 1, cfg, str(tmp_path / "ckpt"))[0]
    for what, messages in out.items():
        text = "\n".join(messages)
        assert "iter_0000002 is incomplete or corrupt; trying the previous one" in text, what
        assert "loaded checkpoint" in text and "iter_0000001" in text, what
    assert "does not match its xxh3_128 checksum" in "\n".join(out["flipped byte"])
    assert "unreadable" in "\n".join(out["truncated meta"])


class _Payload:
    """Unpickling this creates a file: the side effect a malicious checkpoint would have."""

    def __init__(self, path: str):
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


def _load_crafted(cfg, save_dir, marker):
    st = initialize(1)
    model, optimizer, schedule, tracker = build(cfg, st)
    train(model, optimizer, schedule, 1, seed=0)
    train_state = TrainState(model, optimizer, schedule, tracker, Progress(iteration=1))
    save_checkpoint(save_dir, train_state, cfg, st, VOCAB)
    ckpt = os.path.join(save_dir, "iter_0000001")
    errors = []
    meta_text = open(os.path.join(ckpt, "meta.json")).read()
    for name in (shard_file(0), "rng_rank00000.safetensors"):
        original = open(os.path.join(ckpt, name), "rb").read()
        # The attacker controls the whole directory, so the checksum in meta.json matches too.
        with open(os.path.join(ckpt, name), "wb") as f:
            f.write(pickle.dumps({"weights": _Payload(marker)}))
        meta = read_meta(ckpt)
        meta["files"][name] = sha256_file(os.path.join(ckpt, name))
        with open(os.path.join(ckpt, "meta.json"), "w") as f:
            json.dump(meta, f)
        with pytest.raises(ConfigError) as err:
            load_checkpoint(save_dir, train_state, st, VOCAB)
        errors.append(str(err.value))
        with open(os.path.join(ckpt, name), "wb") as f:
            f.write(original)
        with open(os.path.join(ckpt, "meta.json"), "w") as f:
            f.write(meta_text)
    return errors


@pytest.mark.slow
def test_pickle_payload_is_refused_and_never_runs(tmp_path):
    cfg = tiny_config(tmp_path)
    marker = tmp_path / "payload_ran"
    errors = run_distributed(_load_crafted, 1, cfg, str(tmp_path / "ckpt"), str(marker))[0]
    for error in errors:
        assert "not a valid safetensors file" in error and "never unpickled" in error
        assert "\n" not in error
    assert not marker.exists()
    # The payload is live: unpickling it (what a careless loader would do) has the side effect.
    pickle.loads(pickle.dumps(_Payload(str(marker)))).close()
    assert marker.exists()


def test_missing_or_empty_directory_is_a_config_error(tmp_path):
    """``find_latest`` tells the loop whether a save directory can be resumed; an explicit load
    of a missing or empty directory is an error naming checkpoint.load."""
    assert find_latest(str(tmp_path / "nowhere")) is None and find_latest(str(tmp_path)) is None
    with pytest.raises(ConfigError, match="checkpoint.load: .*nowhere not found"):
        candidates(str(tmp_path / "nowhere"))
    with pytest.raises(ConfigError, match="checkpoint.load: .* holds no checkpoint"):
        candidates(str(tmp_path))
    (tmp_path / "iter_0000005").mkdir()
    (tmp_path / "iter_0000009").mkdir()
    (tmp_path / "iter_0000012.tmp-ab12").mkdir()
    assert candidates(str(tmp_path)) == [9, 5]
    (tmp_path / "latest").write_text("5\n")
    assert find_latest(str(tmp_path)) == 5 and candidates(str(tmp_path)) == [5]
    (tmp_path / "latest").write_text("garbage")
    with pytest.raises(ConfigError, match="not an iteration"):
        find_latest(str(tmp_path))
