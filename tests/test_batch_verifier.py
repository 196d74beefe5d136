"""Batched verify steps (`step_batch`, multi-row sessions) equal one-row steps.

Torch backend on the zoo's float64 models: a batch of any composition (ragged prefixes, rollbacks,
appends, drafts, multi-row forks, several sources) gives every row exactly the one-row result
(same ids; log-probs to 1e-9, summation order aside). ONNX Runtime's batched graph agrees with
torch on the tiny float32 bundle. A closed session or a bad item fails alone.
"""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from core.errors import SpecdecError, StatusCode
from core.interfaces import BeamRow, StepCall, VerifyResult
from seq2seq_models.bundle import load_bundle, make_tiny_bundle
from tests import zoo
from verifier_service.session import LocalVerifier, make_verifier

W = zoo.FIRST_WORD


def _same(ref: VerifyResult, got: VerifyResult, tol: float, where=None) -> None:
    assert got.top1 == ref.top1, where
    assert got.topk_ids == ref.topk_ids, where
    for a, b in zip(ref.topk_logprobs, got.topk_logprobs, strict=True):
        assert b == pytest.approx(a, abs=tol), where
    assert got.draft_logprobs == pytest.approx(ref.draft_logprobs, abs=tol, nan_ok=True), where


def _random_call(rng: random.Random, held: int, vocab: int, max_out: int) -> StepCall:
    committed = rng.randint(0, held)
    append = [rng.randrange(W, vocab) for _ in range(rng.randint(0, 3))]
    room = max_out - committed - len(append)
    draft = [rng.randrange(W, vocab) for _ in range(min(room, rng.randint(0, 6)))]
    return StepCall(committed, append, draft, rng.randint(1, 5))


@pytest.mark.parametrize("split", [0, 1], ids=["one-forward", "split-by-length"])
@pytest.mark.parametrize("trio", zoo.model_pool()[:2], ids=lambda t: t.label)
@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(seed=st.integers(0, 2**31 - 1), sessions=st.integers(1, 5))
def test_batches_equal_one_row_steps(trio, split, seed, sessions):
    """Random sessions step in random subsets, single-row or multi-row; every row equals a one-row
    reference (single-row: its twin session stepped alone; a beam row: a fresh session fed the
    row's whole prefix). The batch runs as one forward, or as one forward per block length
    (`split_tokens` = 1: any padding outweighs the fixed cost)."""
    rng = random.Random(seed)
    batched, alone = LocalVerifier(trio.verifier), LocalVerifier(trio.verifier)
    batched.split_tokens = split
    vocab, max_out = zoo.VOCAB, 40
    srcs = [[rng.randrange(W, vocab) for _ in range(rng.randint(1, 20))] for _ in range(sessions)]
    multi = [rng.random() < 0.4 for _ in srcs]
    pairs = [(batched.open(s), alone.open(s)) for s in srcs]
    beams: list[list[list[int]]] = [[[]] for _ in srcs]  # each multi-row session's rows' tokens
    for _ in range(6):
        chosen = [i for i in range(sessions) if rng.random() < 0.7] or [0]
        items, checks = [], []
        for i in chosen:
            session, twin = pairs[i]
            if multi[i]:
                rows = []
                for _ in range(rng.randint(1, 4)):
                    parent = rng.randrange(len(beams[i]))
                    committed = rng.randint(0, min(len(beams[i][parent]), max_out - 3))
                    rows.append(BeamRow(parent, committed, [rng.randrange(W, vocab) for _ in range(rng.randint(0, 2))]))
                top_k = rng.randint(1, 4)
                items.append((session, StepCall(top_k=top_k, rows=rows)))
                new = [beams[i][r.parent][: r.committed_len] + r.append_ids for r in rows]
                beams[i] = new
                checks.append([_fresh_row(alone, srcs[i], toks, top_k) for toks in new])
            else:
                call = _random_call(rng, len(twin.tokens), vocab, max_out)
                items.append((session, call))
                checks.append(twin.step(call.committed_len, call.append_ids, call.draft_ids, call.top_k))
        outcomes = batched.step_batch(items)
        rows_in_batch = sum(call.n_rows for _, call in items)
        for got, ref in zip(outcomes, checks, strict=True):
            if isinstance(ref, list):
                assert isinstance(got, list) and len(got) == len(ref)
                for g, r in zip(got, ref, strict=True):
                    _same(r, g, 1e-9, seed)
                    assert g.batch_rows == rows_in_batch
            else:
                _same(ref, got, 1e-9, seed)
                assert got.batch_rows == rows_in_batch
        for (session, twin), m in zip(pairs, multi, strict=True):
            if not m:
                assert session.tokens == twin.tokens


def _fresh_row(verifier: LocalVerifier, source: list[int], tokens: list[int], top_k: int) -> VerifyResult:
    """The next-token view after `tokens` from a session of its own (the prefix recomputed)."""
    return verifier.open(source).step(0, tokens, [], top_k)


def test_one_row_step_equals_the_full_forward():
    # An independent reference: the whole target through the model's non-incremental forward.
    model = zoo.model_pool()[0].verifier
    cfg = model.config
    session = LocalVerifier(model).open([5, 6, 7, 9, 9])
    session.step(0, [5, 6], [], 1)
    got = session.step(1, [7], [9, 10, 11], top_k=4)
    tgt = torch.tensor([[cfg.bos_id, 5, 7, 9, 10, 11]])
    src = torch.tensor([[5, 6, 7, 9, 9, cfg.eos_id]])
    with torch.no_grad():
        logp = F.log_softmax(model(src, torch.ones_like(src, dtype=torch.bool), tgt)[0, 2:], dim=-1)
    assert got.top1 == logp.argmax(-1).tolist()
    for row, ref in zip(got.topk_logprobs, logp.topk(4).values.tolist(), strict=True):
        assert row == pytest.approx(ref, abs=1e-9)
    assert got.draft_logprobs == pytest.approx([float(logp[i, t]) for i, t in enumerate([9, 10, 11])], abs=1e-9)


@pytest.mark.parametrize("trio", zoo.model_pool()[:2], ids=lambda t: t.label)
def test_greedy_through_step_batch_equals_unbatched_greedy(trio):
    gen = torch.Generator().manual_seed(3)
    sources = [zoo.random_source(gen, n) for n in (3, 9, 17, 25, 12, 1)]
    verifier = LocalVerifier(trio.verifier)

    def greedy_alone(src: list[int]) -> list[int]:
        session, out = verifier.open(src), []
        while len(out) < 30:
            tok = session.step(max(0, len(out) - 1), out[-1:], [], 1).top1[0]
            out.append(tok)
            if tok == verifier.eos_id:
                break
        return out

    sessions = [verifier.open(s) for s in sources]
    outs: list[list[int]] = [[] for _ in sources]
    live = list(range(len(sources)))
    while live:  # finished rows leave the batch; the others go on in one forward per step
        results = verifier.step_batch(
            [(sessions[i], StepCall(max(0, len(outs[i]) - 1), outs[i][-1:], [], 1)) for i in live])
        for i, r in zip(list(live), results, strict=True):
            assert isinstance(r, VerifyResult) and r.batch_rows == len(results)
            outs[i].append(r.top1[0])
            if r.top1[0] == verifier.eos_id or len(outs[i]) >= 30:
                live.remove(i)
    assert outs == [greedy_alone(s) for s in sources]


def test_a_closed_session_and_a_bad_item_fail_alone():
    model = zoo.model_pool()[1].verifier
    verifier = LocalVerifier(model)
    ok1, closed, bad, ok2 = (verifier.open(s) for s in ([5, 6, 7], [8, 9], [10, 11, 12], [13]))
    twins = [LocalVerifier(model).open(s) for s in ([5, 6, 7], [13])]
    closed.close()
    items = [
        (ok1, StepCall(0, [5, 6], [7], 3)),
        (closed, StepCall(0, [5], [], 1)),
        (bad, StepCall(4, [5], [], 1)),  # keeps more than the session holds
        (ok2, StepCall(0, [], [13, 14], 2)),
        (ok1, StepCall(0, [5], [], 1)),  # a second step of one session in one batch
        (bad, StepCall(0, [], [], 1, rows=[BeamRow(3, 0, [])])),  # no such parent row
    ]
    out = verifier.step_batch(items)
    _same(twins[0].step(0, [5, 6], [7], 3), out[0], 1e-12)
    _same(twins[1].step(0, [], [13, 14], 2), out[3], 1e-12)
    for i in (1, 2, 4, 5):
        assert isinstance(out[i], SpecdecError) and out[i].code == StatusCode.FAILED_PRECONDITION, out[i]
    assert out[0].batch_rows == 2
    assert ok1.tokens == [5, 6, 7] and bad.tokens == []
    with pytest.raises(SpecdecError, match="closed"):
        closed.step(0, [5], [], 1)


class CountingEngine:
    """A real engine whose encoder runs are recorded (the sizes of their batches)."""

    def __init__(self, engine) -> None:
        self.engine = engine
        self.runs: list[int] = []

    def encode_batch(self, sources):
        self.runs.append(len(sources))
        return self.engine.encode_batch(sources)

    def __getattr__(self, name):
        return getattr(self.engine, name)


def test_new_sessions_are_encoded_together_by_their_first_forward():
    """Opening encodes nothing; the first forward of new sessions encodes all their sources in one
    run (ragged lengths, each row equal to its session stepped alone), later forwards none, and a
    session closed before its first step never."""
    model = zoo.model_pool()[1].verifier
    verifier = LocalVerifier(model)
    verifier.engine = engine = CountingEngine(verifier.engine)
    verifier.split_source_tokens = 0  # one run whatever the lengths
    sources = [[5, 6, 7], [8], [9, 10, 11, 12, 13, 14, 15, 5, 6], [14, 15]]
    sessions = [verifier.open(s) for s in sources]
    never = verifier.open([12, 13])
    never.close()
    assert engine.runs == []
    calls = [StepCall(0, [5], [6, 7], 2), StepCall(0, [], [], 3), StepCall(0, [9, 9], [], 1), StepCall(0, [], [7], 2)]
    out = verifier.step_batch(list(zip(sessions, calls, strict=True)))
    assert engine.runs == [4]
    for src, call, got in zip(sources, calls, out, strict=True):
        twin = LocalVerifier(model).open(src)
        _same(twin.step(call.committed_len, call.append_ids, call.draft_ids, call.top_k), got, 1e-9)
    late = verifier.open([10, 11, 12])
    verifier.step_batch([(sessions[0], StepCall(3, [], [5], 1)), (late, StepCall(0, [], [], 1))])
    assert engine.runs == [4, 1]  # only the new session's source
    assert sessions[0].cache_bytes > 0 and never.cache_bytes == 0


def test_on_a_cpu_sources_of_far_apart_lengths_are_encoded_in_runs_by_length():
    """Padding a short source to a long one's length costs more than a run of its own (the split
    of `core.batch_slots.split_by_length`, with the encoder's fixed cost); close lengths share one."""
    model = zoo.model_pool()[1].verifier
    verifier = LocalVerifier(model)
    verifier.engine = engine = CountingEngine(verifier.engine)
    assert verifier.split_source_tokens > 0
    sources = [[5] * 2, [6] * 30, [7] * 3, [8] * 31]
    sessions = [verifier.open(s) for s in sources]
    out = verifier.step_batch([(s, StepCall(0, [], [], 1)) for s in sessions])
    assert engine.runs == [2, 2]
    for src, got in zip(sources, out, strict=True):
        _same(LocalVerifier(model).open(src).step(0, [], [], 1), got, 1e-9)
    verifier.step_batch([(verifier.open([5] * n), StepCall(0, [], [], 1)) for n in (20, 22)])
    assert engine.runs == [2, 2, 2]


@pytest.mark.parametrize("role", ["verifier", "nar_drafter"])
def test_onnx_encoder_runs_ragged_sources_as_one_by_one(bundle, tmp_path, role):
    """The encoder graph over right-padded sources gives each source its own K/V, as encoding it alone."""
    from seq2seq_models.onnx_export import ensure_export
    from seq2seq_models.ort_engine import OrtBatchEngine
    from seq2seq_models.ort_runner import open_runner

    model = getattr(bundle, role)
    export = ensure_export(model, bundle.fingerprint, tmp_path, role=role)
    engine = OrtBatchEngine(open_runner(export), model.config.eos_id)
    rng = random.Random(3)
    sources = [[rng.randrange(W, model.config.vocab_size) for _ in range(n)] for n in (1, 17, 6, 30, 6)]
    k, v = engine.encode_batch(sources)
    shape = model.config.decoder_shape
    assert v.shape == (model.config.decoder_layers, len(sources), shape.heads, 31, shape.head_dim)
    assert k.shape == (*v.shape[:3], shape.head_dim, 31)  # keys transposed
    for i, src in enumerate(sources):
        alone_k, alone_v = engine.encode_batch([src])
        n = len(src) + 1  # its own positions, EOS included; the rest is the batch's padding
        assert alone_v.shape[3] == alone_k.shape[4] == n
        assert abs(k[:, i, ..., :n] - alone_k[:, 0]).max() < 1e-4 and abs(v[:, i, :, :n] - alone_v[:, 0]).max() < 1e-4


def test_multi_row_forks_reuse_and_free_rows():
    model = zoo.model_pool()[0].verifier
    verifier = LocalVerifier(model)
    session = verifier.open([5, 6, 7, 8])
    first = session.step_rows([BeamRow(0, 0, [])], top_k=3)
    assert len(first) == 1 and len(first[0].top1) == 1
    # Fork row 0 three ways, then keep rows 2 and 0 (in that order); row 1 is freed.
    session.step_rows([BeamRow(0, 0, [5]), BeamRow(0, 0, [6]), BeamRow(0, 0, [7])], top_k=2)
    assert [r.tokens for r in session.rows] == [[5], [6], [7]]
    out = session.step_rows([BeamRow(2, 1, [8]), BeamRow(0, 1, [9, 10])], top_k=2)
    assert [r.tokens for r in session.rows] == [[7, 8], [5, 9, 10]]
    for got, toks in zip(out, ([7, 8], [5, 9, 10]), strict=True):
        _same(_fresh_row(LocalVerifier(model), [5, 6, 7, 8], toks, 2), got, 1e-9)
    assert session.rows[0].slot is not session.rows[1].slot
    session.close()
    assert verifier.pool.used == []  # every row's slot is free again


# ---- ONNX Runtime --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def bundle(tmp_path_factory):
    return load_bundle(make_tiny_bundle(tmp_path_factory.mktemp("bundle"), seed=7))


@pytest.mark.parametrize("seed", [0, 1])
def test_onnx_batches_agree_with_torch_one_row_steps(bundle, tmp_path, seed):
    rng = random.Random(seed)
    onnx = make_verifier(bundle, "onnxruntime", cache_root=tmp_path)
    torch_v = LocalVerifier(bundle.verifier)
    vocab = onnx.vocab_size
    srcs = [[rng.randrange(W, vocab) for _ in range(rng.randint(1, 25))] for _ in range(6)]
    pairs = [(onnx.open(s), torch_v.open(s)) for s in srcs]
    beam, beam_rows = onnx.open(srcs[0]), [[]]
    for step in range(6):
        chosen = [p for p in pairs if rng.random() < 0.75] or pairs[:1]
        calls = [_random_call(rng, len(t.tokens), vocab, 40) for _, t in chosen]
        rows = [BeamRow(rng.randrange(len(beam_rows)), 0, [rng.randrange(W, vocab)]) for _ in range(3)]
        rows = [BeamRow(r.parent, rng.randint(0, len(beam_rows[r.parent])), r.append_ids) for r in rows]
        out = onnx.step_batch([*((o, c) for (o, _), c in zip(chosen, calls, strict=True)),
                               (beam, StepCall(top_k=3, rows=rows))])
        for (o, t), c, got in zip(chosen, calls, out[:-1], strict=True):
            _same(t.step(c.committed_len, c.append_ids, c.draft_ids, c.top_k), got, 1e-4, (seed, step))
            assert o.tokens == t.tokens
        beam_rows = [beam_rows[r.parent][: r.committed_len] + r.append_ids for r in rows]
        for got, toks in zip(out[-1], beam_rows, strict=True):
            _same(_fresh_row(torch_v, srcs[0], toks, 3), got, 1e-4, (seed, step, "beam"))


@pytest.mark.parametrize("seed", [0, 1])
def test_onnx_one_row_and_batched_graphs_apply_processors_as_torch(bundle, tmp_path, seed):
    """With logits processors on, a lone row (ONNX Runtime's one-row graph) and the same rows in a
    batch (the batched graph) give what torch's head gives: drafts included, so the head rows'
    plans follow the drafted prefix."""
    from core.logits_processors import Processors

    rng = random.Random(seed)
    onnx = make_verifier(bundle, "onnxruntime", cache_root=tmp_path)
    torch_v = LocalVerifier(bundle.verifier)
    vocab = onnx.vocab_size
    for _ in range(3):
        src = [rng.randrange(W, vocab) for _ in range(rng.randint(2, 12))]
        settings = Processors(
            repetition_penalty=rng.choice([1.5, 0.6]), no_repeat_ngram_size=2, encoder_no_repeat_ngram_size=2,
            bad_words_ids=((rng.randrange(W, vocab), rng.randrange(W, vocab)), (rng.randrange(W, vocab),)),
            min_new_tokens=3, suppress_tokens=(rng.randrange(W, vocab),), forced_eos_token_id=onnx.eos_id,
            max_length=8,
        )
        lone, twin, ref = onnx.open(src, settings), onnx.open(src, settings), torch_v.open(src, settings)
        other = onnx.open(src[::-1])
        committed: list[int] = []
        while len(committed) < 7:
            draft = [rng.randrange(W, vocab) for _ in range(min(7 - len(committed), rng.randint(0, 3)))]
            keep = max(0, len(committed) - 1)
            call = StepCall(keep, committed[keep:], draft, 3)
            want = ref.step(call.committed_len, call.append_ids, call.draft_ids, call.top_k)
            _same(want, lone.step(call.committed_len, call.append_ids, call.draft_ids, call.top_k), 1e-4, seed)
            got = onnx.step_batch([(twin, call), (other, StepCall(0, [], [], 1))])[0]
            assert isinstance(got, VerifyResult) and got.batch_rows == 2
            _same(want, got, 1e-4, (seed, "batched"))
            committed += [*draft[: rng.randint(0, len(draft))], want.top1[0]][: 7 - len(committed)]


def test_a_batch_splits_by_block_length_only_where_the_padding_outweighs_a_forward() -> None:
    from core.batch_slots import split_by_length

    # 25 one-token rows and one 3-token probe: 50 token-rows of padding against a fixed cost of 32.
    assert split_by_length([1] * 12 + [3] + [1] * 13, 32) == [[*range(12), *range(13, 26)], [12]]
    assert split_by_length([1] * 12 + [3] + [1] * 3, 32) == [list(range(16))]  # 30 token-rows: not worth it
    assert split_by_length([1] * 12 + [3] + [1] * 13, 0) == [list(range(26))]  # 0: never
    assert split_by_length([4, 4, 4], 1) == [[0, 1, 2]]
    # Three lengths: 11-token GAD blocks and 10-token ones go together, the one-token rows apart.
    assert split_by_length([11, 1, 10, 1, 1, 11, 1, 1], 32) == [[1, 3, 4, 6, 7], [0, 2, 5]]
    assert split_by_length([], 32) == [[]]


def test_a_pool_given_the_model_s_limits_grows_within_the_buffers_it_made_first() -> None:
    """With the model's longest row and source known, a pool of numpy arrays (whose zeros cost nothing
    until touched) makes its buffers with room for them: rows growing a step at a time to the limit,
    and a longer source, are re-laid out within the two buffers of each array made at the start, what
    the rows hold intact. Arrays whose zeros are written as they are made get no room."""
    import numpy as np

    from seq2seq_models.row_cache import KVPool, NumpyArrays

    pool = KVPool(NumpyArrays(), 2, 3, 4, max_positions=100, max_sources=40)
    pool.reserve(8)
    rows = [pool.acquire() for _ in range(8)]
    for i, row in enumerate(rows):
        _fill(row, 10, 6, float(i + 1))
    pool.ensure(positions=pool.positions + 1)  # the second buffer of each array
    buffers = {id(b) for b in [*pool._flat.values(), *pool._spare.values()]}
    assert len(buffers) == 8  # two of each array
    for positions in range(pool.positions + 1, 101, pool.POSITION_STEP):
        pool.ensure(positions=positions)
    pool.ensure(sources=40)
    assert pool.positions >= 100 and pool.sources == 40
    assert {id(b) for b in [*pool._flat.values(), *pool._spare.values()]} == buffers
    assert all(_holds(row, 10, 6, float(i + 1)) for i, row in enumerate(rows))

    class Written(NumpyArrays):
        lazy = False

    eager = KVPool(Written(), 2, 3, 4, max_positions=100, max_sources=40)
    eager.reserve(8)
    _fill(eager.acquire(), 10, 6, 1.0)
    assert eager.nbytes < pool.nbytes and all(b.size < 8 * 2 * 3 * 4 * 100 for b in eager._flat.values())
    assert isinstance(pool.k, np.ndarray)


def _pool(layers: int = 2, heads: int = 3, head_dim: int = 4):
    from seq2seq_models.row_cache import KVPool, NumpyArrays

    return KVPool(NumpyArrays(), layers, heads, head_dim)


def _fill(slot, positions: int, source: int, value: float) -> None:
    """Give `slot` `positions` self positions and a source of `source`, every entry `value` (V: -value)."""
    import numpy as np

    shape, hd = (slot.pool.layers, slot.pool.heads), slot.pool.head_dim  # keys transposed: positions last
    slot.set_source(np.full((*shape, hd, source), value, np.float32),
                    np.full((*shape, source, hd), -value, np.float32))
    slot.write(0, np.full((*shape, hd, positions), value, np.float32),
               np.full((*shape, positions, hd), -value, np.float32))


def _holds(slot, positions: int, source: int, value: float) -> bool:
    pool, i = slot.pool, slot.index
    return bool((pool.k[:, i, ..., :positions] == value).all() and (pool.v[:, i, :, :positions] == -value).all()
                and (pool.ck[:, i, ..., :source] == value).all() and (pool.cv[:, i, :, :source] == -value).all()
                and slot.held == positions and slot.src_len == source)


def test_pool_rows_keep_their_data_through_holes_moves_and_relayouts() -> None:
    """A freed slot is a hole the next row takes; once holes are more than a quarter of the slots the
    last rows move into them; growing and shrinking the capacities keeps what every row holds."""
    pool = _pool()
    rows = [pool.acquire() for _ in range(8)]
    for i, row in enumerate(rows):
        _fill(row, 3 + i, 5 + i, float(i + 1))
    pool.release(rows[2])
    assert pool.n == 8 and pool.slots[2] is None  # a hole, no copy
    again = pool.acquire()
    assert again.index == 2  # the first free slot
    _fill(again, 4, 4, 9.0)
    for row in (rows[1], rows[3], rows[5]):
        pool.release(row)  # 3 holes of 8: the last rows move into them
    kept = [rows[0], again, rows[4], rows[6], rows[7]]
    assert pool.n == 5 and sorted(r.index for r in kept) == list(range(5))
    values = {id(rows[0]): 1.0, id(again): 9.0, id(rows[4]): 5.0, id(rows[6]): 7.0, id(rows[7]): 8.0}
    lengths = {id(rows[0]): (3, 5), id(again): (4, 4), id(rows[4]): (7, 9), id(rows[6]): (9, 11), id(rows[7]): (10, 12)}
    for row in kept:
        assert _holds(row, *lengths[id(row)], values[id(row)])
    pool.ensure(positions=100, sources=70)  # grow: a re-layout
    assert pool.positions >= 100 and pool.sources >= 70
    extra = [pool.acquire() for _ in range(20)]  # more rows than the capacity: another
    assert all(_holds(row, *lengths[id(row)], values[id(row)]) for row in kept)
    for row in extra:
        pool.release(row)
    pool.fit()  # the longest held is 10 positions, the longest source 12: shrink
    assert pool.positions <= 32 and pool.sources <= 16
    assert all(_holds(row, *lengths[id(row)], values[id(row)]) for row in kept)


def test_the_pools_sources_fit_the_longest_exactly_laid_out_once_per_encoder_run() -> None:
    """The cross-attention capacity is the longest source held, not rounded up (a forward reads every
    position of it); new sources encoded together lay the pool out once, for the longest of them;
    once the longest has left, the capacity shrinks to the next when more than an eighth is padding."""
    import numpy as np

    from seq2seq_models.row_cache import Source, encode_new

    pool = _pool()
    shape, hd = (pool.layers, pool.heads), pool.head_dim

    class Encoder:  # the encoder's contract (`row_cache.Encoder`): K/V of the right-padded sources, EOS appended
        def encode_batch(self, sources: list[list[int]]) -> tuple[np.ndarray, np.ndarray]:
            s = max(len(ids) for ids in sources) + 1
            k = np.stack([np.full((*shape, hd, s), float(len(ids)), np.float32) for ids in sources], axis=1)
            v = np.stack([np.full((*shape, s, hd), -float(len(ids)), np.float32) for ids in sources], axis=1)
            return k, v

    layouts = []
    original = pool._layout
    pool._layout = lambda **kw: layouts.append(kw) or original(**kw)
    lengths = [5, 29, 11, 17]
    rows = [pool.acquire() for _ in lengths]
    layouts.clear()
    encode_new(Encoder(), [(Source(list(range(n))), row) for n, row in zip(lengths, rows, strict=True)])
    assert [kw for kw in layouts if "sources" in kw] == [{"sources": 30}]  # one layout, the longest's
    assert pool.sources == 30 and all(_holds_source(row, n + 1, float(n)) for n, row in zip(lengths, rows, strict=True))
    pool.release(rows[1])  # the longest leaves: 18 needed, 12 of 30 padding
    pool.fit()
    assert pool.sources == 18 and all(_holds_source(row, n + 1, float(n)) for n, row in zip(lengths, rows, strict=True)
                                      if row is not rows[1])
    pool.release(rows[3])  # 12 needed of 18: shrinks again
    pool.fit()
    assert pool.sources == 12
    more = pool.acquire()
    encode_new(Encoder(), [(Source(list(range(10))), more)])  # 11 positions: within the capacity, no layout
    pool.fit()
    assert pool.sources == 12


def _holds_source(slot, source: int, value: float) -> bool:
    pool, i = slot.pool, slot.index
    return bool((pool.ck[:, i, ..., :source] == value).all() and (pool.cv[:, i, :, :source] == -value).all()
                and slot.src_len == source)


def test_a_batch_s_last_long_rows_grow_the_pool_in_the_buffers_it_has() -> None:
    """Past the largest layout yet with few rows in use, the pool lays out rows for those in use, not
    for all it reserved (no fresh buffer); the next rows get the reserved rows back, the positions
    fitted to what the rows in use hold."""
    pool = _pool()
    pool.reserve(32)
    rows = [pool.acquire() for _ in range(32)]
    for i, row in enumerate(rows):
        _fill(row, 20, 6, float(i + 1))
    pool.ensure(positions=48, sources=32)  # a full batch's growth: both buffers of each array grow to it
    pool.ensure(positions=64)
    for row in rows[1:]:
        pool.release(row)
    held = pool.nbytes
    pool.ensure(positions=200)  # the last row runs on, past anything laid out for 32 rows
    step = pool.POSITION_STEP
    assert pool.positions == -(-200 // step) * step and pool.row_capacity == 8 and pool.nbytes == held
    assert _holds(rows[0], 20, 6, 1.0)
    _fill(rows[0], 190, 6, 1.0)
    fresh = [pool.acquire() for _ in range(31)]  # the next batch
    assert pool.row_capacity >= 32 and pool.positions == -(-190 // step) * step and _holds(rows[0], 190, 6, 1.0)
    pool.release(rows[0])
    more = pool.acquire()
    assert more.index == 0 and all(not row.held for row in fresh)
    for row in [*fresh, more]:
        pool.release(row)
    pool.reserve(40)  # more rows than before, none in use: the positions go back to the least
    assert pool.row_capacity == 40 and pool.positions == pool.POSITION_STEP


def test_a_forward_over_a_few_rows_gathers_them_and_over_most_feeds_the_pool() -> None:
    """`gather` feeds the pool's arrays as they are when most of its rows step (the others as
    one-position dummies) and copies the few rows that do otherwise; both give each row its own K/V."""
    import numpy as np

    from seq2seq_models.row_cache import RowBlock, gather

    pool = _pool()
    rows = [pool.acquire() for _ in range(4)]
    for i, row in enumerate(rows):
        _fill(row, 2 + i, 3 + i, float(i + 1))
    blocks = [RowBlock(row, [7], row.held, 0, [-1]) for row in rows[:3]]
    feeds, at = gather(blocks, pool)  # 3 of 4: direct
    assert at == [0, 1, 2] and feeds["past_k"].base is not None and np.shares_memory(feeds["past_k"], pool.k)
    assert feeds["past_lens"].tolist() == [2, 3, 4, 0] and feeds["src_lens"].tolist() == [3, 4, 5, 1]
    few, at = gather([RowBlock(rows[3], [7, 8], 5, 0, [-1, -1])], pool)  # 1 of 4: gathered
    assert at == [0] and not np.shares_memory(few["past_k"], pool.k)
    assert few["past_k"].shape[4] == few["past_v"].shape[3] == 5 and (few["past_k"][:, 0] == 4.0).all()
    assert few["cross_k"].shape[4] == few["cross_v"].shape[3] == 6 and (few["cross_v"][:, 0] == -4.0).all()


@pytest.mark.parametrize("trio", zoo.model_pool()[:2], ids=lambda t: t.label)
def test_concurrent_in_process_decodes_equal_decodes_one_at_a_time(trio):
    """Greedy decodes of several sources from their own threads on one in-process verifier, each
    row batched or alone as the threads meet, equal the same decodes one after another."""
    import threading

    from decoding.config import DecodingConfig, Mode
    from decoding.decode import decode

    gen = torch.Generator().manual_seed(5)
    sources = [zoo.random_source(gen, n) for n in (3, 9, 17, 4, 12, 6)]
    config = DecodingConfig(mode=Mode.AR, max_new_tokens=zoo.MAX_LEN - 1)
    alone = [decode(s, config, LocalVerifier(trio.verifier), None).output_ids for s in sources]
    verifier = LocalVerifier(trio.verifier)
    for _ in range(4):
        outputs: dict[int, list[int]] = {}
        start = threading.Barrier(len(sources), timeout=30)

        def run(i: int, start: threading.Barrier, outputs: dict[int, list[int]]) -> None:
            start.wait()
            outputs[i] = decode(sources[i], config, verifier, None).output_ids

        threads = [threading.Thread(target=run, args=(i, start, outputs)) for i in range(len(sources))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert [outputs.get(i) for i in range(len(sources))] == alone
