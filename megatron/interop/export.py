"""Export one of our checkpoints (any TP size) as a HF model directory.

    HF_DIR/config.json          GPT2LMHeadModel (learned positions); LlamaForCausalLM,
                                MistralForCausalLM (a Mistral import), Qwen2ForCausalLM (QKV
                                bias) or Qwen3ForCausalLM (QK norms) for a RoPE GPT; BERT:
                                BertForPreTraining or MegatronBertForPreTraining (...ForMaskedLM
                                without a binary head); ``architectures.for_checkpoint`` chooses
    HF_DIR/model.safetensors    the weights, merged over TP ranks, vocabulary padding cut off,
                                tied copies left out (from_pretrained ties them again)
    HF_DIR/<tokenizer files>    see ``hf_tokenizer``

No process group is needed. The checkpoint's checksums are verified first; the directory is
written beside HF_DIR and renamed onto it last.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import asdict

from megatron.checkpoint import find_checkpoint
from megatron.checkpoint.format import META, verify_checkpoint
from megatron.config.dtypes import DTYPES
from megatron.config.load import config_from_dict
from megatron.data.tokenizers.factory import build_tokenizer
from megatron.errors import ConfigError
from megatron.inference.loading import model_type
from megatron.interop.architectures import for_checkpoint
from megatron.interop.hf_files import HF_DTYPE_NAMES, write_config, write_weights
from megatron.interop.hf_tokenizer import export_tokenizer
from megatron.interop.ours import read_full
from megatron.interop.staging import check_output, staged


def export_hf(
    load_dir: str,
    output: str,
    iteration: int | None = None,
    dtype: str = "fp32",
    overrides: Sequence[str] = (),
) -> str:
    """Write the checkpoint of ``load_dir`` (its newest, or ``iteration``) as a HF model
    directory at ``output``, weights in ``dtype`` (fp32, bf16, fp16); returns ``output``.

    ``load_dir`` is a save directory (a run's, or a tools/checkpoint_util.py output) or one
    ``iter_*`` directory; ``overrides``
    (``tokenizer.key=value``) replace the saved tokenizer settings, e.g. files that moved.
    Raises ConfigError (one line) for a missing or damaged checkpoint, a model no HF class we
    export holds exactly (post-LN GPT, learned positions with RMSNorm, ...), or an ``output``
    that already holds files.
    """
    if dtype not in DTYPES:
        raise ConfigError(f"--dtype {dtype}: use one of {', '.join(DTYPES)}")
    check_output(output)
    ckpt, meta = find_checkpoint(load_dir, iteration)
    problem = verify_checkpoint(ckpt)
    if problem:
        raise ConfigError(f"--load: {problem}; restore it, or export another with --iteration")
    cfg = config_from_dict(meta["config"], os.path.join(ckpt, META), overrides)
    imported = meta.get("imported_from", {}).get("architecture")
    architecture = for_checkpoint(model_type(meta), cfg, imported)
    tokenizer = build_tokenizer(**asdict(cfg.tokenizer))
    vocab = meta["vocab_size"]
    if tokenizer.vocab_size != vocab:
        raise ConfigError(
            f"{ckpt} was saved for {vocab} tokens, tokenizer.{cfg.tokenizer.type} has "
            f"{tokenizer.vocab_size}; point the tokenizer flags at the files it was trained with"
        )
    config = architecture.hf_config(cfg, vocab, tokenizer)
    config["dtype"] = HF_DTYPE_NAMES[dtype]
    tensors = architecture.export_tensors(cfg, read_full(ckpt, meta))
    tensors = {k: t.to(DTYPES[dtype]) for k, t in tensors.items()}
    with staged(output) as tmp:
        write_config(tmp, config)
        write_weights(tmp, tensors)
        export_tokenizer(cfg.tokenizer, tokenizer, tmp, cfg.model.max_position_embeddings)
    return output
