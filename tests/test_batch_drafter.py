"""NAR block drafts of many sessions in one forward (`LocalDrafter.draft_batch`) equal the same drafts
made one at a time, exactly, under varied batch compositions (ragged prefixes, rollbacks, different
k, sessions joining and leaving the batch): on eager torch in float64 against the torch drafter's
own one-row path (`PrefixState` + `nar_block_draft`), and on ONNX Runtime against the unpadded
one-row graph. A failing or closed item never fails the others."""

from __future__ import annotations

import random

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from core.errors import SpecdecError, StatusCode
from core.interfaces import BlockCall
from drafter_service.onnx_nar import OnnxNarDrafter
from drafter_service.session import LocalDrafter, make_drafter
from drafter_service.torch_nar import TorchNarEngine
from seq2seq_models.bundle import load_bundle, make_tiny_bundle
from seq2seq_models.drafting import nar_block_draft
from seq2seq_models.onnx_export import BATCH_DECODER_FILE
from seq2seq_models.prefix_state import PrefixState
from tests.zoo import FIRST_WORD, VOCAB, model_pool

SETTINGS = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@pytest.fixture(scope="module")
def bundle(tmp_path_factory):
    return load_bundle(make_tiny_bundle(tmp_path_factory.mktemp("bundle"), seed=7))


@pytest.fixture(scope="module")
def onnx_drafter(bundle, tmp_path_factory) -> LocalDrafter:
    return make_drafter(bundle, "onnxruntime", cache_root=tmp_path_factory.mktemp("onnx"))


@pytest.fixture(scope="module")
def zoo_onnx(tmp_path_factory) -> dict[int, OnnxNarDrafter]:
    root = tmp_path_factory.mktemp("zoo-onnx")
    return {i: OnnxNarDrafter(model_pool()[i].nar_drafter, cache_root=root) for i in (0, 3)}


@st.composite
def scenarios(draw, vocab: int = VOCAB, max_len: int = 80):
    """Sources of 2..6 sessions and rounds of steps: per round the sessions in the batch (any
    non-empty subset) and each one's (rollback to any kept length, 0..4 appended, k 1..16)."""
    words = st.integers(FIRST_WORD, vocab - 1)
    n = draw(st.integers(2, 6))
    sources = [draw(st.lists(words, min_size=1, max_size=40)) for _ in range(n)]
    held = [0] * n
    rounds = []
    for _ in range(draw(st.integers(1, 6))):
        members = draw(st.lists(st.integers(0, n - 1), min_size=1, max_size=n, unique=True))
        calls = []
        for i in members:
            committed = draw(st.integers(0, held[i]))
            append = draw(st.lists(words, max_size=min(4, max_len - 2 - committed)))
            calls.append((i, BlockCall(committed, append, draw(st.integers(1, 16)))))
            held[i] = committed + len(append)
        rounds.append(calls)
    return sources, rounds


def _run_batched(drafter: LocalDrafter, sources, rounds) -> list[list[list[int]]]:
    sessions = [drafter.open(s) for s in sources]
    out = []
    for calls in rounds:
        results = drafter.draft_batch([(sessions[i], c) for i, c in calls])
        for r in results:
            assert not isinstance(r, BaseException), r
        out.append([r.ids for r in results])
    return out


def _run_one_row_torch(model, sources, rounds) -> list[list[list[int]]]:
    """The torch drafter's one-row path as it was before batching: a `PrefixState` that appends
    eagerly, then `k` masks through `extend(..., bidirectional=True)`."""
    states = [PrefixState(model, s) for s in sources]
    out = []
    for calls in rounds:
        row = []
        for i, c in calls:
            states[i].sync(c.committed_len, c.append_ids)
            k = min(c.k, states[i].max_tokens - len(states[i].tokens))
            row.append(nar_block_draft(model, states[i].cache, k) if k else [])
        out.append(row)
    return out


def _run_one_at_a_time(drafter: LocalDrafter, sources, rounds) -> list[list[list[int]]]:
    sessions = [drafter.open(s) for s in sources]
    return [[sessions[i].draft_block(c.committed_len, c.append_ids, c.k).ids for i, c in calls] for calls in rounds]


@SETTINGS
@given(trio=st.integers(0, 3), scenario=scenarios())
def test_torch_batched_drafts_equal_one_row_drafts_in_float64(trio, scenario):
    models = model_pool()[trio]
    assert models.nar_drafter.embed.weight.dtype == torch.float64
    drafter = LocalDrafter(models.drafter_models())
    assert drafter.backend == "torch"
    sources, rounds = scenario
    assert _run_batched(drafter, sources, rounds) == _run_one_row_torch(models.nar_drafter, sources, rounds)


@SETTINGS
@given(trio=st.sampled_from([0, 3]), scenario=scenarios())
def test_onnx_batched_drafts_equal_one_row_graph_drafts(zoo_onnx, trio, scenario):
    drafter = LocalDrafter(model_pool()[trio].drafter_models(), onnx_nar=zoo_onnx[trio])
    assert drafter.backend == "onnxruntime"
    sources, rounds = scenario
    assert _run_batched(drafter, sources, rounds) == _run_one_at_a_time(drafter, sources, rounds)


@pytest.mark.parametrize("seed", range(4))
def test_onnx_batched_drafts_on_the_tiny_bundle(bundle, onnx_drafter, seed):
    rng = random.Random(seed)
    vocab = bundle.nar_drafter.config.vocab_size
    sources = [[rng.randrange(FIRST_WORD, vocab) for _ in range(rng.randint(1, 40))] for _ in range(rng.randint(2, 8))]
    held = [0] * len(sources)
    rounds = []
    for _ in range(8):
        calls = []
        for i in rng.sample(range(len(sources)), rng.randint(1, len(sources))):
            committed = rng.randint(0, held[i])
            append = [rng.randrange(FIRST_WORD, vocab) for _ in range(rng.randint(0, 4))]
            calls.append((i, BlockCall(committed, append, rng.randint(1, 16))))
            held[i] = committed + len(append)
        rounds.append(calls)
    assert _run_batched(onnx_drafter, sources, rounds) == _run_one_at_a_time(onnx_drafter, sources, rounds)


@pytest.mark.parametrize("backend", ["torch", "onnxruntime"])
def test_failing_and_closed_items_do_not_fail_the_others(bundle, onnx_drafter, backend):
    drafter = onnx_drafter if backend == "onnxruntime" else make_drafter(bundle, "torch")
    other = make_drafter(bundle, "torch")
    sources = [[5, 6, 7], [8, 9], [10, 11, 12, 13], [14], [15, 16]]
    good = [BlockCall(0, [20, 21], 4), BlockCall(0, [], 3)]
    alone = [drafter.open(s).draft_block(c.committed_len, c.append_ids, c.k).ids
             for s, c in zip(sources, good, strict=False)]
    sessions = [drafter.open(s) for s in sources]
    sessions[2].close()
    foreign = other.open([5])
    items = [
        (sessions[0], good[0]),
        (sessions[2], BlockCall(0, [], 2)),  # closed
        (sessions[3], BlockCall(5, [], 2)),  # keeps more than it holds: out of step
        (foreign, BlockCall(0, [], 2)),  # another drafter's session
        (sessions[1], good[1]),
        (sessions[0], BlockCall(0, [], 2)),  # a second draft of one session in one batch
        (sessions[4], BlockCall(0, [7] * 10_000, 2)),  # over the length limit
    ]
    results = drafter.draft_batch(items)
    assert [r.ids for r in (results[0], results[4])] == alone
    codes = [r.code if isinstance(r, SpecdecError) else type(r) for r in results]
    assert codes[1:4] == [StatusCode.FAILED_PRECONDITION, StatusCode.FAILED_PRECONDITION, ValueError]
    assert codes[5:] == [StatusCode.FAILED_PRECONDITION, StatusCode.OUT_OF_RANGE]
    # The refused sessions still draft from where they were; the closed one never again.
    assert sessions[3].draft_block(0, [5], 2).ids == drafter.open(sources[3]).draft_block(0, [5], 2).ids
    with pytest.raises(SpecdecError) as info:
        sessions[2].draft_block(0, [], 1)
    assert info.value.code == StatusCode.FAILED_PRECONDITION


def test_a_session_closed_while_its_forward_runs_is_refused_alone(bundle):
    drafter = make_drafter(bundle, "torch")
    sessions = [drafter.open([5 + i, 6]) for i in range(3)]
    want = [drafter.open([5 + i, 6]).draft_block(0, [9], 3).ids for i in (0, 2)]
    engine = drafter.nar.engine
    assert isinstance(engine, TorchNarEngine)

    class ClosingEngine(TorchNarEngine):
        def forward(self, feeds):
            sessions[1].close()  # as the gRPC side may while the worker runs the forward
            return super().forward(feeds)

    drafter.nar.engine = ClosingEngine(bundle.nar_drafter)
    results = drafter.draft_batch([(s, BlockCall(0, [9], 3)) for s in sessions])
    assert [results[0].ids, results[2].ids] == want
    assert isinstance(results[1], SpecdecError) and results[1].code == StatusCode.FAILED_PRECONDITION


def test_new_sessions_are_encoded_together_by_their_first_draft(bundle):
    """The drafter encodes the sources of a batch's new sessions in one run, each once."""
    drafter = make_drafter(bundle, "torch")
    runs: list[int] = []

    class CountingEngine(TorchNarEngine):
        def encode_batch(self, sources):
            runs.append(len(sources))
            return super().encode_batch(sources)

    drafter.nar.engine = CountingEngine(bundle.nar_drafter)
    sources = [[5, 6], [7, 8, 9, 10, 11], [12]]
    sessions = [drafter.open(s) for s in sources]
    results = drafter.draft_batch([(s, BlockCall(0, [9], 3)) for s in sessions])
    assert runs == [3]
    assert [r.ids for r in results] == [make_drafter(bundle, "torch").open(s).draft_block(0, [9], 3).ids
                                        for s in sources]
    drafter.draft_batch([(sessions[0], BlockCall(1, [7], 2))])
    assert runs == [3]


def test_a_draft_that_cannot_fit_is_empty_and_costs_no_forward(bundle):
    drafter = make_drafter(bundle, "torch")
    limit = bundle.nar_drafter.config.max_len - 1
    full, room = drafter.open([5]), drafter.open([6])
    results = drafter.draft_batch([(full, BlockCall(0, [7] * limit, 4)), (room, BlockCall(0, [7], 2))])
    assert results[0].ids == [] and len(results[1].ids) == 2


def test_the_nar_export_has_a_batched_decoder(onnx_drafter):
    export = onnx_drafter.onnx_nar.export
    assert export.batch_decoder == export.directory / BATCH_DECODER_FILE
    names = [i.name for i in onnx_drafter.onnx_nar.runner.batch_decoder.get_inputs()]
    assert names[-1] == "mask_from" and "targets" not in names


def test_block_call_counts_its_tokens():
    call = BlockCall(3, [1, 2], 10)
    assert (call.n_rows, call.n_tokens) == (1, 12)
