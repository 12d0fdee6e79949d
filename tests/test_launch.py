"""Launching the real pretrain_gpt.py the ways a cluster does, on this one machine.

Three launches of the same tiny GPT at TP=2 x DP=2 must train identically:

* one torchrun with 4 processes (the reference);
* two torchrun launchers with ``--nnodes 2`` (2 processes each), meeting by c10d rendezvous on
  127.0.0.1 as the per-node launchers of scripts/slurm/launch.sh meet on the job's first host;
* 4 plain ``python`` processes given only what ``srun`` sets for one task per GPU
  (SLURM_PROCID/SLURM_NTASKS/SLURM_LOCALID/SLURM_NODEID, the job's node list) and MASTER_PORT.

All three are one world of 4 with the same ranks, the same groups and gloo's fixed reduction
order, so the losses must agree bit for bit: they are compared exactly.

Every process runs through PROBE, which records what megatron.parallel.state built (the members
of its TP and DP groups) and which "node" started it, then runs pretrain_gpt.py unchanged. That
shows each TP group is a block of adjacent ranks inside one node, whichever launcher numbered
the ranks.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from megatron.parallel.launcher import first_slurm_host
from tests.distributed import free_port
from tests.gpt_run import read_metrics, tiny_overrides

ROOT = Path(__file__).resolve().parents[1]
CONFIG = "configs/gpt_tiny.yaml"
ITERS = 6
# Set by torchrun or srun; a launch under test must see only what its own launcher sets.
LAUNCHER_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK",
                 "ROLE_RANK", "MASTER_ADDR", "MASTER_PORT")  # fmt: skip
PROBE = """
import json, os, runpy, sys

import torch.distributed as dist

from megatron.parallel import state

given = {k: os.environ.get(k) for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR")}
build = state.initialize


def initialize(*args, **kwargs):
    built = build(*args, **kwargs)
    record = {
        "given": given,
        "node": os.environ["PROBE_NODE"],
        "rank": built.rank,
        "local_rank": built.local_rank,
        "world_size": dist.get_world_size(),
        "tp": dist.get_process_group_ranks(built.tp_group),
        "dp": dist.get_process_group_ranks(built.dp_group),
        "master_addr": os.environ["MASTER_ADDR"],
    }
    path = os.path.join(os.environ["PROBE_DIR"], f"rank{built.rank}.json")
    with open(path + ".tmp", "w") as f:
        json.dump(record, f)
    os.replace(path + ".tmp", path)
    return built


state.initialize = initialize  # training.py calls it through the module
sys.argv = [os.environ["PROBE_TARGET"], *sys.argv[1:]]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def _base_env(run_dir: Path) -> dict[str, str]:
    """This environment without any launcher's variables, plus what PROBE reads."""
    env = {k: v for k, v in os.environ.items()
           if k not in LAUNCHER_VARS and not k.startswith(("SLURM_", "TORCHELASTIC_"))}  # fmt: skip
    probe = run_dir / "probe.py"
    probe.write_text(PROBE)
    env.update(
        OMP_NUM_THREADS="1",
        PYTHONPATH=str(ROOT),
        PROBE_DIR=str(run_dir),
        PROBE_TARGET=str(ROOT / "pretrain_gpt.py"),
    )
    return env


def _train_args(gpt_data: dict[str, str], run_dir: Path) -> list[str]:
    overrides = tiny_overrides(
        gpt_data,
        run_dir,
        **{"parallel.tensor_parallel_size": 2, "training.train_iters": ITERS},
    )
    return [str(run_dir / "probe.py"), "--config", CONFIG, *overrides]


def _torchrun(*options: str) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", *options]


def _launch(jobs: list[tuple[list[str], dict[str, str]]], run_dir: Path, timeout: float = 240):
    """Start every (command, env) at once and wait for all; on a failure stop the rest.

    Output goes to files, not pipes: a launcher blocked on a full pipe would stall the world.
    What is left running is stopped with SIGTERM first: torchrun starts its workers in sessions
    of their own and only it can stop them; SIGKILL to the job's session comes 40 s later.
    """
    procs, logs = [], []
    try:
        for i, (cmd, env) in enumerate(jobs):
            log = (run_dir / f"launch{i}.log").open("w")
            logs.append(log)
            procs.append(
                subprocess.Popen(
                    cmd,
                    cwd=ROOT,
                    env=env,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                )
            )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            codes = [p.poll() for p in procs]
            if all(code == 0 for code in codes) or any(code for code in codes):
                break
            time.sleep(0.2)
    finally:
        running = [p for p in procs if p.poll() is None]
        for p in running:
            p.terminate()
        for p in running:
            try:
                p.wait(timeout=40)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
        for log in logs:
            log.close()
    if any(p.returncode != 0 for p in procs):
        tails = "\n".join(
            f"--- job {i} (exit {p.returncode}):\n"
            + (run_dir / f"launch{i}.log").read_text()[-3000:]
            for i, p in enumerate(procs)
        )
        raise AssertionError(f"a launch failed (or ran past {timeout:.0f} s)\n{tails}")


def _losses(run_dir: Path) -> list[float]:
    """lm_loss of every iteration; only global rank 0 writes the metrics file."""
    entries = read_metrics(run_dir / "metrics.jsonl")
    assert [e["iteration"] for e in entries] == list(range(1, ITERS + 1))
    return [e["lm_loss"] for e in entries]


def _records(run_dir: Path) -> list[dict]:
    """What PROBE saw on each rank, by rank; checks the TP=2 x DP=2 grid over two nodes."""
    records = [json.loads((run_dir / f"rank{r}.json").read_text()) for r in range(4)]
    for rank, rec in enumerate(records):
        assert rec["rank"] == rank and rec["world_size"] == 4
        # TP groups are rows of the [dp, tp] grid (adjacent ranks), DP groups its columns.
        assert rec["tp"] == [rank - rank % 2, rank - rank % 2 + 1], rec
        assert rec["dp"] == [rank % 2, rank % 2 + 2], rec
        assert rec["local_rank"] == rank % 2
        # A TP group never straddles the two nodes: its members were started by one launcher.
        assert {records[r]["node"] for r in rec["tp"]} == {rec["node"]}
    assert len({rec["node"] for rec in records}) == 2
    return records


@pytest.fixture(scope="module")
def reference(gpt_data, tmp_path_factory) -> list[float]:
    """Losses of one torchrun launcher with 4 processes."""
    run_dir = tmp_path_factory.mktemp("torchrun_4")
    env = _base_env(run_dir)
    cmd = _torchrun("--standalone", "--nproc-per-node=4", *_train_args(gpt_data, run_dir))
    _launch([(cmd, {**env, "PROBE_NODE": "single"})], run_dir)
    records = [json.loads((run_dir / f"rank{r}.json").read_text()) for r in range(4)]
    assert [rec["tp"] for rec in records] == [[0, 1], [0, 1], [2, 3], [2, 3]]
    losses = _losses(run_dir)
    assert losses[-1] < losses[0]
    return losses


@pytest.mark.slow
def test_two_torchrun_nodes_form_one_world(gpt_data, reference, tmp_path):
    env = _base_env(tmp_path)
    port = free_port()
    jobs = []
    for node_rank, node in enumerate(("first", "second")):
        # c10d numbers the nodes in the order they join (it reads --node-rank only with the
        # static backend), so which launcher holds ranks 0-1 is decided at rendezvous.
        cmd = _torchrun(
            "--nnodes=2", "--nproc-per-node=2", f"--node-rank={node_rank}",
            "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}", "--rdzv-id=test-launch",
            *_train_args(gpt_data, tmp_path),
        )  # fmt: skip
        jobs.append((cmd, {**env, "PROBE_NODE": node}))
    _launch(jobs, tmp_path)
    records = _records(tmp_path)
    assert all(rec["given"]["WORLD_SIZE"] == "4" for rec in records)
    assert _losses(tmp_path) == reference


@pytest.mark.slow
def test_slurm_variables_alone_form_the_world(gpt_data, reference, tmp_path):
    env = _base_env(tmp_path)
    slurm = {
        "SLURM_JOB_ID": "4242",
        # Two "nodes" in compressed form; the first expands to this machine's loopback address.
        "SLURM_JOB_NODELIST": "127.0.0.[1-2]",
        "SLURM_JOB_NUM_NODES": "2",
        "SLURM_NNODES": "2",
        "SLURM_NTASKS": "4",
        "SLURM_NTASKS_PER_NODE": "2",
        "MASTER_PORT": str(free_port()),
    }
    jobs = []
    for task in range(4):  # what srun sets in each task of --nodes=2 --ntasks-per-node=2
        per_task = {"SLURM_PROCID": str(task), "SLURM_LOCALID": str(task % 2),
                    "SLURM_NODEID": str(task // 2), "PROBE_NODE": str(task // 2)}  # fmt: skip
        cmd = [sys.executable, *_train_args(gpt_data, tmp_path)]
        jobs.append((cmd, {**env, **slurm, **per_task}))
    _launch(jobs, tmp_path)
    for rec in _records(tmp_path):
        assert rec["given"] == dict.fromkeys(("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR"))
        assert rec["master_addr"] == "127.0.0.1"
    assert _losses(tmp_path) == reference


# Node lists as SLURM writes them, and their expansion (`scontrol show hostnames`).
NODELISTS = {
    "node[01-04,07]": ["node01", "node02", "node03", "node04", "node07"],
    "a1,b2": ["a1", "b2"],
    "gpu-[3-5]": ["gpu-3", "gpu-4", "gpu-5"],
    "node[01-02]-ib": ["node01-ib", "node02-ib"],
    "rack[1-2]-gpu[08,10]": ["rack1-gpu08", "rack1-gpu10", "rack2-gpu08", "rack2-gpu10"],
    "127.0.0.[1-2]": ["127.0.0.1", "127.0.0.2"],
    "localhost": ["localhost"],
}


def _scontrol(bin_dir: Path, log: Path, works: bool) -> None:
    """A stub scontrol: expands NODELISTS and logs its calls, or fails as with no controller."""
    cases = "".join(f"    '{nodes}') printf '%s\\n' {' '.join(hosts)} ;;\n"
                    for nodes, hosts in NODELISTS.items())  # fmt: skip
    body = f"case $3 in\n{cases}    *) exit 1 ;;\nesac\n" if works else "exit 1\n"
    stub = bin_dir / "scontrol"
    stub.write_text(f'#!/bin/bash\necho "$*" >> "{log}"\n{body}')
    stub.chmod(0o755)


@pytest.mark.parametrize("scontrol", ["absent", "stub", "failing"])
def test_first_slurm_host(scontrol, tmp_path, monkeypatch):
    """The first host is the same whether scontrol expands the list or it is parsed here."""
    bin_dir, log = tmp_path / "bin", tmp_path / "scontrol.calls"
    bin_dir.mkdir()
    if scontrol != "absent":
        _scontrol(bin_dir, log, works=scontrol == "stub")
    monkeypatch.setenv("PATH", str(bin_dir))  # no real scontrol either
    for nodes, hosts in NODELISTS.items():
        assert first_slurm_host(nodes) == hosts[0], (scontrol, nodes)
    assert first_slurm_host("") == ""
    calls = log.read_text().splitlines() if log.exists() else []
    assert calls == ([f"show hostnames {nodes}" for nodes in NODELISTS] if scontrol != "absent"
                     else [])  # fmt: skip


SINGLE_NODE = ROOT / "scripts" / "run_single_node.sh"
# Stands in for python: passes the preflight, records the launcher's command line, runs nothing.
RECORD = r"""#!/bin/bash
if [[ $2 == --preflight ]]; then exit 0; fi
printf '%s\0' "$@" > "$RECORD_TO"
"""


def _single_node(tmp_path: Path, gpus: int | None, visible: str | None) -> tuple[str, list[str]]:
    """run_single_node.sh without NPROC, on a machine whose nvidia-smi lists ``gpus`` GPUs (None:
    no nvidia-smi at all): (what it printed, the torchrun arguments it chose)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    (bin_dir / "python-record").write_text(RECORD)
    (bin_dir / "nvidia-smi").unlink(missing_ok=True)
    if gpus is not None:
        listing = "".join(f"GPU {i}: NVIDIA H100 (UUID: GPU-{i})\\n" for i in range(gpus))
        (bin_dir / "nvidia-smi").write_text(f'#!/bin/bash\n[[ $1 == -L ]] && printf "{listing}"\n')
    for tool in bin_dir.iterdir():
        tool.chmod(0o755)
    env = {k: v for k, v in os.environ.items() if k not in ("NPROC", "CUDA_VISIBLE_DEVICES")}
    env.update(PATH=f"{bin_dir}:/usr/bin:/bin", PYTHON=str(bin_dir / "python-record"),
               RECORD_TO=str(tmp_path / "args"))  # fmt: skip
    if visible is not None:
        env["CUDA_VISIBLE_DEVICES"] = visible
    result = subprocess.run(
        ["bash", str(SINGLE_NODE), CONFIG], env=env, cwd=ROOT, capture_output=True, text=True,
        timeout=30,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    return result.stdout, (tmp_path / "args").read_text().split("\0")[:-1]


def test_single_node_picks_nproc_from_the_visible_gpus_or_the_cpus(tmp_path):
    out, args = _single_node(tmp_path, gpus=4, visible=None)
    assert "--nproc-per-node=4" in args
    assert "== NPROC=4: one process per visible GPU (nvidia-smi -L)" in out
    out, args = _single_node(tmp_path, gpus=4, visible="1,3")
    assert "--nproc-per-node=2" in args and "(CUDA_VISIBLE_DEVICES=1,3)" in out
    cpus = len(os.sched_getaffinity(0))
    on_cpu = 1 << (min(cpus, 8).bit_length() - 1)  # the largest power of two <= min(cpus, 8)
    for gpus, visible in ((None, None), (0, None), (4, "-1"), (4, "")):
        out, args = _single_node(tmp_path, gpus, visible)
        assert f"--nproc-per-node={on_cpu}" in args, (gpus, visible, args)
        assert f"== NPROC={on_cpu}: no GPU visible" in out and "set NPROC to choose" in out


def test_single_node_logs_are_ignored_by_git():
    """scripts/run_single_node.sh tees into logs/ of the repository (LOG_DIR's default)."""
    ignored = subprocess.run(["git", "check-ignore", "-q", "logs/torchrun/0/stdout.log"], cwd=ROOT)
    assert ignored.returncode == 0
