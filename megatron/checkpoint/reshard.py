"""Reading checkpoints: their tensors as any rank's slice at any TP size.

A (TP, PP) rank's tensor file (``format.shard_file``) holds its slices under flat keys:
``model/<state-dict key>`` and ``optim/<param>/<exp_avg|exp_avg_sq|main|step>``. meta.json's
``tensors`` records, per key, the split dimension (the parameter's ``tp_split_dim``), the full
shape over all TP ranks, the dtype, and whether its rows are the vocabulary. Other stages' keys
(megatron.checkpoint.stages) and a distributed optimizer's shard files
(megatron.checkpoint.optim_shards) are served under the same keys, so all are read here alike.

Reading a TP-split tensor saved at TP=a as rank r of TP=c is, in effect::

    full = cat([slice_0, ..., slice_{a-1}], split_dim)      # [.., padded_a, ..]
    full = full[:vocab_size]                                 # vocabulary tables: drop padding
    full = pad(full, padded_c - vocab_size zero rows)        # ... and pad for the new TP size
    mine = full.narrow(split_dim, r * n / c, n / c)

but only the elements ``mine`` holds are read, each from the saved slice that holds it (a
safetensors slice read), so a rank reads its share of the tensor and no more; the distributed
optimizer's shard files are still merged whole.

The vocabulary is padded to a multiple of ``make_vocab_size_divisible_by * tp``; rows past the
real vocabulary are zero (weights, moments and main copies alike) and their count depends on the
TP size. Replicated tensors are identical on every TP rank, so slice 0 is read.
"""

from __future__ import annotations

import math
import os
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch
from safetensors import SafetensorError
from torch import Tensor, nn

from megatron.checkpoint.format import open_safetensors
from megatron.checkpoint.read_through import read_file
from megatron.errors import ConfigError
from megatron.optim.optimizer import MainParamOptimizer
from megatron.parallel.experts import is_expert
from megatron.parallel.layers import split_dim
from megatron.parallel.state import ParallelState


def vocab_params(model: nn.Module) -> set[str]:
    """Names of the parameters whose rows are the (padded) vocabulary (``vocab_padded`` set)."""
    return {name for name, p in model.named_parameters() if getattr(p, "vocab_padded", False)}


def padded_vocab(model: nn.Module, tp_size: int) -> int | None:
    """The model's padded vocabulary size (rows over all TP ranks); None without a vocab table."""
    params = dict(model.named_parameters())
    rows = [params[name].shape[0] * tp_size for name in sorted(vocab_params(model))]
    return rows[0] if rows else None


def shard_tensors(model: nn.Module, optimizer: MainParamOptimizer | None) -> dict[str, Tensor]:
    """This rank's slices under checkpoint keys (live references, on the model's device)."""
    tensors = {f"model/{k}": v for k, v in model.state_dict().items()}
    if optimizer is not None:
        for name, entry in optimizer.state_dict()["params"].items():
            for field, value in entry.items():
                if field == "step":
                    value = torch.tensor(value, dtype=torch.int64)
                tensors[f"optim/{name}/{field}"] = value
    return tensors


def _param_of(key: str) -> str:
    kind, rest = key.split("/", 1)
    return rest if kind == "model" else rest.rsplit("/", 1)[0]


def expert_keys(tensors: dict[str, Tensor], model: nn.Module) -> set[str]:
    """The keys of ``tensors`` that hold experts (their parameters' ``is_expert``), whose
    optimizer step counts included."""
    params = dict(model.named_parameters())
    return {k for k in tensors if _param_of(k) in params and is_expert(params[_param_of(k)])}


def tensor_layout(
    tensors: dict[str, Tensor], model: nn.Module, tp_size: int, ep_size: int = 1
) -> dict[str, Any]:
    """Per key: split dim, full shape over ``tp_size`` ranks, dtype, whether rows are the vocab;
    ``experts`` (with ``ep_size`` > 1): the keys of expert files, whose dim 0 holds the experts
    of one EP rank of ``ep_size`` (the full shape counts all of them)."""
    splits = {name: split_dim(p) for name, p in model.named_parameters()}
    vocab = vocab_params(model)
    experts = expert_keys(tensors, model) if ep_size > 1 else set()
    layout = {}
    for key, t in tensors.items():
        dim = None if key.endswith("/step") else splits.get(_param_of(key))
        shape = list(t.shape)
        if dim is not None:
            shape[dim] *= tp_size
        if key in experts and shape:
            shape[0] *= ep_size
        layout[key] = {
            "split_dim": dim,
            "shape": shape,
            "dtype": str(t.dtype).removeprefix("torch."),
            "vocab": dim is not None and _param_of(key) in vocab,
        }
        if key in experts:
            layout[key]["experts"] = True
    return layout


def merge_shards(shards: list[Tensor], split_dim: int | None, vocab_size: int | None) -> Tensor:
    """The full tensor from its TP slices; ``vocab_size`` (vocabulary tables): padding dropped."""
    if split_dim is None:
        return shards[0]
    full = torch.cat(shards, dim=split_dim) if len(shards) > 1 else shards[0]
    return full if vocab_size is None else full.narrow(0, 0, vocab_size)


def take_shard(
    full: Tensor, split_dim: int | None, tp_size: int, tp_rank: int, padded_rows: int | None
) -> Tensor:
    """Rank ``tp_rank``'s contiguous slice of ``full`` at ``tp_size``, as a tensor of its own.

    ``padded_rows`` (vocabulary tables, whose ``full`` holds only the real rows): zero rows are
    appended up to that many first.
    """
    if padded_rows is not None:
        if padded_rows < full.shape[0]:
            raise ValueError(f"padded_rows={padded_rows} < the {full.shape[0]} vocabulary rows")
        full = torch.cat([full, full.new_zeros((padded_rows - full.shape[0], *full.shape[1:]))])
    if split_dim is None:
        return full.clone()
    size = full.shape[split_dim]
    if size % tp_size:
        raise ValueError(f"dimension {split_dim} of size {size} does not split into {tp_size}")
    local = size // tp_size
    return full.narrow(split_dim, tp_rank * local, local).clone()


def _bytes(layout: dict[str, dict[str, Any]], keys: Any, tp_size: int) -> int:
    """Bytes of ``keys`` as one TP rank of ``tp_size`` holds them (split tensors divided)."""
    total = 0
    for key in keys:
        info = layout[key]
        elems = math.prod(info["shape"]) // (tp_size if info["split_dim"] is not None else 1)
        total += elems * getattr(torch, info["dtype"]).itemsize
    return total


class ShardedTensors:
    """The per-TP-rank tensor files of one checkpoint (of one saved pipeline stage: its keys
    alone), read as any rank's slice at any TP size.

    ``layout`` is meta.json's ``tensors``. Files are opened lazily (safetensors maps them) and
    only those a read needs: at an unchanged TP size, a rank touches only its own file.
    ``optim`` (a distributed-optimizer checkpoint: ``optim_shards.OptimShards``)
    serves the ``optim/`` keys of its ``layout``, which ``layout`` must include, per saved TP rank.
    ``plan`` reads the files most of whose bytes a rank wants whole, in one pass each and all at
    once (``read_through``), verifying them on the way when ``checksums`` and ``claims`` say so.
    """

    def __init__(
        self,
        paths: list[str],
        layout: dict[str, dict[str, Any]],
        vocab_size: int,
        optim: Any | None = None,
        experts: list[ShardedTensors] | None = None,
    ):
        self.paths, self.layout, self.vocab_size, self.optim = paths, layout, vocab_size, optim
        self.experts = experts  # saved at EP > 1: each EP rank's expert files, in EP order
        self._files: dict[int, Any] = {}
        self._read: dict[int, dict[str, Tensor]] = {}  # what ``plan`` read, per saved TP rank

    def _as_saved(self, key: str, tp_size: int, tp_rank: int, padded: int | None) -> int | None:
        """The saved TP rank whose slice of ``key`` is rank ``tp_rank``'s as it lies; None when
        ``read`` must cut, merge or pad (or gather the experts' files)."""
        info = self.layout[key]
        if info.get("experts") and self.experts:
            return None
        if info["split_dim"] is None:
            return 0
        if len(self.paths) == tp_size and (not info["vocab"] or padded == info["shape"][0]):
            return tp_rank
        return None

    def plan(
        self,
        wanted: dict[str, Tensor | None],
        tp_size: int,
        tp_rank: int,
        padded: int | None,
        checksums: dict[str, str] | None = None,
        claims: Any | None = None,
    ) -> None:
        """Read now, concurrently, each file from which ``wanted`` (key: the tensor to fill, or
        None) takes at least half the bytes as they lie; ``read`` then serves those keys. A
        file ``claims`` grants is checked against ``checksums`` (by file name) while read."""
        keys: dict[int, dict[str, Tensor | None]] = {}
        for key, into in wanted.items():
            if key in self.layout and not (self.optim and key in self.optim.layout):
                j = self._as_saved(key, tp_size, tp_rank, padded)
                if j is not None:
                    keys.setdefault(j, {})[key] = into
        sizes = {j: os.path.getsize(self.paths[j]) for j in keys}
        keys = {j: w for j, w in keys.items() if 2 * _bytes(self.layout, w, tp_size) >= sizes[j]}
        jobs = []
        for j, w in keys.items():
            name = os.path.basename(self.paths[j])
            check = checksums is not None and claims is not None and claims.claim(name)
            jobs.append((j, self.paths[j], checksums[name] if check else None, w))
        if not jobs:
            return
        with ThreadPoolExecutor(len(jobs), thread_name_prefix="checkpoint-read") as pool:
            done = pool.map(lambda job: (job[0], read_file(*job[1:])), jobs)
            self._read.update(done)

    def _slice(self, key: str, tp_rank: int) -> Tensor:
        if key in self._read.get(tp_rank, {}):
            return self._read[tp_rank].pop(key)
        if self.optim is not None and key in self.optim.layout:
            return self.optim.get(key, tp_rank)
        if tp_rank not in self._files:
            self._files[tp_rank] = open_safetensors(self.paths[tp_rank])
        try:
            return self._files[tp_rank].get_tensor(key)
        except SafetensorError as e:
            raise ConfigError(
                f"{self.paths[tp_rank]}: cannot read {key} ({e}); the checkpoint is damaged"
            ) from None

    def read(self, key: str, tp_size: int, tp_rank: int, padded_rows: int | None) -> Tensor:
        """Tensor ``key`` as rank ``tp_rank`` of ``tp_size`` holds it (CPU, saved dtype).

        ``padded_rows``: the padded vocabulary size at ``tp_size`` (vocabulary tables only).
        An expert key saved at EP > 1 comes back holding every expert (each EP rank's, in order).
        """
        info = self.layout[key]
        if info.get("experts") and self.experts:
            parts = [e.read(key, tp_size, tp_rank, padded_rows) for e in self.experts]
            return parts[0] if key.endswith("/step") else torch.cat(parts)
        saved = self._as_saved(key, tp_size, tp_rank, padded_rows)
        if saved is not None:
            return self._slice(key, saved)
        split, vocab, saved_tp = info["split_dim"], info["vocab"], len(self.paths)
        if self.optim is not None and key in self.optim.layout:
            shards = [self._slice(key, r) for r in range(saved_tp)]
            full = merge_shards(shards, split, self.vocab_size if vocab else None)
            return take_shard(full, split, tp_size, tp_rank, padded_rows if vocab else None)
        size = padded_rows if vocab else info["shape"][split]
        if size % tp_size:
            raise ValueError(f"dimension {split} of size {size} does not split into {tp_size}")
        local = size // tp_size
        real = self.vocab_size if vocab else size  # vocabulary rows past it are zero
        return self._span(key, split, tp_rank * local, (tp_rank + 1) * local, real)

    def _span(self, key: str, split: int, lo: int, hi: int, real: int) -> Tensor:
        """Elements [lo, hi) along ``split`` of the whole tensor, read from the saved slices
        that hold them (only those elements of each), zeros from ``real`` on."""
        saved_tp = len(self.paths)
        held = self.layout[key]["shape"][split] // saved_tp
        pieces = []
        for j in range(saved_tp):
            a, b = max(lo, j * held), min(hi, (j + 1) * held, real)
            if a < b:
                pieces.append(self._part(key, j, split, a - j * held, b - j * held))
        if not pieces:  # padding only: an empty read gives the dtype and the other dimensions
            pieces.append(self._part(key, 0, split, 0, 0))
        out = torch.cat(pieces, split) if len(pieces) > 1 else pieces[0]
        missing = hi - lo - out.shape[split]
        if missing:
            shape = list(out.shape)
            shape[split] = missing
            out = torch.cat([out, out.new_zeros(shape)], split)
        return out

    def _part(self, key: str, tp_rank: int, split: int, start: int, stop: int) -> Tensor:
        """Elements [start, stop) along ``split`` of the slice saved by ``tp_rank``, read alone."""
        if tp_rank not in self._files:
            self._files[tp_rank] = open_safetensors(self.paths[tp_rank])
        try:
            return self._files[tp_rank].get_slice(key)[
                (slice(None),) * split + (slice(start, stop),)
            ]
        except SafetensorError as e:
            raise ConfigError(
                f"{self.paths[tp_rank]}: cannot read {key} ({e}); the checkpoint is damaged"
            ) from None


_OPTIM_FIELDS = ("exp_avg", "exp_avg_sq", "main")


def _fillable(t: Tensor, info: dict[str, Any] | None, tp_size: int) -> Tensor | None:
    """``t`` itself when a checkpoint's tensor (layout ``info``) can be read straight into it:
    on the CPU, contiguous, of the saved dtype and of this rank's share of the saved shape."""
    if info is None or t.device.type != "cpu" or not t.is_contiguous():
        return None
    shape = list(info["shape"])
    if info["split_dim"] is not None:
        shape[info["split_dim"]] //= tp_size
    return t if list(t.shape) == shape and str(t.dtype) == f"torch.{info['dtype']}" else None


def read_state(
    source: Any,
    where: str,
    meta: dict[str, Any],
    model: nn.Module,
    optimizer: MainParamOptimizer | None,
    state: ParallelState,
    model_keys: set[str] | None = None,
) -> tuple[dict[str, Tensor], dict[str, dict[str, Any]]]:
    """This rank's model state dict and optimizer entries (``optimizer.load_state_dict``'s
    ``params``; empty without an optimizer), resharded from the checkpoint's TP size to this one.

    ``source``: the checkpoint's tensors (``stages.open_checkpoint``: any key, from
    the saved stage that holds it); ``where``: its directory, for messages. ``model_keys``: the
    state-dict keys of the whole model this rank's stage is part of (default: this model's), to
    refuse a checkpoint holding tensors no stage of it has. Raises ConfigError naming the
    checkpoint when it was saved from another model, or when an optimizer asks for the state of
    a weights-only checkpoint (meta.json ``weights_only``).
    """
    layout = source.layout
    padded = padded_vocab(model, state.tp_size)
    params = dict(model.named_parameters())

    def mine(key: str, t: Tensor) -> Tensor:
        """An expert tensor (every expert) cut to this EP rank's experts."""
        name = _param_of(key)
        if state.ep_size == 1 or key.endswith("/step") or not is_expert(params.get(name)):
            return t
        held = t.shape[0] // state.ep_size
        return t.narrow(0, state.ep_rank * held, held).clone()

    def read(key: str, shape: torch.Size) -> Tensor:
        if key not in layout:
            raise ConfigError(
                f"{where} has no tensor {key}, which this model needs: it was saved from another "
                "model config; build the model with the checkpoint's model.* settings (its "
                "meta.json config), or load a checkpoint of this model"
            )
        t = mine(key, source.read(key, state.tp_size, state.tp_rank, padded))
        if t.shape != shape:
            raise ConfigError(
                f"{where}: {key} has shape {tuple(t.shape)} at TP={state.tp_size}, the model "
                f"{tuple(shape)}; load it into a model with the checkpoint's model.* settings"
            )
        return t

    local = model.state_dict()
    wanted: dict[str, Tensor | None] = {f"model/{k}": _fillable(t, layout.get(f"model/{k}"),
        state.tp_size) for k, t in local.items()}  # fmt: skip
    if optimizer is not None and not meta.get("weights_only"):
        fields = [f"optim/{name}/{f}" for name in optimizer.names for f in _OPTIM_FIELDS]
        wanted.update((key, None) for key in fields if key in layout)
        moments = {name for name in optimizer.names if f"optim/{name}/exp_avg" in layout}
        for name, live in optimizer.load_targets(moments).items():
            for field, t in live.items():
                key = f"optim/{name}/{field}"
                if key in layout:
                    wanted[key] = _fillable(t, layout[key], state.tp_size)
    source.plan(wanted, state.tp_size, state.tp_rank, padded)
    weights = {name: read(f"model/{name}", t.shape) for name, t in local.items()}
    whole = set(local) if model_keys is None else model_keys
    extra = [k for k in layout if k.startswith("model/") and k[len("model/") :] not in whole]
    if extra:
        raise ConfigError(
            f"{where} holds {extra[0]}, which this model lacks: it was saved from another model "
            "config; build the model with the checkpoint's model.* settings (its meta.json "
            "config), or load a checkpoint of this model"
        )
    entries: dict[str, dict[str, Any]] = {}
    if optimizer is None:
        return weights, entries
    if meta.get("weights_only"):
        raise ConfigError(
            f"{where} holds weights only, no optimizer state (tools/checkpoint_util.py "
            "--weights-only); start from it with checkpoint.finetune=true"
        )
    # The names, not state_dict(): the distributed optimizer's is a collective over DP.
    for name in optimizer.names:
        entry: dict[str, Any] = {}
        for field in _OPTIM_FIELDS:
            if f"optim/{name}/{field}" in layout:
                entry[field] = read(f"optim/{name}/{field}", params[name].shape)
        if f"optim/{name}/step" in layout:
            entry["step"] = int(read(f"optim/{name}/step", torch.Size([])))
        if "main" not in entry and weights[name].dtype == torch.float32:
            # Saved from an fp32 model: its weights are the exact main copy a bf16/fp16 run needs.
            entry["main"] = weights[name]
        entries[name] = entry
    return weights, entries
