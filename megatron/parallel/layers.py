"""Tensor-parallel layers: each holds one slice of a matrix that the serial model holds whole.

Initialisation draws the full matrix from the layer's generator (the same stream on every TP rank,
``RNGTracker.init_generator``) and keeps this rank's slice, so a TP=N model holds exactly the
slices of the TP=1 model. Every split parameter carries ``tp_split_dim``; replicated ones carry
nothing. Clipping, weight-decay grouping and checkpoint resharding all read that one attribute. A
parameter whose dim 0 is the padded vocabulary (the word table, BERT's LM-head bias) also carries
``vocab_padded = True``, so resharding knows which rows are padding.

The column- and row-parallel matmuls run through ``LinearWithGradReduce`` when it pays: it
overlaps the column-parallel input-gradient all-reduce with the weight-gradient matmul, and adds
the weight gradient straight into the fp32 ``main_grad`` that DataParallel gives each parameter.

With ``sequence_parallel`` the column-parallel layer takes activations split along the sequence
and all-gathers them (its backward reduce-scatters the input gradient instead of all-reducing
it), and the row-parallel layer reduce-scatters its output along the sequence instead of
all-reducing it; its bias, added to split activations, is flagged ``sequence_parallel``.
"""

from __future__ import annotations

import os
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

from megatron.parallel.mappings import (
    all_gather_seq,
    copy_to_tp,
    gather_from_tp,
    gather_seq_to_tp,
    reduce_from_tp,
    reduce_scatter_seq_from_tp,
    reduce_scatter_seq_start,
)
from megatron.parallel.sequence_parallel import mark_sequence_parallel
from megatron.parallel.state import ParallelState

InitMethod = Callable[[Tensor], Tensor]


def normal_init(std: float, generator: torch.Generator | None = None) -> InitMethod:
    """N(0, std), drawn from ``generator`` (one on the tensor's device; None: the default one)."""
    return lambda t: nn.init.normal_(t, mean=0.0, std=std, generator=generator)


def split_dim(param: Tensor) -> int | None:
    """The dimension a TP layer split this parameter along, or None when it is replicated."""
    return getattr(param, "tp_split_dim", None)


def sharded_param(
    full_shape: tuple[int, ...],
    dim: int,
    state: ParallelState,
    init: InitMethod,
    device: torch.device,
    valid_rows: int | None = None,
) -> nn.Parameter:
    """Draw the full fp32 matrix, keep this rank's contiguous slice along ``dim``.

    ``valid_rows`` (embeddings only) draws just the real vocabulary rows and zero-pads the rest, so
    models whose padding differs (TP=1 vs TP=N) draw the same numbers for the same rows.
    """
    drawn = list(full_shape)
    if valid_rows is not None:
        drawn[0] = valid_rows
    full = init(torch.empty(drawn, dtype=torch.float32, device=device))
    if valid_rows is not None:
        full = F.pad(full, (0, 0, 0, full_shape[0] - valid_rows))
    local = full_shape[dim] // state.tp_size
    param = nn.Parameter(full.narrow(dim, state.tp_rank * local, local).clone())
    param.tp_split_dim = dim
    return param


def async_grad_allreduce_pays(device: torch.device) -> bool:
    """Whether overlapping the input-gradient all-reduce with the weight-gradient matmul pays.

    On CUDA only with ``CUDA_DEVICE_MAX_CONNECTIONS=1`` (the launch scripts set it): with one
    hardware queue kernels start in issue order, so the all-reduce issued before the wgrad GEMM
    gets its SMs first and runs alongside it; with several queues the GEMM can take every SM and
    the all-reduce waits behind it anyway. On CPU it stays off unless a layer is told otherwise:
    gloo's reduce and the matmul share the same few cores, and the gain there is unmeasured.
    """
    return device.type == "cuda" and os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS") == "1"


def _accumulate_wgrad(main_grad: Tensor, grad_2d: Tensor, x_2d: Tensor) -> None:
    """main_grad += dY^T X in place, summed in fp32 whatever the dtype of dY [t, out], X [t, in]."""
    if grad_2d.dtype == main_grad.dtype:
        main_grad.addmm_(grad_2d.t(), x_2d)
    elif main_grad.is_cuda:
        # cuBLAS multiplies bf16/fp16 with fp32 accumulation straight into the fp32 buffer (apex's
        # wgrad_gemm_accum_fp32): no upcast copies, no low-precision [out, in] temporary.
        torch.addmm(main_grad, grad_2d.t(), x_2d, out_dtype=torch.float32, out=main_grad)
    else:
        # CPU kernels have no mixed-dtype matmul; bf16 products are exact in fp32 anyway.
        main_grad.addmm_(grad_2d.t().float(), x_2d.float())


class LinearWithGradReduce(torch.autograd.Function):
    """Y = X A^T + b (``F.linear``) with a backward that overlaps f's all-reduce and fuses
    weight-gradient accumulation.

    Backward, in this order::

        dX = dY A             (dgrad; with ``group``, its all-reduce over the group starts now)
        dA = dY^T X, db = sum dY   (wgrad, computed while dX is on the wire)
        wait for dX

    With ``group`` this is f followed by the matmul, in one Function: the column-parallel layer
    passes its TP group instead of wrapping its input in ``copy_to_tp``, so the collective count
    is unchanged. With ``sequence_parallel`` too, f is the sequence-parallel one: forward
    all-gathers X along the sequence (and saves the gathered X for the wgrad), backward
    reduce-scatters dX instead of all-reducing it. With ``fuse_wgrad``, dA goes into the weight's
    fp32 ``main_grad`` in place and the weight gets no ``.grad`` at all (DataParallel's hook then
    sees ``None`` and only counts it); the bias gradient (small) takes the ordinary path either
    way.
    """

    @staticmethod
    def forward(
        ctx,
        x: Tensor,
        weight: Tensor,
        bias: Tensor | None,
        group: dist.ProcessGroup | None,
        fuse_wgrad: bool,
        sequence_parallel: bool,
    ) -> Tensor:
        ctx.sequence_parallel = sequence_parallel and group is not None
        if ctx.sequence_parallel:
            x = all_gather_seq(x, group)  # [b, s / tp, h] -> [b, s, h]
        ctx.save_for_backward(x, weight)
        ctx.group, ctx.has_bias = group, bias is not None
        # Held here, not read off the saved weight in backward: activation recomputation hands
        # backward a fresh tensor for each saved one, without the parameter's attributes.
        ctx.main_grad = weight.main_grad if fuse_wgrad else None
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor | None, ...]:
        x, weight = ctx.saved_tensors
        grad_2d = grad.reshape(-1, grad.shape[-1])  # [tokens, out]
        x_2d = x.reshape(-1, x.shape[-1])  # [tokens, in]
        grad_x = handle = None
        if ctx.needs_input_grad[0]:
            grad_x = grad_2d.mm(weight).view_as(x)  # [..., in]
            if ctx.sequence_parallel:
                grad_x, handle = reduce_scatter_seq_start(grad_x, ctx.group)  # [b, s / tp, in]
            elif ctx.group is not None:
                # A fresh tensor nobody else reads before the wait: reduced in place.
                handle = dist.all_reduce(grad_x, group=ctx.group, async_op=True)
        grad_weight = grad_bias = None
        if ctx.needs_input_grad[1]:
            if ctx.main_grad is not None:
                _accumulate_wgrad(ctx.main_grad, grad_2d, x_2d)
            else:
                # The product autograd's linear forms (dY^T X), so both paths match exactly.
                grad_weight = grad_2d.t().mm(x_2d)  # [out, in]
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_bias = grad_2d.sum(0)  # [out]
        if handle is not None:
            handle.wait()
        return grad_x, grad_weight, grad_bias, None, None, None


def _linear(
    x: Tensor,
    weight: nn.Parameter,
    bias: Tensor | None,
    fuse_wgrad: bool,
    group: dist.ProcessGroup | None = None,
    sequence_parallel: bool = False,
) -> Tensor:
    """F.linear, or LinearWithGradReduce when there is a reduce to overlap or a ``main_grad``
    to accumulate into (DataParallel's fp32 buffer)."""
    fuse_wgrad = fuse_wgrad and getattr(weight, "main_grad", None) is not None
    if group is None and not fuse_wgrad:
        return F.linear(x, weight, bias)
    return LinearWithGradReduce.apply(x, weight, bias, group, fuse_wgrad, sequence_parallel)


def _divide(n: int, tp: int, what: str) -> int:
    if n % tp:
        raise ValueError(f"{what}={n} is not divisible by the tensor-parallel size {tp}")
    return n // tp


class ColumnParallelLinear(nn.Module):
    """Y = X A + b with A split by columns: A = [A_1, ..., A_p], b = [b_1, ..., b_p].

    Rank i computes Y_i = X A_i + b_i. The input goes through f (its gradient is all-reduced);
    the output stays split unless ``gather_output``. With ``sequence_parallel`` the input is
    this rank's sequence slice [b, s / tp, in] and f is the sequence-parallel one (all-gather
    forward, reduce-scatter backward); the output is [b, s, out / tp] either way.
    ``async_grad_allreduce`` overlaps that input-gradient collective with the weight-gradient
    matmul (None: where ``async_grad_allreduce_pays``);
    ``gradient_accumulation_fusion`` adds the weight gradient into ``weight.main_grad`` (fp32)
    when the weight has one. Both are plain attributes, so they can be switched after building.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        state: ParallelState,
        init: InitMethod,
        bias: bool = True,
        gather_output: bool = False,
        device: torch.device | None = None,
        async_grad_allreduce: bool | None = None,
        gradient_accumulation_fusion: bool = True,
        sequence_parallel: bool = False,
    ):
        super().__init__()
        self.group, self.gather_output = state.tp_group, gather_output
        self.sequence_parallel = sequence_parallel and state.tp_size > 1
        self.out_per_partition = _divide(out_features, state.tp_size, "out_features")
        device = device or state.device
        if async_grad_allreduce is None:
            async_grad_allreduce = async_grad_allreduce_pays(device)
        self.async_grad_allreduce = async_grad_allreduce and state.tp_size > 1
        self.gradient_accumulation_fusion = gradient_accumulation_fusion
        # nn.Linear stores A transposed, [out, in], so a column split is a split of dim 0.
        self.weight = sharded_param((out_features, in_features), 0, state, init, device)
        self.bias = None
        if bias:
            self.bias = nn.Parameter(torch.zeros(self.out_per_partition, device=device))
            self.bias.tp_split_dim = 0

    def forward(self, x: Tensor) -> Tensor:
        fuse = self.gradient_accumulation_fusion
        if self.async_grad_allreduce:  # f's collectives happen inside the linear
            y = _linear(x, self.weight, self.bias, fuse, self.group, self.sequence_parallel)
        else:
            enter = gather_seq_to_tp if self.sequence_parallel else copy_to_tp
            y = _linear(enter(x, self.group), self.weight, self.bias, fuse)
        return gather_from_tp(y, self.group) if self.gather_output else y


class RowParallelLinear(nn.Module):
    """Y = X A + b with A split by rows and X by columns: A = [A_1; ...; A_p], X = [X_1, ..., X_p].

    Rank i computes X_i A_i; g all-reduces the partial sums, then the replicated bias is added
    once. The input must already be split along its last dimension. ``gradient_accumulation_fusion``
    as in ColumnParallelLinear (nothing to overlap here: the input gradient needs no reduce).
    With ``sequence_parallel`` g is a reduce-scatter along the sequence: the output is this
    rank's [b, s / tp, out], and the bias (flagged ``sequence_parallel``) is added to that slice.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        state: ParallelState,
        init: InitMethod,
        bias: bool = True,
        device: torch.device | None = None,
        gradient_accumulation_fusion: bool = True,
        sequence_parallel: bool = False,
    ):
        super().__init__()
        self.group, self.tp_size = state.tp_group, state.tp_size
        self.sequence_parallel = sequence_parallel and state.tp_size > 1
        self.gradient_accumulation_fusion = gradient_accumulation_fusion
        self.in_per_partition = _divide(in_features, state.tp_size, "in_features")
        device = device or state.device
        self.weight = sharded_param((out_features, in_features), 1, state, init, device)
        self.bias = nn.Parameter(torch.zeros(out_features, device=device)) if bias else None
        if self.bias is not None and self.sequence_parallel:
            mark_sequence_parallel(self.bias)

    def forward(self, x: Tensor) -> Tensor:
        fuse = self.gradient_accumulation_fusion
        if self.tp_size == 1:  # nothing to reduce: let the matmul add the bias (no extra pass)
            return _linear(x, self.weight, self.bias, fuse)
        leave = reduce_scatter_seq_from_tp if self.sequence_parallel else reduce_from_tp
        y = leave(_linear(x, self.weight, None, fuse), self.group)
        return y if self.bias is None else y + self.bias


class VocabParallelEmbedding(nn.Module):
    """Embedding table E split by vocabulary rows: E = [E_1; ...; E_p].

    Rank i owns ids [vocab_start, vocab_end); it looks up those, writes zeros for the others, and
    g sums the partial lookups. Rows past ``vocab_size`` (padding) start at zero.
    """

    def __init__(
        self,
        vocab_size: int,
        padded_vocab_size: int,
        dim: int,
        state: ParallelState,
        init: InitMethod,
        device: torch.device | None = None,
    ):
        super().__init__()
        self.group, self.tp_size = state.tp_group, state.tp_size
        per_partition = _divide(padded_vocab_size, state.tp_size, "padded_vocab_size")
        self.vocab_start = state.tp_rank * per_partition
        self.vocab_end = self.vocab_start + per_partition
        self.weight = sharded_param(
            (padded_vocab_size, dim), 0, state, init, device or state.device, valid_rows=vocab_size
        )
        self.weight.vocab_padded = True

    def forward(self, ids: Tensor) -> Tensor:
        if self.tp_size == 1:
            return F.embedding(ids, self.weight)
        outside = (ids < self.vocab_start) | (ids >= self.vocab_end)
        local = (ids - self.vocab_start).masked_fill(outside, 0)
        out = F.embedding(local, self.weight).masked_fill(outside.unsqueeze(-1), 0.0)
        return reduce_from_tp(out, self.group)
