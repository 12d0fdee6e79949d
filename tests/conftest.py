"""Pytest setup: one intra-op thread per process, and the repo root importable."""

import os
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)
os.environ.setdefault("OMP_NUM_THREADS", "1")
torch.set_num_threads(1)


import pytest  # noqa: E402


@pytest.fixture(scope="session")
def gpt_data(tmp_path_factory):
    """A real tokenizer and preprocessed corpus, built once per test session."""
    from tests.gpt_run import prepare_gpt_data

    return prepare_gpt_data(tmp_path_factory.mktemp("gpt_data"))
