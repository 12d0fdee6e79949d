"""Training metrics: the log window, the workload's FLOPs, memory figures, and ``MetricsLogger``,
which writes each logged iteration to the console, TensorBoard, the JSONL metrics file and W&B."""

from __future__ import annotations

import json
import math
import os
import resource
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from megatron.checkpoint.train_state import LogWindow
from megatron.config.schema import Config
from megatron.estimate.workload import Workload
from megatron.logging import log
from megatron.optim.optimizer import StepResult
from megatron.parallel.state import ParallelState
from megatron.training.stragglers import Straggler
from megatron.training.wandb_logger import WandbRun

# The console names of ``memory_mb``'s figures, each written rank 0's/rank 1's/... (so the
# first number after "peak memory (MB): " stays rank 0's, as tools/gpu_check reads it).
_MEMORY_LABELS = {
    "mem_optimizer_mb": "optimizer state (MB)",
    "mem_peak_mb": "peak memory (MB)",
    "mem_allocated_mb": "memory now (MB)",
}

MB = 2**20


def memory_mb(device: torch.device, optimizer_bytes: int) -> dict[str, float]:
    """This rank's memory now, in MB (2^20 bytes), read on the host without waiting for the device.

    - ``mem_optimizer_mb``: ``optimizer_bytes``, the optimizer's ``state_bytes()``: fp32 main
      copies and Adam moments this rank holds (its shard of them, with the distributed optimizer).
    - ``mem_peak_mb``: on CUDA, ``torch.cuda.max_memory_allocated``: the most the caching
      allocator has handed out to tensors at once since the start (not what it reserved from the
      driver, nor the CUDA context); on CPU, the process's peak resident set (``getrusage``
      ``ru_maxrss``): all RAM it ever held at once, Python, libraries and tensors alike.
    - ``mem_allocated_mb``: the same now: ``torch.cuda.memory_allocated``, or the resident set.
    """
    if device.type == "cuda":
        peak = torch.cuda.max_memory_allocated(device)
        now = torch.cuda.memory_allocated(device)
    else:
        with open("/proc/self/statm") as f:  # pages: size, resident, ...
            now = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
        # Linux reports KiB, and updates its high-water mark lazily: it can lag the RSS now.
        peak = max(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, now)
    return {
        "mem_optimizer_mb": optimizer_bytes / MB,
        "mem_peak_mb": peak / MB,
        "mem_allocated_mb": now / MB,
    }


def gather_memory(memory: dict[str, float], state: ParallelState) -> dict[str, list[float]]:
    """Every rank's ``memory_mb`` figures (index: global rank) on a logged step, {} on others
    (every rank logs the same steps). Host floats, gathered in CPU tensors over the gloo group and
    read through numpy: nothing waits for the device (tests/test_host_syncs.py counts torch's
    reads on any device, so a host-only read through torch would count as a sync).
    """
    if not memory:
        return {}
    mine = torch.tensor([*memory.values()], dtype=torch.float64)
    ranks = [mine]
    if state.world_size > 1:
        ranks = [torch.empty_like(mine) for _ in range(state.world_size)]
        dist.all_gather(ranks, mine, group=state.host_group)
    table = torch.stack(ranks).numpy()  # [world, figures]
    return {name: table[:, i].tolist() for i, name in enumerate(memory)}


class _NullWriter:
    """The TensorBoard writer when there is none: what MetricsLogger calls does nothing."""

    def add_scalar(self, *args: Any, **kwargs: Any) -> None:
        pass

    def close(self) -> None:
        pass


class MetricsLogger:
    """TensorBoard scalars (Megatron's names, each with a ``vs samples`` twin), the same in W&B
    when ``cfg`` asks for it, JSON lines, and the console lines of training and validation."""

    def __init__(
        self,
        tensorboard_dir: str | None,
        metrics_file: str | None,
        enabled: bool,
        config_text: str,
        work: Workload,
        cfg: Config | None = None,
    ):
        self.work = work
        self.enabled = enabled  # the one rank that logs: its warnings are the run's, once
        self.tb: Any = _NullWriter()
        self.metrics = None
        self.wandb: WandbRun | None = None
        if not enabled:
            return
        if cfg is not None and cfg.logging.uses_wandb:
            self.wandb = WandbRun(cfg)
        if tensorboard_dir:
            from torch.utils.tensorboard import SummaryWriter

            self.tb = SummaryWriter(log_dir=tensorboard_dir)
            self.tb.add_text("config", f"```yaml\n{config_text}\n```")
        if metrics_file:
            os.makedirs(os.path.dirname(os.path.abspath(metrics_file)), exist_ok=True)
            # Append: a resumed run continues the same file; each line is flushed whole.
            self.metrics = open(metrics_file, "a", buffering=1)  # noqa: SIM115

    def scalars(self, values: dict[str, float], iteration: int, samples: int) -> None:
        for name, value in values.items():
            self.tb.add_scalar(name, value, iteration)
            self.tb.add_scalar(f"{name} vs samples", value, samples)
        if self.wandb is not None:
            self.wandb.log(values, iteration, samples)

    def record(self, entry: dict[str, Any]) -> None:
        """One JSON line; floats are written with repr precision, so runs compare exactly."""
        if self.metrics is not None:
            self.metrics.write(json.dumps(entry) + "\n")

    def training(
        self,
        iteration: int,
        samples: int,
        window: LogWindow,
        lr: float,
        step: StepResult,
        memory: dict[str, list[float]],
        phases: dict[str, list[float]] | None = None,
        stragglers: Sequence[Straggler] = (),
    ) -> None:
        """The line for ``window``, which ends at ``iteration`` after ``samples`` samples.

        ``lr`` and ``step``: the last step's learning rate and result (loss scale, grad norm);
        ``memory``: each ``memory_mb`` figure of every rank (index: global rank), read after the
        last step's backward and before its update: a peak covers every earlier update, so at
        iteration 1 it does not yet hold the Adam moments torch allocates in the first update.
        ``phases``: every rank's ms per iteration in each phase of the step (``PhaseTimes``), in
        the metrics file and TensorBoard; ``stragglers``: the ranks they name, a warning line each.
        """
        phases = phases or {}
        means, work = window.means(), self.work
        seconds = window.seconds / window.steps
        tokens_per_s = work.tokens_per_iter / seconds
        tflops = work.flops_per_iter / seconds / work.world_size / 1e12
        scale, norm = step.loss_scale, step.grad_norm
        self.record(
            {
                "iteration": iteration,
                "consumed_samples": samples,
                **{k.replace(" ", "_"): v for k, v in means.items()},
                "lr": lr,
                "grad_norm": norm,
                "loss_scale": scale,
                "skipped": window.skipped,
                "nan": window.nans,
                "ms_per_iter": 1000 * seconds,
                "tokens_per_s": tokens_per_s,
                "tflops": tflops,
                **memory,
                **phases,
                **({"stragglers": [s._asdict() for s in stragglers]} if stragglers else {}),
            }
        )
        scalars = {"learning-rate": lr, **means, "loss-scale": scale, "grad-norm": norm}
        self.scalars({**scalars, "iteration-time": seconds}, iteration, samples)
        per_rank = {  # one curve per rank: mem-peak-mb/rank-0, ...
            f"{name.replace('_', '-')}/rank-{rank}": value
            for name, values in {**memory, **phases}.items()
            for rank, value in enumerate(values)
        }
        for name, value in per_rank.items():
            self.tb.add_scalar(name, value, iteration)
        if self.wandb is not None and per_rank:
            self.wandb.log(per_rank, iteration)
        fields: dict[str, Any] = {
            "iteration": f"{iteration:8d}/{work.train_iters:8d}",
            "consumed samples": samples,
            "elapsed time per iteration (ms)": 1000 * seconds,
            "tokens/s": tokens_per_s,
            "TFLOP/s per device": tflops,
            "learning rate": lr,
            **console_means(means),
            "loss scale": scale,
            "grad norm": norm,
            "skipped iterations": window.skipped,
            "nan iterations": window.nans,
            **{_MEMORY_LABELS[k]: "/".join(f"{v:.1f}" for v in vs) for k, vs in memory.items()},
        }
        log.info(format_line(fields))
        first = iteration - window.steps + 1
        for s in stragglers if self.enabled else ():
            log.warning(
                "straggler: rank %d (%s) spends %.1f ms per iteration in %s, its pipeline "
                "stage's median rank %.1f ms (iterations %d-%d)",
                s.rank, s.host, s.ms, s.phase, s.median_ms, first, iteration,
            )  # fmt: skip

    def validation(
        self, iteration: int, samples: int, means: dict[str, float], split: str = "validation"
    ) -> None:
        """The line of an evaluation on ``split`` (validation, or test): each metric and its
        perplexity, named ``<metric> <split>``."""
        values = {}
        for name, value in means.items():
            values[f"{name} {split}"] = value
            values[f"{name} {split} ppl"] = perplexity(value)
        self.scalars(values, iteration, samples)
        fields = {k.replace(" ", "_"): v for k, v in values.items()}
        self.record({"iteration": iteration, "consumed_samples": samples, **fields})
        log.info("%s at iteration %d | %s", split, iteration, format_line(values))

    def downstream(self, iteration: int, samples: int, scores: dict[str, float]) -> None:
        """The line of a ``training.eval_tasks`` run: ``eval/<task>/<metric>`` values."""
        self.scalars(scores, iteration, samples)
        self.record({"iteration": iteration, "consumed_samples": samples, **scores})
        log.info("downstream tasks at iteration %d | %s", iteration, format_line(scores))

    def close(self) -> None:
        self.tb.close()
        if self.wandb is not None:
            self.wandb.close()
        if self.metrics is not None:
            self.metrics.close()


def console_means(means: dict[str, float]) -> dict[str, Any]:
    """``means`` for the console line: a per-layer family (``moe imbalance/layer_3``, ...) becomes
    one field of its values in layer order, ``moe imbalance: 1.12/1.30``, where TensorBoard,
    W&B and the metrics file keep each layer apart."""
    fields: dict[str, Any] = {}
    for name, value in means.items():
        family, _, layer = name.partition("/")
        if not layer:
            fields[name] = value
        else:
            shown = f"{value:.2f}" if value != int(value) else str(int(value))
            fields[family] = f"{fields[family]}/{shown}" if family in fields else shown
    return fields


def perplexity(loss: float) -> float:
    """exp(loss), capped at exp(20) like Megatron so early evaluations stay printable."""
    return math.exp(min(20.0, loss))


def format_line(fields: dict[str, Any]) -> str:
    """`` key: value | key: value`` with Megatron's number formats."""
    parts = []
    for key, value in fields.items():
        if isinstance(value, float):
            scientific = ("loss" in key and key != "loss scale") or key == "learning rate"
            text = f"{value:.6E}" if scientific else f"{value:.2f}"
        else:
            text = str(value)
        parts.append(f"{key}: {text}")
    return " | ".join(parts)
