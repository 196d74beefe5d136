"""Batched beam search: beam 1 is greedy, and batching does not change any source's result."""

from __future__ import annotations

import pytest
import torch

from seq2seq_models.batched_beam import batched_beam_search, beam_search_texts
from seq2seq_models.bundle import scramble_weights
from seq2seq_models.config import ModelConfig
from seq2seq_models.transformer import Seq2SeqTransformer

VOCAB = 24


@pytest.fixture(scope="module")
def model() -> Seq2SeqTransformer:
    cfg = ModelConfig(
        vocab_size=VOCAB, d_model=16, n_heads=2, encoder_layers=1, decoder_layers=2, ffn_dim=32, max_len=64, dropout=0.0
    )
    torch.manual_seed(0)
    m = Seq2SeqTransformer(cfg).double().eval()
    # Random weights with random-sign norm gains: a plain init only echoes the input token.
    scramble_weights(m, torch.Generator().manual_seed(1), dtype=torch.float64)
    with torch.no_grad():
        m.out_bias[3] += 1.5  # make EOS likely enough that hypotheses end at varied lengths
    return m


@pytest.fixture(scope="module")
def sources() -> list[list[int]]:
    gen = torch.Generator().manual_seed(7)
    out = []
    for _ in range(12):
        n = int(torch.randint(1, 15, (1,), generator=gen))
        out.append(torch.randint(5, VOCAB, (n,), generator=gen).tolist())
    return out


def greedy(model: Seq2SeqTransformer, source: list[int], limit: int) -> list[int]:
    cfg = model.config
    cache = model.start(torch.tensor([[*source, cfg.eos_id]]))
    last, out = cfg.bos_id, []
    for step in range(limit):
        logits = model.logits(model.extend(cache, torch.tensor([[last]]))[0, 0])
        logits[[cfg.pad_id, cfg.bos_id, cfg.mask_id]] = float("-inf")
        if step + 1 >= limit:
            return out  # the search forces EOS here
        last = int(logits.argmax())
        if last == cfg.eos_id:
            return out
        out.append(last)
    return out


def test_beam_one_is_greedy(model, sources):
    results = batched_beam_search(model, sources, num_beams=1, max_len_a=1.0, max_len_b=6)
    lengths = {len(r.tokens) for r in results}
    assert len(lengths) > 2, "the fixture should give varied output lengths"
    for src, res in zip(sources, results, strict=True):
        assert res.tokens == greedy(model, src, int(1.0 * len(src)) + 6)


@pytest.mark.parametrize("beams", [2, 4])
def test_batched_equals_one_at_a_time(model, sources, beams):
    together = batched_beam_search(model, sources, num_beams=beams)
    for src, res in zip(sources, together, strict=True):
        alone = batched_beam_search(model, [src], num_beams=beams)[0]
        assert res.tokens == alone.tokens
        assert res.score == pytest.approx(alone.score, abs=1e-9)
        assert res.finished == alone.finished


def test_beam_scores_are_length_normalised_log_probs(model, sources):
    src = sources[0]
    res = batched_beam_search(model, [src], num_beams=3)[0]
    cfg = model.config
    tgt = torch.tensor([[cfg.bos_id, *res.tokens, cfg.eos_id]])
    with torch.no_grad():
        logits = model(torch.tensor([[*src, cfg.eos_id]]), torch.ones(1, len(src) + 1, dtype=torch.bool), tgt[:, :-1])
    logp = torch.log_softmax(logits, -1)[0].gather(1, tgt[0, 1:, None]).sum()
    assert res.finished
    assert res.score == pytest.approx(float(logp) / (len(res.tokens) + 1), abs=1e-9)


def test_chunked_search_keeps_input_order(model, sources):
    direct = batched_beam_search(model, sources, num_beams=2)
    chunked = beam_search_texts(model, sources, batch_tokens=40, num_beams=2)
    assert [r.tokens for r in chunked] == [r.tokens for r in direct]
