"""What the distributed optimizer and sequence parallelism buy, modelled and measured.

Modelled: megatron/estimate/memory.py's figures for both options against the formulas written out by
hand for a small config, the dry run's report and hint, and the README's memory table against
``memory_table`` (regenerate it with ``regenerate_readme``).

Measured: each rank's memory in the metrics file, the console line and TensorBoard of a real
run: pretrain_gpt.py under torchrun at DP=2 (bf16, so every parameter has an fp32 main copy).

``mem_optimizer_mb`` must equal the optimizer's state on every rank, 12 bytes per parameter (fp32
main copy and two Adam moments) for the parameter count megatron/estimate/memory.py computes (itself
checked against the model in tests/test_estimate.py); the distributed optimizer must halve it
at DP=2, up to the padding of its buckets to a multiple of DP. ``mem_peak_mb`` is the peak RSS
on CPU: above what the process holds now at the first line, and never falling.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from megatron.config.load import load_config
from megatron.config.schema import padded_vocab_size
from megatron.estimate.activations import layer_activation_bytes
from megatron.estimate.memory import estimate_memory, memory_table
from megatron.estimate.parameters import count_parameters
from megatron.training.metrics import MB
from tests.gpt_run import read_metrics, run_pretrain, tiny_overrides
from tests.test_estimate import SP_VOCAB, _dry

README = Path(__file__).resolve().parent.parent / "README.md"

ITERS = 3
KEYS = {
    "parallel.tensor_parallel_size": 1,
    "precision.dtype": "bf16",
    "training.train_iters": ITERS,
    "training.eval_iters": 0,
}
FIELDS = ("mem_optimizer_mb", "mem_peak_mb", "mem_allocated_mb")


def _options(distributed: bool, sequence: bool, *overrides: str):
    """gpt_tiny in bf16 at TP 2 with dropout (so the masks count), micro-batch 2."""
    return load_config(
        ["configs/gpt_tiny.yaml"],
        [
            "precision.dtype=bf16",
            "parallel.tensor_parallel_size=2",
            "model.hidden_dropout=0.1",
            "training.micro_batch_size=2",
            f"parallel.distributed_optimizer={str(distributed).lower()}",
            f"parallel.sequence_parallel={str(sequence).lower()}",
            *overrides,
        ],
    )


@pytest.mark.parametrize("recompute", ["none", "full"])
def test_distributed_optimizer_and_sequence_parallel_by_hand(recompute):
    """Each option against the formulas written out: the distributed optimizer divides the fp32
    main params and moments (12 B/param) by DP and nothing else; sequence parallelism divides the
    LayerNorm, dropout and residual activations (and, recomputing, the saved layer inputs) by TP
    and nothing else."""
    recompute_key = f"model.recompute={recompute}"
    m, tp, dp, e, b = _options(False, False, recompute_key).model, 2, 4, 2, 2
    layers, s, h, f, a = 4, 128, 256, 1024, 4
    assert (m.num_layers, m.seq_length, m.hidden_size, m.ffn_hidden_size) == (layers, s, h, f)
    assert (m.num_attention_heads, m.hidden_dropout, m.layernorm_position) == (a, 0.1, "pre")
    padded = padded_vocab_size(SP_VOCAB, 128, tp)
    n = count_parameters(m, padded, tp).per_gpu
    plain, dist_opt, seq_par, both = (
        estimate_memory(_options(distributed, sequence, recompute_key), padded, "gpt", dp)
        for distributed, sequence in ((False, False), (True, False), (False, True), (True, True))
    )

    shard = -(-n // dp)
    assert (plain.main_params, plain.adam_moments) == (4 * n, 8 * n)
    assert (dist_opt.main_params, dist_opt.adam_moments) == (4 * shard, 8 * shard)
    assert (
        (dist_opt.weights, dist_opt.main_grads)
        == (plain.weights, plain.main_grads)
        == (2 * n, 4 * n)
    )
    assert dist_opt.total == plain.total - 12 * (n - shard)

    # One layer: the LayerNorms' inputs, 2 dropout masks and the LayerNorms' fp32 statistics
    # (split by sequence parallelism), QKV's and fc1's inputs (whole), and split by head/ffn
    # column s*b*(4h + 2f)*e + the fused attention's log-sum-exp.
    sequence = s * b * h * (2 * e + 2) + 2 * 8 * s * b
    column_inputs = 2 * e * s * b * h
    split = (s * b * (4 * h + 2 * f) * e + 4 * a * s * b) // tp
    replicated = sequence + column_inputs
    assert layer_activation_bytes(m, b, tp, e) == replicated + split
    sp_layer = sequence // tp + column_inputs + split
    assert layer_activation_bytes(m, b, tp, e, sequence_parallel=True) == sp_layer
    # Outside the layers: the embedding's dropout mask and the final LayerNorm's input and
    # statistics split with sequence parallelism; the LM head's input stays whole.
    outside = s * b * h + e * s * b * h + 8 * s * b
    head_input = e * s * b * h
    if recompute == "none":
        want_plain = layers * (replicated + split) + outside + head_input
        want_sp = layers * sp_layer + outside // tp + head_input
    else:
        layer_input = e * s * b * h
        want_plain = layers * layer_input + replicated + split + outside + head_input
        want_sp = layers * layer_input // tp + sp_layer + outside // tp + head_input
    got = plain.activations_recompute if recompute == "full" else plain.activations_no_recompute
    assert got == want_plain
    assert seq_par.total == plain.total - (want_plain - want_sp)
    assert seq_par.states == plain.states
    assert both.total == plain.total - 12 * (n - shard) - (want_plain - want_sp)


def test_dry_run_names_the_switch_that_fits():
    """8.3B on 64 80-GB GPUs: at TP 1 only the distributed optimizer fits; at TP 2 without
    recomputation, recomputation alone does not (72.5 GiB of 72 usable), the distributed
    optimizer does; the report shows its shards."""
    base = [
        "--config",
        "configs/gpt_8.3b.yaml",
        "--dry-run",
        "--world-size",
        "64",
        "--gpu-memory-gb",
        "80",
    ]
    rc, text = _dry([*base, "parallel.tensor_parallel_size=1"])
    assert rc == 1 and "hint: parallel.distributed_optimizer=true fits" in text
    rc, text = _dry([*base, "parallel.tensor_parallel_size=2", "model.recompute=none"])
    assert rc == 1 and "hint: parallel.distributed_optimizer=true fits" in text
    sharded = ["parallel.distributed_optimizer=true"]
    rc, text = _dry([*base, "parallel.tensor_parallel_size=1", *sharded])
    assert rc == 0 and "Adam moments (2 x fp32, 8 B/param / DP 64)" in text
    assert "fits in 80 GB: yes (51.50 GiB" in text
    rc, text = _dry([*base, "parallel.sequence_parallel=true"])
    assert rc == 0 and "activations, full recomputation (seq-parallel)" in text
    assert "split 8 ways" in text and "fits in 80 GB: yes (18.01 GiB" in text


MEMORY_TABLE = ("<!-- memory-table:start", "<!-- memory-table:end -->")


def _readme_table() -> str:
    cfg = load_config(["configs/gpt_8.3b.yaml"])
    return memory_table(cfg, 50257, 64, 80, (1, 2, 4, 8))


def test_readme_memory_table_is_current():
    """If this fails, run:
    python -c "import tests.test_memory_metrics as t; t.regenerate_readme()"."""
    text = README.read_text()
    body = text.split(MEMORY_TABLE[0], 1)[1].split(MEMORY_TABLE[1], 1)[0]
    assert body.split("-->", 1)[1].strip() == _readme_table()


def regenerate_readme() -> None:
    """Write the current memory table into the README between its markers."""
    text = README.read_text()
    head, rest = text.split(MEMORY_TABLE[0], 1)
    marker, tail = rest.split(MEMORY_TABLE[1], 1)
    marker = marker.split("-->", 1)[0] + "-->"
    README.write_text(
        f"{head}{MEMORY_TABLE[0]}{marker}\n{_readme_table()}\n{MEMORY_TABLE[1]}{tail}"
    )


def _train(gpt_data, run_dir, **extra) -> tuple[list[dict], str]:
    overrides = tiny_overrides(gpt_data, run_dir, **{**KEYS, **extra})
    proc = run_pretrain("pretrain_gpt.py", "configs/gpt_tiny.yaml", overrides, nproc=2)
    return read_metrics(run_dir / "metrics.jsonl"), proc.stdout


def _parameters(overrides: list[str]) -> int:
    """Parameters per rank of the run's model, from the formulas (512-piece tokenizer)."""
    cfg = load_config(["configs/gpt_tiny.yaml"], overrides)
    model = dataclasses.replace(cfg.model, ffn_hidden_size=4 * cfg.model.hidden_size)
    return count_parameters(model, padded_vocab_size(512, 128, 1), 1).per_gpu


@pytest.mark.slow
def test_each_rank_logs_its_memory(gpt_data, tmp_path):
    lines, stdout = _train(gpt_data, tmp_path / "plain")
    assert [e["iteration"] for e in lines] == list(range(1, ITERS + 1))
    n = _parameters(tiny_overrides(gpt_data, tmp_path, **KEYS))
    for entry in lines:
        assert all(len(entry[name]) == 2 for name in FIELDS), entry  # one value per rank
        assert entry["mem_optimizer_mb"] == [12 * n / MB] * 2
        assert all(v > 0 for name in FIELDS for v in entry[name]), entry
    first, last = lines[0], lines[-1]
    assert all(p >= a for p, a in zip(first["mem_peak_mb"], first["mem_allocated_mb"]))
    assert all(b >= a for a, b in zip(first["mem_peak_mb"], last["mem_peak_mb"]))
    peaks = "/".join(f"{v:.1f}" for v in last["mem_peak_mb"])  # rank 0's/rank 1's
    assert stdout.count("peak memory (MB): ") == ITERS and f"peak memory (MB): {peaks}" in stdout
    optimizer_mb = f"{12 * n / MB:.1f}"
    assert f"optimizer state (MB): {optimizer_mb}/{optimizer_mb}" in stdout
    events = EventAccumulator(str(tmp_path / "plain" / "tb"))
    events.Reload()
    tags = events.Tags()["scalars"]
    assert {f"{name.replace('_', '-')}/rank-{r}" for name in FIELDS for r in (0, 1)} <= set(tags)
    peaks = [e.value for e in events.Scalars("mem-peak-mb/rank-1")]
    assert peaks == pytest.approx([e["mem_peak_mb"][1] for e in lines])


@pytest.mark.slow
def test_distributed_optimizer_halves_the_optimizer_state(gpt_data, tmp_path):
    n = _parameters(tiny_overrides(gpt_data, tmp_path, **KEYS))
    sharded, _ = _train(gpt_data, tmp_path / "sharded", **{"parallel.distributed_optimizer": True})
    assert len(sharded) == ITERS
    for entry in sharded:
        for rank in (0, 1):
            half = entry["mem_optimizer_mb"][rank] / (12 * n / MB)
            assert 0.5 <= half < 0.51, (rank, entry)
