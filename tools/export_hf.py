"""Export a checkpoint (any TP size) as a Hugging Face model directory.

    python tools/export_hf.py --load runs/gpt/checkpoints --output hf/gpt [--verify]
    python tools/export_hf.py --load runs/bert/checkpoints --iteration 300 --output hf/bert

A GPT with learned positions becomes GPT2LMHeadModel (pre-LN only); a RoPE + RMSNorm + SwiGLU
GPT becomes Qwen3ForCausalLM (QK norms), Qwen2ForCausalLM (QKV bias) or LlamaForCausalLM
(MistralForCausalLM for a Mistral import), with experts Qwen2MoeForCausalLM (a gated shared
expert), Qwen3MoeForCausalLM (QK norms) or MixtralForCausalLM; BERT becomes
MegatronBertForPreTraining (pre-LN) or BertForPreTraining (post-LN), ...ForMaskedLM without a
binary head. A model none of them holds
exactly is refused in one line naming its model.* key. The output loads with
``AutoModelForCausalLM`` / ``AutoModelForPreTraining`` and, where expressible, ``AutoTokenizer``.
``--verify`` runs both models on fixed ids and fails when their logits differ by over 1e-4.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron.checkpoint import find_checkpoint  # noqa: E402
from megatron.config.dtypes import DTYPES  # noqa: E402
from megatron.errors import ConfigError  # noqa: E402
from megatron.inference.loading import add_tokenizer_flags, tokenizer_overrides  # noqa: E402
from megatron.interop.export import export_hf  # noqa: E402
from megatron.interop.hf_tokenizer import tokenizer_note  # noqa: E402
from megatron.interop.verify import (  # noqa: E402
    TOLERANCE,
    check_transformers,
    describe,
    max_logit_difference,
)


def build_parser() -> argparse.ArgumentParser:
    """The command-line flags."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument(
        "--load", required=True, help="a save directory, one iter_* directory, or a merged one"
    )
    p.add_argument("--iteration", type=int, help="export this checkpoint, not the newest")
    p.add_argument("--output", required=True, help="the HF model directory to create")
    p.add_argument("--dtype", choices=list(DTYPES), default="fp32", help="weights' dtype")
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
        out = export_hf(
            args.load, args.output, args.iteration, args.dtype, tokenizer_overrides(args)
        )
        print(f"wrote {out}")
        note = tokenizer_note(out)
        if note:
            print(note)
        if args.verify:
            ckpt, _ = find_checkpoint(args.load, args.iteration)
            diff = max_logit_difference(ckpt, out, args.dtype)
            print(describe(diff))
            return 0 if diff <= TOLERANCE else 1
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return e.exit_code
    return 0


if __name__ == "__main__":
    sys.exit(main())
