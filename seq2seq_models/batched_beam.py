"""Batched beam search over many sources at once, for offline decoding: the sequence-level
distillation that re-labels the drafters' training data (`training.beam_relabel`). Beam mode in the
services and the benchmarks is the gateway's (`decoding.policies.beam`), not this one.

Every source gets `num_beams` rows in one DecoderCache; each step extends all live rows by one
token in a single forward. A beam that has emitted EOS is finished: it keeps its score and is
continued with a zero-cost PAD, so beams never mix finished and unfinished hypotheses in one
row. A source leaves the batch as soon as all its beams are finished (or it hits its length
limit), which keeps the batch dense when lengths differ. Ranking during the search uses the sum
of log-probs; the final pick among a source's beams is length-normalised
(score / length ** length_penalty).

Sources are independent: a source's result does not depend on which other sources share its
batch (up to floating-point summation order, which tests pin down in float64). PAD, BOS and
MASK are never generated.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from seq2seq_models.beam_step import expand_beams
from seq2seq_models.transformer import Seq2SeqTransformer


@dataclass(frozen=True)
class BeamResult:
    tokens: list[int]  # best hypothesis without BOS and without EOS
    score: float  # its length-normalised log-probability
    finished: bool  # False when it was cut by the length limit


@torch.no_grad()
def batched_beam_search(
    model: Seq2SeqTransformer,
    sources: Sequence[Sequence[int]],
    num_beams: int = 5,
    max_new_tokens: int | None = None,
    length_penalty: float = 1.0,
    max_len_a: float = 1.5,
    max_len_b: int = 10,
) -> list[BeamResult]:
    """Beam-search every source (token ids without EOS; EOS is appended here).

    A source of n tokens may produce up to `min(max_new_tokens, a * n + b)` tokens including
    EOS, capped by the model's max_len. Returns one result per source, in order.
    """
    if not sources:
        return []
    cfg = model.config
    device = model.embed.weight.device
    width = min(num_beams, cfg.vocab_size)
    n_src = len(sources)
    limits = [_limit(len(s), cfg.max_len, max_new_tokens, max_len_a, max_len_b) for s in sources]

    src, src_mask = _pad_sources([[*s, cfg.eos_id] for s in sources], cfg.pad_id, device)
    if src.shape[1] > cfg.max_len:
        raise ValueError(f"source length {src.shape[1]} exceeds the model's max_len {cfg.max_len}")
    capacity = max(limits) + 1
    cache = model.start(src, src_mask, capacity=capacity)
    cache = cache.select(torch.arange(n_src, device=device).repeat_interleave(width))

    # Per live source: beam scores [N, W], sequences [N, W, t], finished flags [N, W].
    live = torch.arange(n_src, device=device)  # original index of each live source
    scores = torch.full((n_src, width), float("-inf"), dtype=torch.float64, device=device)
    scores[:, 0] = 0.0  # only one beam is live at the start, so the first step has no duplicates
    seqs = torch.zeros(n_src, width, 0, dtype=torch.long, device=device)
    finished = torch.zeros(n_src, width, dtype=torch.bool, device=device)
    limit_t = torch.tensor(limits, dtype=torch.long, device=device)
    results: list[BeamResult | None] = [None] * n_src
    last = torch.full((n_src * width, 1), cfg.bos_id, dtype=torch.long, device=device)

    step = 0
    while live.numel():
        hidden = model.extend(cache, last)
        logp = F.log_softmax(model.logits(hidden[:, 0]).double(), dim=-1)
        n_live = live.numel()
        logp = logp.view(n_live, width, -1)
        # Forced EOS at a source's length limit: only EOS stays reachable.
        at_limit = (step + 1) >= limit_t[live]
        if bool(at_limit.any()):
            eos_col = logp[:, :, cfg.eos_id].clone()
            logp[at_limit] = float("-inf")
            logp[:, :, cfg.eos_id] = torch.where(at_limit[:, None], eos_col, logp[:, :, cfg.eos_id])
        # Specials that never occur inside a target are unreachable; PAD only continues a
        # finished beam, at zero cost, so its score stays frozen.
        logp[..., [cfg.pad_id, cfg.bos_id, cfg.mask_id]] = float("-inf")
        top_scores, parent, token = expand_beams(scores, logp, finished, width, cfg.pad_id)
        seqs = torch.cat([seqs.gather(1, parent[:, :, None].expand(-1, -1, seqs.shape[2])), token[:, :, None]], 2)
        finished = finished.gather(1, parent) | (token == cfg.eos_id)
        scores = top_scores
        step += 1

        done = finished.all(dim=1) | at_limit
        rows = (torch.arange(n_live, device=device)[:, None] * width + parent).view(-1)
        if bool(done.any()):
            for j in done.nonzero().view(-1).tolist():
                results[int(live[j])] = _best(seqs[j], scores[j], finished[j], cfg.eos_id, length_penalty)
            keep = (~done).nonzero().view(-1)
            live, scores, seqs, finished = live[keep], scores[keep], seqs[keep], finished[keep]
            token = token[keep]
            rows = rows.view(n_live, width)[keep].view(-1)
        if not live.numel():
            break
        cache = cache.select(rows)
        last = token.reshape(-1, 1)
    return [r for r in results if r is not None]


def beam_search_texts(
    model: Seq2SeqTransformer,
    sources: Sequence[Sequence[int]],
    batch_tokens: int = 4096,
    **kwargs,
) -> list[BeamResult]:
    """`batched_beam_search` over many sources in length-sorted chunks of about `batch_tokens`
    source tokens times beams, so padding stays small and memory bounded; results in input order."""
    order = sorted(range(len(sources)), key=lambda i: len(sources[i]))
    width = kwargs.get("num_beams", 5)
    results: list[BeamResult | None] = [None] * len(sources)
    chunk: list[int] = []
    for i in order:
        longest = len(sources[i]) + 1
        if chunk and (len(chunk) + 1) * longest * width > batch_tokens:
            for j, r in zip(chunk, batched_beam_search(model, [sources[c] for c in chunk], **kwargs), strict=True):
                results[j] = r
            chunk = []
        chunk.append(i)
    if chunk:
        for j, r in zip(chunk, batched_beam_search(model, [sources[c] for c in chunk], **kwargs), strict=True):
            results[j] = r
    return [r for r in results if r is not None]


def _limit(n: int, max_len: int, max_new_tokens: int | None, a: float, b: int) -> int:
    limit = int(a * n) + b
    if max_new_tokens is not None:
        limit = min(limit, max_new_tokens)
    return max(1, min(limit, max_len - 1))  # the decoder input is BOS + all but the last token


def _best(seqs: torch.Tensor, scores: torch.Tensor, finished: torch.Tensor, eos_id: int, alpha: float) -> BeamResult:
    best_norm, best = float("-inf"), None
    for w in range(seqs.shape[0]):
        ids = seqs[w].tolist()
        length = ids.index(eos_id) + 1 if eos_id in ids else len(ids)
        score = float(scores[w])
        norm = score / (length**alpha)
        if best is None or norm > best_norm:  # strict: ties keep the higher-ranked beam
            best_norm, best = norm, (ids[: length - 1] if eos_id in ids else ids[:length], bool(finished[w]))
    assert best is not None
    return BeamResult(tokens=best[0], score=best_norm, finished=best[1])


def _pad_sources(rows: list[list[int]], pad_id: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long, device=device)
    for i, r in enumerate(rows):
        ids[i, : len(r)] = torch.tensor(r, dtype=torch.long)
    lengths = torch.tensor([len(r) for r in rows], device=device)
    return ids, torch.arange(width, device=device)[None, :] < lengths[:, None]
