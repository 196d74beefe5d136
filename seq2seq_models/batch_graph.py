"""The decoder over a ragged batch of rows, written once for eager torch and the ONNX export.

`BatchedDecoder` runs one forward over B rows that each have their own cached past, their own
block of new tokens and their own source; it is what the verifier's batching (`step_batch`,
multi-row sessions) and, with per-row `mask_from`, the NAR drafter's batched block drafts
(`drafter_service.nar_batch`) run on both backends. Eagerly (the torch backend) it runs in the
model's own dtype with the EAGER attention kernel, so float64 tests can compare it with one-row
steps; the ONNX export (`onnx_export`, `decoder_batch.onnx`) traces the same module with the BATCHED kernel,
which keeps the batch and block axes symbolic.

Inputs (int tensors are int64):

* `tokens` [B, T]: each row's block, right-padded to the longest (pad value irrelevant);
* `block_lens` [B]: the real tokens of each row's block (>= 1);
* `past_lens` [B]: the cached positions of each row; its block sits at positions
  `past_lens[b] + t`;
* `past_k` [B, H, hd, P] and `past_v` [B, H, P, hd], one each per layer: each row's cached K/V
  (the keys transposed, as `kernels.attention.KeysT`), right-padded to P >= max past_lens (the
  padding must be finite);
* `cross_k` [B, H, hd, S] and `cross_v` [B, H, S, hd], one each per layer: each row's source's
  cross-attention K/V (keys transposed), right-padded to S (finite padding); `src_lens` [B] their
  lengths (EOS included);
* `head_rows` [R]: flat indices `b * T + t` of the block positions whose final states are wanted;
* `mask_from` [B] (the NAR drafter's variant only, `NAR_BATCH_INPUTS`): where each row's [MASK]s
  start inside its block. Block positions before it are committed tokens (causal, as above); a mask
  position sees the row's whole past and its whole block, as the one-row NAR graph and the torch
  drafter's `extend(..., bidirectional=True)` do. Without it (the verifier), every row is causal.

Outputs: the wanted final-layer states [R, D], and the block's own K [L, B, H, hd, T] (transposed)
and V [L, B, H, T, hd] (the host appends each row's first `block_lens[b]` positions to that row's
cache; nothing of the past is returned, so a step never copies a row's past back).

The K/V come one input per layer (the exported graph's `past_k_0`, ..., `layer_inputs`), and the
block's self-attention attends over the past and the block as `kernels.attention.Parts`, never
joined: a stacked input split into layers, and a past concatenated with each block, were copies of
every row's whole cache at every step (BENCHMARKS.md, "Bulk decoding: notes").

Masks: a past key is visible iff its index < that row's past length; a block key iff it is inside
the row's block and at or before the query (any position, for a [MASK] query). A padded query
(t >= block_lens[b]) also sees its own key, so no query row is ever fully masked (no NaN from an
all -inf softmax), and no real query ever sees a padded key.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor, nn

from kernels.attention import EAGER, AttentionKernel, KeysT, Parts
from seq2seq_models.row_cache import BATCH_INPUTS, NAR_BATCH_INPUTS
from seq2seq_models.transformer import Seq2SeqTransformer

__all__ = ["BATCH_INPUTS", "NAR_BATCH_INPUTS", "BatchedDecoder"]


class BatchedDecoder(nn.Module):
    """`model`'s decoder over a ragged batch (see the module docstring), with `kernel`'s attention."""

    def __init__(self, model: Seq2SeqTransformer, kernel: AttentionKernel = EAGER) -> None:
        super().__init__()
        self.model = model
        self.kernel = kernel

    def forward(
        self, tokens: Tensor, block_lens: Tensor, past_lens: Tensor, past_k: Sequence[Tensor],
        past_v: Sequence[Tensor], cross_k: Sequence[Tensor], cross_v: Sequence[Tensor], src_lens: Tensor,
        head_rows: Tensor, mask_from: Tensor | None = None,
    ) -> tuple[Tensor, Tensor, Tensor]:
        m = self.model
        device = tokens.device
        # Sizes come from the inputs' shapes (traced as graph ops), never from Python ints.
        offsets = torch.arange(tokens.shape[1], device=device)  # [T]
        positions = past_lens[:, None] + offsets[None, :]  # [B, T]
        query = offsets[None, :, None]  # [1, T, 1]
        past_keys = torch.arange(past_k[0].shape[3], device=device)[None, None, :]  # [1, 1, P]
        block_keys = offsets[None, None, :]  # [1, 1, T]
        # `query >= 0` only broadcasts the past mask over the block's queries ([B, T, P]).
        past_visible = (past_keys < past_lens[:, None, None]) & (query >= 0)
        in_block = (block_keys < block_lens[:, None, None]) | (block_keys == query)
        causal = block_keys <= query
        if mask_from is not None:  # a real [MASK] query sees its row's whole block
            causal = causal | ((query >= mask_from[:, None, None]) & (query < block_lens[:, None, None]))
        block_visible = causal & in_block  # [B, T, T]
        self_mask = torch.cat([past_visible, block_visible], dim=2)[:, None]  # [B, 1, T, P + T]
        key_positions = torch.cat([past_keys[0].expand(positions.shape[0], -1), positions], dim=1)  # [B, P + T]
        self_mask = m.self_attention_mask(self_mask, positions, key_positions, decoder=True)

        src_keys = torch.arange(cross_k[0].shape[3], device=device)[None, :]
        cross_mask = (src_keys < src_lens[:, None])[:, None, None, :]  # [B, 1, 1, S]

        x = m.embed_target(tokens, positions)
        hidden, block_k, block_v = decode_after_past(m, x, self_mask, past_k, past_v, cross_k, cross_v, cross_mask,
                                                     self.kernel)
        rows = hidden.flatten(0, 1).index_select(0, head_rows)
        return rows, block_k, block_v


def decode_after_past(
    m: Seq2SeqTransformer, x: Tensor, self_mask: Tensor, past_k: Sequence[Tensor], past_v: Sequence[Tensor],
    cross_k: Sequence[Tensor], cross_v: Sequence[Tensor], cross_mask: Tensor, kernel: AttentionKernel,
) -> tuple[Tensor, Tensor, Tensor]:
    """The decoder over embedded blocks `x` [B, T, D] whose rows' pasts and sources are given per
    layer (keys transposed, as the pools hold them): the final-layer states, and the blocks' own keys
    [L, B, H, hd, T] and values [L, B, H, T, hd], stacked. Each layer attends over its past and the
    block as `Parts`, never joined."""
    block_k: list[Tensor] = []
    block_v: list[Tensor] = []

    def join_past(i: int, k: Tensor, v: Tensor) -> tuple[Parts, Parts]:
        block_k.append(k.transpose(-1, -2))
        block_v.append(v)
        return Parts(KeysT(past_k[i]), k), Parts(past_v[i], v)

    hidden = m.run_decoder(x, self_mask, [KeysT(k) for k in cross_k], list(cross_v), cross_mask, kernel, join_past)
    return hidden, torch.stack(block_k), torch.stack(block_v)
