"""tools/evaluate.py --task lm-eval against lm-eval's own ``hf`` model on the exported copy: a
multiple-choice task, a generate_until task and a rolling-loglikelihood task, written here as
YAML over small JSON files, on a tiny GPT-2-tokenized checkpoint (one process, TP=2, DP=2);
and the bad input that stops before any model is built.

The checkpoint is ``WIDE_ONE_STEP``'s (greedy predictions that vary, so that the greedy flags
and generations say something); its 64 positions make the rolling task need several windows.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from megatron.errors import ConfigError
from tests.distributed import run_distributed
from tests.gpt_run import ROOT, WIDE_ONE_STEP, _tool, run_pretrain, tiny_overrides
from tools.evaluate import build_parser, run

TOKENIZERS = ROOT / "tests" / "fixtures" / "tokenizers"
TASKS = "tiny_choice,tiny_gen,tiny_rolling"
# Contexts must leave room for max_gen_toks in the 64 positions, as the hf model cuts them too.
MAX_GEN = 8

# Each task reads its JSON list of documents; what follows is its own part.
HEADER = """task: tiny_{name}
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
"""
CHOICE_YAML = """output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{label}}}}"
metric_list:
  - {{metric: acc, aggregation: mean, higher_is_better: true}}
  - {{metric: acc_norm, aggregation: mean, higher_is_better: true}}
"""
GEN_YAML = """output_type: generate_until
doc_to_text: "{{{{prompt}}}}"
doc_to_target: "{{{{answer}}}}"
generation_kwargs:
  until: ["\\n", "."]
  max_gen_toks: {max_gen}
  do_sample: false
metric_list:
  - {{metric: exact_match, aggregation: mean, higher_is_better: true}}
"""
ROLLING_YAML = """output_type: loglikelihood_rolling
doc_to_text: ""
doc_to_target: "{{{{text}}}}"
metric_list:
  - {{metric: word_perplexity, aggregation: weighted_perplexity, higher_is_better: false}}
  - {{metric: bits_per_byte, aggregation: bits_per_byte, higher_is_better: false}}
"""


NO_DATA = {"tokenizer": "", "data": ""}  # tiny_overrides' data keys, which gpt2_keys replace


def gpt2_keys(data: str) -> dict[str, object]:
    """The config keys of the fixture GPT-2 BPE and ``data`` tokenized with it."""
    return {
        "tokenizer.type": "gpt2",
        "tokenizer.model": None,
        "tokenizer.vocab_file": TOKENIZERS / "gpt2-vocab.json",
        "tokenizer.merges_file": TOKENIZERS / "gpt2-merges.txt",
        "data.paths": f"[{data}]",
    }


@pytest.fixture(scope="module")
def gpt2_ckpt(tmp_path_factory) -> dict[str, str]:
    """A sample corpus in the fixture GPT-2 BPE, one training step on it (TP=1), its export."""
    run = tmp_path_factory.mktemp("lm_eval_gpt")
    corpus, prefix = run / "corpus.jsonl", run / "corpus"
    vocab, merges = gpt2_keys("")["tokenizer.vocab_file"], gpt2_keys("")["tokenizer.merges_file"]
    _tool("tools/make_sample_corpus.py", "--output", str(corpus), "--size-mb", "0.05")
    _tool("tools/preprocess_data.py", "--input", str(corpus), "--output-prefix", str(prefix),
          "--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", str(vocab),
          "--merge-file", str(merges), "--append-eod")  # fmt: skip
    extra = {**gpt2_keys(f"{prefix}_text_document"), "checkpoint.save": run / "ckpt"}
    overrides = tiny_overrides(NO_DATA, run, **extra, **WIDE_ONE_STEP)
    run_pretrain("pretrain_gpt.py", "configs/gpt_tiny.yaml", overrides)
    from megatron.interop.export import export_hf

    hf = export_hf(str(run / "ckpt"), str(run / "hf"))
    with open(corpus, encoding="utf-8") as f:
        texts = [json.loads(line)["text"] for line in f]
    return {"ckpt": str(run / "ckpt"), "hf": hf, "texts": texts, "data": f"{prefix}_text_document"}


def write_json(path: str, records: list[dict]) -> str:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(records, f)
    return path


@pytest.fixture(scope="module")
def task_dir(gpt2_ckpt, tmp_path_factory) -> str:
    """The three task YAMLs and their data, in one include path; lm-eval reads the data with
    ``datasets`` offline, its cache in a temporary directory."""
    out = tmp_path_factory.mktemp("lm_eval_tasks")
    os.environ.update(
        HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1", HF_DATASETS_CACHE=str(out / "cache")
    )
    words = [t.split() for t in gpt2_ckpt["texts"] if len(t.split()) >= 24][:30]
    choice = [
        {
            "question": " ".join(w[:5]),
            "choices": [" " + " ".join(w[5 + k : 7 + k + i % 3]) for k in (0, 3, 6, 9)],
            "label": i % 4,
        }
        for i, w in enumerate(words[:12])
    ]
    gen = [{"prompt": " ".join(w[: 5 + i]), "answer": w[5 + i]} for i, w in enumerate(words[:8])]
    # 77 to 101 tokens each: two windows of the 64 positions
    rolling = [{"text": " ".join(w[:16])} for w in words[12:18]]
    for name, yaml, records in (
        ("choice", CHOICE_YAML, choice),
        ("gen", GEN_YAML, gen),
        ("rolling", ROLLING_YAML, rolling),
    ):
        data = write_json(str(out / f"{name}.json"), records)
        (out / f"{name}.yaml").write_text(
            HEADER.format(name=name, data=data) + yaml.format(max_gen=MAX_GEN)
        )
    return str(out)


def lm_eval_argv(ckpt: str, tasks: str, include: str, *extra: str) -> list[str]:
    return ["--load", ckpt, "--task", "lm-eval", "--tasks", tasks, "--include-path", include,
            "--log-samples", *extra]  # fmt: skip


def per_request(results: dict) -> dict[str, dict]:
    """Each task's metrics and every request's response, by document."""
    out = {}
    for task, samples in results["samples"].items():
        by_doc = {s["doc_id"]: [r[0] for r in s["resps"]] for s in sorted(
            samples, key=lambda s: s["doc_id"])}  # fmt: skip
        metrics = {k: v for k, v in results["results"][task].items() if k != "alias"}
        out[task] = {"metrics": metrics, "resps": by_doc}
    return out


def evaluate_layouts(argv: list[str]) -> list[dict]:
    """In a 2-process group: ``run`` at TP=2, then at TP=1 x DP=2 (rank 0's results)."""
    got = []
    for tp in ("2", "1"):
        result = run(build_parser().parse_args([*argv, "--tensor-parallel-size", tp]))
        got.append(per_request(result["results"]) if result["results"] else None)
    return got


@pytest.fixture(scope="module")
def serial(gpt2_ckpt, task_dir, tmp_path_factory) -> dict:
    """The CLI at one process, batch size 4 (rows of different lengths share forward passes):
    its stdout, and the results JSON it wrote."""
    out = tmp_path_factory.mktemp("lm_eval_out") / "results.json"
    argv = lm_eval_argv(gpt2_ckpt["ckpt"], TASKS, task_dir)
    cli = subprocess.run(
        [sys.executable, "tools/evaluate.py", *argv, "--batch-size", "4", "--output", str(out)],
        cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True,
        timeout=300,
    )  # fmt: skip
    assert cli.returncode == 0, cli.stderr[-3000:]
    return {"results": per_request(json.loads(out.read_text())), "stdout": cli.stdout}


@pytest.fixture(scope="module")
def ours(serial, gpt2_ckpt, task_dir) -> dict[str, dict]:
    """Each layout's results: one process, and ``run`` at TP=2 and at DP=2 (batch size 3)."""
    argv = lm_eval_argv(gpt2_ckpt["ckpt"], TASKS, task_dir, "--batch-size", "3")
    tp2, dp2 = run_distributed(evaluate_layouts, 2, argv)[0]
    return {"serial": serial["results"], "tp2": tp2, "dp2": dp2}


@pytest.fixture(scope="module")
def oracle(gpt2_ckpt, task_dir) -> dict[str, dict]:
    """lm-eval's own ``hf`` model on the exported copy, one request at a time."""
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    results = simple_evaluate(
        model="hf",
        model_args={"pretrained": gpt2_ckpt["hf"], "device": "cpu", "dtype": "float32"},
        tasks=TASKS.split(","),
        batch_size=1,
        task_manager=TaskManager(include_path=task_dir, include_defaults=False),
        log_samples=True,
    )
    return per_request(results)


def response_gap(mine, want) -> float:
    """How far apart two responses are: 0 for equal texts, the loglikelihood difference (a
    rolling one's relative to its size), inf for different greedy flags or texts."""
    if isinstance(want, str):
        return 0.0 if mine == want else float("inf")
    if isinstance(want, (int, float)):
        return abs(mine - want) / abs(want)
    return abs(mine[0] - want[0]) if bool(mine[1]) == bool(want[1]) else float("inf")


@pytest.mark.parametrize(
    "layout", ["serial", *(pytest.param(x, marks=pytest.mark.slow) for x in ("tp2", "dp2"))]
)
def test_scores_equal_hf_model(request, oracle, layout):
    """Accuracies and exact matches identical, every greedy flag and generation identical, every
    choice's loglikelihood within 1e-4 (measured: 2e-5). A rolling loglikelihood (-700 to -930
    here: this model's tokens cost ~10 nats) is within 1e-6 of its size: the oracle sums each
    window's fp32 log-probabilities in fp32, which alone leaves ~1e-7 (measured: 1.2e-7)."""
    fixture = "serial" if layout == "serial" else "ours"  # one process needs no process group
    got = request.getfixturevalue(fixture)[layout if fixture == "ours" else "results"]
    assert set(got) == set(oracle) == set(TASKS.split(","))
    for task, want in oracle.items():
        assert got[task]["resps"].keys() == want["resps"].keys(), task
        for doc, responses in want["resps"].items():
            mine = got[task]["resps"][doc]
            assert len(mine) == len(responses), (task, doc)
            gaps = [response_gap(a, b) for a, b in zip(mine, responses)]
            limit = 1e-6 if task == "tiny_rolling" else 1e-4
            assert max(gaps) <= limit, (task, doc, mine, responses)
        for metric in ("acc,none", "acc_norm,none", "exact_match,none"):
            if metric in want["metrics"]:
                assert got[task]["metrics"][metric] == want["metrics"][metric], (task, metric)
    ppl = "word_perplexity,none"
    assert got["tiny_rolling"]["metrics"][ppl] == pytest.approx(
        oracle["tiny_rolling"]["metrics"][ppl], rel=1e-5
    )


def test_generations_vary(oracle):
    """The oracle's generations are not all empty or all alike: the checks above have teeth."""
    texts = [r[0] for r in oracle["tiny_gen"]["resps"].values()]
    assert len(set(texts)) > 2 and all(texts)


def test_cli_prints_table_and_lines(serial):
    """lm-eval's table, then one JSON line per task with its metrics and the settings."""
    lines = serial["stdout"].splitlines()
    assert lines[0].startswith("|") and "tiny_choice" in serial["stdout"]
    records = {r["task"]: r for r in map(json.loads, [x for x in lines if x.startswith("{")])}
    assert set(records) == set(TASKS.split(","))
    choice = records["tiny_choice"]
    assert choice["acc"] == serial["results"]["tiny_choice"]["metrics"]["acc,none"]
    assert (choice["n"], choice["batch_size"], choice["tensor_parallel_size"]) == (12, 4, 1)


def refuse(monkeypatch, argv: list[str]) -> str:
    """The one-line error of ``run(argv)``, which must come before any model is built."""

    def no_model(*_):
        raise AssertionError("a model was loaded before the bad input was refused")

    monkeypatch.setattr("tools.evaluate.load_for_inference", no_model)
    with pytest.raises(ConfigError) as err:
        run(build_parser().parse_args(argv))
    message = str(err.value)
    assert "\n" not in message
    return message


def test_bad_input_is_one_line_before_the_model(monkeypatch, tmp_path, task_dir, gpt2_ckpt):
    ckpt = gpt2_ckpt["ckpt"]
    argv = ["--load", ckpt, "--task", "lm-eval", "--include-path", task_dir]
    assert "unknown lm-eval task 'tiny_nope'" in refuse(
        monkeypatch, [*argv, "--tasks", "tiny_choice,tiny_nope"]
    )
    assert "--num-fewshot -1: must be >= 0" in refuse(
        monkeypatch, [*argv, "--tasks", "tiny_choice", "--num-fewshot", "-1"]
    )
    not_dir = tmp_path / "tasks.yaml"
    not_dir.write_text("task: x\n")
    bad_path = ["--load", ckpt, "--task", "lm-eval", "--tasks", "x", "--include-path"]
    assert f"--include-path {not_dir}: not a directory" in refuse(
        monkeypatch, [*bad_path, str(not_dir)]
    )
    assert "--task lm-eval needs --tasks" in refuse(monkeypatch, argv)
    assert "go with --task lm-eval" in refuse(
        monkeypatch, ["--load", ckpt, "--task", "text", "--input", str(not_dir), "--limit", "3"]
    )
    monkeypatch.setitem(sys.modules, "lm_eval", None)  # import lm_eval now raises ImportError
    missing = refuse(monkeypatch, [*argv, "--tasks", "tiny_choice"])
    assert "needs lm-eval-harness, which is not installed: pip install lm-eval" in missing


# In-loop layouts of 4 processes: the acceptance check's, and the other parallelisms' paths
# (the sequence split over TP and CP; virtual stages, whose chunks go around the ring; DP).
LAYOUTS = {
    "tp2_pp2": {"parallel.tensor_parallel_size": 2, "parallel.pipeline_parallel_size": 2},
    "tp2_sp_cp2": {
        "parallel.tensor_parallel_size": 2,
        "parallel.sequence_parallel": "true",
        "parallel.context_parallel_size": 2,
    },
    "dp2_pp2_virtual": {
        "parallel.tensor_parallel_size": 1,
        "parallel.pipeline_parallel_size": 2,
        "parallel.virtual_pipeline_size": 2,
        "model.num_layers": 4,
    },
}


@pytest.mark.slow
@pytest.mark.parametrize("layout", LAYOUTS)
def test_in_loop_equals_offline(gpt2_ckpt, task_dir, tmp_path, layout):
    """A run with training.eval_tasks scores the multiple-choice task at iterations 2 and 4 in
    place; tools/evaluate.py on that run's checkpoint of iteration 2, at one process, gives the
    same accuracies, read from the metrics file; the console line shows them."""
    from tools.evaluate import main

    extra = {
        **gpt2_keys(gpt2_ckpt["data"]),
        **LAYOUTS[layout],
        "model.init_method_std": 0.3,
        "training.train_iters": 4,
        "training.eval_tasks": "[tiny_choice]",
        "training.eval_tasks_include_path": task_dir,
        "training.eval_tasks_interval": 2,
        "checkpoint.save": tmp_path / "ckpt",
        "checkpoint.save_interval": 2,
    }
    overrides = tiny_overrides(NO_DATA, tmp_path, **extra)
    proc = run_pretrain("pretrain_gpt.py", "configs/gpt_tiny.yaml", overrides, nproc=4)
    assert "downstream tasks at iteration 2 | eval/tiny_choice/acc" in proc.stdout + proc.stderr
    lines = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    in_loop = {e["iteration"]: e for e in lines if "eval/tiny_choice/acc" in e}
    assert sorted(in_loop) == [2, 4]
    out = tmp_path / "offline.json"
    argv = ["--load", str(tmp_path / "ckpt" / "iter_0000002"), "--task", "lm-eval"]
    assert (
        main([*argv, "--tasks", "tiny_choice", "--include-path", task_dir, "--output", str(out)])
        == 0
    )
    offline = json.loads(out.read_text())["results"]["tiny_choice"]
    for metric in ("acc", "acc_norm"):
        assert in_loop[2][f"eval/tiny_choice/{metric}"] == offline[f"{metric},none"], metric
    assert in_loop[2]["eval/tiny_choice/acc"] != in_loop[4]["eval/tiny_choice/acc"] or (
        in_loop[2]["eval/tiny_choice/acc_norm"] != in_loop[4]["eval/tiny_choice/acc_norm"]
    )


def test_bad_training_tasks_are_one_line_before_the_model(gpt2_ckpt, task_dir, tmp_path):
    extra = {
        **gpt2_keys(gpt2_ckpt["data"]),
        "parallel.tensor_parallel_size": 1,
        "training.eval_tasks_include_path": task_dir,
    }
    for tasks, message in (
        ("[tiny_choice,tiny_nope]", "training.eval_tasks: unknown lm-eval task 'tiny_nope'"),
        ("[tiny_choice,tiny_gen]", "training.eval_tasks: tiny_gen is a generate_until task"),
    ):
        overrides = tiny_overrides(NO_DATA, tmp_path, **extra, **{"training.eval_tasks": tasks})
        proc = run_pretrain("pretrain_gpt.py", "configs/gpt_tiny.yaml", overrides, check=False)
        assert proc.returncode == 2
        errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
        assert len(errors) == 1 and message in errors[0]
        assert "model:" not in proc.stdout + proc.stderr  # logged once the model is built


def test_training_task_checks_name_their_keys(monkeypatch, tmp_path):
    """The loop's scorer is built before the model: a missing include path names its key, and
    lm-eval missing is one line naming the pip package."""
    from megatron.config.load import load_config
    from megatron.inference.downstream import downstream_tasks

    keys = [f"training.eval_tasks_include_path={tmp_path / 'none'}", "training.eval_tasks=[x]"]
    cfg = load_config([str(ROOT / "configs" / "gpt_tiny.yaml")], keys)
    with pytest.raises(ConfigError, match=r"^training.eval_tasks_include_path .*none: not a dir"):
        downstream_tasks(cfg, None)
    monkeypatch.setitem(sys.modules, "lm_eval", None)
    with pytest.raises(
        ConfigError, match="^training.eval_tasks needs lm-eval-harness.*pip install lm-eval"
    ):
        downstream_tasks(cfg, None)
