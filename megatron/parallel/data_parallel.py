"""Data-parallel gradient sync: fp32 buckets, all-reduced during backward, on the last micro-batch.

Every trainable parameter gets ``param.main_grad``, an fp32 view into one flat buffer that is cut
into buckets of about ``bucket_size_mb``. A post-accumulate-grad hook adds each fresh ``param.grad``
into ``main_grad`` and frees ``param.grad``, so gradients accumulate in fp32 over micro-batches
whatever the model dtype. The TP linears' weights skip that step: their backward adds the weight
gradient into ``main_grad`` itself (megatron/parallel/layers.py, gradient-accumulation fusion),
so no low-precision ``.grad`` exists for them and the hook, which autograd still runs, only
counts them. On the last micro-batch of a step (outside ``no_sync()``), a bucket whose parameters
all have their gradient is averaged over DP by an asynchronous all-reduce (``ReduceOp.AVG`` on
NCCL; divided first, then summed, on gloo) while backward goes on producing the next buckets;
``finish_grad_sync()`` waits for them.

Buckets follow the reverse of registration order, roughly the order backward produces gradients,
and are launched strictly in bucket order, so every DP rank issues the same collectives in the
same order. A parameter used twice (a tied embedding) is one leaf: autograd sums both uses before
its hook fires once. The module itself is untouched (not wrapped): its ``state_dict`` names stay
those of the model.

Typical step::

    for i, batch in enumerate(micro_batches):
        with ddp.no_sync() if i < len(micro_batches) - 1 else contextlib.nullcontext():
            optimizer.scale_loss(loss_fn(batch) / len(micro_batches)).backward()
    ddp.finish_grad_sync()
    optimizer.step(); optimizer.zero_grad(); ddp.zero_grad_buffer()
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import Tensor, nn

from megatron.parallel.state import ParallelState


def mean_op(backend: str) -> dist.ReduceOp | None:
    """The reduction that averages over a group of ``backend``: ``ReduceOp.AVG`` on NCCL (the
    division rides inside the collective, no extra pass over the bucket), None where the backend
    has no AVG (gloo): the caller divides by the group size first and sums."""
    return dist.ReduceOp.AVG if backend == "nccl" else None


@dataclass
class _Bucket:
    flat: Tensor  # fp32 view of the shared buffer holding these parameters' main_grad
    params: list[nn.Parameter]
    ready: int = 0  # parameters whose gradient of the last micro-batch has arrived
    launched: bool = False
    handle: dist.Work | None = field(default=None, repr=False)


class DataParallel:
    """fp32 gradient buffers for ``module`` and their bucketed all-reduce over the DP group."""

    def __init__(self, module: nn.Module, state: ParallelState, bucket_size_mb: float = 25.0):
        self.module, self.group, self.dp_size = module, state.dp_group, state.dp_size
        # parameters() yields a tied parameter once, so it gets one main_grad and one hook.
        params = [p for p in module.parameters() if p.requires_grad][::-1]
        if not params:
            raise ValueError("the module has no trainable parameters")
        self.buffer = torch.zeros(
            sum(p.numel() for p in params), dtype=torch.float32, device=params[0].device
        )
        limit = max(1, int(bucket_size_mb * 2**20) // self.buffer.element_size())
        self.buckets: list[_Bucket] = []
        self._bucket_of: dict[int, _Bucket] = {}
        start = end = 0
        members: list[nn.Parameter] = []
        for i, param in enumerate(params):
            param.main_grad = self.buffer[end : end + param.numel()].view_as(param)
            end += param.numel()
            members.append(param)
            if end - start >= limit or i == len(params) - 1:
                bucket = _Bucket(self.buffer[start:end], members)
                self.buckets.append(bucket)
                self._bucket_of.update({id(p): bucket for p in members})
                start, members = end, []
        self._avg = mean_op(dist.get_backend(self.group)) if self.dp_size > 1 else None
        self._sync = True
        self._next = 0  # index of the first bucket not yet launched this step
        self._hooks = [p.register_post_accumulate_grad_hook(self._on_grad) for p in params]

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate into ``main_grad`` without communicating (all but the last micro-batch)."""
        previous, self._sync = self._sync, False
        try:
            yield
        finally:
            self._sync = previous

    def _on_grad(self, param: nn.Parameter) -> None:
        bucket = self._bucket_of[id(param)]
        if bucket.launched:
            raise RuntimeError(
                "a gradient arrived after its bucket was all-reduced; run every backward but the "
                "last of a step inside no_sync(), then finish_grad_sync()"
            )
        if param.grad is not None:  # None: a fused TP linear already added it into main_grad
            param.main_grad.add_(param.grad)
            param.grad = None
        if self._sync:
            bucket.ready += 1
            # In bucket order only, so all DP ranks issue the same collectives in the same order.
            while self._next < len(self.buckets) and self._is_full(self.buckets[self._next]):
                self._launch(self.buckets[self._next])

    @staticmethod
    def _is_full(bucket: _Bucket) -> bool:
        return bucket.ready == len(bucket.params)

    def _launch(self, bucket: _Bucket) -> None:
        if self.dp_size > 1:
            op = self._avg
            if op is None:
                # No AVG here (gloo): divide first (exact for power-of-two DP sizes), then SUM.
                bucket.flat.div_(self.dp_size)
                op = dist.ReduceOp.SUM
            bucket.handle = dist.all_reduce(bucket.flat, op=op, group=self.group, async_op=True)
        bucket.launched = True
        self._next += 1

    def finish_grad_sync(self) -> None:
        """Launch the buckets backward did not complete (unused parameters), wait for all.

        Afterwards every ``main_grad`` holds the DP mean of the step's summed gradients.
        """
        while self._next < len(self.buckets):
            self._launch(self.buckets[self._next])
        for bucket in self.buckets:
            if bucket.handle is not None:
                bucket.handle.wait()
            bucket.ready, bucket.launched, bucket.handle = 0, False, None
        self._next = 0

    def zero_grad_buffer(self) -> None:
        """Zero every ``main_grad`` (one kernel over the flat buffer) before the next step."""
        self.buffer.zero_()
