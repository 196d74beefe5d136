"""Tensor-level drafting from a single-row decoder cache: NAR block, AR beam search, AR sampling.

Each function leaves the cache exactly as it found it (it rolls back what it appended), so a
drafter session can keep one cache over the committed prefix.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from core.sampling import SamplingParams, sample_index, warp
from kernels.cpu import topk_lowest_id_first
from seq2seq_models.beam_step import expand_beams
from seq2seq_models.transformer import DecoderCache, Seq2SeqTransformer


@torch.no_grad()
def nar_block_draft(model: Seq2SeqTransformer, cache: DecoderCache, k: int) -> list[int]:
    """k tokens in one pass: `k x [MASK]` attends to the whole prefix and the whole block."""
    start = cache.lengths.clone()
    masks = torch.full((1, k), model.config.mask_id, dtype=torch.long, device=start.device)
    hidden = model.extend(cache, masks, bidirectional=True)
    model.truncate(cache, start)
    return model.logits(hidden[0]).argmax(-1).tolist()


@torch.no_grad()
def beam_draft(
    model: Seq2SeqTransformer, cache: DecoderCache, gamma: int, num_beams: int
) -> tuple[list[int], list[float]]:
    """Beam search of up to `gamma` tokens; returns the best beam and log q(x_1..x_i) for every i.

    A beam that emits EOS is finished: it keeps its score and stops growing (it continues with
    a zero-cost padding candidate), so the best draft may be shorter than gamma.
    """
    cfg = model.config
    width = min(num_beams, cfg.vocab_size)
    first = F.log_softmax(model.logits(model.last_hidden(cache)).double(), dim=-1)[0]
    scores, tokens = _top(first, width)
    seqs = tokens[:, None]
    cums = scores[:, None]
    finished = tokens == cfg.eos_id
    if gamma > 1 and not bool(finished.all()):
        beam_cache = cache.select(torch.zeros(width, dtype=torch.long, device=tokens.device))
        for _ in range(gamma - 1):
            if bool(finished.all()):
                break
            hidden = model.extend(beam_cache, seqs[:, -1:])
            logq = F.log_softmax(model.logits(hidden[:, 0]).double(), dim=-1)
            expanded = expand_beams(scores[None], logq[None], finished[None], width, cfg.pad_id)
            cand_scores, parent, token = (t[0] for t in expanded)  # one source
            beam_cache = beam_cache.select(parent)
            seqs = torch.cat([seqs[parent], token[:, None]], dim=1)
            cums = torch.cat([cums[parent], cand_scores[:, None]], dim=1)
            finished = finished[parent] | (token == cfg.eos_id)
            scores = cand_scores
    best = int(torch.argmax(scores))
    ids = seqs[best].tolist()
    if cfg.eos_id in ids:
        ids = ids[: ids.index(cfg.eos_id) + 1]
    return ids, cums[best, : len(ids)].tolist()


@torch.no_grad()
def sample_draft(
    model: Seq2SeqTransformer,
    cache: DecoderCache,
    gamma: int,
    params: SamplingParams,
    rng: np.random.Generator,
) -> tuple[list[int], list[np.ndarray]]:
    """Sample up to `gamma` tokens from the warped q; returns them and the q each came from."""
    start = cache.lengths.clone()
    hidden = model.last_hidden(cache)[0]
    ids: list[int] = []
    rows: list[np.ndarray] = []
    for i in range(gamma):
        logq = F.log_softmax(model.logits(hidden).double(), dim=-1).cpu().numpy()
        q = warp(logq, params)
        token = sample_index(q, rng)
        ids.append(token)
        rows.append(q)
        if token == model.config.eos_id or i == gamma - 1:
            break
        hidden = model.extend(cache, torch.tensor([[token]], device=start.device))[0, 0]
    model.truncate(cache, start)
    return ids, rows


def _top(values: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    # Ties go to the lower index (a stable descending sort's order), so drafts are reproducible;
    # a top-k with a tie check, not a full sort of beams x vocab (which was half of a beam draft).
    vals, idx = topk_lowest_id_first(values[None], min(k, values.shape[0]))
    return vals[0], idx[0]
