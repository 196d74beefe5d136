"""Pre-LN encoder-decoder Transformer with tied embeddings and an incremental decoder.

One class serves all three roles of a bundle:

* the AR verifier: `start` encodes the source once (cross-attention K/V are cached per layer),
  `extend`/`score` append a block of any length to the self-attention KV cache in one forward,
  `truncate` rolls the cache back in O(1) (it only moves the per-row length);
* the small AR drafter: the same, with a small config (its beam search is
  `seq2seq_models.drafting.beam_draft`);
* the NAR block drafter: `extend(..., bidirectional=True)` over `k x [MASK]` after a causal
  prefix; every mask position sees the whole prefix and the whole block, then the block is
  truncated away again.

Batches are right-padded: every row has its own cache length, and a block of tokens carries its
own per-row length; masks keep padding out of every valid position.

The layer math lives in `seq2seq_models.layers`; `encode`, `cross_kv` and `run_decoder` are the
stacks every path shares (training, the KV cache here, and the ONNX export, which passes its own
attention kernel and K/V joining).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from kernels.attention import EAGER, AttentionKernel, KeysT, Parts
from seq2seq_models.config import ModelConfig
from seq2seq_models.layers import DecoderLayer, EncoderLayer, make_norm

# (layer index, block K, block V) -> the keys and values the block attends over in that layer.
LayerJoinPast = Callable[[int, Tensor, Tensor], tuple[Tensor | Parts, Tensor | Parts]]


@dataclass
class DecoderCache:
    """Decoder state for a batch of sequences; row b holds `lengths[b]` valid target positions."""

    self_k: list[Tensor]  # per layer [B, H, capacity, head_dim]
    self_v: list[Tensor]
    cross_k: list[Tensor]  # per layer [B, H, S, head_dim], computed once per source
    cross_v: list[Tensor]
    src_mask: Tensor  # [B, S] True where the source token is real
    lengths: Tensor  # [B] long
    hidden: Tensor  # [B, capacity, D] final-layer states, so a rollback needs no recompute

    @property
    def batch_size(self) -> int:
        return int(self.lengths.shape[0])

    @property
    def capacity(self) -> int:
        return int(self.hidden.shape[1])

    def select(self, rows: Tensor) -> DecoderCache:
        """A new cache made of the given rows (beam reordering, fan-out); the original is untouched."""

        def pick(ts: list[Tensor]) -> list[Tensor]:
            return [t.index_select(0, rows) for t in ts]

        return DecoderCache(
            self_k=pick(self.self_k),
            self_v=pick(self.self_v),
            cross_k=pick(self.cross_k),
            cross_v=pick(self.cross_v),
            src_mask=self.src_mask.index_select(0, rows),
            lengths=self.lengths.index_select(0, rows).clone(),
            hidden=self.hidden.index_select(0, rows),
        )

    def nbytes(self) -> int:
        tensors = [*self.self_k, *self.self_v, *self.cross_k, *self.cross_v, self.hidden]
        return sum(t.element_size() * t.nelement() for t in tensors)


class Seq2SeqTransformer(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        d = config.d_model
        self.embed = nn.Embedding(config.vocab_size, d)
        # Only a model whose source vocabulary differs from its target one has a source embedding.
        self.src_embed = nn.Embedding(config.src_vocab_size, d) if config.src_vocab_size else None
        self.learnt_positions = config.positions == "learnt"
        if self.learnt_positions:
            self.src_pos = nn.Embedding(config.max_len, d)
            self.tgt_pos = nn.Embedding(config.max_len, d)
        else:  # T5: one bias table per stack, shared by every layer's self-attention
            self.src_rel_bias = nn.Embedding(config.relative_buckets, config.encoder_shape.heads)
            self.tgt_rel_bias = nn.Embedding(config.relative_buckets, config.decoder_shape.heads)
        self.encoder_layers = nn.ModuleList(EncoderLayer(config) for _ in range(config.encoder_layers))
        self.decoder_layers = nn.ModuleList(DecoderLayer(config) for _ in range(config.decoder_layers))
        self.encoder_norm = make_norm(config) if config.final_norm else nn.Identity()
        self.decoder_norm = make_norm(config) if config.final_norm else nn.Identity()
        self.src_embed_norm = make_norm(config) if config.embed_norm else nn.Identity()
        self.tgt_embed_norm = make_norm(config) if config.embed_norm else nn.Identity()
        self.lm_head = None if config.tied_head else nn.Linear(d, config.vocab_size, bias=False)
        self.out_bias = nn.Parameter(torch.zeros(config.vocab_size))
        self.dropout = nn.Dropout(config.dropout)
        self.embed_scale = config.token_scale
        nn.init.normal_(self.embed.weight, std=d**-0.5)
        # Learnt positions start as one shared sinusoid table, as large as the scaled token
        # embeddings: with the usual small random init the position signal is a small fraction of
        # the input and a GEC model learns to copy far later, since cross-attention aligns target
        # position i with source position i sooner when both start from the same table
        # (BENCHMARKS.md, "Training (CPU)").
        if self.learnt_positions:
            with torch.no_grad():
                table = sinusoid_table(config.max_len, d)
                self.src_pos.weight.copy_(table)
                self.tgt_pos.weight.copy_(table)

    @property
    def head_weight(self) -> Tensor:
        """The output projection [V, D]: the target embeddings, or a head of its own."""
        return self.embed.weight if self.lm_head is None else self.lm_head.weight

    def self_attention_mask(self, mask: Tensor, queries: Tensor, keys: Tensor, decoder: bool) -> Tensor:
        """`mask` (True = may attend) as the self-attention's mask: unchanged for absolute
        positions; for relative ones (T5) the additive bias of every (query, key) position pair,
        [B, H, T, L], with -inf where `mask` forbids. `queries` [B or 1, T] and `keys` [B or 1, L]
        are positions."""
        if self.learnt_positions:
            return mask
        table = self.tgt_rel_bias if decoder else self.src_rel_bias
        cfg = self.config
        relative = keys[:, None, :] - queries[:, :, None]  # [B, T, L]
        buckets = relative_bucket(relative, not decoder, cfg.relative_buckets, cfg.relative_max_distance)
        bias = table(buckets).permute(0, 3, 1, 2)  # [B, H, T, L]
        return bias.masked_fill(~mask, float("-inf"))

    # ----------------------------------------------------------------------------------------
    # Incremental decoding
    # ----------------------------------------------------------------------------------------

    def start(self, src: Tensor, src_mask: Tensor | None = None, capacity: int = 32) -> DecoderCache:
        """Encode a right-padded source batch once; the returned cache has no target positions yet."""
        if src_mask is None:
            src_mask = torch.ones_like(src, dtype=torch.bool)
        memory = self.encode(src, src_mask)
        b = src.shape[0]
        cfg = self.config
        shape = cfg.decoder_shape
        capacity = min(capacity, cfg.max_len)
        cross_k, cross_v = self.cross_kv(memory)

        def empty() -> Tensor:
            return memory.new_zeros(b, shape.heads, capacity, shape.head_dim)

        return DecoderCache(
            self_k=[empty() for _ in self.decoder_layers],
            self_v=[empty() for _ in self.decoder_layers],
            cross_k=cross_k,
            cross_v=cross_v,
            src_mask=src_mask,
            lengths=torch.zeros(b, dtype=torch.long, device=src.device),
            hidden=memory.new_zeros(b, capacity, cfg.d_model),
        )

    def extend(
        self,
        cache: DecoderCache,
        tokens: Tensor,
        block_lengths: Tensor | None = None,
        bidirectional: bool = False,
    ) -> Tensor:
        """Append a right-padded block `tokens` [B, T] to every row in one forward.

        Returns the final-layer states [B, T, D] (also stored in `cache.hidden`). With
        `bidirectional`, positions of the block attend to the whole block (NAR drafting);
        otherwise attention is causal. Row b advances by `block_lengths[b]` (default T).
        """
        b, t = tokens.shape
        if block_lengths is None:
            block_lengths = torch.full((b,), t, dtype=torch.long, device=tokens.device)
        start = cache.lengths
        needed = int((start + t).max())
        if needed > self.config.max_len:
            raise ValueError(f"target length {needed} exceeds the model's max_len {self.config.max_len}")
        self._ensure_capacity(cache, needed)

        offsets = torch.arange(t, device=tokens.device)
        positions = start[:, None] + offsets[None, :]  # [B, T]
        keys = torch.arange(needed, device=tokens.device)
        if bidirectional:
            visible = keys[None, None, :] < (start + block_lengths)[:, None, None]
            self_mask = visible.expand(b, t, needed)
        else:
            self_mask = keys[None, None, :] <= positions[:, :, None]
        self_mask = self.self_attention_mask(self_mask[:, None], positions, keys[None, :], decoder=True)
        cross_mask = cache.src_mask[:, None, None, :]  # [B, 1, 1, S]

        x = self.dropout(self.embed_target(tokens, positions))
        join_past = partial(_write_cache, cache, positions, needed)
        hidden = self.run_decoder(x, self_mask, cache.cross_k, cache.cross_v, cross_mask, join_past=join_past)
        cache.hidden.scatter_(1, positions[:, :, None].expand_as(hidden), hidden)
        cache.lengths = start + block_lengths
        return hidden

    def score(self, cache: DecoderCache, tokens: Tensor, block_lengths: Tensor | None = None) -> Tensor:
        """Append a block causally and return logits [B, T, V] for every one of its positions."""
        return self.logits(self.extend(cache, tokens, block_lengths))

    @staticmethod
    def truncate(cache: DecoderCache, n: int | Tensor) -> None:
        """Roll every row back to `n` target positions (an int, or one per row)."""
        n_t = torch.as_tensor(n, dtype=torch.long, device=cache.lengths.device).expand_as(cache.lengths)
        if bool((n_t > cache.lengths).any()) or bool((n_t < 0).any()):
            raise ValueError(f"cannot truncate lengths {cache.lengths.tolist()} to {n_t.tolist()}")
        cache.lengths = n_t.clone()

    def logits(self, hidden: Tensor) -> Tensor:
        return F.linear(hidden, self.head_weight, self.out_bias)

    def last_hidden(self, cache: DecoderCache) -> Tensor:
        """[B, D] state of every row's last valid position (the one that predicts the next token)."""
        idx = (cache.lengths - 1).clamp(min=0)
        return cache.hidden[torch.arange(cache.batch_size, device=idx.device), idx]

    # ----------------------------------------------------------------------------------------
    # Full (non-incremental) passes: training, and the reference the cache is tested against
    # ----------------------------------------------------------------------------------------

    def forward(
        self,
        src: Tensor,
        src_mask: Tensor,
        tgt: Tensor,
        self_mask: Tensor | None = None,
    ) -> Tensor:
        """Logits [B, T, V] for a whole target; `self_mask` [B, T, T] (True = may attend)
        defaults to causal."""
        memory = self.encode(src, src_mask)
        cross_k, cross_v = self.cross_kv(memory)
        t = tgt.shape[1]
        if self_mask is None:
            self_mask = torch.ones(t, t, dtype=torch.bool, device=tgt.device).tril()[None]
        positions = torch.arange(t, device=tgt.device)[None, :]
        x = self.dropout(self.embed_target(tgt, positions))
        cross_mask = src_mask[:, None, None, :]
        self_mask = self.self_attention_mask(self_mask[:, None], positions, positions, decoder=True)
        return self.logits(self.run_decoder(x, self_mask, cross_k, cross_v, cross_mask))

    # ----------------------------------------------------------------------------------------
    # The stacks every path shares (above, and the ONNX export with the GRAPH kernel)
    # ----------------------------------------------------------------------------------------

    def encode(self, src: Tensor, src_mask: Tensor | None, kernel: AttentionKernel = EAGER) -> Tensor:
        """Encoder output [B, S, D]; `src_mask` None = every source position is real."""
        positions = torch.arange(src.shape[1], device=src.device)[None, :]
        embed = self.embed if self.src_embed is None else self.src_embed
        x = embed(src) * self.embed_scale
        if self.learnt_positions:
            x = x + self.src_pos(positions)
        x = self.dropout(self.src_embed_norm(x))
        attn_mask = None if src_mask is None else src_mask[:, None, None, :]
        if not self.learnt_positions:
            everything = torch.ones_like(positions, dtype=torch.bool)[:, None, None]
            visible = everything if attn_mask is None else attn_mask
            attn_mask = self.self_attention_mask(visible, positions, positions, decoder=False)
        for layer in self.encoder_layers:
            x = layer(x, attn_mask, kernel)
        return self.encoder_norm(x)

    def cross_kv(self, memory: Tensor, kernel: AttentionKernel = EAGER) -> tuple[list[Tensor], list[Tensor]]:
        """Every decoder layer's cross-attention K and V [B, H, S, hd] of the encoder output."""
        attentions = [layer.cross_attn for layer in self.decoder_layers]
        # One projection of `memory` for every layer's K and V (a graph kernel joins them in one matmul).
        kv = kernel.project(memory, [linear for a in attentions for linear in (a.k_proj, a.v_proj)])
        ks = [a.split(k, kernel) for a, k in zip(attentions, kv[0::2], strict=True)]
        vs = [a.split(v, kernel) for a, v in zip(attentions, kv[1::2], strict=True)]
        return ks, vs

    def embed_target(self, tokens: Tensor, positions: Tensor) -> Tensor:
        """Embedded target tokens at their positions (clamped to the table: a position past it is
        refused before any forward, but padded rows of a batch may point beyond)."""
        x = self.embed(tokens) * self.embed_scale
        if self.learnt_positions:
            x = x + self.tgt_pos(positions.clamp(max=self.config.max_len - 1))
        return self.tgt_embed_norm(x)

    def run_decoder(
        self,
        x: Tensor,
        self_mask: Tensor | None,
        cross_k: Sequence[Tensor | KeysT] | Tensor,
        cross_v: Sequence[Tensor] | Tensor,
        cross_mask: Tensor | None,
        kernel: AttentionKernel = EAGER,
        join_past: LayerJoinPast | None = None,
    ) -> Tensor:
        """Final-layer states [B, T, D] of the embedded block `x`; `cross_k[i]`/`cross_v[i]` are
        layer i's, and `join_past` (None: the block attends only to itself) adds what is cached."""
        for i, layer in enumerate(self.decoder_layers):
            join = None if join_past is None else partial(join_past, i)
            x = layer(x, self_mask, cross_k[i], cross_v[i], cross_mask, kernel, join)
        return self.decoder_norm(x)

    # ----------------------------------------------------------------------------------------

    @staticmethod
    def _ensure_capacity(cache: DecoderCache, needed: int) -> None:
        if needed <= cache.capacity:
            return
        new_cap = max(needed, 2 * cache.capacity)

        def grow(t: Tensor, dim: int) -> Tensor:
            shape = list(t.shape)
            shape[dim] = new_cap - shape[dim]
            return torch.cat([t, t.new_zeros(shape)], dim=dim)

        cache.self_k = [grow(t, 2) for t in cache.self_k]
        cache.self_v = [grow(t, 2) for t in cache.self_v]
        cache.hidden = grow(cache.hidden, 1)


def _write_cache(
    cache: DecoderCache, positions: Tensor, key_len: int, index: int, k: Tensor, v: Tensor
) -> tuple[Tensor, Tensor]:
    """Store a block's K/V [B, H, T, hd] at its rows' positions in layer `index`'s cache; returns
    the first `key_len` cached positions, which the block attends over."""
    write = positions[:, None, :, None].expand_as(k)
    cache.self_k[index].scatter_(2, write, k)
    cache.self_v[index].scatter_(2, write, v)
    return cache.self_k[index][:, :, :key_len], cache.self_v[index][:, :, :key_len]


def sinusoid_table(length: int, dim: int) -> Tensor:
    """[length, dim] sin/cos positions (Vaswani et al. 2017), interleaved, every entry in [-1, 1]."""
    position = torch.arange(length, dtype=torch.float64)[:, None]
    frequency = torch.exp(torch.arange(0, dim, 2, dtype=torch.float64) * (-math.log(10000.0) / dim))
    table = torch.zeros(length, dim, dtype=torch.float64)
    table[:, 0::2] = torch.sin(position * frequency)
    table[:, 1::2] = torch.cos(position * frequency[: dim // 2])
    return table.float()


def relative_bucket(relative: Tensor, bidirectional: bool, num_buckets: int, max_distance: int) -> Tensor:
    """T5's bucket of each relative position (key minus query): exact for small distances, log-spaced
    up to `max_distance`; a bidirectional stack gives keys after the query buckets of their own."""
    buckets = torch.zeros_like(relative)
    if bidirectional:
        num_buckets //= 2
        buckets = buckets + (relative > 0).long() * num_buckets
        distance = relative.abs()
    else:
        distance = (-relative).clamp(min=0)
    max_exact = num_buckets // 2
    far = max_exact + (
        torch.log(distance.float() / max_exact) / math.log(max_distance / max_exact) * (num_buckets - max_exact)
    ).long()
    far = far.clamp(max=num_buckets - 1)
    return buckets + torch.where(distance < max_exact, distance, far)
