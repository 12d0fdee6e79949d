"""Pretrain BERT: names the model, the data and the loss, and hands them to the shared loop.

torchrun --standalone --nproc-per-node 2 pretrain_bert.py --config configs/bert_tiny.yaml
python pretrain_bert.py --config configs/bert_3.9b.yaml --dry-run --world-size 512
"""

from __future__ import annotations

import sys

import torch.nn.functional as F
from torch import Tensor, nn

from megatron.config.schema import Config
from megatron.data.bert_dataset import BertVocab, build_bert_datasets
from megatron.data.hdf5_dataset import split_shards
from megatron.data.tokenizers.factory import Tokenizer
from megatron.training.pretrain import main
from megatron.training.reduction import LossSums


def datasets_provider(cfg: Config, tokenizer: Tokenizer, num_samples: tuple[int, int, int]):
    if cfg.data.format == "hdf5":
        return split_shards(cfg.data.paths, cfg.data.split, cfg.model.seq_length, num_samples)
    d, b = cfg.data, cfg.bert
    return build_bert_datasets(
        d.paths,
        d.split,
        num_samples,
        cfg.model.seq_length,
        cfg.training.seed,
        d.cache_dir,
        BertVocab.from_tokenizer(tokenizer),
        masked_lm_prob=b.masked_lm_prob,
        short_seq_prob=b.short_seq_prob,
        max_ngram=b.max_ngram,
        binary_head=b.binary_head != "none",
    )


def forward_step(model: nn.Module, batch: dict[str, Tensor]) -> LossSums | Tensor:
    """The masked-LM loss summed over the masked tokens, and the binary head's cross entropy
    summed over the samples, each with its count over the whole samples (with context
    parallelism this rank holds a share of the tokens, and the [CLS] only on ring rank 0); on a
    pipeline stage whose output goes on to the next, that output."""
    lm, binary = model(
        batch["text"],
        batch["types"],
        batch["padding_mask"],
        labels=batch["labels"],
        masked_positions=batch["masked_positions"],  # a fixed width: no host sync for the head
    )  # [b, s] fp32, [b, 2]; or the activation for the next stage, None
    if not model.computes_loss:
        return lm
    mask = batch["loss_mask"]
    losses = {"lm loss": ((lm * mask).sum(), batch["loss_tokens"])}
    if binary is not None:
        labels = batch["is_random"]
        total = F.cross_entropy(binary.float(), labels, reduction="sum")
        if "holds_first_token" in batch:
            total = total * batch["holds_first_token"]
        losses[f"{model.binary_task} loss"] = (total, labels.numel())
    return losses


if __name__ == "__main__":
    sys.exit(
        main(
            sys.argv[1:],
            "Pretrain a tensor-parallel BERT.",
            datasets_provider,
            forward_step,
            model_type="bert",
        )
    )
