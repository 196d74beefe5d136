"""Token-based batches by length buckets, and padded tensors for the three training layouts."""

from __future__ import annotations

import random
from collections.abc import Sequence

import torch

from seq2seq_models.config import ModelConfig
from training.data import IdPair

IGNORE = -100  # label value that cross_entropy skips


def token_batches(pairs: Sequence[IdPair], max_tokens: int, seed: int, epoch: int, extra: int = 0) -> list[list[int]]:
    """Index batches whose padded size (rows x longest side + `extra`) stays within `max_tokens`.

    Pairs are sorted by length with a little seeded noise (so batches differ between epochs),
    then the batch order is shuffled. Deterministic in (seed, epoch): a resumed run rebuilds the
    same epoch and skips the batches it already did.
    """
    rng = random.Random(seed * 1_000_003 + epoch)
    size = [max(len(p.source), len(p.target)) + 1 + extra for p in pairs]
    order = sorted(range(len(pairs)), key=lambda i: (size[i] + rng.random() * 2, i))
    batches: list[list[int]] = []
    current: list[int] = []
    longest = 0
    for i in order:
        new_longest = max(longest, size[i])
        if current and new_longest * (len(current) + 1) > max_tokens:
            batches.append(current)
            current, new_longest = [], size[i]
        current.append(i)
        longest = new_longest
    if current:
        batches.append(current)
    rng.shuffle(batches)
    return batches


def pad(rows: Sequence[Sequence[int]], value: int) -> torch.Tensor:
    width = max(len(r) for r in rows)
    out = torch.full((len(rows), width), value, dtype=torch.long)
    for i, r in enumerate(rows):
        out[i, : len(r)] = torch.tensor(r, dtype=torch.long)
    return out


def source_tensors(pairs: Sequence[IdPair], cfg: ModelConfig) -> tuple[torch.Tensor, torch.Tensor]:
    src = pad([[*p.source, cfg.eos_id] for p in pairs], cfg.pad_id)
    return src, src != cfg.pad_id


def ar_tensors(pairs: Sequence[IdPair], cfg: ModelConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """Teacher forcing: decoder input BOS + target, labels target + EOS (padding ignored)."""
    dec_in = pad([[cfg.bos_id, *p.target] for p in pairs], cfg.pad_id)
    labels = pad([[*p.target, cfg.eos_id] for p in pairs], IGNORE)
    return dec_in, labels


def nar_tensors(
    pairs: Sequence[IdPair], cfg: ModelConfig, k: int, generator: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """NAR block rows, the layout `extend(..., bidirectional=True)` sees at inference:
    BOS + a random prefix of the target (causal), then k MASK tokens that attend to the whole
    prefix and the whole block; labels are the next k target tokens (EOS included, ignored
    past it). Returns decoder input [B, T], labels [B, T], self-attention mask [B, T, T]."""
    prefixes, blocks = [], []
    for p in pairs:
        full = [*p.target, cfg.eos_id]
        cut = int(torch.randint(0, len(full), (1,), generator=generator))
        prefixes.append([cfg.bos_id, *full[:cut]])
        blocks.append(full[cut : cut + k])
    width = max(len(r) for r in prefixes) + k
    b = len(pairs)
    dec_in = torch.full((b, width), cfg.pad_id, dtype=torch.long)
    labels = torch.full((b, width), IGNORE, dtype=torch.long)
    mask = torch.zeros(b, width, width, dtype=torch.bool)
    for i, (prefix, block) in enumerate(zip(prefixes, blocks, strict=True)):
        n = len(prefix)
        dec_in[i, :n] = torch.tensor(prefix)
        dec_in[i, n : n + k] = cfg.mask_id
        labels[i, n : n + len(block)] = torch.tensor(block)
        mask[i, :n, :n] = torch.ones(n, n, dtype=torch.bool).tril()
        mask[i, n : n + k, : n + k] = True
        mask[i, n + k :, 0] = True  # padding positions attend somewhere (no NaN); never scored
    return dec_in, labels, mask
