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
from megatron.errors import ConfigError
from megatron.models.bert import BertModel
from megatron.parallel.random import RNGTracker
from megatron.parallel.state import ParallelState
from megatron.training.pretrain import main


def model_provider(
    cfg: Config, vocab_size: int, padded_vocab_size: int, state: ParallelState, tracker: RNGTracker
) -> nn.Module:
    b = cfg.bert
    if 0 < b.num_tokentypes < 2 and b.binary_head != "none":
        raise ConfigError(
            f"bert.num_tokentypes={b.num_tokentypes}: sentence pairs have token types 0 and 1; "
            "use 2 (or 0 for no token-type embedding)"
        )
    return BertModel(
        cfg.model,
        vocab_size,
        padded_vocab_size,
        state,
        tracker,
        b.num_tokentypes,
        b.binary_head,
        cfg.parallel.sequence_parallel,
        cfg.parallel.virtual_pipeline_size or 1,  # this pipeline stage's model chunks
    )


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


def forward_step(model: nn.Module, batch: dict[str, Tensor]) -> tuple[Tensor, dict[str, Tensor]]:
    """Masked-LM loss (mean over masked tokens) plus the binary head's cross entropy; on a
    pipeline stage whose output goes on to the next, that output and no metrics."""
    lm, binary = model(
        batch["text"],
        batch["types"],
        batch["padding_mask"],
        labels=batch["labels"],
        masked_positions=batch["masked_positions"],  # a fixed width: no host sync for the head
    )  # [b, s] fp32, [b, 2]; or the activation for the next stage, None
    if not model.computes_loss:
        return lm, {}
    mask = batch["loss_mask"]
    lm_loss = (lm * mask).sum() / mask.sum()
    if binary is None:
        return lm_loss, {"lm loss": lm_loss.detach()}
    binary_loss = F.cross_entropy(binary.float(), batch["is_random"])
    metrics = {"lm loss": lm_loss.detach(), f"{model.binary_task} loss": binary_loss.detach()}
    return lm_loss + binary_loss, metrics


if __name__ == "__main__":
    sys.exit(
        main(
            sys.argv[1:],
            "Pretrain a tensor-parallel BERT.",
            model_provider,
            datasets_provider,
            forward_step,
            model_type="bert",
        )
    )
