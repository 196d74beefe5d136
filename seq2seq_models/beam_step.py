"""One step of beam search over a decoder batch, written once for the AR drafter's beam drafts
(`drafting.beam_draft`, one source) and the offline batched search (`batched_beam`, many sources).

A beam that has emitted EOS is finished: it continues only with a zero-cost PAD, so its score stays
frozen and finished and live hypotheses are ranked together. Ties go to the lower flat index
(parent-major, then token id), so a search is reproducible and does not depend on its batch.
"""

from __future__ import annotations

import torch

from kernels.cpu import topk_lowest_id_first


def expand_beams(
    scores: torch.Tensor, logp: torch.Tensor, finished: torch.Tensor, width: int, pad_id: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The best `width` continuations of each source's beams.

    scores [N, W] (cumulative log-probs), logp [N, W, V] (next-token log-probs; modified in place),
    finished [N, W] -> (scores [N, width], parent beam [N, width], token [N, width]).
    """
    vocab = logp.shape[-1]
    logp[finished] = float("-inf")
    logp[..., pad_id] = torch.where(finished, 0.0, logp[..., pad_id])
    candidates = (scores[:, :, None] + logp).reshape(scores.shape[0], -1)
    top, flat = topk_lowest_id_first(candidates, min(width, candidates.shape[-1]))
    return top, flat // vocab, flat % vocab
