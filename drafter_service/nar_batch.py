"""NAR block drafts of many sessions in one forward, written once for both backends.

A `NarRow` is the NAR drafter's view of one session: its source, the client's output prefix and a
slot of the drafter's K/V pool (`seq2seq_models.row_cache.KVPool`: the row's KV cache and its
source's cross-attention K/V). `sync` only records the new prefix; the tokens the cache lacks are
fed with the next draft's k [MASK]s, so a draft is one forward whatever it appends.
`BatchNarDrafter.draft_rows` takes the drafts of many rows, runs ONE forward of
`seq2seq_models.batch_graph.BatchedDecoder` with per-row `mask_from`
(the committed tokens causal, the masks seeing the row's whole prefix and block) over all of them
(a `NarEngine`: eager torch, `drafter_service.torch_nar`, or ONNX Runtime, `drafter_service.onnx_nar`), keeps
each row's committed positions' K/V (never the masks') and answers each row in its slot: the mask
positions' argmax ids (ties to the lowest id), or the exception that row raised.

A lone row goes through the engine's `forward_one` when it has one (ONNX Runtime's unpadded
one-row graph), as the verifier's `step_batch` does. The pool is the drafter's: its forwards, and
rows taking or leaving slots, take turns (a lock).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol

import numpy as np

from core.batch_slots import answer_in_slots, split_source_tokens_for
from core.checks import check_session_step
from core.errors import out_of_step
from seq2seq_models.config import ModelConfig
from seq2seq_models.row_cache import Arrays, PoolOwner, RowBlock, RowSlot, Source, encode_new, gather

DraftOutcome = list[int] | BaseException


class NarEngine(Arrays, Protocol):
    """One backend's NAR forward. It may also have `forward_one(block, mask_from)`, the same forward
    for one row without padding; `draft_rows` uses it for a lone row."""

    device: str  # "cpu" or "cuda:N"

    def encode_batch(self, sources: list[list[int]]) -> tuple[Any, Any]: ...

    def forward(self, feeds: dict[str, Any]) -> tuple[Any, Any, np.ndarray]:
        """`row_cache.gather`'s feeds plus `mask_from` -> block_k, block_v [L, B, H, T, hd] (backend
        arrays) and the argmax ids [R] of the mask positions (`head_rows`), numpy."""
        ...


class NarRow:
    """One session's NAR drafter state (the `PrefixState` protocol: `tokens`, `max_tokens`, `sync`)."""

    def __init__(self, drafter: BatchNarDrafter, source_ids: list[int]) -> None:
        cfg = drafter.config
        self.drafter = drafter
        self.config = cfg
        self.source = Source(source_ids)  # encoded by its first forward (`row_cache.Source`)
        self.slot: RowSlot | None = None  # its place in the drafter's pool: taken by its first forward
        self.tokens: list[int] = []  # the client's output prefix after BOS
        self.valid = 0  # leading positions (BOS first) whose K/V the cache holds for this prefix

    @property
    def closed(self) -> bool:
        return self.source.released

    @property
    def max_tokens(self) -> int:
        return self.config.max_len - 1

    @property
    def cache_bytes(self) -> int:
        return 0 if self.closed or self.slot is None else self.slot.nbytes

    def sync(self, committed_len: int, append_ids: list[int]) -> None:
        if self.closed:
            raise out_of_step("the session is closed")
        check_session_step(committed_len, len(self.tokens), len(append_ids), 0, self.config)
        self.tokens = [*self.tokens[:committed_len], *append_ids]
        self.valid = min(self.valid, 1 + committed_len)

    def close(self) -> None:
        with self.drafter.lock:
            self.source.release()
            if self.slot is not None:
                self.slot.release()

    def block(self, k: int) -> tuple[RowBlock, int]:
        """The row's block for a draft of `k` masks (the uncached committed tokens, then the masks)
        and where its masks start."""
        cfg = self.config
        fed = [cfg.bos_id, *self.tokens][self.valid :]
        slot = self.drafter.slot_of(self)
        return RowBlock(slot, [*fed, *[cfg.mask_id] * k], self.valid, len(fed), [-1] * k), len(fed)


class BatchNarDrafter(PoolOwner):
    """The NAR drafter of both backends over an engine: `open` a row, `draft_rows` many at once."""

    # Told the number of sources of every encoder run (the service's metrics); None: nobody listens.
    on_encode: Callable[[int], None] | None = None

    def __init__(self, config: ModelConfig, engine: NarEngine) -> None:
        self.config = config
        self.engine = engine
        self.split_source_tokens = split_source_tokens_for(engine.device)  # `row_cache.encode_new`'s split
        self.own_pool(engine, config)

    def open(self, source_ids: list[int]) -> NarRow:
        return NarRow(self, source_ids)

    def draft_rows(self, items: Sequence[tuple[NarRow, int]]) -> list[DraftOutcome]:
        """k >= 1 draft ids for each (row, k), one forward over every valid row; one outcome per item."""
        with self.lock:
            return answer_in_slots(items, self._plan, self._run, what="draft")

    def _plan(self, slot: int, row: NarRow, k: int) -> tuple[int, NarRow, RowBlock, int]:
        if not isinstance(row, NarRow) or row.drafter is not self:
            raise ValueError("the row does not belong to this drafter")
        if row.closed:
            raise out_of_step("the session is closed")
        if k < 1:
            raise ValueError(f"a block draft needs k >= 1, got {k}")
        return (slot, row, *row.block(k))

    def _run(self, planned: list[tuple[int, NarRow, RowBlock, int]], outcomes: list[DraftOutcome | None]) -> None:
        # New sessions' sources, in one run (or one per group of lengths on a CPU).
        pending = [(row.source, block.slot) for _, row, block, _ in planned]
        encode_new(self.engine, pending, self.split_source_tokens, self.on_encode)
        blocks = [b for _, _, b, _ in planned]
        one = getattr(self.engine, "forward_one", None)
        if len(planned) == 1 and one is not None:  # a lone row: the engine's unpadded path
            _, row, block, mask_from = planned[0]
            block_k, block_v, ids = one(block, mask_from)
            rows = [0]
        else:
            feeds, rows = gather(blocks, self.pool)
            mask_from = np.zeros(len(feeds["block_lens"]), np.int64)  # a direct feed's dummy rows: none
            for (*_, m), r in zip(planned, rows, strict=True):
                mask_from[r] = m
            feeds["mask_from"] = mask_from
            block_k, block_v, ids = self.engine.forward(feeds)
        head = 0
        for (slot, row, block, mask_from), r in zip(planned, rows, strict=True):
            k = len(block.targets)
            if row.closed:  # closed while its forward ran: refused, its state not revived
                outcomes[slot] = out_of_step("the session is closed")
            else:
                if mask_from:  # keep the committed tokens' K/V; the masks' are never cached
                    block.slot.write(block.past_len, block_k[:, r, ..., :mask_from], block_v[:, r, :, :mask_from])
                row.valid = 1 + len(row.tokens)
                outcomes[slot] = [int(t) for t in ids[head : head + k]]
            head += k
