"""Losses: teacher-forced AR cross-entropy, and glancing (GLAT) training for the NAR block drafter."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from seq2seq_models.transformer import Seq2SeqTransformer
from training.batching import IGNORE


def token_loss(logits: Tensor, labels: Tensor, label_smoothing: float = 0.0) -> tuple[Tensor, int, int]:
    """Mean cross-entropy over labelled positions; also the number of labelled and correct ones."""
    flat = logits.reshape(-1, logits.shape[-1])
    target = labels.reshape(-1)
    loss = F.cross_entropy(flat.float(), target, ignore_index=IGNORE, label_smoothing=label_smoothing)
    labelled = target != IGNORE
    correct = int(((flat.argmax(-1) == target) & labelled).sum())
    return loss, int(labelled.sum()), correct


def glancing_inputs(
    model: Seq2SeqTransformer,
    src: Tensor,
    src_mask: Tensor,
    dec_in: Tensor,
    labels: Tensor,
    self_mask: Tensor,
    ratio: float,
    generator: torch.Generator,
) -> tuple[Tensor, Tensor]:
    """GLAT (Qian et al. 2021): predict the block once without gradients, then reveal
    `floor(ratio * errors)` gold tokens of each row's block in place of their MASKs and train on
    the positions that stay masked. Rows the model already gets right reveal nothing, so easy
    blocks are learnt fully parallel while hard ones get a hint of their neighbours."""
    with torch.no_grad():
        pred = model(src, src_mask, dec_in, self_mask).argmax(-1)
    labelled = labels != IGNORE
    errors = ((pred != labels) & labelled).sum(1)
    reveal_n = (errors.float() * ratio).floor().long()
    # Random ranks among the labelled positions of each row (unlabelled ones sort last).
    noise = torch.rand(labels.shape, generator=generator).to(labels.device)
    noise = noise.masked_fill(~labelled, 2.0)
    rank = noise.argsort(1).argsort(1)
    reveal = (rank < reveal_n[:, None]) & labelled
    return torch.where(reveal, labels, dec_in), labels.masked_fill(reveal, IGNORE)
