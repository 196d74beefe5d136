"""Per-row KV caches and the padded batch that `batch_graph.BatchedDecoder` takes.

One row's self-attention K/V live in a capacity buffer [L, H, capacity, hd] that doubles when
full, so a step writes only its block; a rollback is a smaller `past_len` on the next step, with no
copy. `gather` right-pads the rows of one forward into the decoder's batch inputs; `RowKV.write`
stores each row's part of the block K/V the forward returned.

The code is written once over numpy arrays (ONNX Runtime) and torch tensors (the torch backend):
it only allocates through an `Arrays` and uses slicing, which both share.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from core.batch_slots import split_by_length

# The inputs of the batched decoder (`batch_graph.BatchedDecoder`, `decoder_batch.onnx`), by name:
# `gather` makes them. Here, not in batch_graph, so ONNX Runtime callers need no torch.
BATCH_INPUTS = [
    "tokens", "block_lens", "past_lens", "past_k", "past_v", "cross_k", "cross_v", "src_lens", "row_src", "head_rows",
]
NAR_BATCH_INPUTS = [*BATCH_INPUTS, "mask_from"]
# The K/V inputs of the batched decoder: `gather` stacks each over the layers; the exported graph
# takes one input per layer (`layer_inputs`), fed views of the stack (`per_layer`).
LAYERED = ("past_k", "past_v", "cross_k", "cross_v")


def layer_inputs(names: Sequence[str], layers: int) -> list[str]:
    """`names` with each K/V input expanded into one per layer: past_k -> past_k_0, ..., past_k_{L-1}."""
    out: list[str] = []
    for name in names:
        out.extend([f"{name}_{i}" for i in range(layers)] if name in LAYERED else [name])
    return out


def per_layer(feeds: dict[str, Any]) -> dict[str, Any]:
    """`gather`'s feeds with each stacked K/V array [L, ...] given as one view per layer (no copy:
    a stack's layer is contiguous)."""
    out: dict[str, Any] = {}
    for name, value in feeds.items():
        if name in LAYERED:
            out.update((f"{name}_{i}", value[i]) for i in range(value.shape[0]))
        else:
            out[name] = value
    return out

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


class Encoder(Protocol):
    """What encodes sources: a batched engine (`torch_engine.TorchBatchEngine`, `ort_engine.OrtBatchEngine`)."""

    def encode_batch(self, sources: list[list[int]]) -> list[Cross]: ...


class Source:
    """A session's source: its ids until it is encoded together with other new sources
    (`encode_new`: by the verifier service's encoder scheduler soon after open, or by the first
    forward that needs its K/V), then its `Cross`. Released when its session closes.

    Not encoding inside `open` is what lets concurrent sessions share one encoder run: under load
    the encoder was about a quarter of the verifier's work (py-spy, GAD at 32 clients), and a batch
    of sources costs less per source than one run each. A session closed before it is encoded
    never is."""

    def __init__(self, source_ids: list[int]) -> None:
        self.ids = list(source_ids)
        self.cross: Cross | None = None
        self.released = False  # its session closed: never encoded again

    @property
    def nbytes(self) -> int:
        return 0 if self.cross is None else int(self.cross.k.nbytes) * 2

    def release(self) -> None:
        self.released = True
        self.cross = None


def encode_new(encoder: Encoder, sources: Sequence[Source], split_tokens: int = 0,
               on_run: Callable[[int], None] | None = None) -> None:
    """Encode those of `sources` not encoded yet and not released (each once, however often it
    appears): one run, or one per group of lengths where the padding saved outweighs a run's fixed
    cost of `split_tokens` tokens (`core.batch_slots.split_by_length`; 0: one run). `on_run` is
    told the number of sources of each run (a service's metrics)."""
    new = list({id(s): s for s in sources if s.cross is None and not s.released}.values())
    if not new:
        return
    for group in split_by_length([len(s.ids) + 1 for s in new], split_tokens):
        batch = [new[i] for i in group]
        for source, cross in zip(batch, encoder.encode_batch([s.ids for s in batch]), strict=True):
            source.cross = cross
        if on_run is not None:
            on_run(len(batch))


def source_feeds(sources: list[list[int]], eos_id: int) -> dict[str, np.ndarray]:
    """The encoder's inputs for `sources`: ids with EOS appended, right-padded, and the mask of the
    real positions (`encoder.onnx`'s src and src_mask)."""
    lengths = [len(s) + 1 for s in sources]
    src = np.full((len(sources), max(lengths)), eos_id, np.int64)
    mask = np.zeros(src.shape, np.bool_)
    for i, ids in enumerate(sources):
        src[i, : lengths[i]] = [*ids, eos_id]
        mask[i, : lengths[i]] = True
    return {"src": src, "src_mask": mask}


def split_sources(k: Any, v: Any, sources: list[list[int]], own: Callable[[Any], Any]) -> list[Cross]:
    """Each source's `Cross` out of one encoder run's K/V [L, B, H, S, hd] over `sources` (right-
    padded): its own positions (with EOS), made an array of its own by `own` (a contiguous copy:
    the batch's arrays are freed, and ONNX Runtime's one-row graph takes a row's K/V as an input)."""
    return [Cross(own(k[:, i : i + 1, :, : len(ids) + 1]), own(v[:, i : i + 1, :, : len(ids) + 1]))
            for i, ids in enumerate(sources)]


class CrossStack(threading.local):
    """The batch's sources' cross-attention K/V as slots of one padded array [L, N, H, S, hd], kept
    from forward to forward. Under streaming refill the batch's sources change at almost every
    step (a session ends, another joins): restacking them all each time was a large share of the
    verifier's worker's time under load (BENCHMARKS.md, "Load: notes"). Here a source keeps its
    slot while it stays in the batches, a new one takes a free slot (one copy of its K/V), and the
    array is laid out again only when its shape must change: more sources than slots, or the
    longest source's length in another bucket of S_STEP positions (longer, or shorter: every row
    attends over the whole padded S).

    Free slots and the positions past a slot's source hold stale K/V of earlier sources: finite
    values the graph masks out by `src_lens` (their attention weights are exactly 0).

    The state is per thread (a `threading.local`): a service's scheduler has one worker, but
    in-process sessions of one verifier may step from their own threads at once, and two forwards
    filling the same arrays would read each other's rows."""

    S_STEP = 16  # S is the longest source's length rounded up to this: fewer re-layouts, little padding
    MIN_SLOTS = 8

    def __init__(self) -> None:
        self._slots: list[Cross | None] = []
        self._k: Any = None
        self._v: Any = None
        self._past: tuple[Any, Any] | None = None

    def stack(self, sources: Sequence[Cross], zeros: Zeros) -> tuple[Any, Any, list[int], list[int]]:
        """(cross_k, cross_v, the slot of each source, each slot's length) for this forward."""
        if len(sources) == 1:  # one source (one session, or one multi-row session): no copy
            return sources[0].k, sources[0].v, [0], [sources[0].length]
        wanted = {id(c) for c in sources}
        for slot, c in enumerate(self._slots):
            if c is not None and id(c) not in wanted:
                self._slots[slot] = None  # gone from the batch: its slot is free
        s = -(-max(c.length for c in sources) // self.S_STEP) * self.S_STEP
        if self._k is None or len(sources) > len(self._slots) or int(self._k.shape[3]) != s:
            self._layout(sources, s, zeros)
        else:
            # A slot holds its Cross alive, so an id held here is that very Cross.
            held = {id(c) for c in self._slots if c is not None}
            free = (slot for slot, c in enumerate(self._slots) if c is None)
            for c in sources:
                if id(c) not in held:
                    self._put(next(free), c)
        slot_of = {id(c): slot for slot, c in enumerate(self._slots) if c is not None}
        lengths = [1 if c is None else c.length for c in self._slots]
        return self._k, self._v, [slot_of[id(c)] for c in sources], lengths

    def pasts(self, shape: tuple[int, ...], zeros: Zeros) -> tuple[Any, Any]:
        """Two arrays of `shape` for a forward's padded past K/V, carved from buffers kept from
        forward to forward (allocating and zeroing them each step was a tenth of the gather).
        They hold stale values wherever `gather` writes nothing: padding the graph masks out by
        `past_lens`, as the stale source positions above."""
        size = math.prod(shape)
        if self._past is None or int(self._past[0].shape[0]) < size:
            self._past = (zeros((2 * size,)), zeros((2 * size,)))
        return self._past[0][:size].reshape(shape), self._past[1][:size].reshape(shape)

    def _layout(self, sources: Sequence[Cross], s: int, zeros: Zeros) -> None:
        layers, _, heads, _, hd = sources[0].k.shape
        n = max(self.MIN_SLOTS, 1 << (len(sources) - 1).bit_length())
        self._k = zeros((layers, n, heads, s, hd))
        self._v = zeros((layers, n, heads, s, hd))
        self._slots = [None] * n
        for slot, c in enumerate(sources):
            self._put(slot, c)

    def _put(self, slot: int, c: Cross) -> None:
        self._slots[slot] = c
        self._k[:, slot, :, : c.length] = c.k[:, 0]
        self._v[:, slot, :, : c.length] = c.v[:, 0]


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
    crosses = crosses or CrossStack()
    past_k, past_v = crosses.pasts((layers, b, heads, p, hd), zeros)
    for i, r in enumerate(blocks):
        tokens[i, : len(r.fed)] = r.fed
        head_rows.extend(range(i * t + r.head_from, i * t + r.head_from + len(r.targets)))
        targets.extend(r.targets)
        if r.past_len:
            past_k[:, i, :, : r.past_len] = r.kv.k[:, :, : r.past_len]
            past_v[:, i, :, : r.past_len] = r.kv.v[:, :, : r.past_len]
    cross_k, cross_v, slot_of, src_lens = crosses.stack(sources, zeros)
    return {
        "tokens": tokens,
        "block_lens": np.array([len(r.fed) for r in blocks], np.int64),
        "past_lens": np.array([r.past_len for r in blocks], np.int64),
        "past_k": past_k,
        "past_v": past_v,
        "cross_k": cross_k,
        "cross_v": cross_v,
        "src_lens": np.array(src_lens, np.int64),
        "row_src": np.array([slot_of[r.source] for r in blocks], np.int64),
        "head_rows": np.array(head_rows, np.int64),
        "targets": np.array(targets, np.int64),
    }


def scatter(blocks: Sequence[RowBlock], block_k: Any, block_v: Any) -> None:
    """Append each row's real block positions from the forward's block K/V [L, B, H, T, hd]."""
    for i, r in enumerate(blocks):
        n = len(r.fed)
        r.kv.write(r.past_len, block_k[:, i, :, :n], block_v[:, i, :, :n])
