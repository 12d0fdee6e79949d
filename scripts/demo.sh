#!/usr/bin/env bash
# The CPU demo: sample corpus -> sentencepiece tokenizer -> .bin/.idx -> gpt_tiny at TP=2 ->
# validation perplexity and a greedy sample.
# Every step reuses what an earlier run left in data/; a second run resumes from the checkpoint.
# PYTHON: the interpreter (default: the repository's .venv/bin/python, else python3).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-}
if [[ -z $PY ]]; then
    PY=$PWD/.venv/bin/python
    if [[ ! -x $PY ]]; then PY=python3; fi
    echo "== PYTHON=$PY (the repository's .venv, else python3; set PYTHON to choose)"
fi
mkdir -p data
[ -f data/corpus.jsonl ] || $PY tools/make_sample_corpus.py --output data/corpus.jsonl --size-mb 4
[ -f data/tokenizer.model ] || $PY tools/train_tokenizer.py --input data/corpus.jsonl \
    --model-prefix data/tokenizer --vocab-size 4096 --model-type bpe
[ -f data/corpus_text_document.idx ] || $PY tools/preprocess_data.py --input data/corpus.jsonl \
    --output-prefix data/corpus --tokenizer-type sentencepiece \
    --tokenizer-model data/tokenizer.model --append-eod --workers 2
# torchrun as megatron.launch.torchrun: a failure is the worker's one line and exit code.
$PY -m megatron.launch.torchrun --standalone --nproc-per-node 2 \
    pretrain_gpt.py --config configs/gpt_tiny.yaml "$@"
# What the run trained: validation perplexity (the split the loop evaluated on), then a greedy
# sample. One process each: the TP=2 checkpoint is resharded to TP=1 on load.
echo "== validation perplexity"
$PY tools/evaluate.py --load runs/gpt_tiny/checkpoints --task lm --split valid
echo "== greedy sample"
$PY tools/generate.py --load runs/gpt_tiny/checkpoints --prompt "Return the number of" \
    --max-new-tokens 40
echo
cat <<'SUMMARY'
== what the demo wrote
  data/                            the sample corpus, tokenizer (tokenizer.model) and .bin/.idx
  runs/gpt_tiny/checkpoints/       checkpoints (latest names the newest) and resolved_config.yaml
  runs/gpt_tiny/metrics.jsonl      one JSON line per logged iteration and per evaluation
  runs/gpt_tiny/tensorboard/       TensorBoard events: tensorboard --logdir runs/gpt_tiny
The training line's validation perplexity covers training.eval_iters batches of the validation
split; evaluate.py above scored all of it, so the two differ a little.
== next
  bash scripts/demo.sh training.train_iters=400          # resumes from the checkpoint, 200 more
  python -m megatron.launch.torchrun --standalone --nproc-per-node 2 pretrain_gpt.py --config configs/moe_tiny.yaml
  python pretrain_gpt.py --config configs/llama3_8b.yaml --dry-run --world-size 8 --gpu-memory-gb 80
  README.md and docs/ for the rest (docs/moe.md, docs/llama.md, docs/huggingface.md)
SUMMARY
