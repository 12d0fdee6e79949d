"""Global batches the run never trains on: the spike guard's rollbacks and ``data.skip_batches``.

Batches are numbered from 1 in stream order: batch N holds train samples ``(N-1)*gbs`` to
``N*gbs - 1``, the batch that iteration N trains in a run that never skipped. A skipped batch is
passed over, not replaced: the next iteration trains the next batch not skipped, so the data
order is a function of (seed, consumed samples, global batch size, skip list) and a restart with
the same list reproduces the same stream. ``consumed_train_samples`` counts the position in the
stream, skipped batches included.

The list is kept as sorted, disjoint, inclusive ``[first, last]`` ranges, which is also how
checkpoints (``Progress.skip_batches``) and the metrics file hold it.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence

from megatron.config.schema import Config
from megatron.errors import ConfigError

Ranges = list[list[int]]


def parse(entries: Sequence[int | Sequence[int]], key: str = "data.skip_batches") -> Ranges:
    """Config entries (a batch number, or a ``[first, last]`` pair) as merged ranges; a bad
    entry is one ConfigError line naming ``key``."""
    ranges = []
    for entry in entries:
        pair = [entry, entry] if isinstance(entry, int) else list(entry)
        if len(pair) != 2 or not 1 <= pair[0] <= pair[1]:
            raise ConfigError(
                f"{key}: {entry!r} is neither a batch number (from 1) nor a [first, last] pair "
                "with first <= last; fix the entry"
            )
        ranges.append(pair)
    return merge(ranges)


def merge(ranges: Iterable[Sequence[int]]) -> Ranges:
    """Sorted, disjoint ranges covering the same batches; adjacent ranges are joined."""
    out: Ranges = []
    for first, last in sorted(ranges):
        if out and first <= out[-1][1] + 1:
            out[-1][1] = max(out[-1][1], last)
        else:
            out.append([first, last])
    return out


def with_config(saved: Ranges, cfg: Config) -> Ranges:
    """A checkpoint's skip list with ``data.skip_batches`` (given by hand) joined to it."""
    return merge(saved + parse(cfg.data.skip_batches))


def count(ranges: Ranges) -> int:
    return sum(last - first + 1 for first, last in ranges)


def is_skipped(batch: int, ranges: Ranges) -> bool:
    return any(first <= batch <= last for first, last in ranges)


def batches_from(batch: int, ranges: Ranges) -> Iterator[int]:
    """The batch numbers not skipped, from ``batch`` on (unbounded); a skipped range is
    stepped over whole."""
    while True:
        last = next((b for a, b in ranges if a <= batch <= b), None)
        if last is None:
            yield batch
            batch += 1
        else:
            batch = last + 1


def next_batch(consumed_samples: int, global_batch_size: int, ranges: Ranges) -> int:
    """The batch the next iteration trains, the stream being at ``consumed_samples``."""
    return next(batches_from(consumed_samples // global_batch_size + 1, ranges))


def headroom(cfg: Config) -> int:
    """Batches past ``train_iters`` the train split holds for the spike guard:
    ``training.max_rollbacks`` rollbacks of ``training.spike_skip_batches`` (or one
    ``checkpoint.save_interval``) each; 0 with the guard off.

    A function of the guard's settings alone, not of any skip list: the split's size sets its
    sample order (Megatron's epochs), so a run, its rollbacks, its restarts and a run given the
    same skips by hand (``data.skip_batches``) all read one stream. Batches skipped by hand come
    out of the split's spare samples; a run that runs out stops early and says so.
    """
    t = cfg.training
    if t.spike_threshold is None:
        return 0
    return t.max_rollbacks * (t.spike_skip_batches or cfg.checkpoint.save_interval or 0)


def describe(ranges: Ranges) -> str:
    """``3-5, 9``: for one log line."""
    return ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in ranges) or "none"
