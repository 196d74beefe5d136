"""Tiny models for the tests: randomly initialised, then (mostly) trained briefly on a
copy-with-edits task so that drafts are sometimes right and sometimes wrong and every branch
of the accept rules is taken. Built once per test session, in float64 (no near-ties)."""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from hypothesis import strategies as st

from seq2seq_models.config import ModelConfig
from seq2seq_models.transformer import Seq2SeqTransformer

VOCAB = 16
FIRST_WORD = 5  # ids below are specials
MAX_LEN = 80


@dataclass(frozen=True)
class Trio:
    verifier: Seq2SeqTransformer
    nar_drafter: Seq2SeqTransformer
    ar_drafter: Seq2SeqTransformer
    label: str

    def drafter_models(self) -> dict[str, Seq2SeqTransformer]:
        return {"nar_drafter": self.nar_drafter, "ar_drafter": self.ar_drafter}


def config(d_model: int = 16, layers: int = 1, ffn: int = 32) -> ModelConfig:
    return ModelConfig(
        vocab_size=VOCAB, d_model=d_model, n_heads=2, encoder_layers=layers, decoder_layers=layers,
        ffn_dim=ffn, max_len=MAX_LEN, dropout=0.0,
    )


@functools.cache
def model_pool() -> tuple[Trio, ...]:
    """Four trios: well trained, lightly trained, barely trained, untrained."""
    return tuple(_trio(seed, steps) for seed, steps in ((1, 300), (2, 120), (3, 30), (4, 0)))


def edit(source: list[int]) -> list[int]:
    """The 'correction' the tiny models learn: drop a token 7 that follows another 7, and
    rewrite 9 as 10 — mostly a copy, like GEC."""
    out = []
    for i, t in enumerate(source):
        if t == 7 and i > 0 and source[i - 1] == 7:
            continue
        out.append(10 if t == 9 else t)
    return out


def random_source(gen: torch.Generator, length: int) -> list[int]:
    return torch.randint(FIRST_WORD, VOCAB, (length,), generator=gen).tolist()


def sources() -> st.SearchStrategy[list[int]]:
    """Hypothesis sources of length 1..64 over the zoo's words, half of them a short pattern
    repeated, so that many n-grams occur more than once (IAD's unique-match rule meets both)."""
    words = st.integers(FIRST_WORD, VOCAB - 1)
    return st.one_of(
        st.lists(words, min_size=1, max_size=64),
        st.builds(lambda pattern, times: (pattern * times)[:64], st.lists(words, min_size=1, max_size=6),
                  st.integers(1, 20)),
    )


def _trio(seed: int, steps: int) -> Trio:
    torch.manual_seed(seed)
    verifier = Seq2SeqTransformer(config(d_model=24, layers=2, ffn=48))
    nar = Seq2SeqTransformer(config())
    ar = Seq2SeqTransformer(config())
    gen = torch.Generator().manual_seed(seed)
    if steps:
        _train(verifier, gen, steps, nar_block=0)
        _train(nar, gen, steps, nar_block=4)
        _train(ar, gen, steps // 2, nar_block=0)
    return Trio(*(m.double().eval() for m in (verifier, nar, ar)), label=f"seed{seed}-steps{steps}")


def _batch(gen: torch.Generator, size: int) -> tuple[list[list[int]], list[list[int]]]:
    sources, targets = [], []
    for _ in range(size):
        n = int(torch.randint(1, 25, (1,), generator=gen))
        src = random_source(gen, n)
        sources.append(src)
        targets.append(edit(src))
    return sources, targets


def _pad(rows: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(r) for r in rows)
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, : len(r)] = torch.tensor(r)
    mask = torch.arange(width)[None, :] < torch.tensor([len(r) for r in rows])[:, None]
    return ids, mask


def _train(model: Seq2SeqTransformer, gen: torch.Generator, steps: int, nar_block: int) -> None:
    cfg = model.config
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    model.train()
    for _ in range(steps):
        sources, targets = _batch(gen, 32)
        src, src_mask = _pad([[*s, cfg.eos_id] for s in sources])
        if nar_block:
            dec_in, labels, self_mask = _nar_rows(targets, nar_block, cfg, gen)
        else:
            full = [[cfg.bos_id, *t, cfg.eos_id] for t in targets]
            ids, mask = _pad(full)
            dec_in, labels = ids[:, :-1], ids[:, 1:].masked_fill(~mask[:, 1:], -100)
            self_mask = None
        logits = model(src, src_mask, dec_in, self_mask)
        loss = F.cross_entropy(logits.reshape(-1, cfg.vocab_size), labels.reshape(-1), ignore_index=-100)
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.eval()


def _nar_rows(targets, k, cfg, gen):
    """NAR drafter rows: BOS + random prefix (causal) + k masks (bidirectional) -> next k tokens."""
    rows, labels = [], []
    for t in targets:
        full = [*t, cfg.eos_id]
        p = int(torch.randint(0, len(full), (1,), generator=gen))
        rows.append([cfg.bos_id, *full[:p]])
        block = full[p : p + k]
        labels.append(block + [-100] * (k - len(block)))
    width = max(len(r) for r in rows) + k
    dec_in = torch.full((len(rows), width), cfg.pad_id, dtype=torch.long)
    lab = torch.full((len(rows), width), -100, dtype=torch.long)
    self_mask = torch.zeros(len(rows), width, width, dtype=torch.bool)
    for i, (r, lbl) in enumerate(zip(rows, labels, strict=True)):
        n = len(r)
        dec_in[i, :n] = torch.tensor(r)
        dec_in[i, n : n + k] = cfg.mask_id
        lab[i, n : n + k] = torch.tensor(lbl)
        self_mask[i, :n, :n] = torch.ones(n, n, dtype=torch.bool).tril()
        self_mask[i, n : n + k, : n + k] = True
        self_mask[i, n + k :, 0] = True  # padding rows attend somewhere (no NaN)
    return dec_in, lab, self_mask
