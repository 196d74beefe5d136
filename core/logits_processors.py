"""The logits processors of `transformers`' `generate()`, written once for every mode and backend.

A verifier session is configured at open with `Processors` (VerifyOpen.processors); each of its rows
keeps a `RowState`, the processors' state over the row's decoder input (the decoder start token,
then the output), updated a token at a time as the row grows and undone as it rolls back: an n-gram
table, the tokens seen, the length. So the cost per verified position does not grow with the
output. For every head row of a forward (each drafted position, given the prefix accepted so far)
the state gives a `RowPlan`: the ids the repetition penalty scales, the ids banned (-inf), and the
token forced (every other one -inf, it 0). The fused head takes the plans of a forward as
`Processing` (flat index arrays) and applies them between the projection and the top-k
(`apply_processing`, on numpy arrays and torch tensors alike): kernels/reference.py, kernels/cpu.py.

`generate()` runs its processors, in this order: repetition_penalty, no_repeat_ngram_size,
encoder_no_repeat_ngram_size, bad_words_ids, min_length, min_new_tokens, forced_bos_token_id,
forced_eos_token_id, suppress_tokens, begin_suppress_tokens. Greedy search and sampling apply them to
the raw logits (the head then normalises the processed logits: the log-probs a lossless mode compares
and returns); beam search applies them to the log-softmax scores and ranks by those, unnormalised
(`Processors.logprob_space`). Only the repetition penalty acts differently in the two spaces; a
forced token overrides the bans before it, and the suppressions after it apply on top (an EOS both
forced and suppressed is forced here, where `generate` would leave the row all -inf).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

NONE = -1  # no token (RowPlan.forced, the wire's unset token ids)
PENALTY_RANGE = (1e-30, 1e30)  # repetition penalties whose float32 scaled scores stay finite


@dataclass(frozen=True)
class Processors:
    """One session's processors, as `generate()`'s GenerationConfig names them. Lengths count the
    decoder input (the start token, then the output), as `generate()`'s do for an encoder-decoder."""

    repetition_penalty: float = 1.0
    no_repeat_ngram_size: int = 0
    encoder_no_repeat_ngram_size: int = 0
    bad_words_ids: tuple[tuple[int, ...], ...] = ()
    min_length: int = 0
    min_new_tokens: int = 0
    forced_bos_token_id: int = NONE
    forced_eos_token_id: int = NONE
    # generate()'s max_length (the start token plus max_new_tokens): the forced EOS takes its last place.
    max_length: int = 0
    suppress_tokens: tuple[int, ...] = ()
    begin_suppress_tokens: tuple[int, ...] = ()
    # The decoder input length at which begin_suppress_tokens apply (1, after a forced first token 2).
    begin_index: int = 1
    # Beam search: the processors act on log-softmax scores, which stay unnormalised; else on logits.
    logprob_space: bool = False

    @property
    def active(self) -> bool:
        """Whether any processor changes a score."""
        return bool(
            self.repetition_penalty != 1.0 or self.no_repeat_ngram_size or self.encoder_no_repeat_ngram_size
            or self.bad_words_ids or self.min_length or self.min_new_tokens or self.forced_bos_token_id != NONE
            or self.forced_eos_token_id != NONE or self.suppress_tokens or self.begin_suppress_tokens
        )

    def check(self, vocab_size: int) -> None:
        """ValueError for a setting no model could honour (the callers turn it into INVALID_ARGUMENT)."""
        # Scores are float32: a penalty beyond these bounds turns them into inf and the log-probs into NaN.
        if not PENALTY_RANGE[0] <= self.repetition_penalty <= PENALTY_RANGE[1]:
            raise ValueError(f"repetition_penalty must be in [{PENALTY_RANGE[0]:g}, {PENALTY_RANGE[1]:g}] "
                             f"(> 0; 1 leaves scores as they are), got {self.repetition_penalty}")
        for name in ("no_repeat_ngram_size", "encoder_no_repeat_ngram_size", "min_length", "min_new_tokens"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        ids = [t for seq in self.bad_words_ids for t in seq] + [*self.suppress_tokens, *self.begin_suppress_tokens]
        ids += [t for t in (self.forced_bos_token_id, self.forced_eos_token_id) if t != NONE]
        bad = [t for t in ids if not 0 <= t < vocab_size]
        if bad:
            raise ValueError(f"processor token ids outside the vocabulary [0, {vocab_size}): {bad[:5]}")
        if any(not seq for seq in self.bad_words_ids):
            raise ValueError("bad_words_ids holds an empty sequence")


@dataclass(frozen=True)
class RowPlan:
    """What the processors do to one head row: scale `penalized` by the repetition penalty, set
    `banned` to -inf (no id is both), and force `forced` (NONE: nothing; a forced row has no
    penalised or banned ids: every id but the forced one is -inf)."""

    penalized: tuple[int, ...] = ()
    banned: tuple[int, ...] = ()
    forced: int = NONE


@dataclass
class _Static:
    """What a session's rows share: the settings turned into lookups."""

    settings: Processors
    eos_ids: tuple[int, ...]
    single_bans: frozenset[int]  # one-token bad words (never EOS: generate() drops [eos])
    multi_bans: dict[int, dict[tuple[int, ...], list[int]]]  # prefix length -> prefix -> last tokens
    encoder_ngrams: dict[tuple[int, ...], list[int]]  # the source's n-grams: prefix -> next tokens

    @classmethod
    def of(cls, settings: Processors, eos_id: int, encoder_ids: Sequence[int]) -> _Static:
        eos_ids = (eos_id,)
        single = {seq[0] for seq in settings.bad_words_ids if len(seq) == 1 and seq[0] not in eos_ids}
        multi: dict[int, dict[tuple[int, ...], list[int]]] = {}
        for seq in dict.fromkeys(settings.bad_words_ids):  # each sequence once, in order
            if len(seq) > 1:
                multi.setdefault(len(seq) - 1, {}).setdefault(tuple(seq[:-1]), []).append(seq[-1])
        encoder: dict[tuple[int, ...], list[int]] = {}
        n = settings.encoder_no_repeat_ngram_size
        if n:
            ids = list(encoder_ids)
            for i in range(len(ids) - n + 1):
                encoder.setdefault(tuple(ids[i : i + n - 1]), []).append(ids[i + n - 1])
        return cls(settings, eos_ids, frozenset(single), multi, encoder)


class RowState:
    """The processors' state over one row's decoder input (see the module docstring): `push` a
    token, `truncate` to a length (undoing what the removed tokens added), `fork` a copy, and
    `plan` the next position."""

    def __init__(self, static: _Static, start_id: int) -> None:
        self._static = static
        self.tokens: list[int] = []
        self._seen: dict[int, int] = {}  # token -> occurrences (the repetition penalty's set)
        self._ngrams: dict[tuple[int, ...], dict[int, int]] = {}  # n-1 prefix -> next token -> occurrences
        self.push(start_id)

    @classmethod
    def open(cls, settings: Processors, eos_id: int, start_id: int, encoder_ids: Sequence[int]) -> RowState:
        """A new row's state (the decoder start token pushed); `encoder_ids`: the encoder's input,
        its EOS included (encoder_no_repeat_ngram_size's n-grams)."""
        return cls(_Static.of(settings, eos_id, encoder_ids), start_id)

    def fork(self) -> RowState:
        """An independent copy (a beam row's further children)."""
        other = RowState.__new__(RowState)
        other._static = self._static
        other.tokens = list(self.tokens)
        other._seen = dict(self._seen)
        other._ngrams = {prefix: dict(nexts) for prefix, nexts in self._ngrams.items()}
        return other

    def push(self, token: int) -> None:
        self.tokens.append(token)
        self._seen[token] = self._seen.get(token, 0) + 1
        n = self._static.settings.no_repeat_ngram_size
        if n and len(self.tokens) >= n:
            nexts = self._ngrams.setdefault(tuple(self.tokens[len(self.tokens) - n : -1]), {})
            nexts[token] = nexts.get(token, 0) + 1

    def truncate(self, length: int) -> None:
        """Back to the first `length` tokens (the start token included)."""
        n = self._static.settings.no_repeat_ngram_size
        while len(self.tokens) > length:
            token = self.tokens[-1]
            if n and len(self.tokens) >= n:
                prefix = tuple(self.tokens[len(self.tokens) - n : -1])
                _uncount(self._ngrams[prefix], token)
                if not self._ngrams[prefix]:
                    del self._ngrams[prefix]
            _uncount(self._seen, token)
            self.tokens.pop()

    def sync(self, tokens: Sequence[int]) -> None:
        """Make the state that of the decoder input `tokens` (the start token first): roll back to
        the common prefix, push the rest."""
        common, limit = 0, min(len(self.tokens), len(tokens))
        while common < limit and self.tokens[common] == tokens[common]:
            common += 1
        self.truncate(common)
        for token in tokens[common:]:
            self.push(token)

    def plan(self) -> RowPlan:
        """The next position's plan (`generate()`'s processors, in its order)."""
        s = self._static.settings
        length = len(self.tokens)
        penalized = tuple(self._seen) if s.repetition_penalty != 1.0 else ()
        banned: list[int] = []
        n = s.no_repeat_ngram_size
        if n and length >= n:
            banned += self._ngrams.get(tuple(self.tokens[length - n + 1 :]), ())
        n = s.encoder_no_repeat_ngram_size
        if n and length >= n - 1:
            banned += self._static.encoder_ngrams.get(tuple(self.tokens[length - n + 1 :]), ())
        banned += self._static.single_bans
        for size, prefixes in self._static.multi_bans.items():
            if size <= length:
                banned += prefixes.get(tuple(self.tokens[length - size :]), ())
        if length < s.min_length or length - 1 < s.min_new_tokens:
            banned += self._static.eos_ids
        forced = NONE
        if s.forced_bos_token_id != NONE and length == 1:
            forced = s.forced_bos_token_id
        if s.forced_eos_token_id != NONE and length == s.max_length - 1:
            forced = s.forced_eos_token_id
        if forced != NONE:
            banned = []  # forcing overrides the bans before it
        banned += s.suppress_tokens
        if length == s.begin_index:
            banned += s.begin_suppress_tokens
        if forced != NONE:  # every other id -inf, the forced one 0: neither penalised nor banned
            banned = [t for t in banned if t != forced]
            penalized = ()
        if penalized and any(t in self._seen for t in banned):
            # A banned id is not also penalised: the ONNX head writes both in one scatter, where two
            # writes to one place have no defined order (-inf, the ban's, is the result either way).
            unwanted = set(banned)
            penalized = tuple(t for t in penalized if t not in unwanted)
        return RowPlan(penalized, tuple(dict.fromkeys(banned)), forced)


def _uncount(counts: dict[int, int], token: int) -> None:
    if counts[token] == 1:
        del counts[token]
    else:
        counts[token] -= 1


@dataclass(frozen=True)
class Processing:
    """The plans of a forward's head rows as flat index arrays (numpy, or the head's tensors after
    `map`): which rows are in log-prob space, the (row, id, factor) triples of the repetition
    penalty, the (row, id) pairs banned, and the (row, id) pairs forced."""

    logprob_rows: Any  # bool [R]
    penalty_rows: Any  # int64 [P]
    penalty_ids: Any
    penalty_factors: Any  # [P], the scores' dtype
    ban_rows: Any  # int64 [B]
    ban_ids: Any
    forced_rows: Any  # int64 [F]
    forced_ids: Any
    any_logprob_space: bool = False
    # Whether any plan changes a score (else the head runs as without processors, bit for bit).
    acts: bool = field(default=True)

    def map(self, convert: Any) -> Processing:
        """The arrays converted (e.g. to the head's tensors), the flags kept."""
        names = ("logprob_rows", "penalty_rows", "penalty_ids", "penalty_factors", "ban_rows", "ban_ids",
                 "forced_rows", "forced_ids")
        return Processing(*(convert(getattr(self, n)) for n in names), self.any_logprob_space, self.acts)


# The in-graph head's inputs (the verifier's decoder_batch.onnx), named as Processing's arrays.
PROCESSING_INPUTS = ("logprob_rows", "penalty_rows", "penalty_ids", "penalty_factors", "ban_rows", "ban_ids",
                     "forced_rows", "forced_ids")
# Those of a head whose rows are all in logit space (the one-row decoder.onnx): no logprob_rows.
LOGIT_PROCESSING_INPUTS = PROCESSING_INPUTS[1:]


def processing_feeds(p: Processing | None, rows: int, names: Sequence[str] = PROCESSING_INPUTS) -> dict[str, Any]:
    """A forward's processing as the in-graph head's inputs `names` (float32 factors): nothing to do
    for `rows` head rows when `p` is None."""
    import numpy as np

    if p is None:
        none = np.zeros(0, np.int64)
        feeds = {"logprob_rows": np.zeros(rows, bool), "penalty_rows": none, "penalty_ids": none,
                 "penalty_factors": np.zeros(0, np.float32), "ban_rows": none, "ban_ids": none, "forced_rows": none,
                 "forced_ids": none}
        return {name: feeds[name] for name in names}
    feeds = {name: getattr(p, name) for name in names}
    feeds["penalty_factors"] = feeds["penalty_factors"].astype(np.float32)
    return feeds


def processing(plans: Sequence[RowPlan | None], settings: Sequence[Processors | None]) -> Processing | None:
    """A forward's `Processing`: one plan and its session's settings per head row (None: a row
    without processors). None when no row has any."""
    import numpy as np

    if all(p is None for p in plans):
        return None
    logprob = np.array([s is not None and s.logprob_space for s in settings], dtype=bool)
    pen_rows, pen_ids, factors, ban_rows, ban_ids, forced_rows, forced_ids = [], [], [], [], [], [], []
    for r, (plan, s) in enumerate(zip(plans, settings, strict=True)):
        if plan is None or s is None:
            continue
        pen_rows += [r] * len(plan.penalized)
        pen_ids += plan.penalized
        factors += [s.repetition_penalty] * len(plan.penalized)
        ban_rows += [r] * len(plan.banned)
        ban_ids += plan.banned
        if plan.forced != NONE:
            forced_rows.append(r)
            forced_ids.append(plan.forced)
    acts = bool(pen_rows or ban_rows or forced_rows)
    ints = lambda values: np.asarray(values, dtype=np.int64)  # noqa: E731
    return Processing(logprob, ints(pen_rows), ints(pen_ids), np.asarray(factors, dtype=np.float64), ints(ban_rows),
                      ints(ban_ids), ints(forced_rows), ints(forced_ids), bool(logprob.any()), acts)


def apply_processing(scores: Any, p: Processing) -> None:
    """Apply the plans to `scores` [R, V] in place (a numpy array or a torch tensor; `p`'s arrays of
    the same kind): the repetition penalty (a score below 0 times the factor, else over it), the
    bans, the forced tokens. Written with indexing alone, so one definition serves both."""
    if len(p.penalty_rows):
        values = scores[p.penalty_rows, p.penalty_ids]
        factors = p.penalty_factors
        below = values < 0
        scaled = values / factors
        scaled[below] = values[below] * factors[below]
        scores[p.penalty_rows, p.penalty_ids] = scaled
    if len(p.ban_rows):
        scores[p.ban_rows, p.ban_ids] = float("-inf")
    if len(p.forced_rows):
        scores[p.forced_rows] = float("-inf")
        scores[p.forced_rows, p.forced_ids] = 0.0
