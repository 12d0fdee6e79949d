"""Data-parallel gradient sync: fp32 buckets, all-reduced (or reduce-scattered) during backward,
on the last micro-batch.

Every trainable parameter gets ``param.main_grad``, an fp32 view into one flat buffer that is cut
into buckets of about ``bucket_size_mb``. A post-accumulate-grad hook adds each fresh ``param.grad``
into ``main_grad`` and frees ``param.grad``, so gradients accumulate in fp32 over micro-batches
whatever the model dtype. The TP linears' weights skip that step: their backward adds the weight
gradient into ``main_grad`` itself (megatron/parallel/layers.py, gradient-accumulation fusion),
so no low-precision ``.grad`` exists for them and the hook, which autograd still runs, only
counts them. On the last micro-batch of a step (outside ``no_sync()``), a bucket whose parameters
all have their gradient is averaged over DP by an asynchronous all-reduce (``ReduceOp.AVG`` on
NCCL; divided first, then summed, on gloo) while backward goes on producing the next buckets;
``finish_grad_sync()`` waits for them. Under a pipeline schedule the last micro-batch's backward
is each model chunk's own: the schedule calls ``sync_backward`` before every backward, on for
each chunk's last one; a bucket holding a pipeline-tied parameter (the word table's copy on the
first and the last stage) also waits for ``finish_grad_sync``, since the two copies' gradients
must be summed over their stages before the DP reduction (their DP shards differ).

With ``shard_optimizer`` (parallel.distributed_optimizer, megatron/optim/distributed_optimizer.py)
each bucket is padded to a multiple of the DP size and DP rank d owns the d-th contiguous slice of
every bucket. A full bucket is then reduce-scattered instead (the same average, landing only in
the owned slice), and the parameters become views of one flat model-dtype buffer laid out like the
gradient buffer, so that after the optimizer wrote its updated slices, ``gather_params()``
all-gathers each bucket's parameters in place (with ``overlap_param_gather``, left running into
the next forward, where each module waits for its own buckets). Both collectives, with the output
aliasing the input as here, exist on NCCL and on gloo for CPU tensors (checked with torch 2.13)::

    buffer  | bucket 0 (padded to 2n)  | bucket 1 (padded to 2m)  |     (DP = 2)
    rank 0  | [0, n)                   | [0, m)                   |  -> its shard: n + m values
    rank 1  |          [n, 2n)         |          [m, 2m)         |

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

from megatron.parallel.experts import is_expert
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
    start: int  # offset of ``flat`` in the buffer
    numel: int  # the parameters' elements; ``flat`` may hold padding after them
    shard: slice  # this DP rank's slice of ``flat`` (all of it without shard_optimizer)
    # The ranks holding copies of these parameters, reduced over: DP x CP, or for experts split
    # over EP the expert-data-parallel group (None: this rank holds the only copy).
    group: dist.ProcessGroup | None = field(default=None, repr=False)
    average: dist.ReduceOp | None = None  # the group's AVG where it is every replica (NCCL)
    experts: bool = False  # holds experts split over EP (reduced over their own copies)
    shards: int = 1  # the ranks its slices are spread over (shard_optimizer), 1 otherwise
    param_flat: Tensor | None = field(default=None, repr=False)  # the params' flat buffer view
    ready: int = 0  # parameters whose gradient of the last micro-batch has arrived
    # Holds a pipeline-tied parameter (the word table's copy on a stage at either end): waits
    # for finish_grad_sync, once the copies' gradients have been summed over the two stages.
    held: bool = False
    launched: bool = False
    handle: dist.Work | None = field(default=None, repr=False)
    gather: dist.Work | None = field(default=None, repr=False)  # its parameters' all-gather


class DataParallel:
    """fp32 gradient buffers for ``module`` and their bucketed all-reduce (or, with
    ``shard_optimizer``, reduce-scatter) over the DP group."""

    def __init__(
        self,
        module: nn.Module,
        state: ParallelState,
        bucket_size_mb: float = 25.0,
        shard_optimizer: bool = False,
        overlap_param_gather: bool = False,
    ):
        if overlap_param_gather and not shard_optimizer:
            raise ValueError("overlap_param_gather needs shard_optimizer (sharded parameters)")
        # Over DP x CP: the CP ranks of a replica hold the same weights too (each backpropagated
        # its share of the samples' tokens, scaled by CP so that this average is their sum).
        self.module, self.group, self.dp_size = module, state.grad_group, state.replica_size
        self.dp_rank, self.shard_optimizer = state.replica_rank, shard_optimizer
        # parameters() yields a tied parameter once, so it gets one main_grad and one hook.
        params = [p for p in module.parameters() if p.requires_grad][::-1]
        if not params:
            raise ValueError("the module has no trainable parameters")
        self.params = params  # in buffer order
        self.offsets: dict[int, int] = {}  # id(param) -> its first element in the buffers
        limit = max(1, int(bucket_size_mb * 2**20) // 4)  # fp32 values per bucket
        # Experts split over EP reduce over their own replicas: they fill buckets of their own.
        split = [is_expert(p) and state.ep_size > 1 for p in params]
        copies = {False: (state.grad_group, self.dp_size, state.replica_rank)}
        copies[True] = (state.expert_dp_group, state.expert_dp_size, state.expert_dp_rank)
        spans: list[tuple[int, int, list[nn.Parameter], bool]] = []  # (start, numel, members, ep)
        start = numel = 0
        members: list[nn.Parameter] = []
        for i, param in enumerate(params):
            self.offsets[id(param)] = start + numel
            numel += param.numel()
            members.append(param)
            if numel >= limit or i == len(params) - 1 or split[i + 1] != split[i]:
                spans.append((start, numel, members, split[i]))
                pad_to = copies[split[i]][1] if shard_optimizer else 1
                start += -(-numel // pad_to) * pad_to  # padded, so that DP slices are equal
                numel, members = 0, []
        self.buffer = torch.zeros(start, dtype=torch.float32, device=params[0].device)
        self.param_buffer = self._flatten_params() if shard_optimizer else None
        self.buckets: list[_Bucket] = []
        self._bucket_of: dict[int, _Bucket] = {}
        average = mean_op(dist.get_backend(self.group)) if self.dp_size > 1 else None
        for start, numel, members, ep in spans:
            group, size, rank = copies[ep]
            pad_to, owner = (size, rank) if shard_optimizer else (1, 0)  # unsharded: all of it
            padded = -(-numel // pad_to) * pad_to
            part = padded // pad_to
            mine = slice(part * owner, part * (owner + 1))
            flat = self.buffer[start : start + padded]
            bucket = _Bucket(flat, members, start, numel, mine, group=group if size > 1 else None)
            bucket.average = None if ep else average
            bucket.experts, bucket.shards = ep, pad_to
            bucket.held = any(getattr(p, "pipeline_tied", False) for p in members)
            if self.param_buffer is not None:
                bucket.param_flat = self.param_buffer[start : start + padded]
            self.buckets.append(bucket)
            self._bucket_of.update({id(p): bucket for p in members})
        for param in params:
            offset = self.offsets[id(param)]
            param.main_grad = self.buffer[offset : offset + param.numel()].view_as(param)
        self._sync = True
        self._next = 0  # index of the first bucket not yet launched this step
        self._hooks = [p.register_post_accumulate_grad_hook(self._on_grad) for p in params]
        self.overlap_param_gather = overlap_param_gather and self.dp_size > 1
        if self.overlap_param_gather:
            self._wait_for_gathers_on_use()

    @torch.no_grad()
    def _flatten_params(self) -> Tensor:
        """Move every parameter into one flat buffer laid out like ``buffer``; return it.

        The Parameter objects stay (optimizers and hooks keep working); only their storage moves.
        """
        dtypes = {p.dtype for p in self.params}
        if len(dtypes) > 1:
            raise ValueError(f"the distributed optimizer needs one parameter dtype, got {dtypes}")
        flat = torch.zeros_like(self.buffer, dtype=self.params[0].dtype)
        for param in self.params:
            offset = self.offsets[id(param)]
            view = flat[offset : offset + param.numel()].view_as(param)
            view.copy_(param)
            param.data = view
        return flat

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate into ``main_grad`` without communicating (all but the last micro-batch)."""
        previous, self._sync = self._sync, False
        try:
            yield
        finally:
            self._sync = previous

    def sync_backward(self, enabled: bool) -> None:
        """Whether the next backward's gradients complete buckets (as outside ``no_sync``), set
        by a pipeline schedule before each backward: on the last one of each model chunk."""
        self._sync = enabled

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
            while self._next < len(self.buckets) and self._is_ready(self.buckets[self._next]):
                self._launch(self.buckets[self._next])

    @staticmethod
    def _is_ready(bucket: _Bucket) -> bool:
        return bucket.ready == len(bucket.params) and not bucket.held

    def _launch(self, bucket: _Bucket) -> None:
        if self.dp_size > 1:
            op, group = bucket.average, bucket.group
            if op is None:
                # No AVG here (gloo), or experts: the mean is over all DP x CP replicas, of which
                # their group holds 1 / EP, each copy the sum over its EP group's tokens. Divide
                # first (exact for power-of-two sizes), then SUM.
                bucket.flat.div_(self.dp_size)
                op = dist.ReduceOp.SUM
            # group None: this rank holds the only copy, so there is nothing to reduce.
            if group is not None and self.shard_optimizer:
                # The average lands in this rank's slice only (the output aliases the input).
                bucket.handle = dist.reduce_scatter_single(
                    bucket.flat[bucket.shard], bucket.flat, op=op, group=group, async_op=True
                )
            elif group is not None:
                bucket.handle = dist.all_reduce(bucket.flat, op=op, group=group, async_op=True)
        bucket.launched = True
        self._next += 1

    def finish_grad_sync(self) -> None:
        """Launch the buckets backward did not complete (unused parameters, held buckets),
        wait for all.

        Afterwards every ``main_grad`` holds the DP mean of the step's summed gradients; with
        ``shard_optimizer`` only the elements in this rank's bucket slices do.
        """
        while self._next < len(self.buckets):
            self._launch(self.buckets[self._next])
        for bucket in self.buckets:
            if bucket.handle is not None:
                bucket.handle.wait()
            bucket.ready, bucket.launched, bucket.handle = 0, False, None
        self._next = 0

    def gather_params(self) -> None:
        """Every bucket's parameters from the DP rank that owns each slice, in place in
        ``param_buffer`` (``shard_optimizer`` only), launched in forward order (the reverse of
        the buckets'). Waited for here, or with ``overlap_param_gather`` where they are read:
        each bucket by the first forward that uses it, the rest by ``wait_param_gather``."""
        if self.param_buffer is None or self.dp_size == 1:
            return
        self.wait_param_gather()
        for b in reversed(self.buckets):
            if b.group is not None:
                b.gather = dist.all_gather_single(
                    b.param_flat, b.param_flat[b.shard], b.group, async_op=True
                )
        if not self.overlap_param_gather:
            self.wait_param_gather()

    def wait_param_gather(self, buckets: list[_Bucket] | None = None) -> None:
        """Wait for the parameter all-gathers still running (of ``buckets``, else of all)."""
        for bucket in self.buckets if buckets is None else buckets:
            if bucket.gather is not None:
                bucket.gather.wait()
                bucket.gather = None

    def _wait_for_gathers_on_use(self) -> None:
        """Hooks that wait for a bucket's all-gather just before its parameters are read: each
        module's forward for the buckets of its own parameters; the model's forward for those
        of pipeline-tied ones (the last stage reads its word-table copy in the LM head, never
        calling the embedding); and the model's ``state_dict`` (checkpoints) for all."""

        def waiting_for(buckets: list[_Bucket]):
            return lambda module, args: self.wait_param_gather(buckets)

        def buckets_of(params: Iterator[nn.Parameter]) -> list[_Bucket]:
            found = {id(b): b for p in params if (b := self._bucket_of.get(id(p))) is not None}
            return list(found.values())

        for module in self.module.modules():
            own = buckets_of(module.parameters(recurse=False))
            if own:
                module.register_forward_pre_hook(waiting_for(own))
        tied = buckets_of(p for p in self.params if getattr(p, "pipeline_tied", False))
        if tied:
            self.module.register_forward_pre_hook(waiting_for(tied))
        self.module.register_state_dict_pre_hook(lambda *args: self.wait_param_gather())

    def zero_grad_buffer(self) -> None:
        """Zero every ``main_grad`` (one kernel over the flat buffer) before the next step."""
        self.buffer.zero_()
