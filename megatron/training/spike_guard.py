"""The loss-spike guard (``training.spike_threshold``): what PaLM, OPT and BLOOM's operators did by
hand, restart from a checkpoint before the spike and skip the batches around it, done by the run.

A spike is an iteration whose loss exceeds ``spike_threshold`` times the median of the last
``spike_window`` iterations' losses (judged once that many are in). The loss is the step's
``lm loss``, already summed over the world in the step's one all-reduce and host sync, so every
rank judges the same number and they all decide alike, with no collective of their own.

On a spike the loop (``roll_back``) reloads the newest checkpoint saved before it and
adds to the skip list (``megatron.config.skip_list``) the batches trained since that checkpoint,
up to and including the spike's, or the last ``spike_skip_batches`` of them. The window of recent
losses travels in checkpoints (``Progress.recent_losses``), so a resumed run judges as one that
never stopped.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from megatron import checkpoint
from megatron.checkpoint.train_state import Progress, TrainState
from megatron.config import skip_list
from megatron.config.schema import Config, TrainingConfig
from megatron.logging import log
from megatron.parallel.state import ParallelState
from megatron.training.source_losses import PREFIX

LOSS = "lm loss"  # the loss judged
TOO_MANY_SPIKES = 5  # the exit code after training.max_rollbacks rollbacks and one more spike


@dataclass(frozen=True)
class Spike:
    iteration: int
    loss: float
    median: float  # of the window it was judged against
    batch: int  # the global batch it trained on
    by_source: dict[str, float]  # a blend's loss of each source in the spiked step


def judge(
    t: TrainingConfig, progress: Progress, means: dict[str, float | None], batch: int
) -> Spike | None:
    """The spike at ``progress.iteration`` (just trained on ``batch``, whose metrics are
    ``means``), or None after taking its loss into the window. A non-finite loss is the
    non-finite-step machinery's, not a spike."""
    loss = means.get(LOSS)
    if t.spike_threshold is None or loss is None or not math.isfinite(loss):
        return None
    window = progress.recent_losses
    if len(window) >= t.spike_window:
        median = statistics.median(window)
        if loss > t.spike_threshold * median:
            by_source = {k: v for k, v in means.items() if k.startswith(PREFIX) and v is not None}
            return Spike(progress.iteration, loss, median, batch, by_source)
    progress.recent_losses = [*window, loss][-t.spike_window :]
    return None


def batches_to_skip(
    t: TrainingConfig, restored: Progress, spike: Spike, skip: skip_list.Ranges
) -> skip_list.Ranges:
    """The batches trained after the checkpoint ``restored`` came from, up to and including the
    spike's (the last ``spike_skip_batches`` of them when set), as ranges."""
    first = skip_list.next_batch(restored.consumed_train_samples, t.global_batch_size, skip)
    trained = [b for b in range(first, spike.batch + 1) if not skip_list.is_skipped(b, skip)]
    if t.spike_skip_batches is not None:
        trained = trained[-t.spike_skip_batches :]
    return skip_list.merge([b, b] for b in trained)


def roll_back(
    spike: Spike,
    cfg: Config,
    train: TrainState,
    state: ParallelState,
    vocab_size: int,
    record: Callable[[dict[str, Any]], None],
    save: Callable[[], None],
) -> int | None:
    """Reload into ``train`` the newest checkpoint saved before ``spike`` (none may still be
    being written) and skip the batches since, every rank alike: each judged the same summed
    loss. None: go on (the caller reopens the streams); past training.max_rollbacks: ``save``d,
    and ``TOO_MANY_SPIKES`` to exit with. ``record`` takes the metrics file's line."""
    t, save_dir = cfg.training, cfg.checkpoint.save
    before = [it for it in checkpoint.iterations(save_dir) if it < spike.iteration]
    what = f"loss spike at iteration {spike.iteration}: {LOSS} {spike.loss:.4g} > "
    what += f"{t.spike_threshold:g} x {spike.median:.4g} (median of the last {t.spike_window})"
    if not before:
        log.warning("%s; no checkpoint before it in %s to roll back to: going on", what, save_dir)
        return None
    old = train.progress
    path = checkpoint.checkpoint_dir(save_dir, before[-1])
    checkpoint.load_checkpoint(path, train, state, vocab_size)
    restored = train.progress
    skipped = batches_to_skip(t, restored, spike, old.skip_batches)
    restored.skip_batches = skip_list.merge(old.skip_batches + skipped)
    restored.rollbacks = old.rollbacks + 1
    train.optimizer.set_lr(train.schedule.lr)
    log.warning(
        "%s; rolled back to iteration %d, skipping batches %s (rollback %d of %d)",
        what, restored.iteration, skip_list.describe(skipped), restored.rollbacks,
        t.max_rollbacks,
    )  # fmt: skip
    by_source = {k.replace(" ", "_"): v for k, v in spike.by_source.items()}
    record({"iteration": spike.iteration, "spike_loss": spike.loss,
            "spike_median": spike.median, "rolled_back_to": restored.iteration,
            "skip_batches": restored.skip_batches, **by_source})  # fmt: skip
    if restored.rollbacks <= t.max_rollbacks:
        return None
    save()
    log.error(
        "stopping: more than training.max_rollbacks=%d loss spikes; iteration %d is saved "
        "with its skip list; raise max_rollbacks, or lower the learning rate, to go on",
        t.max_rollbacks, restored.iteration,
    )  # fmt: skip
    return TOO_MANY_SPIKES
