"""``--verify``: our model (TP=1, this process, fp32) against transformers' on the same weights.

Both run on fixed token ids; BERT also gets token types and a padding mask, and its
sentence-order logits are compared too. Only the real vocabulary's logit columns are compared
(our padding columns have no HF counterpart). fp32 models that compute the same function agree
to ~1e-6 here (summation order, erf vs tanh-form GeLU rounding); a mapping mistake moves logits
by ~1e-1, hence the 1e-4 limit.
"""

from __future__ import annotations

import sys

import torch
from torch import Tensor

from megatron.checkpoint.format import read_meta
from megatron.config.dtypes import DTYPES
from megatron.config.load import config_from_dict
from megatron.errors import ConfigError
from megatron.inference.loading import model_type
from megatron.interop.hf_files import read_config
from megatron.interop.ours import load_serial

TOLERANCE = 1e-4


def check_transformers() -> None:
    """ConfigError (one line: how to install it) unless transformers imports. The tools ask
    first, so that a refused --verify has written nothing and the rerun finds no output."""
    try:
        import transformers  # noqa: F401 (only --verify needs it)
    except ImportError as e:
        raise ConfigError(
            f"--verify needs transformers ({e}): {sys.executable} -m pip install transformers"
        ) from None


def describe(diff: float) -> str:
    """The one line --verify prints."""
    verdict = "ok" if diff <= TOLERANCE else "FAILED"
    return f"verify: max |logit difference| ours vs HF {diff:.3g} (limit {TOLERANCE:g}): {verdict}"


def sample_inputs(vocab_size: int, seq_length: int, token_types: bool) -> dict[str, Tensor]:
    """Two sequences of fixed random ids [2, s]; the second's last quarter is padding, and with
    ``token_types`` the second half of each is segment 1."""
    s = min(seq_length, 16)
    ids = torch.randint(0, vocab_size, (2, s), generator=torch.Generator().manual_seed(0))
    types = torch.zeros_like(ids)
    if token_types:
        types[:, s // 2 :] = 1
    mask = torch.ones_like(ids)
    mask[1, s - s // 4 :] = 0
    return {"ids": ids, "types": types, "mask": mask}


@torch.no_grad()
def max_logit_difference(ckpt_dir: str, hf_dir: str, dtype: str = "fp32") -> float:
    """Largest |ours - HF| over the logits of the sample inputs, both models in fp32.

    ``ckpt_dir``: one ``iter_*`` directory; ``dtype``: the export's weight dtype, through which
    our weights are rounded first so both models hold the same numbers.
    """
    import transformers  # only --verify needs it

    transformers.utils.logging.disable_progress_bar()  # keep the tool's output to its lines

    meta = read_meta(ckpt_dir)
    cfg = config_from_dict(meta["config"], ckpt_dir)
    ours = load_serial(ckpt_dir, meta, cast=None if dtype == "fp32" else DTYPES[dtype])
    architecture = read_config(hf_dir)["architectures"][0]
    hf = getattr(transformers, architecture).from_pretrained(hf_dir, dtype=torch.float32).eval()
    vocab = meta["vocab_size"]
    bert = model_type(meta) == "bert"
    x = sample_inputs(
        vocab, cfg.model.max_position_embeddings, bert and cfg.bert.num_tokentypes > 1
    )
    if not bert:
        return (ours(x["ids"])[..., :vocab] - hf(input_ids=x["ids"]).logits).abs().max().item()
    lm, binary = ours(x["ids"], x["types"], x["mask"])  # [b, s, padded], [b, 2] or None
    out = hf(input_ids=x["ids"], token_type_ids=x["types"], attention_mask=x["mask"])
    hf_lm = out.prediction_logits if binary is not None else out.logits
    diff = (lm[..., :vocab] - hf_lm).abs().max().item()
    if binary is not None:
        diff = max(diff, (binary - out.seq_relationship_logits).abs().max().item())
    return diff
