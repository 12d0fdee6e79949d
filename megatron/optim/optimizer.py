"""AdamW over fp32 main parameters, with loss scaling, a world-wide overflow check and
tensor-parallel-aware global-norm clipping, in one host sync.

One step, in order, all of it queued on the device without waiting for it:

1. gradients: ``param.main_grad`` (fp32, summed over micro-batches and averaged over DP by
   megatron/parallel/data_parallel.py; the TP linears' weights add into it in their own
   backward and never hold a ``.grad``), else ``param.grad`` (no DP wrapper), in fp32;
2. unscale them (fp16 only);
3. non-finite check, agreed by every rank through one all-reduce (a sum) over the world: all ranks
   must skip together or the replicas drift apart. The caller's own values to sum over the world
   (the loop's metrics and exit flags) ride in the same all-reduce;
4. global L2 norm: a TP-split parameter (``tp_split_dim`` set) holds a different slice on each TP
   rank, so every TP rank adds its slice; a replicated one (LayerNorm, row-parallel bias) holds the
   same gradient on every TP rank, so only TP rank 0 adds it. Pipeline stages hold other layers,
   so the squared sum is all-reduced over the model-parallel group (TP x PP); the tied word
   embedding's copy on the last stage (``pipeline_tied``) holds the first stage's gradient and is
   not added again. After the DP all-reduce every DP replica already holds the same gradients;
5. clip to ``clip_grad`` (the coefficient min(1, clip / norm) stays on the device), run AdamW on
   the fp32 main params, copy them back to the model's dtype. On a non-finite value the fused
   AdamW kernel reads the agreed flag and changes nothing (moments, step count, parameters), so
   the copy-back rewrites the unchanged values; the caller must then skip its LR step as well;
6. the step's one host sync: read the flag, the norm and the caller's sums, after the last kernel,
   so that a clock stopped after ``step()`` has timed all of it.

Low-precision (bf16/fp16) parameters get fp32 main copies; fp32 parameters are their own main.
``MainParamOptimizer`` holds that step for both optimizers: this module's, over whole
parameters, and megatron/optim/distributed_optimizer.py's, over this DP rank's shard of them.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from megatron.config.schema import OptimizerConfig
from megatron.errors import ConfigError
from megatron.optim.grad_scaler import GradScaler
from megatron.parallel.experts import is_expert
from megatron.parallel.state import ParallelState


@dataclass(frozen=True)
class StepResult:
    """What one ``step()`` did."""

    updated: bool  # False: a non-finite gradient on some rank; nothing changed anywhere
    grad_norm: float  # global L2 norm before clipping (inf or nan when not updated)
    found_inf: bool  # a non-finite gradient on any rank (the loop counts these)
    loss_scale: float  # the scale this step's loss was multiplied by
    sums: Sequence[float] = ()  # the caller's ``extras``, summed over the world


def _squared_norm(grads: list[Tensor], device: torch.device) -> Tensor:
    """Sum of squares of all ``grads`` as an fp64 scalar, accumulated in fp64: then how the
    gradients are cut into tensors (whole parameters, DP shards, TP slices) changes the sum only
    in its last fp64 bits, and the fp32 clip coefficient almost never."""
    if not grads:
        return torch.zeros((), dtype=torch.float64, device=device)
    return torch.stack(torch._foreach_norm(grads, 2, dtype=torch.float64)).square().sum()


def counts_in_norm(param: Tensor, state: ParallelState) -> bool:
    """Whether ``param``'s gradient is part of the global norm on this rank: all but the last
    stage's copy of the tied word embedding, whose gradient the first stage's copy holds too."""
    return not (getattr(param, "pipeline_tied", False) and not state.is_first_stage)


def decays(name: str, param: Tensor) -> bool:
    """Whether weight decay applies: matrices yes; biases, LayerNorm and other vectors no."""
    return not (param.ndim < 2 or name.endswith(".bias"))


def check_entries(saved: dict[str, Any], names: list[str], params: list[Tensor]) -> None:
    """Refuse per-parameter optimizer state saved for another model or another TP size."""
    missing = [n for n in names if n not in saved]
    extra = [n for n in saved if n not in names]
    if missing or extra:
        raise ConfigError(
            f"optimizer state does not match the model (missing {missing[:3]}, unexpected "
            f"{extra[:3]}); load a checkpoint of this model or set checkpoint.finetune=true"
        )
    for name, param in zip(names, params):
        for key in ("main", "exp_avg", "exp_avg_sq"):
            value = saved[name].get(key)
            if value is not None and tuple(value.shape) != tuple(param.shape):
                raise ConfigError(
                    f"optimizer state {name}.{key} has shape {tuple(value.shape)}, the "
                    f"model {tuple(param.shape)}; reshard the checkpoint to this TP size"
                )


class MainParamOptimizer(ABC):
    """The step shared by both optimizers (see the module docstring), over ``main_params``: fp32
    tensors, each a whole parameter or a piece of one, each with its own fp32 gradient.

    The interface the loop and the checkpoints use: ``step``, ``zero_grad``, ``scale_loss``,
    ``lr``/``set_lr``, ``scaler``, ``names``, ``state_bytes``, ``reload_main_params``,
    ``state_dict``/``load_state_dict``. A subclass builds its main params, calls ``_setup``, and
    says how gradients reach them (``_attach_grads``), how the flag and the squared norm are
    reduced (``_reduce``) and how the updated values reach the model (``_copy_back``).
    """

    # Whether each rank holds its experts whole (the copies over the expert-data-parallel group
    # are alike: one counts in the norm), or a shard of them (each shard counts).
    holds_whole_experts = True

    def __init__(self, cfg: OptimizerConfig, scaler: GradScaler, state: ParallelState):
        self.cfg, self.scaler, self.state = cfg, scaler, state
        self.clip_grad = cfg.clip_grad
        self.names: list[str] = []  # trainable parameters' names: state_dict()["params"] keys
        self.model_params: list[nn.Parameter] = []  # those parameters, in the same order

    def _setup(self, mains: list[Tensor], owners: Sequence[int]) -> None:
        """AdamW over ``mains``, main i being (part of) parameter ``owners[i]`` of ``names`` and
        ``model_params``, which says whether main i decays, is TP-split and counts in the norm."""
        if not mains:
            raise ValueError("the model has no trainable parameters")
        params = [self.model_params[i] for i in owners]
        self.main_params, self.device = mains, mains[0].device
        # TP-split parameters count on every TP rank; replicated ones on TP rank 0 only; experts
        # split over EP (other experts on each EP rank) on one copy of each, in the world's sum.
        self._split = [getattr(p, "tp_split_dim", None) is not None for p in params]
        whole = self.holds_whole_experts and self.state.ep_size > 1
        self._expert = [is_expert(p) and whole for p in params]
        self._counted = [counts_in_norm(p, self.state) for p in params]
        decay = [decays(self.names[i], p) for i, p in zip(owners, params)]
        # Steps applied to each main param, on the host: read without a device sync.
        self._steps = [0] * len(mains)
        groups = [
            {"params": ps, "weight_decay": wd}
            for ps, wd in (
                ([m for m, d in zip(mains, decay) if d], self.cfg.weight_decay),
                ([m for m, d in zip(mains, decay) if not d], 0.0),
            )
            if ps
        ]
        # Fused (on CPU too): every parameter in a few launches, and the only variant that skips
        # on a device-side overflow flag, which keeps the host from waiting mid-step.
        self.inner = torch.optim.AdamW(
            groups,
            lr=self.cfg.lr,
            betas=(self.cfg.adam_beta1, self.cfg.adam_beta2),
            eps=self.cfg.adam_eps,
            fused=True,
        )

    @property
    def lr(self) -> float:
        """The learning rate the next step will use."""
        return self.inner.param_groups[0]["lr"]

    def set_lr(self, lr: float) -> None:
        """Use ``lr`` from the next step on (the LR schedule's value)."""
        for group in self.inner.param_groups:
            group["lr"] = lr

    def scale_loss(self, loss: Tensor) -> Tensor:
        """The loss to call ``backward()`` on: multiplied by the loss scale (fp16), else as is."""
        return loss if self.scaler.scale == 1.0 else loss * self.scaler.scale

    @abstractmethod
    def _attach_grads(self) -> list[Tensor | None]:
        """Point each main param's ``.grad`` at its fp32 gradient; return them in main order."""

    @abstractmethod
    def _reduce(self, summed: Tensor, local: Tensor) -> tuple[Tensor, Tensor]:
        """(``summed`` summed over the world, the global squared norm) from this rank's values."""

    @abstractmethod
    def _copy_back(self) -> None:
        """Make the model's parameters hold the (updated) main params, in the model's dtype."""

    @abstractmethod
    def state_bytes(self) -> int:
        """Bytes of optimizer state (fp32 main copies, Adam moments) this rank holds."""

    @abstractmethod
    def reload_main_params(self) -> None:
        """Overwrite the fp32 main copies with the model's parameters (after loading weights)."""

    @abstractmethod
    def state_dict(self) -> dict[str, Any]:
        """``{"params": {name: {"exp_avg", "exp_avg_sq", "step", ["main"]}}, "grad_scaler"}``."""

    @abstractmethod
    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore ``state_dict()`` output into the main copies, moments, steps and scaler."""

    def load_targets(self, with_moments: set[str]) -> dict[str, dict[str, Tensor]]:
        """Per parameter name, the live tensors a checkpoint may be read straight into before
        ``load_state_dict`` (which then keeps them): none unless an optimizer says so."""
        return {}

    def _release_grads(self) -> None:
        # An fp32 param's .grad is now a view of its main_grad bucket: left in place, the next
        # backward would accumulate into the bucket directly and count that gradient twice.
        for main in self.main_params:
            main.grad = None
        for param in self.model_params:
            param.grad = None

    @torch.no_grad()
    def step(self, extras: Tensor | None = None) -> StepResult:
        """Unscale, check, clip, update and copy back; skip everything on a non-finite value.

        ``extras``: this rank's 1-D values (any float dtype, on the device) to be summed over the
        world in the step's own all-reduce; the sums come back, in fp64, as ``StepResult.sums``.
        """
        loss_scale = self.scaler.scale
        grads = self._attach_grads()
        present = [g for g in grads if g is not None]
        if loss_scale != 1.0:
            torch._foreach_mul_(present, 1.0 / loss_scale)
        kinds = zip(grads, self._split, self._counted, self._expert, strict=True)
        pairs = [(g, s, e) for g, s, c, e in kinds if g is not None and c]
        split = _squared_norm([g for g, s, e in pairs if s and not e], self.device)
        repl = _squared_norm([g for g, s, e in pairs if not s], self.device)
        head = [split + repl]
        if any(self._expert):
            experts = _squared_norm([g for g, s, e in pairs if e], self.device)
            head = [split + repl + experts, experts * (self.state.expert_dp_rank == 0)]
        found = (~torch.isfinite(head[0])).to(torch.float64).reshape(1)
        local = split + repl if self.state.tp_rank == 0 else split
        parts = [found, *(h.reshape(1).to(torch.float64) for h in head[1:])]
        summed = torch.cat(parts if extras is None else [*parts, extras.to(torch.float64)])
        summed, squared = self._reduce(summed, local)
        if len(head) > 1:  # the experts' squares, summed over the world (one copy each)
            squared = squared + summed[1]
        skip = summed[0] > 0
        if self.clip_grad > 0:
            # min(1, clip / norm) in fp64 like a host-side coefficient, then fp32 like the
            # scalar a host-side multiply would use: the same numbers, without a sync.
            coeff = (self.clip_grad / (squared.sqrt() + 1e-6)).clamp(max=1.0)
            torch._foreach_mul_(present, coeff.to(torch.float32))
        self.inner.found_inf = skip.to(torch.float32)  # read by the fused kernel: skip on device
        self.inner.step()
        self._copy_back()
        # The one host sync of a step, after its last kernel: the agreed flag, the norm, the sums.
        found_inf, *sums, squared = torch.cat([summed, squared.reshape(1)]).tolist()
        sums = sums[len(head) - 1 :]  # the caller's
        grad_norm = math.sqrt(squared) if squared >= 0 else math.nan
        found_inf = found_inf > 0
        if not found_inf:
            for i, grad in enumerate(grads):
                self._steps[i] += grad is not None  # torch's AdamW skips a param without .grad
        self.scaler.update(found_inf)
        self._release_grads()
        return StepResult(not found_inf, grad_norm, found_inf, loss_scale, tuple(sums))

    def zero_grad(self) -> None:
        """Drop ``.grad`` of model and main params (DataParallel.zero_grad_buffer zeroes
        ``main_grad``)."""
        self._release_grads()


def _own(saved: Tensor, main: Tensor, live: Tensor | None) -> Tensor:
    """``saved`` if it is the live moment a load read straight into, else a fresh copy of it."""
    return saved if saved is live else torch.empty_like(main).copy_(saved)


class MixedPrecisionOptimizer(MainParamOptimizer):
    """AdamW on fp32 main parameters, whole ones; see the module docstring for one step."""

    def __init__(
        self,
        named_params: list[tuple[str, nn.Parameter]],
        cfg: OptimizerConfig,
        scaler: GradScaler,
        state: ParallelState,
    ):
        super().__init__(cfg, scaler, state)
        mains: list[Tensor] = []
        for name, param in named_params:
            if not param.requires_grad:
                continue
            # An fp32 parameter is its own main copy; a bf16/fp16 one gets an fp32 leaf copy.
            mains.append(param if param.dtype == torch.float32 else param.detach().float())
            self.names.append(name)
            self.model_params.append(param)
        self._setup(mains, range(len(mains)))
        self._lowp = [(p, m) for p, m in zip(self.model_params, self.main_params) if m is not p]

    def _attach_grads(self) -> list[Tensor | None]:
        grads: list[Tensor | None] = []
        for param, main in zip(self.model_params, self.main_params):
            grad = getattr(param, "main_grad", None)
            if grad is None and param.grad is not None:
                grad = param.grad.float()  # a no-op for fp32, a copy for bf16/fp16
            main.grad = grad
            grads.append(grad)
        return grads

    def _reduce(self, summed: Tensor, local: Tensor) -> tuple[Tensor, Tensor]:
        if self.state.world_size > 1:
            # Every rank holding part of the model must agree to skip, or replicas diverge; the
            # caller's values ride along, so the step stays one collective over the world.
            dist.all_reduce(summed)
        if self.state.tp_size * self.state.pp_size > 1:
            # Each TP rank holds other slices of the split parameters, each stage other layers:
            # sum the squares over both.
            dist.all_reduce(local, group=self.state.mp_group)
        return summed, local

    def _copy_back(self) -> None:
        if self._lowp:
            torch._foreach_copy_([p for p, _ in self._lowp], [m for _, m in self._lowp])

    def state_bytes(self) -> int:
        """Bytes of optimizer state on this rank: fp32 main copies of low-precision params and
        both Adam moments (counted before the first step allocates them)."""
        numel = sum(m.numel() for m in self.main_params)
        return 4 * (2 * numel + sum(m.numel() for _, m in self._lowp))

    @torch.no_grad()
    def reload_main_params(self) -> None:
        """Refresh fp32 main copies from the model (after loading weights without optimizer
        state, e.g. ``checkpoint.finetune``)."""
        for param, main in self._lowp:
            main.copy_(param)

    def state_dict(self) -> dict[str, Any]:
        """AdamW moments and step, fp32 main copies of low-precision params, and the loss scaler.

        ``{"params": {name: {"exp_avg", "exp_avg_sq", "step", ["main"]}}, "grad_scaler": {...}}``:
        every tensor has its parameter's local shape (split along ``tp_split_dim``), so checkpoints
        can reshard it; "step" is a host int; moments are absent before the first step. Tensors
        are live references.
        """
        params: dict[str, dict[str, Any]] = {}
        for i, (name, param, main) in enumerate(
            zip(self.names, self.model_params, self.main_params)
        ):
            entry: dict[str, Any] = {}
            adam = self.inner.state.get(main)
            if adam:
                entry.update(exp_avg=adam["exp_avg"], exp_avg_sq=adam["exp_avg_sq"])
                entry["step"] = self._steps[i]
            if main is not param:
                entry["main"] = main
            params[name] = entry
        return {"params": params, "grad_scaler": self.scaler.state_dict()}

    def load_targets(self, with_moments: set[str]) -> dict[str, dict[str, Tensor]]:
        """The main copies kept apart from their params, and the Adam moments of the names in
        ``with_moments`` (a checkpoint holds them), allocated now if no step has made them."""
        targets: dict[str, dict[str, Tensor]] = {}
        for name, param, main in zip(self.names, self.model_params, self.main_params):
            entry = targets[name] = {} if main is param else {"main": main}
            if name in with_moments:
                adam = self.inner.state[main]
                for field in ("exp_avg", "exp_avg_sq"):
                    if field not in adam:
                        adam[field] = torch.empty_like(main)
                    entry[field] = adam[field]
        return targets

    @torch.no_grad()
    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore ``state_dict()`` output; call after the model weights are loaded.

        A saved ``main`` overwrites the main copy (and the model param); without one, the main
        copy is taken from the model. The moments are copied into fresh tensors: a checkpoint's
        may map its file, which would then be read at the first step and held on disk after
        ``keep_last`` deleted it.
        """
        saved = state["params"]
        check_entries(saved, self.names, self.model_params)
        # torch numbers parameters across groups in order; its state dict is keyed by number.
        order = [p for group in self.inner.param_groups for p in group["params"]]
        index = {id(p): i for i, p in enumerate(order)}
        inner = {"state": {}, "param_groups": self.inner.state_dict()["param_groups"]}
        for i, (name, param, main) in enumerate(
            zip(self.names, self.model_params, self.main_params)
        ):
            entry = saved[name]
            if "main" in entry:
                main.copy_(entry["main"])
                if main is not param:
                    param.copy_(main)
            elif main is not param:
                main.copy_(param)
            self._steps[i] = int(entry.get("step", 0)) if "exp_avg" in entry else 0
            if "exp_avg" in entry:
                live = self.inner.state.get(main, {})
                inner["state"][index[id(main)]] = {
                    "step": torch.tensor(float(self._steps[i])),
                    **{f: _own(entry[f], main, live.get(f)) for f in ("exp_avg", "exp_avg_sq")},
                }
        # torch's own loader casts and moves every state tensor next to its parameter.
        self.inner.load_state_dict(inner)
        self.scaler.load_state_dict(state["grad_scaler"])
