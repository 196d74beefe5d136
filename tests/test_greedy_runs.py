"""Multi-step greedy (`core.greedy`, `decoding.policies.greedy`): runs of AR steps in one call give
the tokens, steps and stats of one step per call, on random tiny models in float64."""

from __future__ import annotations

import functools

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from decoding.config import DecodingConfig, Mode
from decoding.decode import decode
from decoding.policies.adaptive import AR_RUN, LoadModel
from decoding.policies.greedy import greedy_loop
from decoding.policies.loop import DecodeStats
from drafter_service.session import LocalDrafter
from tests.checks import RandomK
from tests.zoo import MAX_LEN, model_pool
from tests.zoo import sources as zoo_sources
from verifier_service.session import LocalVerifier

PROPERTY = settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@functools.cache
def _verifier(trio_index: int) -> LocalVerifier:
    return LocalVerifier(model_pool()[trio_index].verifier)


class Chunked:
    """An in-process session that runs at most `chunk` steps per `step_greedy` call, recording
    each call's size (the remote session's `max_greedy_steps`)."""

    def __init__(self, session, chunk: int, first_runs: tuple[int, ...]) -> None:
        self.session = session
        self.max_greedy_steps = chunk
        self.first_greedy_runs = first_runs
        self.calls: list[int] = []

    def step_greedy(self, committed_len, append_ids, steps, top_k):
        assert steps <= self.max_greedy_steps
        result = self.session.step_greedy(committed_len, append_ids, steps, top_k)
        self.calls.append(len(result.top1))
        return result

    def step(self, committed_len, append_ids, draft_ids, top_k):  # drafted steps: one at a time
        self.calls.append(1)
        return self.session.step(committed_len, append_ids, draft_ids, top_k)

    def close(self) -> None:
        self.session.close()


@PROPERTY
@given(trio=st.integers(0, 3), source=zoo_sources(), max_new=st.integers(1, MAX_LEN - 1),
       chunk=st.integers(1, 40), prefix_len=st.integers(0, 3), streaming=st.booleans())
def test_greedy_runs_equal_one_step_at_a_time(trio, source, max_new, chunk, prefix_len, streaming):
    verifier = _verifier(trio)
    reference = decode(source, DecodingConfig(mode=Mode.AR, max_new_tokens=max_new), verifier)
    prefix = reference.output_ids[: min(prefix_len, max_new - 1)]
    if prefix:  # a committed prefix (AR after a drafter failure) continues the same way
        reference = decode(source, DecodingConfig(mode=Mode.AR, max_new_tokens=max_new), verifier, prefix=prefix)
    first_runs = (1, 4) if streaming else ()
    session = Chunked(verifier.open(source), chunk, first_runs)
    stats = DecodeStats()
    blocks: list[list[int]] = []
    try:
        out = greedy_loop(session, 1, max_new, verifier.eos_id, stats, blocks.append, prefix)
    finally:
        session.close()
    assert out == reference.output_ids
    assert [t for b in blocks for t in b] == out[len(prefix):]
    assert stats.iterations == reference.stats.iterations
    assert stats.finish_reason == reference.stats.finish_reason
    assert stats.steps_per_draft_length == reference.stats.steps_per_draft_length
    assert sum(session.calls) == stats.iterations
    # A stream's first runs are 1 and 4 steps (its first token comes alone), then the chunk.
    assert session.calls[0] == (1 if streaming else min(chunk, max_new - len(prefix), len(out) - len(prefix) + 1))
    assert all(n <= chunk for n in session.calls)


def test_a_run_stops_at_eos_and_when_the_session_is_full():
    """Asked for more steps than fit, a run answers through EOS, or until the session is full: its
    last step is the one after the most tokens a session holds (max_target_len)."""
    ends = set()
    for trio in (0, 2):  # trio 0 ends these sources with EOS, trio 2 runs them to the limit
        verifier = _verifier(trio)
        for source in ([5, 6, 7], [9, 9, 9, 9], [4]):
            reference = decode(source, DecodingConfig(mode=Mode.AR, max_new_tokens=MAX_LEN - 1), verifier)
            session = verifier.open(source)
            try:
                run = session.step_greedy(0, [], 10 * MAX_LEN, 1)
            finally:
                session.close()
            if reference.stats.finish_reason == "eos":
                assert run.top1 == [*reference.output_ids, verifier.eos_id]
            else:
                assert len(reference.output_ids) == verifier.max_target_len
                assert run.top1[:-1] == reference.output_ids
                assert len(run.top1) == verifier.max_target_len + 1
            ends.add(reference.stats.finish_reason)
    assert ends == {"eos", "length"}, ends


class ChunkedVerifier:
    """The in-process verifier whose sessions take runs of AR steps (as a remote one does)."""

    def __init__(self, verifier: LocalVerifier, chunk: int) -> None:
        self.verifier = verifier
        self.chunk = chunk
        self.sessions: list[Chunked] = []
        for name in ("vocab_size", "source_vocab_size", "bos_id", "eos_id", "max_source_len", "max_target_len"):
            setattr(self, name, getattr(verifier, name))

    def open(self, source_ids):
        session = Chunked(self.verifier.open(source_ids), self.chunk, ())
        self.sessions.append(session)
        return session


@PROPERTY
@given(trio=st.integers(0, 3), source=zoo_sources(), max_new=st.integers(1, MAX_LEN - 1),
       mode=st.sampled_from([Mode.GAD, Mode.IAD]), k=st.integers(1, 8), seed=st.integers(0, 2**16))
def test_adaptive_runs_of_plain_steps_stay_lossless(trio, source, max_new, mode, k, seed):
    """Adaptive speculation choosing k = 0 takes its plain AR steps as runs (Draft.ar_steps) on a
    verifier that has them: the output is still AR greedy's, and the runs really happen."""
    verifier = _verifier(trio)
    reference = decode(source, DecodingConfig(mode=Mode.AR, max_new_tokens=max_new), verifier)
    chunked = ChunkedVerifier(verifier, chunk=16)
    drafter = LocalDrafter(model_pool()[trio].drafter_models())
    config = DecodingConfig(mode=mode, k=k, adaptive=True, max_new_tokens=max_new)
    # Block lengths at random, k = 0 half the time: a loaded server's choice.
    result = decode(source, config, chunked, drafter, load=RandomK(seed, zero_share=0.5))
    assert result.output_ids == reference.output_ids
    assert result.stats.finish_reason == reference.stats.finish_reason
    (session,) = chunked.sessions
    assert sum(session.calls) == result.stats.iterations
    # A run is AR_RUN steps, or (where no draft could pay: a hopeless k = 0) to the end of the
    # output, in the verifier's runs of `chunk`.
    assert all(n <= AR_RUN or n == 16 for n in session.calls[:-1])


class _Plain(LoadModel):
    def choose(self, mode: str, a: float, k_max: int, rows: int) -> int:
        return 0


def test_a_loaded_adaptive_request_takes_its_plain_steps_in_runs():
    """k = 0 chosen every time, even for the best drafts (a compute-bound batch): the output in
    the verifier's longest runs, no probe, and AR greedy's output."""
    verifier = _verifier(2)  # runs these sources to the length limit
    reference = decode([5, 6, 7], DecodingConfig(mode=Mode.AR, max_new_tokens=60), verifier)
    chunked = ChunkedVerifier(verifier, chunk=16)
    drafter = LocalDrafter(model_pool()[2].drafter_models())
    config = DecodingConfig(mode=Mode.GAD, k=6, adaptive=True, max_new_tokens=60)
    result = decode([5, 6, 7], config, chunked, drafter, load=_Plain())
    assert result.output_ids == reference.output_ids
    (session,) = chunked.sessions
    assert session.calls == [16, 16, 16, 12] and result.stats.drafted_tokens == 0
