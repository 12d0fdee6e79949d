"""The GPU check: one command (``scripts/gpu_check.sh``) that measures what a lent GPU can tell.

Steps, each written to its own JSON file: the CUDA subset of the tests, GPT 1.2B throughput and
MFU in bf16, fp16 dynamic loss scaling, and which SDPA backend the models' attention runs on.
``docs/gpu_check.md`` describes the files.
"""
