"""When a pipeline stage holds which micro-batch's activations: the schedules' unit order.

megatron/parallel/pipeline runs, on stage s of p with m micro-batches and v model chunks per
stage, a warm-up of forwards, then one forward and one backward at a time, then the remaining
backwards; a micro-batch chunk's activations live from the start of its forward to the end of
its backward. Replaying that order (no tensors, no processes) gives what megatron/estimate/memory.py
needs: the most bytes a stage holds at once, and the most micro-batch chunks in flight. With
1F1B that is min(p - s, m) micro-batches, p on the first stage; interleaved it is
min(2(p - s - 1) + (v - 1)p + 1, m*v) chunks of 1/v of a stage's layers each (all m*v when
m == p): p + (p - 1)/v stages' worth on the first stage, Megatron's p * (1 + (p - 1)/(p*v)).
"""

from __future__ import annotations

Unit = tuple[str, int]  # ("F" or "B", chunk): a forward or a backward of one micro-batch chunk


def schedule_units(pp_size: int, chunks: int, num_micro_batches: int, stage: int) -> list[Unit]:
    """The units stage ``stage`` runs, in the order megatron/parallel/pipeline runs them;
    ``chunks`` > 1 is the interleaved schedule. Forward unit k is chunk (k mod p*v) // p,
    backward unit k the chunks in reverse order (v = 1: chunk 0 throughout)."""
    p, v, m, s = pp_size, chunks, num_micro_batches, stage
    total = m * v
    if v == 1:
        warmup = min(p - s - 1, m)
    else:
        warmup = total if m == p else min((p - s - 1) * 2 + (v - 1) * p, total)

    def forward(k: int) -> Unit:
        return ("F", (k % (p * v)) // p)

    def backward(k: int) -> Unit:
        return ("B", v - 1 - (k % (p * v)) // p)

    order = [forward(k) for k in range(warmup)]
    for i in range(total - warmup):  # steady state: forward unit warmup + i, backward unit i
        order += [forward(warmup + i), backward(i)]
    return order + [backward(k) for k in range(total - warmup, total)]


def peak_held(units: list[Unit], held_bytes: list[int]) -> int:
    """The most bytes held at once, a forward of chunk c holding ``held_bytes[c]`` until the
    backward of that chunk (each chunk's backwards run in its forwards' order)."""
    held = most = 0
    for kind, chunk in units:
        held += held_bytes[chunk] if kind == "F" else -held_bytes[chunk]
        most = max(most, held)
    return most


def in_flight(pp_size: int, chunks: int, num_micro_batches: int, stage: int) -> int:
    """The most micro-batch chunks the stage holds at once: min(p - s, m) with 1F1B, and
    min(2(p - s - 1) + (v - 1)p + 1, m*v) interleaved (all m*v when m == p)."""
    return peak_held(schedule_units(pp_size, chunks, num_micro_batches, stage), [1] * chunks)


def ideal_bubble(pp_size: int, chunks: int, num_micro_batches: int) -> float:
    """Pipeline idle over busy time with equal stage times and free communication: (p-1)/(m*v)."""
    return (pp_size - 1) / (num_micro_batches * chunks)
