"""Rows' KV caches in one pool per model, and the padded batch that `batch_graph.BatchedDecoder` takes.

A `KVPool` holds every open row's self-attention K/V and its source's cross-attention K/V in four
arrays laid out as the batched decoder reads them: keys [L, rows, H, hd, positions] (transposed:
`kernels.attention.KeysT`) and values [L, rows, H, positions, hd], for the self-attention and for
the source (source positions). A row owns a slot (`RowSlot`); the slots in use stay
near the front (a new row takes the first free slot, and when free slots are many among the used
ones the last rows move into them, one copy each), so a forward over most of the rows feeds each
layer's view of the arrays as it is and no row's past is copied to make the batch (the rows not
stepping, and free slots, ride along as one-position dummy rows); a forward over a smaller share of
the pool gathers its rows (one copy per array). A step writes only its block; a rollback is a smaller
past length on the next step, with no copy. Capacities grow (a re-layout: one copy of what is
held) and shrink again once the longest rows have left, since a forward attends over them.

The pool replaced a capacity buffer per row and a per-forward stack of the batch's sources: copying
each row's past into the padded batch, and re-laying the sources out as sessions came and went,
were a large share of a batched step's host time (BENCHMARKS.md, "Bulk decoding: notes").

The code is written once over numpy arrays (ONNX Runtime) and torch tensors (the torch backend):
it allocates and gathers through an `Arrays` and otherwise only slices, which both share.
"""

from __future__ import annotations

import copy
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, Self

import numpy as np

from core.batch_slots import split_by_length

if TYPE_CHECKING:
    from seq2seq_models.config import ModelConfig

# The inputs of the batched decoder (`batch_graph.BatchedDecoder`, `decoder_batch.onnx`), by name:
# `gather` makes them. Here, not in batch_graph, so ONNX Runtime callers need no torch.
BATCH_INPUTS = ["tokens", "block_lens", "past_lens", "past_k", "past_v", "cross_k", "cross_v", "src_lens", "head_rows"]
NAR_BATCH_INPUTS = [*BATCH_INPUTS, "mask_from"]
# The K/V inputs of the decoders: `gather` gives each stacked over the layers; the exported graphs
# take one input per layer (`layer_inputs`), fed views of the stack (`per_layer`).
LAYERED = ("past_k", "past_v", "cross_k", "cross_v")


def layer_inputs(names: Sequence[str], layers: int) -> list[str]:
    """`names` with each K/V input expanded into one per layer: past_k -> past_k_0, ..., past_k_{L-1}."""
    out: list[str] = []
    for name in names:
        out.extend([f"{name}_{i}" for i in range(layers)] if name in LAYERED else [name])
    return out


def per_layer(feeds: dict[str, Any]) -> dict[str, Any]:
    """Feeds with each stacked K/V array [L, ...] given as one view per layer (no copy: a layer of a
    pool's leading rows is contiguous)."""
    out: dict[str, Any] = {}
    for name, value in feeds.items():
        if name in LAYERED:
            out.update((f"{name}_{i}", value[i]) for i in range(value.shape[0]))
        else:
            out[name] = value
    return out


class Arrays(Protocol):
    """How a backend makes arrays: zeros of its dtype and device. `lazy`: whether those zeros cost no
    memory until touched (room a buffer never uses is then free: `KVPool._room`)."""

    lazy: bool

    def zeros(self, shape: tuple[int, ...]) -> Any: ...



class NumpyArrays:
    """`Arrays` of float32 numpy (ONNX Runtime's host arrays)."""

    # numpy's zeros are pages the system maps on first touch: room a buffer never uses costs nothing.
    lazy = True

    @staticmethod
    def zeros(shape: tuple[int, ...]) -> np.ndarray:
        return np.zeros(shape, np.float32)



_KEYS = ("k", "ck")  # the pool's arrays of keys, stored transposed (positions last)


def _round_up(n: int, step: int) -> int:
    return -(-n // step) * step


class KVPool:
    """The K/V of a model's open rows (see the module docstring). Not thread-safe: its owner (a
    verifier, a drafter) serialises the forwards and the opening and closing of rows."""

    ROW_STEP = 8  # the rows' capacity grows in these steps, and keeps its peak
    POSITION_STEP = 16  # self-attention capacity: a multiple of this, fitted to the longest row
    # Cross-attention capacity: the longest source exactly, since sources never grow; shrunk once the
    # longest has left and the padding is more than an eighth of the longest source still held.
    SOURCE_SLACK = 8
    # Free slots among the used ones ride along in a forward fed the arrays as they are (their
    # positions read like a row's); once more than one in this many, the last rows move into them.
    COMPACT_FREE = 4
    # A forward over at least this share of the occupied rows feeds the pool's arrays as they are.
    DIRECT_SHARE = 0.75
    # The most floats of room a buffer is made with beyond its layout (`_room`).
    ROOM_FLOATS = 64 << 20

    def __init__(self, arrays: Arrays, layers: int, heads: int, head_dim: int, max_positions: int = 0,
                 max_sources: int = 0) -> None:
        self.arrays = arrays
        self.layers, self.heads, self.head_dim = layers, heads, head_dim
        # The most positions a row's self-attention and its source hold (the model's limits; 0: unknown).
        self.max_positions, self.max_sources = max_positions, max_sources
        self.slots: list[RowSlot | None] = []  # slots[i].index == i; None: free (never the last)
        self.row_capacity = 0
        self.positions = 0  # self-attention positions every slot has room for
        self.sources = 0  # cross-attention positions likewise
        self.k: Any = None  # [L, row_capacity, H, hd, positions] (keys transposed)
        self.v: Any = None  # [L, row_capacity, H, positions, hd]
        self.ck: Any = None  # [L, row_capacity, H, hd, sources]
        self.cv: Any = None  # [L, row_capacity, H, sources, hd]
        # Each array is a view of a flat buffer, and a re-layout copies into a second one, kept from
        # the last: memory touched for the first time costs far more than a copy (page faults:
        # BENCHMARKS.md, "Bulk decoding: notes"), so buffers are reused and only grow.
        self._flat: dict[str, Any] = {}
        self._spare: dict[str, Any] = {}

    def empty_like(self) -> KVPool:
        """An empty pool of the same arrays, shape and limits (a twin's)."""
        return KVPool(self.arrays, self.layers, self.heads, self.head_dim, self.max_positions, self.max_sources)

    @property
    def n(self) -> int:
        """Slots up to the last one in use (a direct feed's rows: free ones among them included)."""
        return len(self.slots)

    @property
    def used(self) -> list[RowSlot]:
        """The slots in use."""
        return [slot for slot in self.slots if slot is not None]

    @property
    def nbytes(self) -> int:
        """Bytes of the buffers the pool holds (both of each array's)."""
        buffers = [*self._flat.values(), *self._spare.values()]
        return sum(int(b.nelement() * b.element_size()) if hasattr(b, "nelement") else int(b.nbytes) for b in buffers)

    def acquire(self) -> RowSlot:
        """A new row's slot (holding no positions and no source yet): the first free one."""
        index = next((i for i, slot in enumerate(self.slots) if slot is None), len(self.slots))
        slot = RowSlot(self, index)
        if index == len(self.slots):
            self.slots.append(slot)
            if len(self.slots) > self.row_capacity:
                self._regrow(len(self.slots))
        else:
            self.slots[index] = slot
        return slot

    def release(self, slot: RowSlot) -> None:
        """Free `slot` (once). Its place stays free for the next row; when free places are more than
        a quarter of the slots up to the last one in use, the last rows move into them (rows that
        leave together, a cohort's, then cost no copies)."""
        if slot.released:
            return
        slot.released = True
        self.slots[slot.index] = None
        while self.slots and self.slots[-1] is None:
            self.slots.pop()
        free = [i for i, s in enumerate(self.slots) if s is None]
        if self.COMPACT_FREE * len(free) > len(self.slots):
            for i in free:
                while self.slots and self.slots[-1] is None:
                    self.slots.pop()
                if i >= len(self.slots):
                    break
                self._move(self.slots.pop(), i)

    def _move(self, row: RowSlot, i: int) -> None:
        """Move `row` into free slot `i` (one copy of what it holds)."""
        j, held, src = row.index, row.held, row.src_len
        self.k[:, i, ..., :held] = self.k[:, j, ..., :held]
        self.v[:, i, :, :held] = self.v[:, j, :, :held]
        self.ck[:, i, ..., :src] = self.ck[:, j, ..., :src]
        self.cv[:, i, :, :src] = self.cv[:, j, :, :src]
        row.index = i
        self.slots[i] = row

    def reserve(self, rows: int) -> None:
        """Room for `rows` rows (a bulk run's rows in flight), so that they never re-lay the pool out."""
        if rows > self.row_capacity:
            self._regrow(rows)

    def _regrow(self, rows: int) -> None:
        """Room for `rows` rows, the positions fitted to the rows in use: capacities a batch's last,
        long rows needed would be padding for every new row (and a larger buffer than needed)."""
        self._layout(rows=_round_up(rows, self.ROW_STEP), positions=max(self.POSITION_STEP, self._longest("held")),
                     sources=max(1, self._longest("src_len")))

    def ensure(self, positions: int = 0, sources: int = 0) -> None:
        """Room for `positions` self-attention and `sources` cross-attention positions in every slot
        (positions rounded up to their step: a re-layout copies what the rows hold, and a padded
        position costs every forward, so the capacity grows a step at a time; sources exactly)."""
        if positions > self.positions:
            self._layout(positions=positions)
        if sources > self.sources:
            self._layout(sources=sources)

    def fit(self, positions: int = 0) -> None:
        """Shrink capacities the rows no longer need (the longest left): a forward fed the arrays as
        they are attends over all of them, so padded positions cost every forward (BENCHMARKS.md,
        "Bulk decoding: notes"). `positions`: room still wanted
        (the coming blocks)."""
        need_p = _round_up(max(positions, self._longest("held")), self.POSITION_STEP)
        if self.positions > need_p + self.POSITION_STEP:
            self._layout(positions=need_p)
        need_s = max(1, self._longest("src_len"))
        if self.sources > need_s + max(1, need_s // self.SOURCE_SLACK):
            self._layout(sources=need_s)

    def _layout(self, rows: int | None = None, positions: int | None = None, sources: int | None = None) -> None:
        """New arrays for the capacities given (positions rounded up; the others kept), holding what the rows
        hold: the self-attention pair when rows or positions change, the cross-attention pair when
        rows or sources do."""
        n = len(self.slots)
        new_rows = self.row_capacity if rows is None else rows
        if rows is None and new_rows > _round_up(max(n, 1), self.ROW_STEP) and self._outgrows(positions, sources):
            # Longer rows than ever, with few rows in use (a batch's last, long ones): rows enough for
            # those in use, in the buffers there are, rather than new buffers for the rows reserved.
            # Fresh memory costs far more than the re-layout when the next rows come (see above).
            new_rows = _round_up(max(n, 1), self.ROW_STEP)
        resized = new_rows != self.row_capacity
        if positions is not None or resized or self.k is None:
            p = max(_round_up(self.positions if positions is None else positions, self.POSITION_STEP),
                    self.POSITION_STEP)
            held = self._longest("held")
            self.k, self.v = (self._moved(name, new_rows, p, held, n) for name in ("k", "v"))
            self.positions = p
        if sources is not None or resized or self.ck is None:
            s = max(self.sources if sources is None else sources, 1)
            held = self._longest("src_len")
            self.ck, self.cv = (self._moved(name, new_rows, s, held, n) for name in ("ck", "cv"))
            self.sources = s
        self.row_capacity = new_rows

    def _longest(self, valid: str) -> int:
        """The most positions any row in use holds: `held` (self-attention) or `src_len` (source)."""
        return max([0, *(getattr(slot, valid) for slot in self.slots if slot is not None)])

    def _outgrows(self, positions: int | None, sources: int | None) -> bool:
        """Whether laying out `positions` (or `sources`) for the rows' capacity needs a new buffer (the
        spare one, which a re-layout copies into, is too small)."""
        if positions is not None:
            names, width = ("k", "v"), _round_up(positions, self.POSITION_STEP)
        elif sources is not None:
            names, width = ("ck", "cv"), sources
        else:
            return False
        size = self.layers * self.row_capacity * self.heads * width * self.head_dim
        return any(self._spare.get(name) is None or size > int(self._spare[name].shape[0]) for name in names)

    def _shape(self, name: str, rows: int, positions: int) -> tuple[int, ...]:
        """Array `name`'s shape for `rows` rows of `positions` positions (keys transposed)."""
        if name in _KEYS:
            return (self.layers, rows, self.heads, self.head_dim, positions)
        return (self.layers, rows, self.heads, positions, self.head_dim)

    def gathered(self, name: str, blocks: Sequence[RowBlock], positions: int, valid: str) -> Any:
        """The first `positions` positions of array `name`'s rows of `blocks`, copied into a buffer of
        the pool's kept from call to call (fresh memory each forward would cost more than the copy):
        each row's valid ones (its slot's `valid` count, at most `positions`), the rest stale or
        zero, finite either way and masked by the graph."""
        array = getattr(self, name)
        shape = self._shape(name, len(blocks), positions)
        size = self.layers * len(blocks) * self.heads * positions * self.head_dim
        key = f"gathered_{name}"
        buffer = self._spare.get(key)
        if buffer is None or int(buffer.shape[0]) < size:
            buffer = self._spare[key] = self.arrays.zeros((max(size + size // 2, self._room(name, self.row_capacity)),))
        out = buffer[:size].reshape(shape)
        keys = name in _KEYS
        for i, blk in enumerate(blocks):
            n = min(positions, getattr(blk.slot, valid))
            if keys:
                out[:, i, ..., :n] = array[:, blk.slot.index, ..., :n]
            else:
                out[:, i, :, :n] = array[:, blk.slot.index, :, :n]
        return out

    def _room(self, name: str, rows: int) -> int:
        """The floats a new buffer of array `name` is made with for `rows` rows, at least: where zeros
        cost nothing until touched (`Arrays.lazy`), room for the longest layout the model allows
        (at most ROOM_FLOATS), so the re-layouts of rows growing a step at a time, and the gathers of
        longer rows, reuse the pages they touched rather than touch new ones (memory touched for the
        first time costs far more than a copy: BENCHMARKS.md, "Bulk decoding: notes"); elsewhere
        (torch's zeros write them), none."""
        if not self.arrays.lazy:
            return 0
        width = _round_up(self.max_positions, self.POSITION_STEP) if name in ("k", "v") else self.max_sources
        return min(self.layers * rows * self.heads * self.head_dim * width, self.ROOM_FLOATS)

    def _moved(self, name: str, rows: int, positions: int, held: int, n: int) -> Any:
        """Array `name` laid out anew as `rows` x `positions`, in the spare buffer (grown if it is too
        small), holding the first `n` rows' first `held` positions of the current one; the current
        buffer becomes the spare. Positions never written are zeros or stale K/V: finite either way,
        and masked."""
        shape = self._shape(name, rows, positions)
        size = self.layers * rows * self.heads * positions * self.head_dim
        spare = self._spare.get(name)
        if spare is None or int(spare.shape[0]) < size:
            # At least as large as the largest one yet, with room to grow: capacities go up and down
            # as rows come and go, and a buffer as large as the peak serves them all.
            current = self._flat.get(name)
            peak = max(size, 0 if current is None else int(current.shape[0]))
            # Not touched now: numpy's zeros are pages the system maps on first touch, so the room to
            # grow costs nothing until a layout uses it (touching all of it up front cost more).
            spare = self.arrays.zeros((max(peak + peak // 2, self._room(name, rows)),))
        new = spare[:size].reshape(shape)
        old = getattr(self, name)
        if old is not None and n:
            n = min(n, int(old.shape[1]), rows)  # a slot taken just now holds nothing yet
            if name in _KEYS:
                p = min(held, int(old.shape[4]), positions)
                new[:, :n, ..., :p] = old[:, :n, ..., :p]
            else:
                p = min(held, int(old.shape[3]), positions)
                new[:, :n, :, :p] = old[:, :n, :, :p]
        if name in self._flat:
            self._spare[name] = self._flat[name]
        self._flat[name] = spare
        return new


class PoolOwner:
    """A model's side of its rows: their `KVPool` and the lock under which its forwards and rows
    taking or leaving slots take turns (in-process sessions may step from threads of their own).
    Shared by the verifier and the NAR drafter (`BatchVerifier`, `BatchNarDrafter`)."""

    pool: KVPool
    lock: threading.RLock

    def own_pool(self, arrays: Arrays, config: ModelConfig) -> None:
        """A pool of the model's decoder shape, empty, and its lock."""
        shape = config.decoder_shape
        self.pool = KVPool(arrays, config.decoder_layers, shape.heads, shape.head_dim, config.max_len, config.max_len)
        self.lock = threading.RLock()

    def reserve_rows(self, rows: int) -> None:
        """Room in the pool for `rows` rows at once (a bulk run's), so they never re-lay it out."""
        with self.lock:
            self.pool.reserve(rows)

    def twin(self) -> Self:
        """The same model (engine, graphs, weights) with a pool and lock of its own: a model worker
        of its own over one copy of the weights (`specdec decode --workers`, `[verifier] model_workers`)."""
        other = copy.copy(self)
        other.pool = self.pool.empty_like()
        other.lock = threading.RLock()
        return other

    def slot_of(self, row: Any) -> RowSlot:
        """`row.slot`, taken from the pool now if it has none (under the lock)."""
        if row.slot is None:
            row.slot = self.pool.acquire()
        return row.slot


class RowSlot:
    """One row's place in its pool: self-attention positions [0, held) and its source's
    cross-attention positions [0, src_len) are valid. `index` moves when rows are freed."""

    def __init__(self, pool: KVPool, index: int) -> None:
        self.pool = pool
        self.index = index
        self.held = 0
        self.src_len = 0  # 0: no source yet
        self.released = False

    @property
    def k(self) -> Any:
        """This row's self-attention K [L, H, hd, positions] (a view of the pool's array)."""
        return self.pool.k[:, self.index]

    @property
    def v(self) -> Any:
        return self.pool.v[:, self.index]

    @property
    def nbytes(self) -> int:
        """This row's share of its pool."""
        pool = self.pool
        return 8 * pool.layers * pool.heads * pool.head_dim * (pool.positions + pool.sources)

    def write(self, start: int, k: Any, v: Any) -> None:
        """Store a block's K [L, H, hd, n] (transposed) and V [L, H, n, hd] at positions
        start..start+n; the row then holds start + n."""
        n = int(v.shape[2])
        self.held = min(self.held, start)
        pool = self.pool
        pool.ensure(positions=start + n)
        pool.k[:, self.index, ..., start : start + n] = k
        pool.v[:, self.index, :, start : start + n] = v
        self.held = start + n

    def set_source(self, k: Any, v: Any) -> None:
        """Store its source's cross-attention K [L, H, hd, S] (transposed) and V [L, H, S, hd] (S
        includes the source's EOS)."""
        s = int(v.shape[2])
        pool = self.pool
        pool.ensure(sources=s)
        pool.ck[:, self.index, ..., :s] = k
        pool.cv[:, self.index, :, :s] = v
        self.src_len = s

    def fork(self, keep: int) -> RowSlot:
        """A new row holding a copy of this row's first `keep` positions and its source (beam search)."""
        keep = min(keep, self.held)
        pool = self.pool
        other = pool.acquire()
        i, j, s = self.index, other.index, self.src_len
        pool.k[:, j, ..., :keep], pool.v[:, j, :, :keep] = pool.k[:, i, ..., :keep], pool.v[:, i, :, :keep]
        pool.ck[:, j, ..., :s], pool.cv[:, j, :, :s] = pool.ck[:, i, ..., :s], pool.cv[:, i, :, :s]
        other.held, other.src_len = keep, s
        return other

    def release(self) -> None:
        self.pool.release(self)


@dataclass
class RowBlock:
    """One row of a forward: feed `fed` after the row's first `past_len` cached positions, and
    report the head for block positions `head_from..` (one per entry of `targets`, -1 = none)."""

    slot: RowSlot
    fed: list[int]
    past_len: int
    head_from: int
    targets: list[int]


class Encoder(Protocol):
    """What encodes sources: a batched engine (`torch_engine.TorchBatchEngine`, `ort_engine.OrtBatchEngine`)."""

    def encode_batch(self, sources: list[list[int]]) -> tuple[Any, Any]:
        """Cross-attention K and V [L, B, H, S, hd] of the right-padded sources (EOS appended)."""
        ...


class Source:
    """A session's source ids until they are encoded, together with other new sources (`encode_new`:
    by the verifier service's encoder scheduler soon after open, or by the first forward that needs
    them), into its row's slot. Released when its session closes.

    Not encoding inside `open` is what lets concurrent sessions share one encoder run: under load
    the encoder was about a quarter of the verifier's work (py-spy, GAD at 32 clients), and a batch
    of sources costs less per source than one run each. A session closed before it is encoded
    never is."""

    def __init__(self, source_ids: list[int]) -> None:
        self.ids = list(source_ids)
        self.encoded = False
        self.released = False  # its session closed: never encoded again

    def release(self) -> None:
        self.released = True


def encode_new(encoder: Encoder, pending: Sequence[tuple[Source, RowSlot]], split_tokens: int = 0,
               on_run: Callable[[int], None] | None = None) -> None:
    """Encode those of the `pending` sources not encoded yet and not released (each once, however often
    it appears), each into its slot: one run, or one per group of lengths where the padding saved
    outweighs a run's fixed cost of `split_tokens` tokens (`core.batch_slots.split_by_length`; 0: one
    run). `on_run` is told the number of sources of each run (a service's metrics)."""
    new = list({id(s): (s, slot) for s, slot in pending if not s.encoded and not s.released}.values())
    if not new:
        return
    # Room for the longest first: one re-layout, not one per longer source in turn.
    new[0][1].pool.ensure(sources=max(len(s.ids) + 1 for s, _ in new))
    for group in split_by_length([len(s.ids) + 1 for s, _ in new], split_tokens):
        batch = [new[i] for i in group]
        k, v = encoder.encode_batch([s.ids for s, _ in batch])
        for i, (source, slot) in enumerate(batch):
            n = len(source.ids) + 1
            slot.set_source(k[:, i, ..., :n], v[:, i, :, :n])
            source.encoded = True
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


def gather(blocks: Sequence[RowBlock], pool: KVPool) -> tuple[dict[str, Any], list[int]]:
    """The batched decoder's inputs (`BATCH_INPUTS` plus `targets`) for `blocks`, all rows of `pool`,
    and the batch row each block is in. Int inputs are int64 numpy arrays; K/V are the pool's arrays
    (or gathered from them), stacked over the layers."""
    t = max(len(b.fed) for b in blocks)
    end = max(b.past_len + len(b.fed) for b in blocks)
    pool.ensure(positions=end)  # room for the blocks' K/V after
    direct = len(blocks) >= pool.DIRECT_SHARE * pool.n  # the slots up to the last in use, free ones too
    if direct:
        pool.fit(end)
        rows = [b.slot.index for b in blocks]
        b = pool.n
        past_k, past_v, cross_k, cross_v = pool.k[:, :b], pool.v[:, :b], pool.ck[:, :b], pool.cv[:, :b]
    else:
        rows = list(range(len(blocks)))
        b = len(blocks)
        p = max(blk.past_len for blk in blocks)
        s = max(blk.slot.src_len for blk in blocks)
        past_k, past_v = (pool.gathered(name, blocks, p, "held") for name in ("k", "v"))
        cross_k, cross_v = (pool.gathered(name, blocks, s, "src_len") for name in ("ck", "cv"))
    tokens = np.zeros((b, t), np.int64)
    # Rows no block is in (a direct feed's dummies): one token, no past, one source position.
    block_lens = np.ones(b, np.int64)
    past_lens = np.zeros(b, np.int64)
    src_lens = np.ones(b, np.int64)
    past_lens[rows] = [blk.past_len for blk in blocks]
    src_lens[rows] = [blk.slot.src_len for blk in blocks]
    if t == 1 and all(blk.head_from == 0 and len(blk.targets) == 1 for blk in blocks):
        # AR steps: one token and one head row each, set for all rows at once.
        tokens[rows, 0] = [blk.fed[0] for blk in blocks]
        head_rows = np.array(rows, np.int64)
        targets = np.array([blk.targets[0] for blk in blocks], np.int64)
    else:
        head: list[int] = []
        aimed: list[int] = []
        for blk, r in zip(blocks, rows, strict=True):
            tokens[r, : len(blk.fed)] = blk.fed
            block_lens[r] = len(blk.fed)
            head.extend(range(r * t + blk.head_from, r * t + blk.head_from + len(blk.targets)))
            aimed.extend(blk.targets)
        head_rows, targets = np.array(head, np.int64), np.array(aimed, np.int64)
    return {
        "tokens": tokens,
        "block_lens": block_lens,
        "past_lens": past_lens,
        "past_k": past_k,
        "past_v": past_v,
        "cross_k": cross_k,
        "cross_v": cross_v,
        "src_lens": src_lens,
        "head_rows": head_rows,
        "targets": targets,
    }, rows


def scatter(blocks: Sequence[RowBlock], rows: Sequence[int], block_k: Any, block_v: Any) -> None:
    """Append each block's real positions from the forward's block K [L, B, H, hd, T] (transposed) and
    V [L, B, H, T, hd] (block i is batch row `rows[i]`) to its row's slot."""
    if isinstance(block_k, np.ndarray) and all(len(blk.fed) == 1 for blk in blocks):
        # Every block one token (AR steps): one copy per array for all the rows.
        pool = blocks[0].slot.pool
        pool.ensure(positions=max(blk.past_len for blk in blocks) + 1)
        index = np.array([blk.slot.index for blk in blocks])
        at = np.array([blk.past_len for blk in blocks])
        pool.k[:, index, :, :, at] = block_k[:, rows, :, :, 0]
        pool.v[:, index, :, at] = block_v[:, rows, :, 0]
        for blk in blocks:
            blk.slot.held = blk.past_len + 1
        return
    for blk, r in zip(blocks, rows, strict=True):
        n = len(blk.fed)
        blk.slot.write(blk.past_len, block_k[:, r, ..., :n], block_v[:, r, :, :n])
