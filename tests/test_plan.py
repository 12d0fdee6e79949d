"""``--dry-run --cluster NAME --nodes N`` (its time lines and ``--json``) and ``--plan``.

The plan on the paper's 8.3B model for 64 DGX-2H GPUs (4 nodes of 16) must rank TP 8 x DP 8
first or among its top layouts, and name the TP size it leaves out for crossing nodes (TP 32
there: TP 16 still fits in a DGX-2H's 16 GPUs); every layout it prints must fit by the memory
estimate of every pipeline stage; a plan with nothing that fits is one line naming the nodes
that would do.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from megatron.config.load import parse_args
from megatron.errors import ConfigError
from megatron.estimate.cluster import PROFILE_DIR, load_cluster
from megatron.estimate.memory import estimate_memory, fits
from megatron.estimate.step_time import step_time
from megatron.launch.dry_run import dry_run_to_stdout
from megatron.launch.plan import SHOWN, distinct_grids, search

PAPER_8_3B = ["--config", "configs/gpt_8.3b.yaml", "precision.dtype=fp16"]


def _run(argv: list[str], capsys) -> tuple[int, str]:
    cfg, args = parse_args(argv)
    code = dry_run_to_stdout(cfg, args, "gpt")
    return code, capsys.readouterr().out


def test_dry_run_json_is_one_object_with_the_predicted_step(capsys):
    argv = [*PAPER_8_3B, "--dry-run", "--cluster", "dgx2h-v100", "--nodes", "2", "--json"]
    code, out = _run(argv, capsys)
    report = json.loads(out)  # the whole of stdout: one object
    assert code == 0 and report["fits"] is True and report["world_size"] == 32
    cfg, _ = parse_args(argv)
    predicted = step_time(cfg, 51200, "gpt", 32, load_cluster("dgx2h-v100"))
    assert report["ms_per_iter"] == pytest.approx(predicted.seconds * 1e3)
    assert report["tflops_per_gpu"] == pytest.approx(predicted.tflops_per_gpu)
    for key in ("tokens_per_s", "mfu", "exposed_comm_fraction", "bubble_fraction"):
        assert 0 <= report[key] < 1e9
    assert 0 < report["weak_scaling_efficiency"] <= 1
    memory = report["memory_gib_per_gpu"]
    assert memory["total"] == pytest.approx(sum(v for k, v in memory.items() if k != "total"))
    assert any(line.startswith("predicted on 2 node(s) of dgx2h-v100") for line in report["report"])


def test_dry_run_text_names_the_prediction(capsys):
    code, out = _run([*PAPER_8_3B, "--dry-run", "--cluster", "dgx2h-v100", "--nodes", "1"], capsys)
    assert code == 0 and "world 16 = DP 2 x TP 8" in out and "TFLOP/s per GPU" in out
    assert "no --world-size" not in out and "fits in 32 GB: yes" in out


@pytest.mark.parametrize(
    ("extra", "words"),
    [
        (["--nodes", "2"], "--nodes needs --cluster"),
        (["--cluster", "dgx-h100", "--nodes", "2", "--world-size", "8"], "disagrees"),
        (["--cluster", "dgx-z9000"], "no such profile"),
        (["--plan", "--cluster", "dgx-h100"], "--plan needs --cluster NAME and --nodes N"),
    ],
)
def test_bad_cluster_flags_are_one_line(extra, words, capsys):
    with pytest.raises(ConfigError) as e:
        _run([*PAPER_8_3B, "--dry-run", *extra], capsys)
    assert words in str(e.value) and "\n" not in str(e.value)


def test_plan_for_8_3b_on_64_dgx2h_gpus(capsys):
    code, out = _run([*PAPER_8_3B, "--plan", "--cluster", "dgx2h-v100", "--nodes", "4"], capsys)
    ranked = [line for line in out.splitlines() if line[:2] in {f"{i}." for i in range(1, 6)}]
    assert code == 0 and len(ranked) == SHOWN
    assert any(line.split(",")[0].endswith("TP 8 x DP 8") for line in ranked[:3]), ranked
    assert "TP 32 is not offered: it would cross nodes (16 GPUs per node" in out


def test_every_layout_the_plan_prints_fits():
    cfg, _ = parse_args([*PAPER_8_3B, "training.global_batch_size=64"])
    cluster = load_cluster("dgx2h-v100")
    found, searched = search(cfg, "gpt", 32, cluster, 50257)
    assert searched > len(found) > SHOWN  # some layouts were left out for memory
    for c in distinct_grids(found)[:SHOWN]:
        derived = c.cfg.derived(32)
        padded = derived.padded_vocab_size(50257)
        for stage in range(c.cfg.parallel.pipeline_parallel_size):
            mem = estimate_memory(c.cfg, padded, "gpt", derived.dp_size, stage)
            assert fits(mem.total, cluster.gpu_memory_gb), (c.label(), stage)


def test_a_plan_with_nothing_that_fits_names_the_nodes_that_would(tmp_path, capsys):
    """Two 16 GB GPUs per node cannot hold 8.3B's weights and Adam state; more nodes can."""
    profile = (Path(PROFILE_DIR) / "dgx2h-v100.yaml").read_text(encoding="utf-8")
    small = tmp_path / "small.yaml"
    small.write_text(profile.replace("gpus_per_node: 16", "gpus_per_node: 2").replace(
        "gpu_memory_gb: 32", "gpu_memory_gb: 16"))  # fmt: skip
    argv = [*PAPER_8_3B, "training.global_batch_size=64", "--plan", "--cluster", str(small)]
    with pytest.raises(ConfigError) as e:
        _run([*argv, "--nodes", "1"], capsys)
    message = str(e.value)
    assert "\n" not in message and "none of the" in message and "fits 16 GB" in message
    nodes = int(message.split("the smallest change that fits: --nodes ")[1].split()[0])
    code, out = _run([*argv, "--nodes", str(nodes)], capsys)
    assert code == 0 and "1. " in out
