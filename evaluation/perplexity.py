"""Verifier perplexity of decoded outputs: how likely the verifier itself finds them (teacher-forced)."""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F

from seq2seq_models.transformer import Seq2SeqTransformer


def output_nll(model: Seq2SeqTransformer, source_ids: list[int], output_ids: list[int], with_eos: bool = True) -> float:
    """Summed negative log-likelihood of `output_ids` (+ EOS when `with_eos`) given the source,
    in one full forward pass; the source is fed as the sessions feed it (with EOS appended)."""
    cfg = model.config
    targets = [*output_ids, cfg.eos_id] if with_eos else list(output_ids)
    if not targets:
        return 0.0
    src = torch.tensor([[*source_ids, cfg.eos_id]])
    tgt = torch.tensor([[cfg.bos_id, *targets[:-1]]])
    with torch.no_grad():
        logits = model(src, torch.ones_like(src, dtype=torch.bool), tgt)
        logp = F.log_softmax(logits[0].float(), dim=-1)
    return -float(logp[torch.arange(len(targets)), torch.tensor(targets)].sum())


def perplexity(
    model: Seq2SeqTransformer,
    sources: Sequence[list[int]],
    outputs: Sequence[list[int]],
    with_eos: Sequence[bool] | None = None,
) -> float:
    """exp(mean per-token NLL) over every scored token of every output (a corpus-level mean, so
    long outputs weigh by their length). `with_eos[i]` says whether output i ended with EOS; an
    output cut at max_new_tokens has no EOS to score."""
    flags = [True] * len(outputs) if with_eos is None else list(with_eos)
    total, tokens = 0.0, 0
    for src, out, eos in zip(sources, outputs, flags, strict=True):
        total += output_nll(model, src, out, eos)
        tokens += len(out) + int(eos)
    return math.exp(total / tokens) if tokens else float("nan")
