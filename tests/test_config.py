"""Config: every shipped YAML loads and validates; layering, overrides, types, derived values, and
each documented error with its message, raised before any process group exists."""

from __future__ import annotations

import dataclasses
import glob
import os

import numpy as np
import pytest
import torch.distributed as dist

from megatron.config.load import load_config, parse_args
from megatron.config.schema import (
    Config,
    config_reference,
    padded_vocab_size,
    split_fractions,
    to_dict,
    to_yaml,
    weighted_paths,
)
from megatron.data.indexed_dataset import IndexedDatasetWriter
from megatron.errors import ConfigError
from megatron.launch.preflight import validate

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIGS = sorted(glob.glob(os.path.join(ROOT, "configs", "*.yaml")))
TINY = os.path.join(ROOT, "configs", "gpt_tiny.yaml")

# DESIGN.md "Config keys that scripts and users rely on": these names are fixed.
DESIGN_KEYS = """model.num_layers model.hidden_size model.num_attention_heads model.ffn_hidden_size
    model.seq_length model.max_position_embeddings model.hidden_dropout model.attention_dropout
    model.layernorm_position model.make_vocab_size_divisible_by model.recompute
    parallel.tensor_parallel_size tokenizer.type tokenizer.model tokenizer.vocab_file
    tokenizer.merges_file tokenizer.lower_case data.paths data.split data.cache_dir
    training.micro_batch_size training.global_batch_size training.train_iters training.seed
    training.eval_interval training.eval_iters optimizer.lr optimizer.min_lr optimizer.weight_decay
    optimizer.clip_grad optimizer.lr_warmup_iters optimizer.lr_decay_style precision.dtype
    checkpoint.save checkpoint.load checkpoint.save_interval logging.log_interval
    logging.tensorboard_dir logging.metrics_file""".split()


def write(tmp_path, name: str, text: str) -> str:
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def tiny(*overrides: str) -> Config:
    return load_config([TINY], list(overrides))


def error_of(fn, *args, **kwargs) -> str:
    with pytest.raises(ConfigError) as info:
        fn(*args, **kwargs)
    message = str(info.value)
    assert "\n" not in message, "ConfigError messages are one line"
    return message


def test_design_keys_exist():
    cfg = to_dict(tiny())
    for key in DESIGN_KEYS:
        section, name = key.split(".")
        assert name in cfg[section], key
    reference = config_reference()
    assert all(f"`{key}`" in reference for key in DESIGN_KEYS)


@pytest.mark.parametrize("path", CONFIGS, ids=os.path.basename)
def test_every_shipped_config_loads_and_validates(path):
    cfg = load_config([path])
    replica = cfg.parallel.tensor_parallel_size * cfg.parallel.pipeline_parallel_size
    for world in (replica, 2 * replica, 4 * replica):
        validate(cfg, world, check_files=False)
    assert load_config([path]) == cfg


@pytest.mark.parametrize(
    "name, layers, hidden, heads, tp",
    [
        ("gpt_1.2b", 40, 1536, 16, 1),
        ("gpt_2.5b", 54, 1920, 20, 2),
        ("gpt_4.2b", 64, 2304, 24, 4),
        ("gpt_8.3b", 72, 3072, 32, 8),
    ],
)
def test_paper_table1_shapes(name, layers, hidden, heads, tp):
    cfg = load_config([os.path.join(ROOT, "configs", f"{name}.yaml")])
    m = cfg.model
    assert (m.num_layers, m.hidden_size, m.num_attention_heads) == (layers, hidden, heads)
    assert cfg.parallel.tensor_parallel_size == tp
    assert (m.seq_length, cfg.tokenizer.type, cfg.precision.dtype) == (1024, "gpt2", "bf16")
    assert m.ffn_hidden_size == 4 * hidden


def test_padded_vocab():
    assert padded_vocab_size(50257, 128, 8) == 51200
    assert padded_vocab_size(50257, 128, 1) == 50304
    assert padded_vocab_size(256, 128, 2) == 256
    cfg = load_config([os.path.join(ROOT, "configs", "gpt_8.3b.yaml")])
    assert cfg.derived(8).padded_vocab_size(50257) == 51200


def test_derived_values():
    d = tiny("training.global_batch_size=32", "training.micro_batch_size=2").derived(8)
    assert (d.tp_size, d.dp_size, d.num_micro_batches, d.head_dim) == (2, 4, 4, 64)
    # The grid is [dp, pp, tp]: DP = world / (tp * pp), and each pipeline runs gbs / (mbs * dp).
    d = tiny("training.global_batch_size=32", "parallel.pipeline_parallel_size=2").derived(8)
    assert (d.tp_size, d.pp_size, d.dp_size, d.num_micro_batches) == (2, 2, 2, 4)


def test_layering_later_file_and_overrides_win(tmp_path):
    a = write(tmp_path, "a.yaml", "model:\n  num_layers: 7\noptimizer:\n  lr: 0.5\n")
    b = write(tmp_path, "b.yaml", "optimizer:\n  lr: 0.25\n  min_lr: 1.0e-3\n")
    cfg = load_config([TINY, a, b], ["optimizer.min_lr=2e-3", "data.paths=[0.3, x, 0.7, y]"])
    assert cfg.model.num_layers == 7 and cfg.model.hidden_size == 256
    assert (cfg.optimizer.lr, cfg.optimizer.min_lr) == (0.25, 2e-3)  # "2e-3" read as a number
    assert weighted_paths(cfg.data.paths) == [(0.3, "x"), (0.7, "y")]


def test_resolved_defaults():
    cfg = tiny(
        "model.max_position_embeddings=null",
        "training.train_iters=null",
        "training.train_samples=1000",
        "optimizer.lr_decay_iters=null",
    )
    assert cfg.model.max_position_embeddings == cfg.model.seq_length
    assert cfg.training.train_iters == 63  # ceil(1000 / 16)
    assert cfg.optimizer.lr_decay_iters == 63
    validate(cfg, 2, check_files=False)


def test_a_config_of_one_model_holds_only_its_sections(tmp_path):
    assert tiny().model.type == "gpt"
    assert load_config([os.path.join(ROOT, "configs", "bert_tiny.yaml")]).model.type == "bert"
    assert "bert" not in to_dict(tiny()) and "bert:" not in to_yaml(tiny())
    bert = tiny("model.type=bert", "bert.max_ngram=2")
    assert to_dict(bert)["bert"]["max_ngram"] == 2
    assert "bert" in to_dict(tiny("model.type=null"))
    assert load_config([write(tmp_path, "bert.yaml", to_yaml(bert))]) == bert
    assert "Literal" in error_of(tiny, "model.type=t5")


def test_yaml_round_trip(tmp_path):
    cfg = tiny("optimizer.lr=3e-4", "data.paths=[0.5, a, 0.5, b]")
    again = load_config([write(tmp_path, "resolved.yaml", to_yaml(cfg))])
    assert again == cfg


def test_unknown_keys_name_file_line_and_suggest(tmp_path):
    bad = write(tmp_path, "bad.yaml", "model:\n  num_layers: 2\n  hiden_size: 8\n")
    assert error_of(load_config, [TINY, bad]) == (
        f"{bad}:3: unknown key model.hiden_size; did you mean model.hidden_size?"
    )
    misplaced = write(tmp_path, "misplaced.yaml", "training:\n  lr: 0.1\n")
    assert "did you mean optimizer.lr?" in error_of(load_config, [misplaced])
    assert "unknown section 'modle'; did you mean model?" in error_of(tiny, "modle.x=1")
    assert "expected section.key=value" in error_of(tiny, "lr=3")


def test_values_are_type_checked(tmp_path):
    bad = write(tmp_path, "bad.yaml", "training:\n  micro_batch_size: two\n")
    assert error_of(load_config, [TINY, bad]) == (
        f"{bad}:2: training.micro_batch_size='two' is not of type int; fix the value"
    )
    assert "is not of type int" in error_of(tiny, "model.num_layers=true")
    assert "is not of type int" in error_of(tiny, "model.num_layers=2.5")
    assert "Literal" in error_of(tiny, "model.recompute=some")
    assert "is not of type bool" in error_of(tiny, "data.eod_mask_loss=1")
    assert tiny("optimizer.lr=1").optimizer.lr == 1.0  # an int is a valid float


def test_a_key_or_section_given_twice_is_refused(tmp_path):
    """PyYAML keeps the last of two equal keys: the first section's keys would vanish unread."""
    twice = write(
        tmp_path, "twice.yaml", "training:\n  seed: 1\nmodel:\n  num_layers: 2\ntraining:\n"
    )
    assert error_of(load_config, [TINY, twice]) == (
        f"{twice}:5: duplicate key training (first at line 1); merge the two"
    )
    key = write(tmp_path, "key.yaml", "model:\n  num_layers: 2\n\n  num_layers: 3\n")
    assert error_of(load_config, [TINY, key]) == (
        f"{key}:4: duplicate key model.num_layers (first at line 2); merge the two"
    )
    # Keys equal in name at different places are no duplicates.
    apart = write(tmp_path, "apart.yaml", "model:\n  type: gpt\ntokenizer:\n  type: gpt2\n")
    assert load_config([TINY, apart]).tokenizer.type == "gpt2"


def test_numbers_must_be_finite(tmp_path):
    """inf or nan passes every range check and then skips every step: refused at load."""
    nan = write(tmp_path, "nan.yaml", "optimizer:\n  lr: .nan\n")
    assert error_of(load_config, [TINY, nan]) == (
        f"{nan}:2: optimizer.lr=nan is not a finite number; give a finite value"
    )
    for override in ("optimizer.lr=inf", "optimizer.lr=.inf", "optimizer.lr=1e999"):
        assert error_of(tiny, override) == (
            f"override '{override}': optimizer.lr=inf is not a finite number; give a finite value"
        )
    assert "model.init_method_std=-inf is not a finite" in error_of(
        tiny, "model.init_method_std=-.inf"
    )


def test_required_key_and_invalid_yaml(tmp_path):
    partial = write(tmp_path, "partial.yaml", "model:\n  num_layers: 2\n")
    assert "model.hidden_size is required" in error_of(load_config, [partial])
    broken = write(tmp_path, "broken.yaml", "model:\n  num_layers: [2\n")
    assert error_of(load_config, [broken]).startswith(f"{broken}:")
    assert "cannot read config" in error_of(load_config, [str(tmp_path / "none.yaml")])


@pytest.mark.parametrize(
    "overrides, world, message",
    [
        (
            [
                "parallel.tensor_parallel_size=3",
                "model.num_attention_heads=16",
                "model.hidden_size=96",
            ],
            3,
            "parallel.tensor_parallel_size=3 does not divide model.num_attention_heads=16; "
            "use a TP size that divides both 16 and the world size 3",
        ),
        (
            [],
            3,
            "parallel.tensor_parallel_size=2 does not divide the world size 3; "
            "launch a multiple of 2 processes",
        ),
        (
            ["parallel.pipeline_parallel_size=4"],
            4,
            "parallel.tensor_parallel_size=2 x parallel.pipeline_parallel_size=4 = 8 does not "
            "divide the world size 4; launch a multiple of 8 GPUs or use a pipeline size of 1 or 2",
        ),
        (
            ["parallel.pipeline_parallel_size=2", "model.num_layers=3"],
            4,
            "model.num_layers=3 does not divide into parallel.pipeline_parallel_size=2 stages; "
            "use num_layers=2 or 4 or a pipeline size of 1 or 3",
        ),
        (
            ["parallel.pipeline_parallel_size=2", "parallel.virtual_pipeline_size=4"],
            4,
            "model.num_layers=4 does not divide into parallel.pipeline_parallel_size=2 x "
            "parallel.virtual_pipeline_size=4 = 8 chunks; use num_layers=8 or a "
            "virtual_pipeline_size of 1 or 2",
        ),
        (
            ["parallel.virtual_pipeline_size=2"],
            2,
            "parallel.virtual_pipeline_size=2 interleaves chunks across pipeline stages and needs "
            "parallel.pipeline_parallel_size >= 2; set it to null or add stages",
        ),
        (
            [
                "parallel.pipeline_parallel_size=4",
                "parallel.virtual_pipeline_size=2",
                "model.num_layers=8",
                "training.global_batch_size=12",
                "training.micro_batch_size=2",
            ],
            8,
            "parallel.virtual_pipeline_size=2 needs the micro-batches per step, training."
            "global_batch_size / (micro_batch_size * DP) = 12 / (2 * 1) = 6, to be a multiple of "
            "parallel.pipeline_parallel_size=4; use a global_batch_size of 8 or 16",
        ),
        (["parallel.pipeline_parallel_size=0"], 2, "parallel.pipeline_parallel_size=0 must be"),
        (
            ["model.hidden_size=250"],
            2,
            "model.hidden_size=250 is not divisible by model.num_attention_heads=4; use 248 or 252",
        ),
        (
            ["training.global_batch_size=20"],
            4,
            "training.global_batch_size=20 is not a multiple of training.micro_batch_size * DP = "
            "4 * 2; use training.global_batch_size=16 or 24",
        ),
        (
            ["model.seq_length=256"],
            2,
            "model.seq_length=256 exceeds model.max_position_embeddings=128; "
            "raise it to at least 256",
        ),
        (
            ["model.ffn_hidden_size=1023"],
            2,
            "model.ffn_hidden_size=1023 is not divisible by parallel.tensor_parallel_size=2; "
            "use 1022 or 1024",
        ),
        (
            ["training.train_iters=null"],
            2,
            "set training.train_iters or training.train_samples (how long to train)",
        ),
        (
            ["training.train_iters=300", "optimizer.lr_warmup_iters=300"],
            2,
            "optimizer.lr_warmup_iters=300 must be below optimizer.lr_decay_iters=300 (default: "
            "training.train_iters); use optimizer.lr_warmup_iters=0, 30 or 299",
        ),
        (["training.micro_batch_size=0"], 2, "training.micro_batch_size=0 must be positive"),
        (["model.hidden_dropout=1.5"], 2, "model.hidden_dropout=1.5 must be in [0, 1)"),
        (["optimizer.min_lr=1.0"], 2, "must not exceed optimizer.lr=0.001"),
        (["checkpoint.finetune=true"], 2, "checkpoint.finetune=true needs checkpoint.load"),
        (
            ["checkpoint.finetune=true", "checkpoint.load=runs/pre", "checkpoint.save=runs/pre/"],
            2,
            "checkpoint.finetune=true saves into checkpoint.load=runs/pre, the pretrained "
            "checkpoint; set checkpoint.save to a directory of its own",
        ),
        (["training.test_iters=-1"], 2, "training.test_iters=-1 must be zero or positive"),
        (["tokenizer.type=gpt2"], 2, "tokenizer.type=gpt2 needs tokenizer.vocab_file; set it"),
        (["data.split=1,2,3,4"], 2, "data.split='1,2,3,4' must be 1-3 non-negative numbers"),
        (["data.paths=[0.5, a, b]"], 2, "mixes prefixes and weights"),
        (
            ["training.train_iters=300", "training.train_samples=100"],
            2,
            "training.train_iters=300 disagrees with",
        ),
    ],
)
def test_documented_errors(overrides, world, message):
    assert message in error_of(validate, tiny(*overrides), world, check_files=False)
    assert not dist.is_initialized()


def test_files_must_exist(tmp_path):
    cfg = tiny()
    tokenizer = tmp_path / "tok.model"
    msg = error_of(
        validate,
        dataclasses.replace(
            cfg, tokenizer=dataclasses.replace(cfg.tokenizer, model=str(tokenizer))
        ),
        2,
    )
    assert msg == f"tokenizer.model: {tokenizer} not found; fix the path"
    tokenizer.write_bytes(b"")
    with_tok = dataclasses.replace(
        cfg, tokenizer=dataclasses.replace(cfg.tokenizer, model=str(tokenizer))
    )
    missing = tmp_path / "ckpt"
    msg = error_of(
        validate,
        dataclasses.replace(
            with_tok, checkpoint=dataclasses.replace(cfg.checkpoint, load=str(missing))
        ),
        2,
    )
    assert msg.startswith(f"checkpoint.load: {missing} not found")
    missing.write_text("a file, not a checkpoint directory")
    msg = error_of(
        validate,
        dataclasses.replace(
            with_tok, checkpoint=dataclasses.replace(cfg.checkpoint, load=str(missing))
        ),
        2,
    )
    assert msg.startswith(f"checkpoint.load: {missing} is a file; give the save directory")
    hdf5 = dataclasses.replace(
        with_tok,
        data=dataclasses.replace(cfg.data, format="hdf5", paths=[str(tmp_path / "shards")]),
    )
    assert "data.paths:" in error_of(validate, hdf5, 2)


def test_split_and_weights():
    assert split_fractions("949,50,1") == (0.949, 0.05, 0.001)
    assert split_fractions("1") == (1.0, 0.0, 0.0)
    assert weighted_paths(["a", "b"]) == [(1.0, "a"), (1.0, "b")]
    assert weighted_paths([1, "a", "0.5", "b"]) == [(1.0, "a"), (0.5, "b")]
    for bad in ([], ["a", 0.5], [0.0, "a"], [-1.0, "a", 2.0, "b"]):
        error_of(weighted_paths, bad)


def test_parse_args(tmp_path):
    extra = write(tmp_path, "extra.yaml", "training:\n  seed: 7\n")
    cfg, args = parse_args(
        [
            "--config",
            TINY,
            "optimizer.lr=0.1",
            "--config",
            extra,
            "--dry-run",
            "--world-size",
            "16",
            "--gpu-memory-gb",
            "32",
        ]
    )
    assert (cfg.training.seed, cfg.optimizer.lr) == (7, 0.1)
    assert (args.dry_run, args.world_size, args.gpu_memory_gb) == (True, 16, 32.0)
    assert not dist.is_initialized()


def test_token_dtype_must_hold_the_vocabulary(tmp_path):
    """A 300-token WordPiece vocabulary fits uint16 token files, not uint8 ones."""
    vocab = tmp_path / "vocab.txt"
    special = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    vocab.write_text("\n".join(special + [f"w{i}" for i in range(295)]) + "\n")
    for name, dtype in (("wide", np.uint16), ("narrow", np.uint8)):
        with IndexedDatasetWriter(str(tmp_path / name), dtype) as writer:
            writer.add_document([[1, 2, 3]])
    base = ["tokenizer.type=wordpiece", f"tokenizer.vocab_file={vocab}"]
    validate(tiny(*base, f"data.paths=[{tmp_path / 'wide'}]"), 2)
    narrow = tiny(*base, f"data.paths=[{tmp_path / 'narrow'}]")
    assert error_of(validate, narrow, 2) == (
        f"{tmp_path / 'narrow'}.idx: token dtype uint8 cannot hold the tokenizer's 300 ids; "
        "re-run tools/preprocess_data.py with it"
    )
    missing = tiny(*base, f"data.paths=[{tmp_path / 'absent'}]")
    assert "file not found" in error_of(validate, missing, 2)
