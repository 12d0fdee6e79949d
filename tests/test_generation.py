"""Generation: KV-cache decoding against recomputing the prefix, against HF's generate on the
export, a batch of different-length prompts against each alone, sampling, stops, and
tools/generate.py end to end (TP=2 against TP=1 there).

The checks use ``wide_gpt``: one iteration from a wide initialisation, whose greedy
continuations change token to token (the barely trained fixture repeats one token), so
token-for-token equality means something; its 64 positions leave room for 32 new tokens.
"""

from __future__ import annotations

import glob
import json
import os
import subprocess
import sys
from collections.abc import Iterator

import pytest
import torch

from megatron.errors import ConfigError
from megatron.inference.generation import Generation, generate
from megatron.inference.loading import Loaded, load_for_inference
from megatron.inference.sampling import SamplingParams, filter_logits
from megatron.parallel import state as parallel_state
from tests.distributed import free_port
from tests.gpt_run import ROOT
from tools.checkpoint_util import main as checkpoint_util
from tools.generate import continuation

TEXTS = ["def foo(self):\n    return", "import", "Return the number of items in the list."]
NEW = 16


@pytest.fixture(scope="module")
def wide(wide_gpt) -> Iterator[Loaded]:
    """``wide_gpt`` loaded in this process (a world of one); its process group is torn down
    after the module, so later tests start without one."""
    yield load_for_inference(wide_gpt["ckpt"], [])
    parallel_state.shutdown()


def encode(loaded: Loaded) -> list[list[int]]:
    """TEXTS as token ids: three prompts of different lengths."""
    prompts = [loaded.tokenizer.encode(t) for t in TEXTS]
    assert len({len(p) for p in prompts}) == len(prompts)
    return prompts


def assert_logits_close(got: torch.Tensor, want: torch.Tensor, tol: float) -> None:
    """Within ``tol`` of the logits' scale (their largest magnitude)."""
    scale = float(want.abs().max())
    assert float((got - want).abs().max()) <= tol * scale


def greedy(loaded: Loaded, prompts: list[list[int]], **kwargs) -> list[Generation]:
    """NEW greedy tokens per prompt, past eod, with their logits."""
    kwargs.setdefault("stop_at_eod", False)
    return generate(loaded.model, prompts, NEW, loaded.tokenizer.eod, return_logits=True, **kwargs)


def test_kv_cache_decoding_matches_recomputing_the_prefix(wide):
    """Prefill once, then one position per forward; tokens equal, and logits within 1e-5 of
    the logits' scale of running the whole sequence each step. The scale (max |logit| ~ 11)
    sets the unit: the two differ only in summation order (one query against many), which moves
    fp32 hidden states by ~1e-6 relative, and a logit by that times the scale."""
    model, prompts = wide.model, encode(wide)
    widths = []
    hook = model.register_forward_pre_hook(lambda _, args: widths.append(args[0].shape[1]))
    try:
        got = greedy(wide, prompts)
    finally:
        hook.remove()
    shortest, longest = min(map(len, prompts)), max(map(len, prompts))
    assert widths == [shortest] + [1] * (longest + NEW - 1 - shortest)
    with torch.no_grad():
        for prompt, gen in zip(prompts, got):
            seq, ref = list(prompt), []
            for _ in range(NEW):
                logits = model(torch.tensor([seq]))[0, -1, : model.vocab_size]  # [vocab]
                ref.append(logits)
                seq.append(int(logits.argmax()))
            assert gen.tokens == seq[len(prompt) :]
            assert gen.stop == "max_new_tokens"
            assert_logits_close(gen.logits, torch.stack(ref), 1e-5)


def test_a_batch_matches_each_prompt_alone(wide):
    """Teacher forcing inside the longer prompts makes the batch exact, not approximate: only
    the batch size of the matrix products differs."""
    prompts = encode(wide)
    batch = greedy(wide, prompts)
    assert len({tuple(g.tokens) for g in batch}) == len(batch)
    for prompt, gen in zip(prompts, batch):
        (alone,) = greedy(wide, [prompt])
        assert gen.tokens == alone.tokens
        assert_logits_close(gen.logits, alone.logits, 1e-5)


def test_greedy_matches_hf_generate_of_the_export(wide_gpt, wide, tmp_path):
    """32 greedy tokens per prompt equal GPT2LMHeadModel.generate's on the exported weights,
    each prompt alone on the HF side (no padding), the three in one batch on ours. HF would stop
    at its eos, the eod, so both sides run past it: HF told so per call (a generation_config
    with eos None would get the model's eos merged back in)."""
    transformers = pytest.importorskip("transformers")
    from megatron.interop.export import export_hf

    path = export_hf(wide_gpt["ckpt"], str(tmp_path / "hf"))
    hf = transformers.GPT2LMHeadModel.from_pretrained(path).eval()
    eod, prompts = wide.tokenizer.eod, encode(wide)
    ours = generate(wide.model, prompts, 32, eod, stop_at_eod=False, return_logits=True)
    for prompt, gen in zip(prompts, ours):
        with torch.no_grad():
            out = hf.generate(
                torch.tensor([prompt]),
                max_new_tokens=32,
                do_sample=False,
                eos_token_id=None,
                pad_token_id=eod,
                output_logits=True,
                return_dict_in_generate=True,
            )
        assert gen.tokens == out.sequences[0, len(prompt) :].tolist()
        assert len(gen.tokens) == 32
        assert_logits_close(gen.logits, torch.cat(out.logits), 1e-5)


def test_stops_at_eod_and_at_the_position_table(wide):
    """Use as "eod" a token the model is known to produce: each sequence ends before its first
    one, the others run on unchanged; a long run stops when the 64 positions are full."""
    prompts = encode(wide)
    full = greedy(wide, prompts)
    eod = full[0].tokens[3]
    cut = generate(wide.model, prompts, NEW, eod)
    for ref, gen in zip(full, cut):
        if eod in ref.tokens:
            assert (gen.tokens, gen.stop) == (ref.tokens[: ref.tokens.index(eod)], "eod")
        else:
            assert (gen.tokens, gen.stop) == (ref.tokens, "max_new_tokens")
    long = generate(wide.model, prompts, 100, wide.tokenizer.eod, stop_at_eod=False)
    assert [len(p) + len(g.tokens) for p, g in zip(prompts, long)] == [64] * len(prompts)
    assert {g.stop for g in long} == {"max_positions"}
    assert [g.tokens for g in generate(wide.model, prompts, 0, eod)] == [[]] * len(prompts)


def test_seeded_sampling_is_reproducible_and_top_k_1_is_greedy(wide):
    prompts = encode(wide)

    def sample(seed: int, **params) -> list[list[int]]:
        gen = torch.Generator().manual_seed(seed)
        params = SamplingParams(False, **params)
        out = generate(wide.model, prompts, NEW, 0, params, gen, stop_at_eod=False)
        return [g.tokens for g in out]

    nucleus = dict(temperature=0.8, top_p=0.9, top_k=50)
    assert sample(7, **nucleus) == sample(7, **nucleus)
    assert sample(7, **nucleus) != sample(8, **nucleus)
    assert sample(3, top_k=1) == [g.tokens for g in greedy(wide, prompts)]


def test_filter_logits_keeps_top_k_and_the_nucleus():
    logits = torch.tensor([[2.0, 1.0, 0.0, 3.0]]).log_softmax(-1)
    kept = lambda **p: torch.isfinite(filter_logits(logits, SamplingParams(False, **p)))  # noqa: E731
    assert kept(top_k=2).tolist() == [[True, False, False, True]]
    probs = logits.exp()[0]  # 0.24, 0.09, 0.03, 0.64
    assert kept(top_p=float(probs[3]) - 0.01).tolist() == [[False, False, False, True]]
    assert kept(top_p=float(probs[3] + probs[0]) - 0.01).tolist() == [[True, False, False, True]]
    assert kept(top_p=float(probs[3] + probs[0]) + 0.01).tolist() == [[True, True, False, True]]
    halved = filter_logits(logits, SamplingParams(False, temperature=0.5))
    torch.testing.assert_close(halved, logits * 2)
    for bad in (dict(temperature=0.0), dict(top_k=-1), dict(top_p=0.0), dict(top_p=1.5)):
        with pytest.raises(ConfigError):
            SamplingParams(False, **bad)


def _tool(*args: str, nproc: int = 1) -> subprocess.CompletedProcess:
    launch = [sys.executable]
    if nproc > 1:
        launch += ["-m", "torch.distributed.run", "--nproc-per-node", str(nproc)]
        launch += ["--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{free_port()}"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run(
        [*launch, "tools/generate.py", *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_generate_tool_at_tp2_matches_tp1(wide_gpt, wide, tmp_path):
    """torchrun at TP=2 (resharded from the TP=1 checkpoint on load), all prompts of different
    lengths in one batch: each line keeps its input keys and adds the continuation's text, ids
    and stop reason, the ids those of TP=1 in this process. The empty prompt starts from eod;
    the last (61 of the 64 positions) stops at the position table."""
    requests = [{"prompt": t, "id": i} for i, t in enumerate(TEXTS)]
    requests += [{"prompt": ""}, {"prompt": TEXTS[1] * 15}]
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in requests))
    args = ["--load", wide_gpt["ckpt"], "--input", str(src), "--output", str(out)]
    proc = _tool(*args, "--batch-size", "5", "--max-new-tokens", str(NEW), nproc=2)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    tok = wide.tokenizer
    encoded = [tok.encode(r["prompt"]) for r in requests]
    expect = generate(wide.model, [ids or [tok.eod] for ids in encoded], NEW, tok.eod)
    assert [line.pop("tokens") for line in lines] == [g.tokens for g in expect]
    assert [line.pop("stop") for line in lines] == [g.stop for g in expect]
    assert expect[-1].stop == "max_positions"
    texts = [continuation(tok, ids, g.tokens) for ids, g in zip(encoded, expect)]
    assert [line.pop("text") for line in lines] == texts
    assert lines == requests
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.jsonl", "out.jsonl"]


def load_forms(save_dir: str, tmp_path) -> dict[str, str]:
    """What --load accepts: the run's save directory, one iter_* directory of it, and what
    tools/checkpoint_util.py --merge --weights-only wrote from it."""
    merged = str(tmp_path / "merged")
    assert (
        checkpoint_util(["--input", save_dir, "--output", merged, "--merge", "--weights-only"]) == 0
    )
    (iter_dir,) = sorted(glob.glob(os.path.join(save_dir, "iter_*")))
    return {"save dir": save_dir, "iter dir": iter_dir, "merged": merged}


@pytest.mark.parametrize("form", ["save dir", "iter dir", "merged"])
def test_generate_tool_prints_the_continuation(form, wide_gpt, wide, tmp_path):
    load = load_forms(wide_gpt["ckpt"], tmp_path)[form]
    proc = _tool("--load", load, "--prompt", TEXTS[1], "--max-new-tokens", "5")
    assert proc.returncode == 0, proc.stderr[-3000:]
    prompt = wide.tokenizer.encode(TEXTS[1])
    (gen,) = generate(wide.model, [prompt], 5, wide.tokenizer.eod)
    full = wide.tokenizer.decode(prompt + gen.tokens)
    assert proc.stdout == full[len(wide.tokenizer.decode(prompt)) :] + "\n"
    assert proc.stderr.strip() == f"stop: {gen.stop} after {len(gen.tokens)} tokens"


MISTAKES = {
    "no checkpoint": "no such directory",
    # The run's own directory: its logs, and its save directory ckpt/.
    "run directory": "holds no checkpoint (it holds cache/, ckpt/, metrics.jsonl, tb/; its ckpt/",
    "prompt too long": "position table",
}


@pytest.mark.parametrize("case", list(MISTAKES))
def test_generate_tool_mistakes_are_one_line(case, wide_gpt, tmp_path):
    run_dir = os.path.dirname(wide_gpt["ckpt"])
    load = {"no checkpoint": str(tmp_path / "nowhere"), "run directory": run_dir}
    proc = _tool("--load", load.get(case, wide_gpt["ckpt"]), "--prompt", "x " * 100)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), proc.stderr
    assert MISTAKES[case] in lines[0]


def test_generation_benchmark_runs(wide_gpt):
    """A tiny run of benchmarks/bench_generate.py: one JSON line, HF's tokens equal ours."""
    args = ["--load", wide_gpt["ckpt"], "--batch", "2", "--prompt-tokens", "4"]
    args += ["--new-tokens", "4", "--repeats", "1", "--threads", "1"]
    proc = subprocess.run(
        [sys.executable, "benchmarks/bench_generate.py", *args],
        cwd=ROOT,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    (line,) = proc.stdout.splitlines()
    result = json.loads(line)
    assert result["same_tokens"] and result["ours_tok_s"] > 0 and result["hf_tok_s"] > 0
