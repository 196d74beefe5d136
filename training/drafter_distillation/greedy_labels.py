"""The verifier's greedy outputs for many sources at once: the targets `specdec distill` trains on.

Greedy is what the verifier's AR mode commits, and what GAD's drafts are checked against: after the
output's forced first tokens (a many-to-many model's target language), the argmax over the whole
vocabulary at every step (ties to the lowest id) until EOS. Sources are batched by length; a row
that has emitted EOS rides along, ignored, until its batch ends.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from seq2seq_models.transformer import Seq2SeqTransformer


@torch.no_grad()
def greedy_outputs(
    model: Seq2SeqTransformer,
    sources: Sequence[Sequence[int]],
    max_tokens: int,
    first: Sequence[int] = (),
    batch_tokens: int = 4096,
) -> list[list[int]]:
    """Each source's greedy output (the `first` tokens included, EOS not), in order, as the AR mode
    with `max_new_tokens=max_tokens` gives it: an output without EOS by then is cut there (kept,
    as the batched beam search of `training.beam_relabel` keeps its cut outputs). Sources are token ids
    without EOS (appended here); a batch holds about `batch_tokens` source tokens."""
    order = sorted(range(len(sources)), key=lambda i: len(sources[i]))
    outputs: list[list[int]] = [[] for _ in sources]
    chunk: list[int] = []
    for i in [*order, None]:
        if i is not None and (not chunk or (len(chunk) + 1) * (len(sources[i]) + 1) <= batch_tokens):
            chunk.append(i)
            continue
        for j, out in zip(chunk, _greedy_batch(model, [sources[c] for c in chunk], max_tokens, first), strict=True):
            outputs[j] = out
        chunk = [] if i is None else [i]
    return outputs


def _greedy_batch(
    model: Seq2SeqTransformer, sources: list[Sequence[int]], max_tokens: int, first: Sequence[int]
) -> list[list[int]]:
    cfg = model.config
    device = model.embed.weight.device
    n = len(sources)
    width = max(len(s) for s in sources) + 1
    src = torch.full((n, width), cfg.pad_id, dtype=torch.long, device=device)
    for r, s in enumerate(sources):
        src[r, : len(s) + 1] = torch.tensor([*s, cfg.eos_id], dtype=torch.long)
    lengths = torch.tensor([len(s) + 1 for s in sources], device=device)
    src_mask = torch.arange(width, device=device)[None, :] < lengths[:, None]
    cache = model.start(src, src_mask, capacity=min(cfg.max_len, max_tokens + 1))
    start = torch.tensor([[cfg.bos_id, *first]], dtype=torch.long, device=device).expand(n, -1)
    hidden = model.extend(cache, start)[:, -1]
    generated = torch.empty(n, 0, dtype=torch.long, device=device)
    finished = torch.zeros(n, dtype=torch.bool, device=device)  # rows that have emitted EOS
    while len(first) + generated.shape[1] < max_tokens:
        token = model.logits(hidden).argmax(-1)
        generated = torch.cat([generated, token[:, None]], 1)
        finished |= token == cfg.eos_id
        if bool(finished.all()):
            break
        hidden = model.extend(cache, token[:, None])[:, 0]
    return [[*first, *(row[: row.index(cfg.eos_id)] if cfg.eos_id in row else row)] for row in generated.tolist()]
