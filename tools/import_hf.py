"""Import a Hugging Face model directory, with its tokenizer, as our checkpoint at any TP size.

Accepted: GPT2LMHeadModel, BertForPreTraining, MegatronBertForPreTraining and the Llama family
(LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM) with its
mixtures of experts (MixtralForCausalLM, Qwen2MoeForCausalLM, Qwen3MoeForCausalLM).

    python tools/import_hf.py --input hf/gpt2 --output runs/gpt2 --tensor-parallel-size 2 --verify
    python pretrain_gpt.py --config runs/gpt2/config.yaml data.paths=[data/gpt2_text_document]
    python -m megatron.launch.torchrun --standalone --nproc-per-node 2 pretrain_gpt.py \\
        --config runs/gpt2/config.yaml data.paths=[data/gpt2_text_document] \\
        parallel.tensor_parallel_size=2

The input needs config.json, model.safetensors (never pytorch_model.bin: nothing is unpickled)
and its tokenizer files: GPT-2's and BERT's are taken as they are, a Llama-family model's
tokenizer is what AutoTokenizer loads from the directory (tokenizer.json, else tokenizer.model),
its eos our end of document. ``--tokenizer-type`` with ``--tokenizer-model`` (or ``--vocab-file``,
``--merge-file``) name other files instead, taken as they are, e.g. for a directory without any.
An embedding with more rows than the tokenizer has ids (Qwen2.5: 152064 for 151665) is kept
whole. The output holds the checkpoint (weights only, at the TP size asked for), the tokenizer
and a config.yaml our entrypoints accept at any world size (TP=1: the checkpoint reshards on
load), which continues pretraining the import into its finetuned/.
``--verify`` (it needs transformers) runs both models on fixed ids and fails when their logits
differ by over 1e-4; it is checked for before anything is written.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron.errors import ConfigError  # noqa: E402
from megatron.inference.loading import add_tokenizer_flags, tokenizer_overrides  # noqa: E402
from megatron.interop.importer import finetune_commands, import_hf  # noqa: E402
from megatron.interop.verify import (  # noqa: E402
    TOLERANCE,
    check_transformers,
    describe,
    max_logit_difference,
)


def build_parser() -> argparse.ArgumentParser:
    """The command-line flags."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--input", required=True, help="the HF model directory")
    p.add_argument("--output", required=True, help="the save directory to create")
    p.add_argument("--tensor-parallel-size", type=int, default=1, help="TP size to save at")
    p.add_argument("--verify", action="store_true", help="compare logits with transformers")
    add_tokenizer_flags(p)
    return p


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point: 0, 1 when --verify finds the logits apart, 2 (one line) for a
    user mistake."""
    args = build_parser().parse_args(argv)
    try:
        if args.verify:
            check_transformers()
        ckpt = import_hf(
            args.input, args.output, args.tensor_parallel_size, tokenizer_overrides(args)
        )
        print(
            f"wrote {ckpt} (TP={args.tensor_parallel_size}, resharded on load to the run's TP "
            "size); continue pretraining it on your data (PREFIX: a preprocessed prefix) with:"
        )
        for command in finetune_commands(args.output):
            print(f"  {command}")
        if args.verify:
            diff = max_logit_difference(ckpt, args.input)
            print(describe(diff))
            return 0 if diff <= TOLERANCE else 1
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return e.exit_code
    return 0


if __name__ == "__main__":
    sys.exit(main())
