"""benchmarks/bench_lm_eval.py at a small shape, its own scratch checkpoint and BPE included:
both sides score the same requests and reach the same accuracy. Timings are not checked."""

from __future__ import annotations

import pytest

from benchmarks.bench_lm_eval import main


@pytest.mark.slow
def test_both_sides_agree():
    argv = ["--vocab", "600", "--docs", "8", "--context-words", "8", "--batch-size", "4"]
    result = main([*argv, "--repeats", "1", "--threads", "1"])
    assert result["requests"] == 32 and result["shape"]["vocab"] == 600
    assert result["ours_acc"] == result["hf_acc"], result
    assert result["ours_req_s"] > 0 and result["hf_req_s"] > 0
