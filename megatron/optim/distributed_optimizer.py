"""The distributed optimizer (ZeRO-1): each DP rank holds and updates 1/DP of the fp32 main params
and Adam moments.

The shard follows the gradient buckets of megatron/parallel/data_parallel.py (built with
``shard_optimizer``): each bucket is padded to a multiple of DP and rank d owns the d-th
contiguous slice of every bucket; its shard is the concatenation of its bucket slices, three flat
fp32 tensors of one length: ``main``, ``exp_avg``, ``exp_avg_sq`` (an fp32 model has no separate
``main``: its parameter buffer's slices are the main copy, as the plain optimizer uses fp32
parameters as their own). A *piece* is the part of one parameter inside this rank's slices (at
most one per parameter: a parameter lies in one bucket).

One step is MainParamOptimizer's (megatron/optim/optimizer.py) with these differences:

- gradients: the buckets' reduce-scatter left the DP mean in this rank's slices of the gradient
  buffer; each piece's ``.grad`` is a view of its part of them;
- AdamW runs over the pieces, views of the flat main shard, each in its parameter's weight-decay
  group: element for element the same math as over whole parameters;
- the norm: pieces of TP-split parameters count on every rank, of replicated ones on TP rank 0
  only (and the last stage's copy of a pipeline-tied embedding nowhere). DP shards, TP slices
  and pipeline stages are disjoint, so the squared norm is summed over the world, in the
  same single all-reduce as the overflow flag and the caller's sums;
- copy-back: the shard into the model-dtype parameter buffer's slices (nothing to copy for an
  fp32 model, updated in place), then every bucket is
  all-gathered in place (``DataParallel.gather_params``), before the step's one host sync; with
  ``overlap_param_gather`` the gathers go on into the next forward, each bucket waited for by
  its first use (and all of them before the next step writes the buffer).

For checkpoints: ``shard_state()`` and ``layout()`` describe this rank's shard and where its
values belong; ``assemble(layout, shards)`` turns all DP ranks' shards back into the
per-parameter format of ``MixedPrecisionOptimizer.state_dict()["params"]``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from megatron.config.schema import OptimizerConfig
from megatron.optim.grad_scaler import GradScaler
from megatron.optim.optimizer import MainParamOptimizer, check_entries
from megatron.parallel.data_parallel import DataParallel
from megatron.parallel.experts import is_expert
from megatron.parallel.state import ParallelState

FIELDS = ("main", "exp_avg", "exp_avg_sq")  # the flat fp32 tensors of a shard


@dataclass(frozen=True)
class _Piece:
    """Elements [lo, hi) of flattened parameter ``index``, held at ``at`` in this rank's shard."""

    index: int
    lo: int
    hi: int
    at: int


def _shard_pieces(
    ddp: DataParallel, params: list[Tensor]
) -> tuple[list[_Piece], list[tuple[int, int]]]:
    """The pieces of ``params`` in this DP rank's bucket slices, in parameter order (the order
    MixedPrecisionOptimizer sums the norm in: at DP=1 the two are bit-identical), and per bucket
    the (buffer offset, length) of this rank's slice."""
    index = {id(p): i for i, p in enumerate(params)}
    pieces: list[_Piece] = []
    owned: list[tuple[int, int]] = []
    at = 0  # where the current bucket's slice starts in the shard
    for bucket in ddp.buckets:
        lo, hi = bucket.start + bucket.shard.start, bucket.start + bucket.shard.stop
        for param in bucket.params:
            first = ddp.offsets[id(param)]
            start, stop = max(first, lo), min(first + param.numel(), hi)
            if start < stop:
                pieces.append(
                    _Piece(index[id(param)], start - first, stop - first, at + start - lo)
                )
        owned.append((lo, hi - lo))
        at += hi - lo
    return sorted(pieces, key=lambda piece: piece.index), owned


class DistributedOptimizer(MainParamOptimizer):
    """AdamW over this DP rank's shard of ``ddp``'s buckets; see the module docstring."""

    holds_whole_experts = False  # expert buckets are sharded over their own replicas

    def __init__(
        self, ddp: DataParallel, cfg: OptimizerConfig, scaler: GradScaler, state: ParallelState
    ):
        super().__init__(cfg, scaler, state)
        if ddp.param_buffer is None:
            raise ValueError("the distributed optimizer needs DataParallel(shard_optimizer=True)")
        self.ddp = ddp
        named = [(n, p) for n, p in ddp.module.named_parameters() if p.requires_grad]
        self.names = [n for n, _ in named]
        self.model_params = [p for _, p in named]
        self.pieces, owned = _shard_pieces(ddp, self.model_params)
        if not self.pieces:
            raise ValueError(
                f"replica {state.replica_rank} owns only bucket padding: the model is too small to "
                f"shard over {ddp.dp_size} ranks"
            )
        device, size = ddp.buffer.device, sum(length for _, length in owned)
        # An fp32 model's parameter buffer is its own main copy (as in the plain optimizer): the
        # pieces are views of it, and only the moments are extra state.
        self.main_is_param = ddp.param_buffer.dtype == torch.float32
        keys = FIELDS[1:] if self.main_is_param else FIELDS
        self.shard = {key: torch.zeros(size, dtype=torch.float32, device=device) for key in keys}
        # This rank's slice of the parameter buffer per bucket; with a separate main shard, the
        # (main shard slice, parameter buffer slice) pairs of the copy-back and the reload.
        self._slices = [ddp.param_buffer[lo : lo + length] for lo, length in owned]
        self._owned, offset = [], 0
        for (_, length), param_slice in zip(owned, self._slices):
            if not self.main_is_param:
                self._owned.append((self.shard["main"][offset : offset + length], param_slice))
            offset += length
        if self.main_is_param:
            mains = [ddp.param_buffer[self._buffer_range(p)] for p in self.pieces]
        else:
            mains = [self._view("main", p) for p in self.pieces]
        self._grads = [ddp.buffer[self._buffer_range(p)] for p in self.pieces]
        self._setup(mains, [p.index for p in self.pieces])
        # The moments live in the flat shard: torch's AdamW finds its state already there (as it
        # would after its first step) and updates these views in place.
        for piece, main in zip(self.pieces, mains):
            self.inner.state[main] = {
                "step": torch.zeros((), dtype=torch.float32, device=device),
                "exp_avg": self._view("exp_avg", piece),
                "exp_avg_sq": self._view("exp_avg_sq", piece),
            }
        self.reload_main_params()

    def _view(self, key: str, piece: _Piece) -> Tensor:
        return self.shard[key][piece.at : piece.at + piece.hi - piece.lo]

    def _buffer_range(self, piece: _Piece) -> slice:
        first = self.ddp.offsets[id(self.model_params[piece.index])]
        return slice(first + piece.lo, first + piece.hi)

    def _attach_grads(self) -> list[Tensor | None]:
        # The step writes the parameter buffer, which the last step's all-gathers (left
        # running with overlap_param_gather) must have finished with.
        self.ddp.wait_param_gather()
        for main, grad in zip(self.main_params, self._grads):
            main.grad = grad
        return list(self._grads)

    def _reduce(self, summed: Tensor, local: Tensor) -> tuple[Tensor, Tensor]:
        if self.state.world_size == 1:
            return summed, local
        # The flag and the caller's values must agree everywhere; the squared norm's parts are
        # disjoint over DP (shards), TP (slices; replicated ones counted on TP rank 0 only) and PP.
        both = torch.cat([summed, local.reshape(1)])
        dist.all_reduce(both)
        return both[:-1], both[-1]

    def _copy_back(self) -> None:
        if self._owned:  # else the main pieces are the parameter buffer itself
            torch._foreach_copy_([p for _, p in self._owned], [m for m, _ in self._owned])
        self.ddp.gather_params()  # every DP rank's updated slices into every rank's parameters

    def state_bytes(self) -> int:
        """Bytes of optimizer state on this rank: both moment shards, and the fp32 main shard
        unless the model is fp32 (its parameters are then the main copy)."""
        return sum(t.numel() * t.element_size() for t in self.shard.values())

    @torch.no_grad()
    def reload_main_params(self) -> None:
        """Refresh the fp32 main shard from the model (after loading weights without optimizer
        state, e.g. ``checkpoint.finetune``)."""
        if self._owned:
            torch._foreach_copy_([m for m, _ in self._owned], [p for _, p in self._owned])

    def layout(self) -> dict[str, Any]:
        """Where the shards' values belong (JSON-able; the same on every DP rank): parameter
        names, shapes and buffer offsets in buffer order, the buckets' spans, the ranks each is
        sharded over and whether it holds experts split over EP, and the DP and EP sizes."""
        params = sorted(self.model_params, key=lambda p: self.ddp.offsets[id(p)])
        name = {id(p): n for n, p in zip(self.names, self.model_params)}
        ep = self.state.ep_size
        return {
            "dp_size": self.ddp.dp_size,
            "ep_size": ep,
            "main_is_param": self.main_is_param,
            "buckets": [
                {
                    "start": b.start,
                    "numel": b.numel,
                    "size": b.flat.numel(),
                    "shards": b.shards,
                    "experts": b.experts,
                }
                for b in self.ddp.buckets
            ],  # fmt: skip
            "params": [
                {
                    "name": name[id(p)],
                    "shape": list(p.shape),
                    "offset": self.ddp.offsets[id(p)],
                    "experts": is_expert(p) and ep > 1,
                }
                for p in params
            ],  # fmt: skip
        }

    def shard_state(self) -> dict[str, Any]:
        """This rank's flat ``main``, ``exp_avg``, ``exp_avg_sq`` (live references; padding is
        zero; for an fp32 model ``main`` is a copy of its parameter-buffer slices) and the
        host-int ``step`` count."""
        main = self.shard.get("main")
        if main is None:
            main = torch.cat(self._slices)
        return {**self.shard, "main": main, "step": self._steps[0]}

    def state_dict(self) -> dict[str, Any]:
        """``MixedPrecisionOptimizer.state_dict()``'s per-parameter format, gathered over DP.

        A collective over the DP group: every DP rank must call it. The tensors are copies.
        """
        dp, gathered = self.ddp.dp_size, self.shard
        if dp > 1:
            gathered = {}
            for key, flat in self.shard.items():
                gathered[key] = flat.new_empty(flat.numel() * dp)  # [dp * shard], rank-major
                dist.all_gather_single(gathered[key], flat, group=self.ddp.group)
        # Every rank applied the same steps (the skip is agreed world-wide).
        shards = [
            {**{k: v.chunk(dp)[r] for k, v in gathered.items()}, "step": self._steps[0]}
            for r in range(dp)
        ]
        params = assemble(self.layout(), shards, self.state.ep_rank)
        return {"params": params, "grad_scaler": self.scaler.state_dict()}

    @torch.no_grad()
    def load_shard(self, flat: dict[str, Tensor], step: int, scaler: dict[str, Any]) -> None:
        """Restore this rank's own saved ``shard_state()`` tensors, saved at this very layout:
        the moments and main copy as they lie (``flat``'s tensors may be the shard's own, read
        straight into), no gather or reassembly; the model weights come from its own file."""
        for key, t in flat.items():
            if t is not self.shard[key]:
                self.shard[key].copy_(t)
        for main in self.main_params:
            self.inner.state[main]["step"].fill_(float(step))
        self._steps = [step] * len(self.main_params)
        self.scaler.load_state_dict(scaler)

    @torch.no_grad()
    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore the per-parameter format (``state_dict()``, ``assemble`` or
        ``MixedPrecisionOptimizer.state_dict()``); call after the model weights are loaded.

        Every rank takes its own slices. A saved ``main`` overwrites the model param (whole, on
        every rank, so no all-gather is needed); without one the main shard is taken from the
        model. The moments are copied.
        """
        saved = state["params"]
        check_entries(saved, self.names, self.model_params)
        with_moments = ["exp_avg" in saved[n] for n in self.names]
        steps = {int(saved[n]["step"]) for n, has in zip(self.names, with_moments) if has}
        if len(steps) > 1 or (any(with_moments) and not all(with_moments)):
            raise ValueError(
                "the distributed optimizer keeps one step count for all parameters; this state "
                f"has moments for {sum(with_moments)} of {len(self.names)} parameters and steps "
                f"{sorted(steps)}"
            )
        step = steps.pop() if steps else 0
        for name, param in zip(self.names, self.model_params):
            if "main" in saved[name]:
                param.copy_(saved[name]["main"])
        for piece, main in zip(self.pieces, self.main_params):
            entry, param = saved[self.names[piece.index]], self.model_params[piece.index]
            main.copy_(entry.get("main", param).reshape(-1)[piece.lo : piece.hi])
            adam = self.inner.state[main]
            for key in ("exp_avg", "exp_avg_sq"):
                if key in entry:
                    adam[key].copy_(entry[key].reshape(-1)[piece.lo : piece.hi])
                else:
                    adam[key].zero_()
            adam["step"].fill_(float(step))
        self._steps = [step] * len(self.main_params)
        self.scaler.load_state_dict(state["grad_scaler"])


def assemble(
    layout: dict[str, Any], shards: list[dict[str, Any]], ep_rank: int = 0
) -> dict[str, dict[str, Any]]:
    """All DP ranks' ``shard_state()`` (in DP rank order) as per-parameter state; at EP > 1 the
    experts those of EP rank ``ep_rank`` (from the shards of its expert-data-parallel copies,
    replicas ``ep_rank``, ``ep_rank + ep``, ...).

    ``{name: {"exp_avg", "exp_avg_sq", "step", ["main"]}}`` with TP-local shapes, exactly as
    ``MixedPrecisionOptimizer.state_dict()["params"]`` gives it: ``main`` only where the model is
    not fp32, moments and step only after a step was applied. Tensors are fresh copies.
    """
    dp = layout["dp_size"]
    if len(shards) != dp:
        raise ValueError(f"the layout is over {dp} DP ranks, got {len(shards)} shards")
    step = int(shards[0]["step"])
    keys = [k for k in FIELDS if k != "main" or not layout["main_is_param"]]
    keys = [k for k in keys if k == "main" or step > 0]
    full: dict[str, Tensor] = {}
    for key in keys:
        # Bucket by bucket, rank by rank: the buffer order (buckets are contiguous and sorted).
        chunks, at = [], 0
        for bucket in layout["buckets"]:
            members = shards
            if bucket.get("experts"):
                members = shards[ep_rank :: layout["ep_size"]]
            part = bucket["size"] // bucket.get("shards", dp)
            chunks += [shard[key][at : at + part] for shard in members]
            at += part
        full[key] = torch.cat(chunks)
    params: dict[str, dict[str, Any]] = {}
    for p in layout["params"]:
        numel = int(torch.Size(p["shape"]).numel())
        entry: dict[str, Any] = {
            key: flat[p["offset"] : p["offset"] + numel].view(p["shape"]).clone()
            for key, flat in full.items()
        }
        if step > 0:
            entry["step"] = step
        params[p["name"]] = entry
    return params
