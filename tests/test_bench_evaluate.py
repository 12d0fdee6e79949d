"""benchmarks/bench_evaluate.py at a small shape: on the ``wide_gpt`` checkpoint (built by the real
entrypoint) our sliding-window perplexity and the transformers recipe's agree within 1e-6
relative, over windows that overlap and a ragged last one. Timings are not checked.
"""

from __future__ import annotations

import pytest

from benchmarks.bench_evaluate import main

pytest.importorskip("transformers")


@pytest.mark.slow
def test_perplexities_agree(wide_gpt):
    argv = ["--load", wide_gpt["ckpt"], "--tokens", "300", "--seq-length", "32", "--stride", "12"]
    result = main([*argv, "--micro-batch-size", "3", "--repeats", "1", "--threads", "1"])
    assert result["tokens"] == 300 and result["windows"] == 24
    assert result["ppl_rel_diff"] <= 1e-6, result
