"""Initialisation follows what a rank holds: each layer (and each embedding table and head) draws
from its own stream, seeded from the run's seed and its global index.

A pipeline stage builds and draws only its own layers, and they equal the whole model's bit for
bit; a TP rank draws each whole matrix and keeps its slice, so it holds the serial model's slice
exactly. Nothing here is a float sum, so every comparison is exact.
"""

import dataclasses

import torch
import torch.distributed as dist

from megatron.models import transformer
from megatron.models.bert import BertModel
from megatron.models.gpt import GPTModel
from megatron.parallel.random import RNGTracker
from megatron.parallel.state import ParallelState, initialize
from tests.distributed import run_distributed
from tests.model_config import tiny_model_config

VOCAB, PADDED = 200, 256  # padded alike at TP=1 and TP=2 (multiples of 128 * tp)
LAYERS = 4


def build(model_class, state: ParallelState, seed: int = 1234, chunks: int = 1):
    tracker = RNGTracker(state.device)
    tracker.seed(seed, state.tp_rank)
    cfg = tiny_model_config(num_layers=LAYERS)
    return model_class(cfg, VOCAB, PADDED, state, tracker, chunks=chunks)


def stage(pp_rank: int, pp_size: int) -> ParallelState:
    """Pipeline stage ``pp_rank`` of ``pp_size`` in one process (no groups: nothing is sent)."""
    return dataclasses.replace(
        ParallelState.serial(torch.device("cpu")), pp_size=pp_size, pp_rank=pp_rank
    )


class CountingLayer(transformer.TransformerLayer):
    """A TransformerLayer that records the global index of every one constructed."""

    built: list[int] = []

    def __init__(self, cfg, state, tracker, index, *args, **kwargs):
        CountingLayer.built.append(index)
        super().__init__(cfg, state, tracker, index, *args, **kwargs)


def test_a_stage_builds_only_its_layers_and_they_equal_the_whole_models(monkeypatch):
    monkeypatch.setattr(transformer, "TransformerLayer", CountingLayer)
    serial = ParallelState.serial(torch.device("cpu"))
    seeded = torch.Generator().manual_seed(1234).get_state()
    for model_class in (GPTModel, BertModel):
        whole = build(model_class, serial).state_dict()
        for pp_rank, pp_size, chunks, held in ((0, 4, 1, [0]), (3, 4, 1, [3]), (1, 2, 2, [1, 3])):
            CountingLayer.built = []
            part = build(model_class, stage(pp_rank, pp_size), chunks=chunks).state_dict()
            assert CountingLayer.built == held
            # Every draw came from the parts' own streams: the shared (dropout) generator is
            # where seeding left it.
            assert torch.equal(torch.default_generator.get_state(), seeded)
            layers = {int(k.split(".")[2]) for k in part if k.startswith("transformer.layers.")}
            assert layers == set(held)
            for key, value in part.items():
                assert torch.equal(value, whole[key]), (model_class.__name__, pp_rank, key)


def test_a_seed_changes_every_part():
    serial = ParallelState.serial(torch.device("cpu"))
    one, two = build(BertModel, serial, seed=1), build(BertModel, serial, seed=2)
    drawn = [k for k, v in one.named_parameters() if v.std() > 0]  # not the ones, zeros
    assert any(k.startswith("pooler.") for k in drawn) and "embedding.word.weight" in drawn
    for key in drawn:
        assert not torch.equal(one.get_parameter(key), two.get_parameter(key)), key


def _tp_slices_equal_serial(model_class) -> list[str]:
    state = initialize(2)
    whole = build(model_class, ParallelState.serial(state.device)).state_dict()
    checked = []
    for name, param in build(model_class, state).named_parameters():
        dim = getattr(param, "tp_split_dim", None)
        full = whole[name]
        if dim is not None:
            local = full.shape[dim] // 2
            full = full.narrow(dim, state.tp_rank * local, local)
        assert torch.equal(param.detach(), full), (name, dist.get_rank())
        checked.append(name)
    return checked


def test_tp2_ranks_hold_the_serial_models_slices():
    for model_class in (GPTModel, BertModel):
        checked = run_distributed(_tp_slices_equal_serial, 2, model_class)
        assert checked[0] == checked[1] and "transformer.layers.3.mlp.fc2.weight" in checked[0]
