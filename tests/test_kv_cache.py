"""Block scoring with the rollback KV cache equals a full recompute (fp32, max abs diff <= 1e-5)."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from seq2seq_models.config import ModelConfig
from seq2seq_models.transformer import Seq2SeqTransformer

TOL = 1e-5
VOCAB = 40


def _model(seed: int) -> Seq2SeqTransformer:
    torch.manual_seed(seed)
    cfg = ModelConfig(
        vocab_size=VOCAB, d_model=32, n_heads=4, encoder_layers=2, decoder_layers=2, ffn_dim=64,
        max_len=64, dropout=0.0,
    )
    return Seq2SeqTransformer(cfg).eval()


MODELS = [_model(s) for s in range(3)]


def _full_logits(model, src, src_mask, tgt):
    with torch.no_grad():
        return model(src, src_mask, tgt)


@settings(max_examples=60, deadline=None)
@given(
    model_index=st.integers(0, len(MODELS) - 1),
    seed=st.integers(0, 2**31 - 1),
    blocks=st.lists(st.integers(1, 9), min_size=1, max_size=6),
    rollbacks=st.lists(st.integers(0, 8), min_size=6, max_size=6),
)
def test_block_scoring_with_truncation_matches_full_recompute(model_index, seed, blocks, rollbacks):
    """Append blocks of random sizes, roll back a random amount after each, and compare every
    scored position with a from-scratch forward over the same prefix."""
    model = MODELS[model_index]
    gen = torch.Generator().manual_seed(seed)
    src = torch.randint(5, VOCAB, (1, int(torch.randint(1, 20, (1,), generator=gen))), generator=gen)
    src_mask = torch.ones_like(src, dtype=torch.bool)
    target = torch.randint(5, VOCAB, (1, 63), generator=gen)
    target[0, 0] = model.config.bos_id
    with torch.no_grad():
        cache = model.start(src, src_mask, capacity=4)  # small: forces growth on the way
        length = 0
        for block, back in zip(blocks, rollbacks, strict=False):
            block = min(block, 63 - length)
            if block <= 0:
                break
            logits = model.score(cache, target[:, length : length + block])
            expected = _full_logits(model, src, src_mask, target[:, : length + block])[:, length:]
            assert (logits - expected).abs().max().item() <= TOL
            length = max(1, length + block - back)
            model.truncate(cache, length)
            # Rolled-back positions are rewritten with *different* tokens next time round.
            target[0, length:] = torch.randint(5, VOCAB, (63 - length,), generator=gen)


@settings(max_examples=40, deadline=None)
@given(
    seed=st.integers(0, 2**31 - 1),
    batch=st.integers(2, 5),
)
def test_right_padded_batches_of_varied_lengths_match_each_row_alone(seed, batch):
    model = MODELS[seed % len(MODELS)]
    gen = torch.Generator().manual_seed(seed)
    src_lens = torch.randint(1, 16, (batch,), generator=gen)
    src = torch.randint(5, VOCAB, (batch, int(src_lens.max())), generator=gen)
    src_mask = torch.arange(src.shape[1])[None, :] < src_lens[:, None]
    src = src.masked_fill(~src_mask, model.config.pad_id)
    tgt = torch.randint(5, VOCAB, (batch, 40), generator=gen)
    tgt[:, 0] = model.config.bos_id
    with torch.no_grad():
        cache = model.start(src, src_mask, capacity=8)
        done = torch.zeros(batch, dtype=torch.long)
        for _ in range(3):
            block_lens = torch.randint(1, 8, (batch,), generator=gen)
            width = int(block_lens.max())
            block = torch.full((batch, width), model.config.pad_id, dtype=torch.long)
            for b in range(batch):
                n = int(block_lens[b])
                block[b, :n] = tgt[b, int(done[b]) : int(done[b]) + n]
            logits = model.score(cache, block, block_lens)
            for b in range(batch):
                n, start = int(block_lens[b]), int(done[b])
                s = src[b : b + 1, : int(src_lens[b])]
                alone = _full_logits(model, s, torch.ones_like(s, dtype=torch.bool), tgt[b : b + 1, : start + n])
                assert (logits[b, :n] - alone[0, start:]).abs().max().item() <= TOL
            done += block_lens
            # Roll every row back by a different amount, as rejected drafts do.
            back = torch.minimum(torch.randint(0, 4, (batch,), generator=gen), done - 1)
            done -= back
            model.truncate(cache, done)
    assert cache.lengths.tolist() == done.tolist()


def test_nar_block_sees_the_whole_block_and_leaves_the_cache_as_it_was():
    model = MODELS[0]
    src = torch.tensor([[7, 8, 9, 10]])
    prefix = torch.tensor([[model.config.bos_id, 11, 12]])
    k = 4
    masks = torch.full((1, k), model.config.mask_id)
    with torch.no_grad():
        cache = model.start(src)
        model.extend(cache, prefix)
        hidden = model.extend(cache, masks, bidirectional=True)
        model.truncate(cache, 3)
        # Reference: one full pass with prefix causal and the block seeing prefix + whole block.
        t = 3 + k
        self_mask = torch.zeros(1, t, t, dtype=torch.bool)
        self_mask[0, :3, :3] = torch.ones(3, 3, dtype=torch.bool).tril()
        self_mask[0, 3:, :] = True
        full = model(src, torch.ones_like(src, dtype=torch.bool), torch.cat([prefix, masks], 1), self_mask)
        assert (model.logits(hidden) - full[:, 3:]).abs().max().item() <= TOL
        # The rolled-back cache scores the next token exactly as before the draft.
        after = model.score(cache, torch.tensor([[13]]))
        expected = model(src, torch.ones_like(src, dtype=torch.bool), torch.tensor([[2, 11, 12, 13]]))[:, 3:]
        assert (after - expected).abs().max().item() <= TOL
