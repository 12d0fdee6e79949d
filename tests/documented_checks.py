"""How each command in the README and docs/ is checked (tests/test_documented_commands.py reads
the commands from the Markdown and runs each as its entry here says): the kinds of check, and the
table of every documented command with its own."""

from __future__ import annotations

from dataclasses import dataclass

# Appended to a long run: fewer iterations, and no warmup (it must be shorter than the run).
SHORT = (
    "training.train_iters=4",
    "training.eval_interval=4",
    "training.eval_iters=1",
    "optimizer.lr_warmup_iters=0",
)


@dataclass(frozen=True)
class Run:
    append: tuple[str, ...] = ()
    replace: tuple[tuple[str, str], ...] = ()


@dataclass(frozen=True)
class Instead:
    command: str
    why: str


@dataclass(frozen=True)
class Covered:
    test: str  # a test that runs this very command


@dataclass(frozen=True)
class Skip:
    why: str


TINY = (("iter_0000100", "iter_0000004"), ("--iteration 200", "--iteration 4"))  # SHORT's saves
CHECKS: dict[str, Run | Instead | Covered | Skip] = {
    # README.md
    "python3 -m venv .venv && .venv/bin/pip install -q -r requirements.txt && "
    "PYTHON=.venv/bin/python bash scripts/demo.sh": Instead(
        " ".join(["PYTHON=.venv/bin/python bash scripts/demo.sh", *SHORT]),
        "the install needs the package index (CI installed the same and more); the demo as "
        "written, shortened",
    ),
    '(command -v slurmctld >/dev/null || [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null '
    "|| { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq slurm-wlm "
    'munge >/dev/null; } || echo "warning: slurm-wlm and munge did not install; '
    'tests/test_slurm_real.py will skip") && python3 -m venv .venv && .venv/bin/pip install -q '
    "--no-compile -r "
    "requirements-dev.txt && .venv/bin/python -m pytest -q -n 2 --dist loadfile": Skip(
        "the test command: CI runs exactly this"
    ),
    "python -m megatron.launch.torchrun --standalone --nproc-per-node 8 "
    "pretrain_gpt.py --config configs/gpt_8.3b.yaml": (
        Instead(
            "python pretrain_gpt.py --config configs/gpt_8.3b.yaml --preflight --world-size 8",
            "8 GPUs: every check the run makes before its first collective, at world size 8",
        )
    ),
    "NPROC=8 scripts/run_single_node.sh configs/gpt_345m.yaml parallel.tensor_parallel_size=2": (
        Instead(
            "python pretrain_gpt.py --config configs/gpt_345m.yaml --preflight --world-size 8 "
            "parallel.tensor_parallel_size=2",
            "8 GPUs: the preflight the script runs before torchrun",
        )
    ),
    "sbatch --nodes 2 scripts/slurm/pretrain_gpt.sbatch configs/gpt_39b.yaml": Instead(
        "NNODES=2 bash scripts/slurm/pretrain_gpt.sbatch --dry configs/gpt_39b.yaml",
        "a SLURM cluster: the script's dry mode, 2 nodes",
    ),
    "sbatch --nodes 64 scripts/slurm/pretrain_gpt.sbatch configs/gpt_39b.yaml": Instead(
        "NNODES=64 bash scripts/slurm/pretrain_gpt.sbatch --dry configs/gpt_39b.yaml",
        "a SLURM cluster: the script's dry mode, 64 nodes",
    ),
    "python pretrain_gpt.py --config configs/gpt_8.3b.yaml --dry-run --world-size 8 "
    "--gpu-memory-gb 32 model.recompute=full": Run(),
    "python pretrain_gpt.py --config configs/gpt_39b.yaml --dry-run --world-size 16 "
    "--gpu-memory-gb 80": Run(),
    "python pretrain_gpt.py --config configs/gpt_8.3b.yaml --dry-run --cluster dgx2h-v100 "
    "--nodes 32 precision.dtype=fp16 training.micro_batch_size=8": Run(),
    "python pretrain_gpt.py --config configs/gpt_8.3b.yaml --plan --cluster dgx2h-v100 --nodes 4 "
    "precision.dtype=fp16": Run(),
    "python tools/preprocess_data.py --input 'corpus/*.jsonl.gz' --output-prefix data/my "
    "--tokenizer-type GPT2BPETokenizer --vocab-file gpt2-vocab.json --merge-file gpt2-merges.txt "
    "--append-eod --workers 16": Run(),
    "python tools/ln_experiment.py --prepare-only --data-dir data/bert": Run(),
    "python -m megatron.launch.torchrun --standalone --nproc-per-node 2 "
    "pretrain_bert.py --config configs/bert_tiny.yaml": (Run(append=SHORT)),
    'python tools/generate.py --load runs/gpt_tiny/checkpoints --prompt "Return the" '
    "--max-new-tokens 40": Run(),
    "python -m megatron.launch.torchrun --standalone --nproc-per-node 2 "
    "tools/generate.py --load runs/gpt_tiny/checkpoints "
    "--input prompts.jsonl --output out.jsonl": Run(),
    "python tools/evaluate.py --load runs/gpt_tiny/checkpoints --task lm --split test": Run(),
    "python -m megatron.launch.torchrun --standalone --nproc-per-node 4 "
    "tools/evaluate.py --tensor-parallel-size 2 "
    "--load runs/gpt_tiny/checkpoints --task wikitext --input wiki.test.tokens --stride 64": Run(),
    "python tools/evaluate.py --load runs/gpt_tiny/checkpoints --task lambada --input "
    "lambada_test.jsonl": Run(),
    "python tools/export_hf.py --load runs/gpt_tiny/checkpoints --output hf/gpt_tiny --verify": (
        Run()
    ),
    "python tools/import_hf.py --input hf/gpt2 --output runs/gpt2 --tensor-parallel-size 2 "
    "--verify": Run(),
    "python tools/preprocess_data.py --input data/corpus.jsonl --output-prefix data/corpus_gpt2 "
    "--tokenizer-type GPT2BPETokenizer --vocab-file runs/gpt2/tokenizer/vocab.json --merge-file "
    "runs/gpt2/tokenizer/merges.txt --append-eod": Run(),
    "python pretrain_gpt.py --config runs/gpt2/config.yaml "
    "data.paths=[data/corpus_gpt2_text_document] training.train_iters=5": Run(),
    "python tools/import_hf.py --input hf/llama --output runs/llama --tensor-parallel-size 2 "
    "--verify": Run(),
    "python tools/preprocess_data.py --input data/corpus.jsonl --output-prefix data/corpus_llama "
    "--tokenizer-type HuggingFaceTokenizer --tokenizer-model runs/llama/tokenizer/tokenizer.json "
    "--append-eod": Run(),
    "python pretrain_gpt.py --config runs/llama/config.yaml "
    "data.paths=[data/corpus_llama_text_document] training.train_iters=5": Run(),
    "python tools/evaluate.py --load runs/llama/finetuned --task lm --split valid": Run(),
    "python tools/export_hf.py --load runs/llama/finetuned --output hf/llama_finetuned --verify": (
        Run()
    ),
    # docs/
    "python tools/bert_to_hdf5.py --data-path data/bert/bert_text_sentence --vocab-file "
    "data/bert/vocab.txt --output-prefix data/shards/train --seq-length 128": Run(),
    "python pretrain_bert.py --config configs/bert_3.9b.yaml --dry-run --world-size 512 "
    "--gpu-memory-gb 32": Run(),
    "python tools/preprocess_data.py --input my-corpus.json --output-prefix my-gpt2 --vocab-file "
    "gpt2-vocab.json --tokenizer-type GPT2BPETokenizer --merge-file gpt2-merges.txt --append-eod "
    "--keep-newlines --workers 8 --partitions 2": Run(),
    "python tools/evaluate.py --load runs/gpt_tiny/checkpoints --task wikitext --input "
    "wiki.test.tokens --stride 64": Run(),
    "python -m megatron.launch.torchrun --standalone --nproc-per-node 4 "
    "tools/evaluate.py --tensor-parallel-size 2 --load "
    "runs/gpt_tiny/checkpoints --task lambada --input lambada_test.jsonl": Run(),
    "python tools/evaluate.py --load runs/gpt_tiny/checkpoints --task lm --split valid": Run(),
    "python tools/evaluate.py --load runs/gpt_tiny/checkpoints/iter_0000100 --task lm --split "
    "valid": Run(replace=TINY),
    "python tools/evaluate.py --load runs/gpt_tiny/checkpoints --task lm-eval --tasks my_choice "
    "--include-path my_tasks": Run(),
    "python -m megatron.launch.torchrun --standalone --nproc-per-node 2 "
    "tools/evaluate.py --load runs/gpt_tiny/checkpoints "
    "--task lm-eval --tasks my_choice --include-path my_tasks --batch-size 16 --output "
    "results.json": Run(),
    "python tools/evaluate.py --load runs/gpt_tiny/checkpoints --task lm-eval --tasks "
    "hellaswag,arc_easy --limit 100": Skip(
        "downloads HellaSwag and ARC from the Hugging Face Hub; the two commands before it run "
        "a local task the same way"
    ),
    'python tools/generate.py --load runs/gpt_tiny/checkpoints --prompt "def main(" '
    "--max-new-tokens 32": Run(),
    "python tools/generate.py --load runs/gpt_tiny/checkpoints/iter_0000100 --prompt "
    '"def main("': Run(replace=TINY),
    "python -m megatron.launch.torchrun --standalone --nproc-per-node 2 "
    "tools/generate.py --load runs/gpt_tiny/checkpoints "
    "--input prompts.jsonl --output out.jsonl --batch-size 8 --top-p 0.9 --seed 7": Run(
        replace=(("out.jsonl", "out-sampled.jsonl"),)  # the README's run wrote out.jsonl
    ),
    "scripts/gpu_check.sh": Skip("needs a GPU; --dry, next, runs the same steps on the CPU"),
    "scripts/gpu_check.sh --steps gpt_bf16,sdpa": Skip("needs a GPU; --dry runs every step"),
    "OUT=/tmp/check PYTHON=.venv/bin/python scripts/gpu_check.sh --dry": Covered(
        "tests/test_gpu_check.py::test_dry_run_writes_every_step"
    ),
    "python tools/export_hf.py --load runs/bert_tiny/checkpoints --iteration 200 --output "
    "hf/bert_tiny --dtype bf16": Run(replace=TINY),
    "python -m megatron.launch.torchrun --standalone --nproc-per-node 2 "
    "pretrain_gpt.py --config runs/gpt2/config.yaml "
    "data.paths=[data/corpus_gpt2_text_document] parallel.tensor_parallel_size=2 "
    "training.train_iters=10": Run(),
    "mkdir -p logs": Run(),
    "sbatch scripts/slurm/pretrain_gpt.sbatch configs/gpt_8.3b.yaml [section.key=value ...]": (
        Instead(
            "bash scripts/slurm/pretrain_gpt.sbatch --dry configs/gpt_8.3b.yaml",
            "a SLURM cluster: the script's dry mode",
        )
    ),
    "REQUEUE=1 sbatch --nodes=4 --time=2-00:00:00 scripts/slurm/pretrain_gpt.sbatch "
    "configs/gpt_8.3b.yaml": Instead(
        "REQUEUE=1 NNODES=4 bash scripts/slurm/pretrain_gpt.sbatch --dry configs/gpt_8.3b.yaml",
        "a SLURM cluster: the script's dry mode, 4 nodes",
    ),
    "LAUNCHER=srun sbatch --ntasks-per-node=8 scripts/slurm/pretrain_gpt.sbatch "
    "configs/gpt_8.3b.yaml": Instead(
        "LAUNCHER=srun bash scripts/slurm/pretrain_gpt.sbatch --dry configs/gpt_8.3b.yaml",
        "a SLURM cluster: the script's dry mode, one task per GPU",
    ),
    "apt-get install -y slurm-wlm munge": Skip(
        "root and the package index; the README's test command installs the same where it can"
    ),
    "python3 -m tests.slurm_cluster /tmp/slurm-test": Skip(
        "starts daemons as root; tests/test_slurm_real.py's fixture runs the same start()"
    ),
    "export SLURM_CONF=/tmp/slurm-test/slurm.conf": Skip("a shell setting for the next commands"),
    "GPUS_PER_NODE=1 sbatch --nodes=2 --gpus-per-node=0 scripts/slurm/pretrain_gpt.sbatch "
    "configs/gpt_tiny.yaml": Covered(
        "tests/test_slurm_real.py::test_two_node_tp_equals_one_node"  # the same, on test data
    ),
    "bash scripts/slurm/pretrain_gpt.sbatch --help": Run(),
    "bash scripts/slurm/pretrain_gpt.sbatch --dry configs/gpt_tiny.yaml": Run(),
    "NNODES=2 GPUS_PER_NODE=2 bash scripts/slurm/pretrain_gpt.sbatch --dry configs/gpt_tiny.yaml": (
        Run()
    ),
    "python -m megatron.launch.torchrun --standalone --nproc-per-node 2 "
    "pretrain_gpt.py --config "
    "configs/gpt_tiny.yaml": Run(append=SHORT),
    "python -m megatron.launch.torchrun --standalone --nproc-per-node 2 "
    "pretrain_gpt.py --config "
    "configs/moe_tiny.yaml training.train_iters=20": Run(append=SHORT),
    "python pretrain_gpt.py --config configs/llama3_8b.yaml --dry-run --world-size 8 "
    "--gpu-memory-gb 80": Run(),
    "python pretrain_gpt.py --config configs/llama3_70b.yaml --dry-run --world-size 64 "
    "--gpu-memory-gb 80": Run(),
    "python pretrain_gpt.py --config configs/qwen2.5_7b.yaml --dry-run --world-size 8 "
    "--gpu-memory-gb 80": Run(),
    "python pretrain_gpt.py --config configs/mistral_7b.yaml --dry-run --world-size 8 "
    "--gpu-memory-gb 80": Run(),
    # docs/checkpoints.md: checkpoint_util on the demo's checkpoints
    "python tools/checkpoint_util.py --load runs/gpt_tiny/checkpoints --summary": Run(),
    "python tools/checkpoint_util.py --load runs/gpt_tiny/checkpoints --output "
    "runs/gpt_tiny/merged --merge": Run(),
    # docs/profiling.md: a trace of iterations 3 and 4, then its files (ls fails without them)
    "python -m megatron.launch.torchrun --standalone --nproc-per-node 2 "
    "pretrain_gpt.py --config "
    "configs/gpt_tiny.yaml training.train_iters=6 optimizer.lr_warmup_iters=0 "
    "checkpoint.save=runs/profiled logging.tensorboard_dir=runs/profiled/tensorboard "
    "'logging.profile_steps=[3,4]'": Run(),
    "ls runs/profiled/tensorboard/profile/rank0.*.pt.trace.json.gz "
    "runs/profiled/tensorboard/profile/rank1.*.pt.trace.json.gz": Run(),
    # docs/moe.md: the mixture-of-experts configs
    "python pretrain_gpt.py --config configs/mixtral_8x7b.yaml --dry-run --world-size 64 "
    "--gpu-memory-gb 80": Run(),
    "python pretrain_gpt.py --config configs/qwen3_30b_a3b.yaml --dry-run --world-size 32 "
    "--gpu-memory-gb 80": Run(),
    "python pretrain_gpt.py --config configs/qwen2_57b_a14b.yaml --dry-run --world-size 64 "
    "--gpu-memory-gb 80": Run(),
    # docs/moe.md: expert parallelism on one 8-GPU node and on 64 GPUs
    "python pretrain_gpt.py --config configs/mixtral_8x7b.yaml --dry-run --world-size 8 "
    "--gpu-memory-gb 141 parallel.tensor_parallel_size=4 parallel.pipeline_parallel_size=1 "
    "parallel.expert_parallel_size=2": Run(),
    "python pretrain_gpt.py --config configs/qwen3_30b_a3b.yaml --dry-run --world-size 8 "
    "--gpu-memory-gb 80 parallel.tensor_parallel_size=4 parallel.pipeline_parallel_size=1 "
    "parallel.expert_parallel_size=2 model.recompute=full": Run(),
    "python pretrain_gpt.py --config configs/mixtral_8x7b.yaml --dry-run --world-size 64 "
    "--gpu-memory-gb 80 parallel.pipeline_parallel_size=4 parallel.expert_parallel_size=8": Run(),
    "python pretrain_gpt.py --config configs/qwen3_30b_a3b.yaml --dry-run --world-size 64 "
    "--gpu-memory-gb 80 parallel.expert_parallel_size=8": Run(),
    # docs/context_parallel.md: Llama 3 8B at 32K and 128K tokens
    "python pretrain_gpt.py --config configs/llama3_8b.yaml --dry-run --world-size 8 "
    "--gpu-memory-gb 80 model.seq_length=32768 model.max_position_embeddings=32768 "
    "parallel.context_parallel_size=4": Run(),
    "python pretrain_gpt.py --config configs/llama3_8b.yaml --dry-run --world-size 8 "
    "--gpu-memory-gb 80 model.seq_length=32768 model.max_position_embeddings=32768 "
    "parallel.context_parallel_size=4 model.recompute=full": Run(),
    "python pretrain_gpt.py --config configs/llama3_8b.yaml --dry-run --world-size 8 "
    "--gpu-memory-gb 80 model.seq_length=131072 model.max_position_embeddings=131072 "
    "parallel.context_parallel_size=4 model.recompute=full": Run(),
    "python pretrain_gpt.py --config configs/llama3_8b.yaml --dry-run --world-size 8 "
    "--gpu-memory-gb 80 model.seq_length=131072 model.max_position_embeddings=131072 "
    "parallel.tensor_parallel_size=8 model.recompute=full": Run(),
    "python pretrain_gpt.py --config configs/llama3_8b.yaml --dry-run --world-size 64 "
    "--gpu-memory-gb 80 model.seq_length=32768 model.max_position_embeddings=32768 "
    "parallel.context_parallel_size=4": Run(),
    "python pretrain_gpt.py --config configs/llama3_8b.yaml --dry-run --world-size 64 "
    "--gpu-memory-gb 80 model.seq_length=131072 model.max_position_embeddings=131072 "
    "parallel.context_parallel_size=16": Run(),
}


# What a command's output must show besides succeeding.
SHOWS = {
    "python3 -m venv .venv && .venv/bin/pip install -q -r requirements.txt && "
    "PYTHON=.venv/bin/python bash scripts/demo.sh": "== what the demo wrote",
}
