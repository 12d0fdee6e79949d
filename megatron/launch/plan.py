"""``--plan``: the layouts of a config that fit ``--nodes`` of ``--cluster`` by the memory
estimate, ranked by the step-time model; the five fastest, each with why it wins.

Searched: TP over the divisors of the heads (and query groups) up to one node (a TP group that
crossed nodes would run its per-layer all-reduces on the network: named, not offered), PP over
the divisors of the layers, 2 or 4 virtual stages where PP > 1, CP over what divides the rest
from 8192 tokens on (below that a ring hop costs more than the attention it splits), EP over
the divisors of the experts, sequence parallelism, the distributed optimizer (its parameter
gather overlapped), full recomputation or none, micro-batch size 1 to 8. The global batch and
the model stay as configured; each layout passes the checks a launch runs (``validate``). The
five shown are the fastest of five different rank grids (TP, PP, v, CP, EP).
"""

from __future__ import annotations

import argparse
import itertools
import math
from collections.abc import Iterator
from dataclasses import dataclass, replace
from typing import TextIO

from megatron.config.schema import Config
from megatron.errors import ConfigError
from megatron.estimate.cluster import Cluster
from megatron.estimate.memory import GIB, fits, worst_stage
from megatron.estimate.parameters import ModelType
from megatron.estimate.step_time import StepTime, step_time
from megatron.launch.data_checks import missing_files, vocab_size
from megatron.launch.dry_run_time import cluster_and_world
from megatron.launch.preflight import validate

SHOWN = 5
SEARCHED = (  # the parallel keys the search sets, in the order layouts() gives their values
    "tensor_parallel_size",
    "pipeline_parallel_size",
    "virtual_pipeline_size",
    "context_parallel_size",
    "expert_parallel_size",
    "sequence_parallel",
    "distributed_optimizer",
)
MICRO_BATCHES = (1, 2, 4, 8)


@dataclass(frozen=True)
class Candidate:
    cfg: Config
    world: int
    step: StepTime
    memory_gib: float

    def label(self) -> str:
        p, m = self.cfg.parallel, self.cfg.model
        parts = [f"TP {p.tensor_parallel_size}"]
        if p.pipeline_parallel_size > 1:
            v = f" (v {p.virtual_pipeline_size})" if p.virtual_pipeline_size else ""
            parts.append(f"PP {p.pipeline_parallel_size}{v}")
        if p.context_parallel_size > 1:
            parts.append(f"CP {p.context_parallel_size}")
        parts.append(f"DP {self.cfg.derived(self.world).dp_size}")
        options = [f"mbs {self.cfg.training.micro_batch_size}", f"recompute {m.recompute}"]
        options += [f"EP {p.expert_parallel_size}"] * (p.expert_parallel_size > 1)
        options += ["SP"] * p.sequence_parallel + [
            "distributed optimizer"
        ] * p.distributed_optimizer
        return " x ".join(parts) + ", " + ", ".join(options)

    def parts(self) -> dict[str, float]:
        """The step in seconds: pipeline idle, exposed communication, and the rest (compute)."""
        step = self.step
        bubble = step.seconds * step.bubble_fraction / (1 + step.bubble_fraction)
        return {
            "pipeline bubble": bubble,
            "exposed communication": step.exposed_comm,
            "compute": step.seconds - bubble - step.exposed_comm,
        }


def _divisors(n: int, most: int) -> list[int]:
    return [d for d in range(1, min(n, most) + 1) if n % d == 0]


def layouts(cfg: Config, world: int, node: int) -> Iterator[Config]:
    """Every combination of the searched switches whose sizes divide the world."""
    m, p = cfg.model, cfg.parallel
    for tp in _divisors(math.gcd(m.num_attention_heads, m.query_groups), node):
        for pp in _divisors(m.num_layers, world // tp):
            rest = world // (tp * pp)
            if world % (tp * pp):
                continue
            chunks = [None] + [v for v in (2, 4) if pp > 1 and m.num_layers % (pp * v) == 0]
            cps = _divisors(rest, rest) if m.seq_length >= 8192 else [1]
            eps = _divisors(m.num_experts, rest) if m.num_experts else [1]
            for v, cp, ep, sp, dist, recompute, mbs in itertools.product(
                chunks, cps, eps, (False, True), (False, True), ("none", "full"), MICRO_BATCHES
            ):
                if (sp and tp == 1) or (dist and rest // cp == 1) or rest % cp:
                    continue
                sizes = dict(zip(SEARCHED, (tp, pp, v, cp, ep, sp, dist)))
                parallel = replace(p, overlap_param_gather=dist, **sizes)
                yield replace(
                    cfg,
                    parallel=parallel,
                    model=replace(m, recompute=recompute),
                    training=replace(cfg.training, micro_batch_size=mbs),
                )


def search(
    cfg: Config, model_type: ModelType, world: int, cluster: Cluster, vocab: int
) -> tuple[list[Candidate], int]:
    """(the layouts that fit, fastest first; how many valid layouts were searched)."""
    found, searched = [], 0
    for layout in layouts(cfg, world, cluster.gpus_per_node):
        try:
            validate(layout, world, check_files=False)
        except ConfigError:
            continue
        searched += 1
        derived = layout.derived(world)
        padded = derived.padded_vocab_size(vocab)
        memory = worst_stage(layout, padded, model_type, derived.dp_size).total
        if fits(memory, cluster.gpu_memory_gb):
            step = step_time(layout, padded, model_type, world, cluster)
            found.append(Candidate(layout, world, step, memory / GIB))
    return sorted(found, key=lambda c: c.step.seconds), searched


def distinct_grids(found: list[Candidate]) -> list[Candidate]:
    """The fastest candidate of each rank grid (TP, PP, virtual stages, CP, EP), in order."""
    seen, kept = set(), []
    for c in found:
        p = c.cfg.parallel
        grid = (p.tensor_parallel_size, p.pipeline_parallel_size, p.virtual_pipeline_size)
        grid += (p.context_parallel_size, p.expert_parallel_size)
        if grid not in seen:
            seen.add(grid)
            kept.append(c)
    return kept


def _why(rank: int, c: Candidate, best: Candidate, cluster: Cluster) -> str:
    """Rank 1: where its time goes; the others: what they lose against rank 1, and to what."""
    p, parts = c.cfg.parallel, c.parts()
    if rank == 1:
        where = "TP on NVLink inside a node" if p.tensor_parallel_size > 1 else "no TP traffic"
        bubble = (
            "no pipeline bubble"
            if p.pipeline_parallel_size == 1
            else (f"bubble {c.step.bubble_fraction:.0%}")
        )
        return (
            f"fastest: {where}, {bubble}, {c.step.exposed_comm_fraction:.0%} of the step in "
            f"exposed communication, MFU {c.step.mfu:.0%}"
        )
    extra = {k: v - best.parts()[k] for k, v in parts.items()}
    worst = max(extra, key=lambda k: extra[k])
    slower = c.step.seconds / best.step.seconds - 1
    return f"{slower:+.1%} against 1: more {worst} (+{extra[worst] * 1e3:,.0f} ms)"


def _not_offered(cfg: Config, cluster: Cluster) -> list[str]:
    """The TP sizes the heads allow beyond one node, and why they are left out."""
    m, node = cfg.model, cluster.gpus_per_node
    wider = _divisors(math.gcd(m.num_attention_heads, m.query_groups), 1 << 20)
    inter, intra = cluster.link(True).bandwidth / 1e9, cluster.link(False).bandwidth / 1e9
    return [
        f"TP {t} is not offered: it would cross nodes ({node} GPUs per node of {cluster.name}), "
        f"putting every layer's TP all-reduces on the network ({inter:g} GB/s per GPU "
        f"achievable, against {intra:g} inside a node)"
        for t in wider
        if t > node
    ][:1]


def plan_to(cfg: Config, args: argparse.Namespace, model_type: ModelType, out: TextIO) -> int:
    """Print the plan; 0. No layout fits: ConfigError naming the smallest change that does."""
    cluster, world = cluster_and_world(args)
    if cluster is None or world is None:
        raise ConfigError("--plan needs --cluster NAME and --nodes N (the GPUs to plan for)")
    vocab, _ = vocab_size(cfg, missing_files(cfg))
    found, searched = search(cfg, model_type, world, cluster, vocab)
    nodes = world // cluster.gpus_per_node
    if not found:
        raise ConfigError(_no_fit(cfg, model_type, nodes, cluster, vocab, searched))
    out.write(
        f"plan: {len(found)} of {searched} valid layouts fit {cluster.gpu_memory_gb:g} GB per GPU"
        f" on {nodes} node(s) of {cluster.name} ({world} GPUs), global batch "
        f"{cfg.training.global_batch_size}; the fastest of each rank grid:\n"
    )
    for rank, c in enumerate(distinct_grids(found)[:SHOWN], 1):
        out.write(
            f"{rank}. {c.label()}: {c.step.seconds * 1e3:,.0f} ms/iteration, "
            f"{c.step.tflops_per_gpu:.1f} TFLOP/s per GPU, {c.memory_gib:.1f} GiB per GPU\n"
            f"   {_why(rank, c, found[0], cluster)}\n"
        )
    for line in _not_offered(cfg, cluster):
        out.write(f"{line}\n")
    return 0


def _no_fit(
    cfg: Config, model_type: ModelType, nodes: int, cluster: Cluster, vocab: int, searched: int
) -> str:
    """The one line for a plan with nothing that fits: the fewest nodes (up to 64 times as
    many) on which some layout fits, and the fastest layout there."""
    head = (
        f"--plan: none of the {searched} valid layouts fits {cluster.gpu_memory_gb:g} GB per GPU "
        f"on {nodes} node(s) of {cluster.name} (micro-batch 1 and full recomputation included)"
    )
    more = nodes * 2
    while more <= nodes * 64:
        found, _ = search(cfg, model_type, more * cluster.gpus_per_node, cluster, vocab)
        if found:
            return f"{head}; the smallest change that fits: --nodes {more} ({found[0].label()})"
        more *= 2
    return f"{head}, nor on {nodes * 64} nodes; lower model.seq_length or the model's size"
