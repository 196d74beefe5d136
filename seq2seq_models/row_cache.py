"""Per-row KV caches and the padded batch that `batch_graph.BatchedDecoder` takes.

One row's self-attention K/V live in a capacity buffer [L, H, capacity, hd] that doubles when
full, so a step writes only its block; a rollback is a smaller `past_len` on the next step, with no
copy. `gather` right-pads the rows of one forward into the decoder's batch inputs; `RowKV.write`
stores each row's part of the block K/V the forward returned.

The code is written once over numpy arrays (ONNX Runtime) and torch tensors (the torch backend):
it only allocates through an `Arrays` and uses slicing, which both share.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

# The inputs of the batched decoder (`batch_graph.BatchedDecoder`, `decoder_batch.onnx`), by name:
# `gather` makes them. Here, not in batch_graph, so ONNX Runtime callers need no torch.
BATCH_INPUTS = [
    "tokens", "block_lens", "past_lens", "past_k", "past_v", "cross_k", "cross_v", "src_lens", "row_src", "head_rows",
]
NAR_BATCH_INPUTS = [*BATCH_INPUTS, "mask_from"]

Zeros = Callable[[tuple[int, ...]], Any]  # shape -> a zero array of the backend's type and dtype
MIN_CAPACITY = 16


class RowKV:
    """One row's self-attention K/V [L, H, capacity, hd]; positions [0, held) are valid."""

    def __init__(self, zeros: Zeros, layers: int, heads: int, head_dim: int, capacity: int = MIN_CAPACITY) -> None:
        self._zeros = zeros
        self._shape = (layers, heads, head_dim)
        self.k = zeros((layers, heads, capacity, head_dim))
        self.v = zeros((layers, heads, capacity, head_dim))
        self.held = 0

    @property
    def capacity(self) -> int:
        return int(self.k.shape[2])

    @property
    def nbytes(self) -> int:
        return int(self.k.nbytes) + int(self.v.nbytes)

    def reserve(self, n: int) -> None:
        """Room for `n` positions, doubling the capacity (the valid ones are copied once)."""
        if n <= self.capacity:
            return
        cap = max(n, 2 * self.capacity)
        layers, heads, hd = self._shape
        for name in ("k", "v"):
            new = self._zeros((layers, heads, cap, hd))
            new[:, :, : self.held] = getattr(self, name)[:, :, : self.held]
            setattr(self, name, new)

    def write(self, start: int, k: Any, v: Any) -> None:
        """Store a block's K/V [L, H, n, hd] at positions start..start+n; the row then holds start + n."""
        n = int(k.shape[2])
        self.held = min(self.held, start)
        self.reserve(start + n)
        self.k[:, :, start : start + n] = k
        self.v[:, :, start : start + n] = v
        self.held = start + n

    def fork(self, keep: int) -> RowKV:
        """A new row holding a copy of this row's first `keep` positions (beam search forks)."""
        keep = min(keep, self.held)
        layers, heads, hd = self._shape
        other = RowKV(self._zeros, layers, heads, hd, max(MIN_CAPACITY, keep))
        other.k[:, :, :keep] = self.k[:, :, :keep]
        other.v[:, :, :keep] = self.v[:, :, :keep]
        other.held = keep
        return other


@dataclass
class RowBlock:
    """One row of a forward: feed `fed` after the row's first `past_len` cached positions, and
    report the head for block positions `head_from..` (one per entry of `targets`, -1 = none)."""

    kv: RowKV
    fed: list[int]
    past_len: int
    head_from: int
    targets: list[int]
    source: int  # index of the row's source among the batch's distinct sources


@dataclass(frozen=True)
class Cross:
    """One source's cross-attention K/V [L, 1, H, S, hd] (S includes its EOS)."""

    k: Any
    v: Any

    @property
    def length(self) -> int:
        return int(self.k.shape[3])


class CrossStack:
    """The batch's padded cross-attention K/V [L, N, H, S, hd], remade only when the batch's sources
    change: a scheduler's consecutive forwards mostly hold the same sessions, and restacking every
    source's K/V each step would cost about as much as gathering the rows' pasts."""

    def __init__(self) -> None:
        self._sources: tuple[Cross, ...] = ()
        self._stacked: tuple[Any, Any] | None = None

    def stack(self, sources: Sequence[Cross], zeros: Zeros) -> tuple[Any, Any]:
        if len(sources) == 1:  # one source (one session, or one multi-row session): no copy
            return sources[0].k, sources[0].v
        same = len(sources) == len(self._sources) and all(a is b for a, b in zip(sources, self._sources, strict=True))
        if not same or self._stacked is None:
            layers, _, heads, _, hd = sources[0].k.shape
            s = max(c.length for c in sources)
            cross_k = zeros((layers, len(sources), heads, s, hd))
            cross_v = zeros((layers, len(sources), heads, s, hd))
            for j, c in enumerate(sources):
                cross_k[:, j, :, : c.length] = c.k[:, 0]
                cross_v[:, j, :, : c.length] = c.v[:, 0]
            self._sources, self._stacked = tuple(sources), (cross_k, cross_v)
        return self._stacked


def gather(
    blocks: Sequence[RowBlock], sources: Sequence[Cross], zeros: Zeros, crosses: CrossStack | None = None
) -> dict[str, Any]:
    """The batched decoder's inputs (`batch_graph.BATCH_INPUTS` plus `targets`) for `blocks`:
    int inputs as int64 numpy arrays, K/V padded with zeros in the backend's own arrays; `crosses`
    keeps the last stack of sources for the next call."""
    b = len(blocks)
    t = max(len(r.fed) for r in blocks)
    p = max(r.past_len for r in blocks)
    tokens = np.zeros((b, t), np.int64)
    head_rows: list[int] = []
    targets: list[int] = []
    first = blocks[0].kv
    layers, heads, _, hd = first.k.shape
    past_k = zeros((layers, b, heads, p, hd))
    past_v = zeros((layers, b, heads, p, hd))
    for i, r in enumerate(blocks):
        tokens[i, : len(r.fed)] = r.fed
        head_rows.extend(range(i * t + r.head_from, i * t + r.head_from + len(r.targets)))
        targets.extend(r.targets)
        if r.past_len:
            past_k[:, i, :, : r.past_len] = r.kv.k[:, :, : r.past_len]
            past_v[:, i, :, : r.past_len] = r.kv.v[:, :, : r.past_len]
    cross_k, cross_v = (crosses or CrossStack()).stack(sources, zeros)
    return {
        "tokens": tokens,
        "block_lens": np.array([len(r.fed) for r in blocks], np.int64),
        "past_lens": np.array([r.past_len for r in blocks], np.int64),
        "past_k": past_k,
        "past_v": past_v,
        "cross_k": cross_k,
        "cross_v": cross_v,
        "src_lens": np.array([c.length for c in sources], np.int64),
        "row_src": np.array([r.source for r in blocks], np.int64),
        "head_rows": np.array(head_rows, np.int64),
        "targets": np.array(targets, np.int64),
    }


def scatter(blocks: Sequence[RowBlock], block_k: Any, block_v: Any) -> None:
    """Append each row's real block positions from the forward's block K/V [L, B, H, T, hd]."""
    for i, r in enumerate(blocks):
        n = len(r.fed)
        r.kv.write(r.past_len, block_k[:, i, :, :n], block_v[:, i, :, :n])
