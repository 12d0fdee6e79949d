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
