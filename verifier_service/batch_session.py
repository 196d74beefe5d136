"""Verifier sessions whose steps run in ragged batches, written once for both backends.

A session holds one source and one or more rows (`Row`: output tokens and a slot of the verifier's
K/V pool, `seq2seq_models.row_cache.KVPool`, which holds the row's KV cache and its source's
cross-attention K/V). `BatchVerifier.step_batch` takes the steps of many sessions
(`core.interfaces.StepCall`, single- or multi-row), validates each, runs ONE forward of
`seq2seq_models.batch_graph.BatchedDecoder` over all their rows (an `Engine`: eager torch or ONNX
Runtime), appends every row's block to its cache and answers each item in its slot: a
`VerifyResult`, a list of them for a multi-row step, or the exception that item raised (a closed
session, a step out of step, ...) without failing the others. `session.step` is a batch of one. The
pool is the verifier's, so its forwards, and the opening and closing of rows, take turns (a lock:
in-process sessions may step from threads of their own).

A single-row step is today's protocol: keep `committed_len` tokens, append `append_ids`, score
`draft_ids`; the block fed is `append + draft` after the kept prefix. When nothing is appended,
the position whose state predicts d_1 is already cached: it is re-fed (its K/V are recomputed
identically), so the head rows always start inside the block and no hidden states are kept.

A multi-row step (`step_rows`, beam search) replaces the session's rows: row i forks the current
row `parent` (cut to `committed_len`, then `append_ids`), one head position each. The first child
of a parent takes over the parent's slot; further children get a slot holding a copy of its kept
prefix and source (made before the forward writes anything); rows no child names are freed. The
prefix is never recomputed.

A session opened with logits processors (`core.logits_processors.Processors`) keeps each row's
processor state (`RowState`) beside its cache, forked and rolled back with it; before the forward,
the state gives each head row its plan (each drafted position's given the prefix accepted so far),
and the engine's head applies them (`Processing`).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from core.batch_slots import answer_in_slots, split_by_length, split_source_tokens_for, split_tokens_for
from core.checks import check_session_step
from core.errors import invalid, out_of_step
from core.greedy import greedy_next, merge_greedy
from core.interfaces import BeamRow, StepCall, VerifyResult
from core.logits_processors import Processing, Processors, RowPlan, RowState, processing
from seq2seq_models.config import ModelConfig
from seq2seq_models.row_cache import Arrays, PoolOwner, RowBlock, RowSlot, Source, encode_new, gather, scatter
from verifier_service.model_verifier import ModelVerifier

StepOutcome = VerifyResult | list[VerifyResult] | BaseException


class Engine(Arrays, Protocol):
    """One backend's forward: encoding sources, its arrays (`row_cache.Arrays`), and the batched
    decoder with the head.

    An engine may also have `forward_one(block, top_k, processing=None)`, the same forward for a
    batch of one row without padding (ONNX Runtime's one-row graph), whose processors act on logits
    only; `step_batch` uses it for lone rows but beam search's (log-prob space)."""

    device: str  # "cpu" or "cuda:N"

    def encode_batch(self, sources: list[list[int]]) -> tuple[Any, Any]: ...

    # Whether the head applies logits processors (`forward`'s `processing`).
    processes_logits: bool

    def forward(
        self, feeds: dict[str, Any], top_k: int, processing: Processing | None = None
    ) -> tuple[Any, Any, np.ndarray, np.ndarray, np.ndarray]:
        """`row_cache.gather`'s feeds -> block_k, block_v [L, B, H, T, hd] (backend arrays) and the
        head's topk_logprobs [R, top_k], topk_ids [R, top_k], target_logprobs [R] as numpy, after
        the head rows' logits processors (`processing`, None: none)."""
        ...


@dataclass
class Row:
    tokens: list[int]  # output tokens after BOS whose K/V the row holds (drafts included)
    slot: RowSlot | None = None  # its place in the verifier's pool: taken by its first encode or step
    state: RowState | None = None  # the logits processors' state, when the session has processors


class BatchSession:
    """A verifier session (`core.interfaces.VerifierSession` and `MultiRowSession`) of a `BatchVerifier`."""

    def __init__(self, verifier: BatchVerifier, source_ids: list[int], processors: Processors | None = None) -> None:
        self._verifier = verifier
        self.source = Source(source_ids)  # encoded by its first forward (`row_cache.Source`)
        self.processors = processors if processors is not None and processors.active else None
        state = None
        if self.processors is not None:
            cfg = verifier.config
            state = RowState.open(self.processors, cfg.eos_id, cfg.bos_id, [*source_ids, cfg.eos_id])
        self.rows: list[Row] = [Row([], None, state)]

    @property
    def closed(self) -> bool:
        return self.source.released

    @property
    def tokens(self) -> list[int]:
        """Row 0's tokens (the only row of a single-row session)."""
        return self.rows[0].tokens if self.rows else []

    @property
    def cache_bytes(self) -> int:
        return sum(r.slot.nbytes for r in self.rows if r.slot is not None)

    def step(self, committed_len: int, append_ids: list[int], draft_ids: list[int], top_k: int) -> VerifyResult:
        result = self._verifier.step_batch([(self, StepCall(committed_len, append_ids, draft_ids, top_k))])[0]
        if isinstance(result, BaseException):
            raise result
        assert isinstance(result, VerifyResult)
        return result

    def step_greedy(self, committed_len: int, append_ids: list[int], steps: int, top_k: int) -> VerifyResult:
        """`core.interfaces.GreedySession.step_greedy`: the steps one after the other, in process."""
        call: StepCall | None = StepCall(committed_len, list(append_ids), [], top_k)
        verifier = self._verifier
        results: list[VerifyResult] = []
        while call is not None:
            result = self.step(call.committed_len, call.append_ids, [], top_k)
            results.append(result)
            call = greedy_next(call, result, len(results), steps, verifier.eos_id, verifier.max_target_len)
        return merge_greedy(results)

    def step_rows(self, rows: list[BeamRow], top_k: int) -> list[VerifyResult]:
        result = self._verifier.step_batch([(self, StepCall(top_k=top_k, rows=list(rows)))])[0]
        if isinstance(result, BaseException):
            raise result
        assert isinstance(result, list)
        return result

    def close(self) -> None:
        with self._verifier.lock:
            self.source.release()
            _release(self.rows)
            self.rows = []


@dataclass
class _Planned:
    """One item of a batch after validation: its rows' blocks and how to commit them."""

    slot: int
    session: BatchSession
    call: StepCall
    blocks: list[RowBlock]
    new_rows: list[Row]
    draft_lens: list[int] = field(default_factory=list)

    def plans(self, bos_id: int) -> list[list[RowPlan] | None]:
        """Each block's head rows' plans (None: the session has no processors). Brings each row's
        processor state to the block's whole sequence, drafts included, as its cache will hold."""
        out: list[list[RowPlan] | None] = []
        for block, row in zip(self.blocks, self.new_rows, strict=True):
            state = row.state
            if state is None:
                out.append(None)
                continue
            kept = [bos_id, *row.tokens[: block.past_len - 1]] if block.past_len else []
            sequence = kept + block.fed
            first = block.past_len + block.head_from + 1  # the first head row sees this much
            state.sync(sequence[:first])
            plans = [state.plan()]
            for token in sequence[first:]:
                state.push(token)
                plans.append(state.plan())
            out.append(plans[: len(block.targets)])
        return out


class BatchVerifier(ModelVerifier, PoolOwner):
    """The `core.interfaces.Verifier` of both backends, with `step_batch` (see the module docstring)."""

    engine: Engine
    # Told the number of sources of every encoder run (the service's metrics); None: nobody listens.
    on_encode: Callable[[int], None] | None = None
    # Told, after every decoder forward, the key positions its attention ran over (each row's past and
    # source, padded to the longest of the forward) and those the rows hold; None: nobody listens.
    on_attend: Callable[[int, int], None] | None = None

    def __init__(self, config: ModelConfig, engine: Engine) -> None:
        super().__init__(config)
        self.config = config
        self.engine = engine
        self.own_pool(engine, config)
        # A batch whose blocks differ in length runs as several forwards, one per group of lengths,
        # when the padding that saves (in token-rows) outweighs a forward's fixed cost:
        # `core.batch_slots.split_by_length`. 0: never split.
        self.split_tokens = split_tokens_for(engine.device)
        self.split_source_tokens = split_source_tokens_for(engine.device)  # the encoder's, likewise

    def open(self, source_ids: list[int], processors: Processors | None = None) -> BatchSession:
        """A session over `source_ids`; its source is encoded by its first forward, or before by
        `encode` (with other sessions' sources). `processors`: its logits processors (INVALID_ARGUMENT
        for settings no model could honour, or on a backend whose head has none)."""
        if processors is not None and processors.active:
            try:
                processors.check(self.vocab_size)
            except ValueError as exc:
                raise invalid(str(exc)) from None
            if not getattr(self.engine, "processes_logits", False):
                raise invalid(f"the {getattr(self, 'backend', 'this')} verifier's head applies no logits processors "
                              "(repetition_penalty, no_repeat_ngram_size, bad_words_ids, ...): use the torch backend")
        return BatchSession(self, source_ids, processors)

    def encode(self, sessions: Sequence[BatchSession]) -> None:
        """Encode the sources of `sessions` not encoded yet (nor closed) in one encoder run."""
        with self.lock:
            pending = [(s.source, self.slot_of(s.rows[0])) for s in sessions
                       if not s.source.encoded and not s.closed and s.rows]
            encode_new(self.engine, pending, self.split_source_tokens, self.on_encode)

    def step_batch(self, items: Sequence[tuple[BatchSession, StepCall]]) -> list[StepOutcome]:
        """One forward over every valid item's rows; one outcome per item, in order."""
        with self.lock:
            # The new sessions' sources first, in one run: a fork copies its parent's source.
            self.encode([s for s, _ in items if isinstance(s, BatchSession) and s._verifier is self])
            return answer_in_slots(items, self._plan, self._run)

    # ---- planning: validation and forks, nothing committed ------------------------------------

    def _plan(self, slot: int, session: BatchSession, call: StepCall) -> _Planned:
        if not isinstance(session, BatchSession) or session._verifier is not self:
            raise ValueError("the session does not belong to this verifier")
        if session.closed:
            raise out_of_step("the session is closed")
        if call.rows is None:
            row = session.rows[0]
            block = self._row_block(row, call.committed_len, call.append_ids, call.draft_ids)
            return _Planned(slot, session, call, [block], [row], [len(call.draft_ids)])
        return self._plan_rows(slot, session, call)

    def _plan_rows(self, slot: int, session: BatchSession, call: StepCall) -> _Planned:
        assert call.rows is not None
        taken: set[int] = set()
        blocks: list[RowBlock] = []
        new_rows: list[Row] = []
        for r in call.rows:
            if not 0 <= r.parent < len(session.rows):
                raise out_of_step(f"row parent {r.parent} but the session has {len(session.rows)} rows")
            parent = session.rows[r.parent]
            check_session_step(r.committed_len, len(parent.tokens), len(r.append_ids), 0, self.config)
        try:
            for r in call.rows:
                parent = session.rows[r.parent]
                if r.parent in taken:  # a further child: its own copy of the kept prefix (and processor state)
                    state = None if parent.state is None else parent.state.fork()
                    row = Row(parent.tokens[: r.committed_len], self.slot_of(parent).fork(1 + r.committed_len), state)
                else:  # the first child takes the parent's slot over
                    taken.add(r.parent)
                    row = Row(parent.tokens, self.slot_of(parent), parent.state)
                new_rows.append(row)
                blocks.append(self._row_block(row, r.committed_len, r.append_ids, []))
        except BaseException:  # the step is refused: its forks leave the pool again
            _release(_apart(new_rows, session.rows))
            raise
        return _Planned(slot, session, call, blocks, new_rows, [0] * len(blocks))

    def _row_block(self, row: Row, committed_len: int, append_ids: list[int], draft_ids: list[int]) -> RowBlock:
        cfg = self.config
        check_session_step(committed_len, len(row.tokens), len(append_ids), len(draft_ids), cfg)
        # Position 0 is BOS; reuse the kept positions' K/V except the one predicting d_1 when
        # nothing is appended (re-fed, see the module docstring); a fresh row feeds BOS too.
        first_row = committed_len + len(append_ids)
        slot = self.slot_of(row)
        past_len = min(1 + committed_len if append_ids else committed_len, slot.held)
        # The sequence [BOS, *kept, *append_ids, *draft_ids] from position past_len on, without
        # copying the kept prefix first.
        kept = row.tokens[past_len - 1 : committed_len] if past_len else [cfg.bos_id, *row.tokens[:committed_len]]
        return RowBlock(slot, [*kept, *append_ids, *draft_ids], past_len, first_row - past_len, [*draft_ids, -1])

    # ---- the forward and the commit -------------------------------------------------------------

    def _run(self, planned: list[_Planned], outcomes: list[StepOutcome | None]) -> None:
        try:
            self._forward_all(planned, outcomes)
        except BaseException:  # the forward failed: the rows forked for it leave the pool again
            for p in planned:
                _release(_apart(p.new_rows, p.session.rows))
            raise

    def _forward_all(self, planned: list[_Planned], outcomes: list[StepOutcome | None]) -> None:
        started = time.perf_counter()  # the load signal is the decoder's forward (encoding is per request)
        blocks: list[RowBlock] = []
        plans: list[tuple[list[RowPlan] | None, Processors | None]] = []  # each block's, with its settings
        for p in planned:
            blocks.extend(p.blocks)
            plans.extend((block_plans, p.session.processors) for block_plans in p.plans(self.config.bos_id))
        top_k = min(self.vocab_size, max(p.call.top_k for p in planned))
        # Each block's head rows [n_targets, k] (top-k log-probs, top-k ids) and draft log-probs.
        heads: list[tuple[list, list, list]] = [()] * len(blocks)  # type: ignore[list-item]
        groups = split_by_length([len(b.fed) for b in blocks], self.split_tokens)
        for group in groups:
            chosen = [blocks[i] for i in group]
            outs = self._forward(chosen, top_k, _processing(chosen, plans, group))
            for i, out in zip(group, outs, strict=True):
                heads[i] = out
        forward_s = time.perf_counter() - started
        load = {"batch_rows": len(blocks), "batch_tokens": sum(len(b.fed) for b in blocks), "forward_s": forward_s}
        at = 0  # the next block's index in `heads`
        for p in planned:
            if p.session.closed:  # closed while its forward ran: refused, its rows not revived
                outcomes[p.slot] = out_of_step("the session is closed")
                _release(_apart(p.new_rows, p.session.rows))
                at += len(p.blocks)
                continue
            k = min(p.call.top_k, self.vocab_size)
            results = []
            for block, row, n_draft in zip(p.blocks, p.new_rows, p.draft_lens, strict=True):
                topk_lp, topk_ids, target_lp = heads[at]
                at += 1
                if topk_ids and len(topk_ids[0]) > k:  # this step asked for fewer than the forward's widest
                    topk_ids, topk_lp = [r[:k] for r in topk_ids], [r[:k] for r in topk_lp]
                results.append(VerifyResult(
                    top1=[r[0] for r in topk_ids],
                    topk_ids=topk_ids,
                    topk_logprobs=topk_lp,
                    draft_logprobs=target_lp[:n_draft],
                    **load,
                ))
                row.tokens = row.tokens[: block.past_len - 1] + block.fed if block.past_len else block.fed[1:]
            if len(p.session.rows) > 1 or p.call.rows is not None:  # free the rows no child named
                _release(_apart(p.session.rows, p.new_rows))
            p.session.rows = p.new_rows
            outcomes[p.slot] = results[0] if p.call.rows is None else results

    def _forward(
        self, blocks: list[RowBlock], top_k: int, processing: Processing | None
    ) -> list[tuple[list, list, list]]:
        """One forward over `blocks`; each block's head rows (top-k log-probs and ids per position,
        as lists, and the draft positions' log-probs), after their logits processors. Appends every
        block's K/V to its row's slot."""
        if not blocks:
            return []
        one = getattr(self.engine, "forward_one", None)
        extra = () if processing is None else (processing,)  # engines without processors take none
        if len(blocks) == 1 and one is not None and not (processing is not None and processing.any_logprob_space):
            # A lone row: the engine's unpadded path.
            block_k, block_v, topk_lp, topk_ids, target_lp = one(blocks[0], top_k, *extra)
            rows = [0]
            feeds = None
        else:
            feeds, rows = gather(blocks, self.pool)
            block_k, block_v, topk_lp, topk_ids, target_lp = self.engine.forward(feeds, top_k, *extra)
        if self.on_attend is not None:
            held = sum(b.past_len + b.slot.src_len for b in blocks)
            if feeds is None:  # the unpadded path
                self.on_attend(held, held)
            else:
                past, cross = feeds["past_k"], feeds["cross_k"]  # [L, B, H, hd, P] and [L, B, H, hd, S]
                self.on_attend(int(past.shape[1]) * (int(past.shape[-1]) + int(cross.shape[-1])), held)
        scatter(blocks, rows, block_k, block_v)
        # As lists once per forward: per block, slicing and converting each cost more than the rest
        # of its result.
        lps, ids, targets = topk_lp.tolist(), topk_ids.tolist(), target_lp.tolist()
        heads = []
        head = 0
        for b in blocks:
            n = len(b.targets)
            heads.append((lps[head : head + n], ids[head : head + n], targets[head : head + n - 1]))
            head += n
        return heads


def _processing(
    blocks: list[RowBlock], plans: list[tuple[list[RowPlan] | None, Processors | None]], group: list[int]
) -> Processing | None:
    """The processors of one forward's head rows: each block's plans (or none), in block order."""
    row_plans: list[RowPlan | None] = []
    settings: list[Processors | None] = []
    for block, i in zip(blocks, group, strict=True):
        block_plans, processors = plans[i]
        row_plans += block_plans if block_plans is not None else [None] * len(block.targets)
        settings += [processors] * len(block.targets)
    return processing(row_plans, settings)


def _release(rows: Sequence[Row]) -> None:
    """Free the slots of `rows` (those that have one)."""
    for row in rows:
        if row.slot is not None:
            row.slot.release()


def _apart(rows: Sequence[Row], others: Sequence[Row]) -> list[Row]:
    """The rows of `rows` whose slot none of `others` holds."""
    held = {id(r.slot) for r in others if r.slot is not None}
    return [r for r in rows if r.slot is not None and id(r.slot) not in held]
