"""Pretrain GPT: names the model, the data and the loss, and hands them to the shared loop.

torchrun --standalone --nproc-per-node 2 pretrain_gpt.py --config configs/gpt_tiny.yaml
python pretrain_gpt.py --config configs/gpt_tiny.yaml training.train_iters=20   # one process
"""

from __future__ import annotations

import sys

from torch import Tensor, nn

from megatron.config.schema import Config
from megatron.data.gpt_dataset import build_gpt_datasets
from megatron.data.tokenizers.factory import Tokenizer
from megatron.inference.downstream import downstream_tasks
from megatron.training.pretrain import main
from megatron.training.reduction import LossSums


def datasets_provider(cfg: Config, tokenizer: Tokenizer, num_samples: tuple[int, int, int]):
    d = cfg.data
    return build_gpt_datasets(
        d.paths,
        d.split,
        num_samples,
        cfg.model.seq_length,
        cfg.training.seed,
        d.cache_dir,
        tokenizer.eod,
        reset_position_ids=d.reset_position_ids,
        reset_attention_mask=d.reset_attention_mask,
        eod_mask_loss=d.eod_mask_loss,
    )


def forward_step(model: nn.Module, batch: dict[str, Tensor]) -> LossSums | Tensor:
    """The per-token loss summed over the tokens the loss mask keeps, and their count over the
    whole samples (``loss_tokens``: with context parallelism this rank holds a share of them);
    on a pipeline stage whose output goes on to the next, that output."""
    output = model(
        batch["tokens"],
        batch["position_ids"],
        batch.get("document_ids"),  # present with data.reset_attention_mask
        labels=batch["labels"],
    )  # [b, s] fp32 losses, or the activation for the next stage
    if not model.computes_loss:
        return output
    losses = output * batch["loss_mask"]
    if "source" in batch:  # a blend's sample: the per-sample sums split the loss by source
        return {"lm loss": (losses.sum(), batch["loss_tokens"], losses.sum(-1))}
    return {"lm loss": (losses.sum(), batch["loss_tokens"])}


if __name__ == "__main__":
    sys.exit(
        main(
            sys.argv[1:],
            "Pretrain a tensor-parallel GPT.",
            datasets_provider,
            forward_step,
            model_type="gpt",
            downstream=downstream_tasks,
        )
    )
