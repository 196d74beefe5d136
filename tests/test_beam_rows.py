"""Beam search on one multi-row verifier session equals the beam search of one session per
hypothesis, token for token, on random tiny models (float64: no near-ties).

Two paths are compared: the policy on the verifier's own `step_rows` (where the backend's sessions
have it; otherwise `open_rows` gives the adapter, and the test ids say `adapter`) and the policy
forced onto the adapter over single-row sessions. What the policy computes is checked against
`transformers`' `generate` in tests/test_beam_generate.py. The multi-row session contract itself
(`step_rows` forks rows by parent index) is checked against fresh single-row sessions.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from core.errors import SpecdecError, StatusCode
from core.interfaces import BeamRow, Verifier
from core.multirow import RowsOverSessions, has_rows, open_rows
from decoding.config import DecodingConfig, EarlyStopping, Mode
from decoding.decode import decode
from decoding.modes import MODES
from decoding.policies.beam import BeamSettings, beam_search
from decoding.policies.loop import DecodeStats
from tests.zoo import FIRST_WORD, MAX_LEN, VOCAB, model_pool
from tests.zoo import sources as zoo_sources
from verifier_service.session import LocalVerifier

PROPERTY = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
trios = st.integers(0, 3)


@functools.cache
def _verifier(trio: int) -> LocalVerifier:
    return LocalVerifier(model_pool()[trio].verifier)


class _CountingVerifier(LocalVerifier):
    """The real verifier, counting the sessions opened and closed through it."""

    def __init__(self, model) -> None:
        super().__init__(model)
        self.opened = 0
        self.closed = 0

    def open(self, source_ids: list[int]):
        self.opened += 1
        session = super().open(source_ids)
        close = session.close

        def counted_close() -> None:
            self.closed += 1
            close()

        session.close = counted_close  # type: ignore[method-assign]
        return session


# Which multi-row path the policy takes on the torch backend: the session's own, or the adapter.
PATH = "native" if has_rows(_verifier(0).open([FIRST_WORD])) else "adapter"


def _search(verifier: Verifier, source: list[int], settings: BeamSettings, max_new: int, native_rows: bool = True,
            processors=None):
    """(each hypothesis' tokens and finish reason, their scores, the stats)."""
    stats = DecodeStats()
    out = beam_search(verifier, source, settings, max_new, stats, native_rows=native_rows, processors=processors)
    return ([(h.output_ids, h.finish_reason) for h in out], [h.score for h in out],
            (stats.iterations, stats.output_tokens, stats.finish_reason))


@pytest.mark.parametrize("path", [PATH])
@PROPERTY
@given(
    trio=trios,
    source=zoo_sources(),
    max_new=st.integers(1, 40),
    width=st.integers(1, 6),
    early=st.sampled_from(list(EarlyStopping)),
    penalty=st.sampled_from([1.0, 0.0, 2.0, -0.5]),
    delta=st.one_of(st.none(), st.just(math.inf), st.floats(0, 4, allow_nan=False)),
    m=st.one_of(st.none(), st.integers(1, 6)),
    processors=st.one_of(st.none(), st.fixed_dictionaries({
        "no_repeat_ngram_size": st.integers(2, 3), "repetition_penalty": st.sampled_from([1.0, 1.5]),
        "min_new_tokens": st.integers(0, 6),
    })),
)
def test_multirow_beam_equals_one_session_per_hypothesis(path, trio, source, max_new, width, early, penalty, delta, m,
                                                         processors):
    """With logits processors too: each row's processor state forks with it, as each single-row
    session's rolls back to its hypothesis."""
    verifier = _verifier(trio)
    settings = BeamSettings(width, penalty, early, n_best=width, delta=delta, max_candidates=m)
    procs = None if processors is None else DecodingConfig(mode=Mode.BEAM, num_beams=max(width, 2),
                                                           max_new_tokens=max_new, **processors).processors()
    adapter = _search(verifier, source, settings, max_new, native_rows=False, processors=procs)
    rows = _search(verifier, source, settings, max_new, processors=procs)
    assert rows[0] == adapter[0] and rows[2] == adapter[2]
    assert rows[1] == pytest.approx(adapter[1], abs=1e-9)  # one forward for all rows or one each: float64 rounding


@pytest.mark.parametrize("path", [PATH])
@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(trio=trios, source=zoo_sources(), max_new=st.integers(1, 30), width=st.integers(1, 5))
def test_beam_mode_through_decode_runs_the_policy(path, trio, source, max_new, width):
    """The mode registry runs the multi-row policy: `decode()` gives its n-best list and stats."""
    verifier = _verifier(trio)
    config = DecodingConfig(mode=Mode.BEAM, max_new_tokens=max_new, num_beams=width, num_return_sequences=width)
    result = decode(source, config, verifier)
    hypotheses, scores, (iterations, output_tokens, finish) = _search(verifier, source,
                                                                      BeamSettings(width, n_best=width), max_new)
    assert [(h.output_ids, h.finish_reason) for h in result.hypotheses] == hypotheses
    assert [h.score for h in result.hypotheses] == scores and result.output_ids == hypotheses[0][0]
    assert (result.stats.iterations, result.stats.output_tokens, result.stats.finish_reason) == (
        iterations, output_tokens, finish,
    )


def test_beam_holds_one_verifier_session_per_request():
    """Gateway admission counts one verifier session for a beam request, whatever its width."""
    assert MODES[Mode.BEAM].verifier_sessions(DecodingConfig(mode=Mode.BEAM, num_beams=16)) == 1


@pytest.mark.parametrize("native", [True, False], ids=[f"open_rows-{PATH}", "adapter"])
def test_search_opens_and_closes_its_sessions(native):
    """One session on the multi-row path; at most `width` sessions on the adapter (idle ones are
    re-targeted, never leaked); every session is closed when the search ends."""
    verifier = _CountingVerifier(model_pool()[1].verifier)
    source = [5, 6, 7, 8, 9, 10, 11, 12]
    beam_search(verifier, source, BeamSettings(5), 20, DecodeStats(), native_rows=native)
    if native and PATH == "native":
        assert verifier.opened == 1
    else:
        assert 1 < verifier.opened <= 5
    assert verifier.closed == verifier.opened


# ---- the multi-row session contract: rows fork by parent index -----------------------------


@dataclass(frozen=True)
class _Program:
    source: list[int]
    steps: list[list[BeamRow]]


@st.composite
def _programs(draw) -> _Program:
    """Random multi-row step sequences: every row forks a random current row, cut anywhere."""
    words = st.integers(FIRST_WORD, VOCAB - 1)
    source = draw(st.lists(words, min_size=1, max_size=20))
    lengths = [0]  # tokens of each current row
    steps = []
    for _ in range(draw(st.integers(1, 6))):
        rows = []
        for _ in range(draw(st.integers(1, 5))):
            parent = draw(st.integers(0, len(lengths) - 1))
            keep = draw(st.integers(0, lengths[parent]))
            append = draw(st.lists(words, max_size=min(3, MAX_LEN - 2 - keep)))
            rows.append(BeamRow(parent, keep, append))
        steps.append(rows)
        lengths = [r.committed_len + len(r.append_ids) for r in rows]
    return _Program(source, steps)


@pytest.mark.parametrize("native", [True, False], ids=[f"open_rows-{PATH}", "adapter"])
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(trio=trios, program=_programs())
def test_step_rows_scores_each_row_as_a_fresh_session_would(native, trio, program):
    verifier = _verifier(trio)
    session = open_rows(verifier, program.source, native=native)
    tokens: list[list[int]] = [[]]
    try:
        for rows in program.steps:
            tokens = [[*tokens[r.parent][: r.committed_len], *r.append_ids] for r in rows]
            results = session.step_rows(rows, 4)
            assert len(results) == len(rows)
            for row_tokens, res in zip(tokens, results, strict=True):
                fresh = verifier.open(program.source)
                want = fresh.step(0, row_tokens, [], 4)
                fresh.close()
                assert res.topk_ids == want.topk_ids
                assert res.top1 == want.top1
                assert res.topk_logprobs[0] == pytest.approx(want.topk_logprobs[0], abs=1e-9)
                assert res.draft_logprobs == []
    finally:
        session.close()


@pytest.mark.parametrize("native", [True, False], ids=[f"open_rows-{PATH}", "adapter"])
@pytest.mark.parametrize("row", [BeamRow(1, 0, []), BeamRow(0, 2, []), BeamRow(-1, 0, [])])
def test_a_row_out_of_step_is_failed_precondition(native, row):
    """A parent that is not a current row, or a cut longer than the parent, is out of step."""
    session = open_rows(_verifier(0), [5, 6, 7], native=native)
    try:
        session.step_rows([BeamRow(0, 0, [8])], 2)  # one row of one token
        with pytest.raises(SpecdecError) as err:
            session.step_rows([BeamRow(0, 1, [9]), row], 2)
        assert err.value.code == StatusCode.FAILED_PRECONDITION
    finally:
        session.close()


def test_adapter_retargets_idle_sessions_instead_of_opening_more():
    """Width 3, then one row, then 3 rows again: the two sessions left idle are re-targeted."""
    verifier = _CountingVerifier(model_pool()[0].verifier)
    adapter = RowsOverSessions(verifier, [5, 6, 7], verifier.open([5, 6, 7]))
    adapter.step_rows([BeamRow(0, 0, [])], 2)
    adapter.step_rows([BeamRow(0, 0, [5]), BeamRow(0, 0, [6]), BeamRow(0, 0, [7])], 2)
    adapter.step_rows([BeamRow(1, 1, [8])], 2)
    adapter.step_rows([BeamRow(0, 2, [9]), BeamRow(0, 2, [10]), BeamRow(0, 1, [11])], 2)
    assert adapter.rows == [[6, 8, 9], [6, 8, 10], [6, 11]]
    assert verifier.opened == adapter.sessions_opened == 3
    adapter.close()
    assert verifier.closed == 3


@pytest.mark.parametrize("width", [1, 3])
@pytest.mark.parametrize("bad", [-math.inf, math.nan])
def test_a_step_with_no_continuation_ends_with_the_running_hypothesis(width, bad):
    """Every score of a step banned (-inf) or not a number: the search stops and answers its best
    running hypothesis, as generate() does when a logits processor bans everything."""
    from decoding.policies.beam import BeamSettings, _Search

    search = _Search(BeamSettings(width=width), eos=2, max_new_tokens=8, vocab=10, prefix=[])
    rows = search.advance([([5, 6, 7, 8, 9, 3], [-0.1, -0.5, -1.0, -2.0, -3.0, -4.0])])
    assert len(rows) == width
    assert search.advance([([5, 6, 7, 8, 9, 3], [bad] * 6)] * width) == []
    best = search.best()
    assert best[0].output_ids == [5] and best[0].finish_reason == "length"


@pytest.mark.parametrize("length_penalty", [-1e6, -300.0, 300.0, 1e6])
def test_an_extreme_length_penalty_ranks_without_overflow(length_penalty):
    """length ** length_penalty past float64's range is inf or 0, as in generate()'s tensors: the
    search still ends with an output instead of raising."""
    from decoding.policies.beam import BeamSettings, _Search

    search = _Search(BeamSettings(width=3, length_penalty=length_penalty), eos=2, max_new_tokens=6, vocab=10,
                     prefix=[])
    scored = [([5, 2, 6, 7, 8, 9], [-0.1, -0.5, -1.0, -2.0, -3.0, -4.0])]
    while rows := search.advance(scored):
        scored = [([2, 5, 6, 7, 8, 9], [-0.3, -0.6, -1.1, -2.0, -3.0, -4.0])] * len(rows)
    best = search.best()
    assert best and all(not math.isnan(h.score) for h in best)
