"""The batching scheduler through real servers: concurrent Verify and Draft streams against a
verifier / drafter on loopback (tiny bundle, both backends) give exactly what the same streams give
one at a time, while the metrics show forwards of more than one row; cancelled streams drop out
without disturbing the others; the batch keys come from TOML, environment and flags, checked."""

from __future__ import annotations

import queue
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from functools import partial

import grpc
import pytest

from core.config import load_sections
from protos.specdec.v1 import drafter_pb2, drafter_pb2_grpc, verifier_pb2, verifier_pb2_grpc
from specdec.cli import build_parser
from specdec.commands.serve import batch_overrides
from specdec.serve import ServiceStack, serve_config
from tests.services.conftest import scrape, wait_until

CLIENTS = 6
STEPS = 12
# Some company for every step: the clients' steps meet in the queue even on a loaded machine.
WAIT_MS = 20.0


def _sources(vocab: int) -> list[list[int]]:
    return [[(7 * c + 3 * i) % (vocab - 10) + 10 for i in range(5 + 3 * c)] for c in range(CLIENTS)]


class Stream:
    """A bidi stream driven one message at a time from a sync client."""

    def __init__(self, rpc, timeout: float = 60) -> None:
        self._requests: queue.SimpleQueue = queue.SimpleQueue()
        self.call = rpc(iter(self._requests.get, None), timeout=timeout)

    def send(self, message):
        self._requests.put(message)
        return next(self.call)

    def cancel_after(self, message, delay_s: float = 0.005) -> None:
        self._requests.put(message)
        time.sleep(delay_s)
        self.call.cancel()

    def close(self) -> None:
        self._requests.put(None)
        self.call.cancel()


def _verify_loop(channel_address: str, source: list[int], cancel_after: int | None = None) -> dict:
    """GAD's accept rule against the verifier, with copy drafts of varying length (ragged steps,
    rollbacks): the tokens it commits and every step's top-1 lists and batch rows."""
    with grpc.insecure_channel(channel_address) as channel:
        stream = Stream(verifier_pb2_grpc.VerifierServiceStub(channel).Verify)
        stream.send(verifier_pb2.VerifyRequest(open=verifier_pb2.VerifyOpen(source_ids=source)))
        return _verify_steps(stream, source, cancel_after)


def _verify_steps(stream: Stream, source: list[int], cancel_after: int | None = None) -> dict:
    """`_verify_loop`'s steps on a stream already open over `source`; closes it."""
    out: list[int] = []  # final tokens the verifier holds
    pending: list[int] = []  # final tokens not sent yet
    top1s, rows = [], []
    for step_no in range(STEPS):
        start = (len(out) + step_no) % len(source)
        draft = source[start : start + step_no % 4]
        step = verifier_pb2.VerifyStep(committed_len=len(out), append_ids=pending, draft_ids=draft, top_k=2)
        if step_no == cancel_after:  # the step is sent, then the stream cancelled: mostly while it is queued
            stream.cancel_after(verifier_pb2.VerifyRequest(step=step))
            return {"cancelled": True}
        result = stream.send(verifier_pb2.VerifyRequest(step=step)).step
        out += pending
        top1 = [p.top1 for p in result.positions]
        top1s.append(top1)
        rows.append(result.batch_rows)
        assert result.batch_tokens >= result.batch_rows and result.forward_ms > 0
        accepted = 0
        while accepted < len(draft) and draft[accepted] == top1[accepted]:
            accepted += 1
        # The accepted draft tokens are in the verifier's cache: they become final by commit.
        out += draft[:accepted]
        pending = [top1[accepted]]
    stream.close()
    return {"out": out + pending, "top1s": top1s, "rows": rows}




def _forwards_over_one_row(samples: dict[str, float], service: str) -> float:
    rows = f"specdec_{service}_batch_rows"
    return samples[f"{rows}_count"] - samples[f'{rows}_bucket{{le="1.0"}}']


def _serve(role: str, bundle_dir, **keys) -> ServiceStack:
    table = {"address": "127.0.0.1:0", "metrics_address": "127.0.0.1:0", **keys}
    return ServiceStack(role, bundle_dir, {role: table})


@pytest.mark.parametrize("backend", ["torch", "onnxruntime"])
def test_concurrent_verify_streams_batch_and_answer_as_sequential_ones(bundle_dir, bundle, backend):
    sources = _sources(bundle.verifier.config.vocab_size)
    with _serve("verifier", bundle_dir, backend=backend, batch_wait_ms=WAIT_MS) as stack:
        address = stack.running.addresses["verifier"]
        server = stack.running.verifier
        alone = [_verify_loop(address, s) for s in sources]
        assert all(rows == [1] * STEPS for rows in (r["rows"] for r in alone))
        with ThreadPoolExecutor(CLIENTS) as pool:
            together = list(pool.map(lambda s: _verify_loop(address, s), sources))
        samples = scrape(server.host.metrics_port)
    for got, want in zip(together, alone, strict=True):
        assert got["out"] == want["out"] and got["top1s"] == want["top1s"]
    assert max(max(r["rows"]) for r in together) > 1
    assert _forwards_over_one_row(samples, "verifier") > 0
    steps = 2 * CLIENTS * STEPS
    assert samples["specdec_verifier_steps_total"] == steps
    # Fewer forwards than steps, and every step's queue wait observed once.
    assert samples["specdec_verifier_forwards_total"] < steps
    assert samples["specdec_verifier_queue_wait_seconds_count"] == steps
    assert samples["specdec_verifier_batch_rows_sum"] == steps


@pytest.mark.parametrize("backend", ["torch", "onnxruntime"])
def test_sessions_opened_while_the_worker_is_busy_are_encoded_in_one_run(bundle_dir, bundle, backend):
    """Opening answers at once, the worker busy or not, and queues the source for the encoder; the
    sources of sessions opened while the worker was busy are encoded in one run, before their first
    steps, which then answer as the same streams one at a time do."""
    sources = _sources(bundle.verifier.config.vocab_size)[:4]
    with _serve("verifier", bundle_dir, backend=backend) as stack:
        address = stack.running.addresses["verifier"]
        server = stack.running.verifier
        alone = [_verify_loop(address, s) for s in sources]
        before = scrape(server.host.metrics_port)
        busy = threading.Event()
        server.executor.submit(busy.wait)  # the worker is busy until the opens are answered
        try:
            with grpc.insecure_channel(address) as channel:
                stub = verifier_pb2_grpc.VerifierServiceStub(channel)
                streams = [Stream(stub.Verify) for _ in sources]
                for stream, source in zip(streams, sources, strict=True):
                    stream._requests.put(verifier_pb2.VerifyRequest(open=verifier_pb2.VerifyOpen(source_ids=source)))
                assert all(next(stream.call).HasField("opened") for stream in streams)
                assert _queued_encodes(server) == len(sources)  # queued before `opened` went out
                busy.set()
                first = [stream.send(verifier_pb2.VerifyRequest(step=verifier_pb2.VerifyStep(top_k=2))).step
                         for stream in streams]
                for stream in streams:
                    stream.close()
        finally:
            busy.set()
        after = scrape(server.host.metrics_port)
    assert after["specdec_verifier_encoder_runs_total"] - before["specdec_verifier_encoder_runs_total"] == 1
    assert after["specdec_verifier_encoded_sources_total"] - before["specdec_verifier_encoded_sources_total"] == 4
    # The run is the worker's busy time as much as the forwards are: timed on its own histogram.
    assert after["specdec_verifier_encode_seconds_count"] - before["specdec_verifier_encode_seconds_count"] == 1
    assert after["specdec_verifier_encode_seconds_sum"] > before["specdec_verifier_encode_seconds_sum"]
    assert [[p.top1 for p in step.positions] for step in first] == [want["top1s"][0][:1] for want in alone]


@pytest.mark.parametrize("backend", ["torch", "onnxruntime"])
def test_model_workers_share_the_sessions_out_and_answer_as_one_worker(bundle_dir, bundle, backend):
    """[verifier] model_workers = 2, placement = "sessions": sessions open on the worker with fewer,
    each worker's steps batch among its own sessions, answers equal one worker's, and every session
    is freed."""
    sources = _sources(bundle.verifier.config.vocab_size)
    with _serve("verifier", bundle_dir, backend=backend) as stack:
        alone = [_verify_loop(stack.running.addresses["verifier"], s) for s in sources]
    with _serve("verifier", bundle_dir, backend=backend, batch_wait_ms=WAIT_MS, model_workers=2,
                intra_op_threads=2, placement="sessions") as stack:
        address = stack.running.addresses["verifier"]
        server = stack.running.verifier
        assert len(server.lanes) == 2 and server.lanes[0].verifier is not server.lanes[1].verifier
        with grpc.insecure_channel(address) as channel:
            stub = verifier_pb2_grpc.VerifierServiceStub(channel)
            streams = [Stream(stub.Verify) for _ in range(4)]
            for stream, source in zip(streams, sources[:4], strict=True):
                assert stream.send(verifier_pb2.VerifyRequest(open=verifier_pb2.VerifyOpen(source_ids=source)))
            assert [lane.sessions for lane in server.lanes] == [2, 2]
            for stream in streams:
                stream.close()
        assert wait_until(lambda: server.active_sessions == 0 and not server._lane_of)
        assert [lane.sessions for lane in server.lanes] == [0, 0]
        with ThreadPoolExecutor(CLIENTS) as pool:
            together = list(pool.map(lambda s: _verify_loop(address, s), sources))
        samples = scrape(server.host.metrics_port)
        assert wait_until(lambda: server.active_sessions == 0 and not server._lane_of)
    for got, want in zip(together, alone, strict=True):
        assert got["out"] == want["out"] and got["top1s"] == want["top1s"]
    assert samples["specdec_verifier_steps_total"] == CLIENTS * STEPS


def test_model_workers_place_sessions_by_source_length(bundle_dir, bundle):
    """The default placement: short and long sources open on different workers, the workers kept
    about even, so the forwards attend over less padding than when each session takes the worker
    with fewer (the verifier's attention counters). Answers equal one worker's either way."""
    vocab = bundle.verifier.config.vocab_size
    short = [[(5 * c + i) % (vocab - 10) + 10 for i in range(3)] for c in range(3)]
    long = [[(3 * c + 2 * i) % (vocab - 10) + 10 for i in range(40)] for c in range(3)]
    sources = [short[0], short[1], long[0], long[1], short[2], long[2]]  # the order they open in
    with _serve("verifier", bundle_dir) as stack:
        alone = [_verify_loop(stack.running.addresses["verifier"], s) for s in sources]
    padding = {}
    for placement, placed in (("length", [[3, 3, 3], [40, 40, 40]]), ("sessions", [[3, 3, 40], [3, 40, 40]])):
        with _serve("verifier", bundle_dir, batch_wait_ms=WAIT_MS, model_workers=2, intra_op_threads=2,
                    placement=placement) as stack:
            server = stack.running.verifier
            with grpc.insecure_channel(stack.running.addresses["verifier"]) as channel:
                stub = verifier_pb2_grpc.VerifierServiceStub(channel)
                streams = [Stream(stub.Verify) for _ in sources]
                for stream, source in zip(streams, sources, strict=True):
                    assert stream.send(verifier_pb2.VerifyRequest(open=verifier_pb2.VerifyOpen(source_ids=source)))
                assert sorted(sorted(lane.sources) for lane in server.lanes) == placed
                before = scrape(server.host.metrics_port)
                with ThreadPoolExecutor(len(sources)) as pool:  # the open streams' steps side by side
                    together = list(pool.map(_verify_steps, streams, sources))
                after = scrape(server.host.metrics_port)
            assert wait_until(lambda server=server: server.active_sessions == 0 and not server._lane_of)
        for got, want in zip(together, alone, strict=True):
            assert got["out"] == want["out"] and got["top1s"] == want["top1s"]
        attended, held = (after[name] - before[name] for name in
                          ("specdec_verifier_attended_positions_total", "specdec_verifier_held_positions_total"))
        assert 0 < held <= attended
        padding[placement] = attended / held
    assert padding["length"] < padding["sessions"]


def test_model_workers_below_one_are_refused(bundle_dir):
    with pytest.raises(ValueError, match=r"\[verifier\] model_workers: must be at least 1; got 0"):
        serve_config(load_sections(None, environ={}, overrides={"verifier": {"model_workers": 0}}))


def _queued_encodes(server) -> int:
    """The new sources queued for the encoder on the verifier's (first) worker."""
    encoder = server.lanes[0].encoder
    with server.executor._cond:
        return sum(getattr(entry, "scheduler", None) is encoder for entry in server.executor._queue)


def test_max_batch_rows_1_turns_batching_off(bundle_dir, bundle):
    sources = _sources(bundle.verifier.config.vocab_size)
    with _serve("verifier", bundle_dir, max_batch_rows=1, batch_wait_ms=WAIT_MS) as stack:
        address = stack.running.addresses["verifier"]
        with ThreadPoolExecutor(CLIENTS) as pool:
            together = list(pool.map(lambda s: _verify_loop(address, s), sources))
        samples = scrape(stack.running.verifier.host.metrics_port)
    assert all(rows == [1] * STEPS for rows in (r["rows"] for r in together))
    assert _forwards_over_one_row(samples, "verifier") == 0
    assert samples["specdec_verifier_forwards_total"] == CLIENTS * STEPS


def test_streams_cancelled_mid_way_leave_the_others_exact_and_free_their_sessions(bundle_dir, bundle):
    sources = _sources(bundle.verifier.config.vocab_size)
    with _serve("verifier", bundle_dir, batch_wait_ms=WAIT_MS) as stack:
        address = stack.running.addresses["verifier"]
        server = stack.running.verifier
        alone = [_verify_loop(address, s) for s in sources]
        for round_no in range(3):
            cancel = {c: (round_no + c) % STEPS for c in range(0, CLIENTS, 2)}  # every other client
            with ThreadPoolExecutor(CLIENTS) as pool:
                cancels = [cancel.get(c) for c in range(CLIENTS)]
                together = list(pool.map(partial(_verify_loop, address), sources, cancels))
            for c, got in enumerate(together):
                if c in cancel:
                    assert got == {"cancelled": True}
                else:
                    assert got["out"] == alone[c]["out"] and got["top1s"] == alone[c]["top1s"]
        assert wait_until(lambda: server.active_sessions == 0 and server.streams.admitted == 0)


def test_concurrent_nar_block_drafts_batch_and_match_sequential_ones(bundle_dir, bundle):
    """... and each block says which forward it ran in (rows, tokens, milliseconds: what a client's
    adaptive speculation learns the drafter's cost from)."""
    sources = _sources(bundle.verifier.config.vocab_size)
    loads: dict[bool, list[tuple[int, int, int, float]]] = {False: [], True: []}  # together -> loads

    def drafts(address: str, source: list[int], together: bool = False) -> list[list[int]]:
        with grpc.insecure_channel(address) as channel:
            stream = Stream(drafter_pb2_grpc.DrafterServiceStub(channel).Draft)
            stream.send(drafter_pb2.DraftRequest(open=drafter_pb2.DraftOpen(source_ids=source, seed=0)))
            out: list[int] = []
            blocks = []
            for step_no in range(STEPS):
                k = 1 + step_no % 5
                if step_no % 3 == 2:
                    out = out[:-1]  # keep one token fewer than the drafter holds: it rolls back
                append = source[step_no % len(source) : step_no % len(source) + 1]
                step = drafter_pb2.DraftStep(
                    committed_len=len(out), append_ids=append, block=drafter_pb2.BlockDraft(k=k)
                )
                result = stream.send(drafter_pb2.DraftRequest(step=step)).result
                ids = list(result.ids)
                loads[together].append((len(append) + k, result.batch_rows, result.batch_tokens, result.forward_ms))
                out += append
                blocks.append(ids)
            stream.close()
            return blocks

    with _serve("drafter", bundle_dir, batch_wait_ms=WAIT_MS) as stack:
        address = stack.running.addresses["drafter"]
        before = scrape(stack.running.drafter.host.metrics_port)
        alone = [drafts(address, s) for s in sources]
        with ThreadPoolExecutor(CLIENTS) as pool:
            together = list(pool.map(lambda s: drafts(address, s, together=True), sources))
        samples = scrape(stack.running.drafter.host.metrics_port)
    assert together == alone
    # Every session's source encoded once, by its first draft; alone, one run each.
    encoded, runs = ("specdec_drafter_encoded_sources_total", "specdec_drafter_encoder_runs_total")
    assert samples[encoded] - before[encoded] == 2 * CLIENTS
    assert CLIENTS < samples[runs] - before[runs] <= 2 * CLIENTS
    assert all((rows, tokens) == (1, own) and ms > 0 for own, rows, tokens, ms in loads[False])
    assert all(rows >= 1 and tokens >= own and ms > 0 for own, rows, tokens, ms in loads[True])
    assert any(rows > 1 and tokens > own for own, rows, tokens, _ in loads[True])
    assert _forwards_over_one_row(samples, "drafter") > 0
    assert samples["specdec_drafter_queue_wait_seconds_count"] == 2 * CLIENTS * STEPS


# ---- multi-row (beam) steps on the wire ---------------------------------------------------------


@pytest.fixture(scope="module")
def verifier_stack(bundle_dir):
    with _serve("verifier", bundle_dir, max_draft_len=4) as stack:
        yield stack


def _one_step(address: str, step: verifier_pb2.VerifyStep, source=(20, 21, 22)):
    with grpc.insecure_channel(address) as channel:
        stream = Stream(verifier_pb2_grpc.VerifierServiceStub(channel).Verify)
        stream.send(verifier_pb2.VerifyRequest(open=verifier_pb2.VerifyOpen(source_ids=source)))
        try:
            return stream.send(verifier_pb2.VerifyRequest(step=step)).step
        finally:
            stream.close()


def _code(address: str, step: verifier_pb2.VerifyStep) -> grpc.StatusCode:
    with pytest.raises(grpc.RpcError) as info:
        _one_step(address, step)
    return info.value.code()


def _rows(*rows: tuple[int, int, list[int]]) -> list[verifier_pb2.BeamRow]:
    return [verifier_pb2.BeamRow(parent=p, committed_len=c, append_ids=a) for p, c, a in rows]


@pytest.mark.parametrize(
    ("step", "code"),
    [
        (verifier_pb2.VerifyStep(rows=_rows(*[(0, 0, [20])] * 5)), grpc.StatusCode.OUT_OF_RANGE),
        (verifier_pb2.VerifyStep(rows=_rows((0, 0, [20])), append_ids=[20]), grpc.StatusCode.INVALID_ARGUMENT),
        (verifier_pb2.VerifyStep(rows=_rows((0, 0, [20])), draft_ids=[20]), grpc.StatusCode.INVALID_ARGUMENT),
        (verifier_pb2.VerifyStep(rows=_rows((0, 0, [20])), committed_len=1), grpc.StatusCode.INVALID_ARGUMENT),
        (verifier_pb2.VerifyStep(rows=_rows((0, 0, [10**6]))), grpc.StatusCode.INVALID_ARGUMENT),
        (verifier_pb2.VerifyStep(rows=_rows((0, 0, [20])), top_k=-1), grpc.StatusCode.INVALID_ARGUMENT),
        (verifier_pb2.VerifyStep(rows=_rows((-1, 0, [20]))), grpc.StatusCode.FAILED_PRECONDITION),
        (verifier_pb2.VerifyStep(rows=_rows((0, -2, [20]))), grpc.StatusCode.FAILED_PRECONDITION),
    ],
    ids=["too-many-rows", "rows-and-append", "rows-and-draft", "rows-and-commit", "bad-id", "bad-top-k",
         "negative-parent", "negative-commit"],
)
def test_a_bad_multi_row_step_is_refused_at_the_edge(verifier_stack, step, code):
    assert _code(verifier_stack.running.addresses["verifier"], step) == code


def test_a_multi_row_step_answers_one_position_per_row(verifier_stack):
    """One position per row, batched as one forward; an unknown parent is FAILED_PRECONDITION."""
    address = verifier_stack.running.addresses["verifier"]
    rows = verifier_pb2.VerifyStep(rows=_rows((0, 0, [20, 21]), (0, 0, [22])), top_k=3)
    result = _one_step(address, rows)
    assert len(result.positions) == 2 and all(len(p.topk_ids) == 3 for p in result.positions)
    assert result.batch_rows >= 2
    orphan = verifier_pb2.VerifyStep(rows=_rows((1, 0, [20])))  # a fresh session has row 0 only
    assert _code(address, orphan) == grpc.StatusCode.FAILED_PRECONDITION


# ---- configuration --------------------------------------------------------------------------------


def test_batch_keys_come_from_the_file_the_environment_and_flags(tmp_path):
    path = tmp_path / "specdec.toml"
    path.write_text("[verifier]\nmax_batch_rows = 8\nbatch_wait_ms = 2\n[drafter]\nmax_batch_tokens = 64\n")
    config = serve_config(load_sections(path, environ={}))
    assert (config.verifier_limits.max_batch_rows, config.verifier_limits.batch_wait_ms) == (8, 2.0)
    assert config.verifier_limits.max_batch_tokens == 512  # the default
    assert (config.drafter_limits.max_batch_rows, config.drafter_limits.max_batch_tokens) == (32, 64)
    environ = {"SPECDEC__VERIFIER__MAX_BATCH_ROWS": "1", "SPECDEC__DRAFTER__BATCH_WAIT_MS": "0.5"}
    by_env = serve_config(load_sections(path, environ=environ))
    assert by_env.verifier_limits.max_batch_rows == 1 and by_env.drafter_limits.batch_wait_ms == 0.5
    args = build_parser().parse_args(["serve", "all", "--max-batch-rows", "4", "--batch-wait-ms", "3"])
    flags = batch_overrides(args)
    by_flags = serve_config(load_sections(path, environ=environ, overrides={"verifier": flags, "drafter": flags}))
    assert by_flags.verifier_limits.max_batch_rows == by_flags.drafter_limits.max_batch_rows == 4
    assert by_flags.verifier_limits.batch_wait_ms == 3.0 and by_flags.drafter_limits.max_batch_tokens == 64


@pytest.mark.parametrize(
    ("section", "key", "value", "message"),
    [
        ("verifier", "max_batch_rows", 0, "must be at least 1; got 0"),
        ("drafter", "max_batch_tokens", -5, "must be at least 1; got -5"),
        ("verifier", "batch_wait_ms", -1.0, "must be positive, or 0 for never; got -1.0"),
        ("drafter", "max_batch_rows", "many", "expected int, got str 'many'"),
        ("verifier", "batch_wait_ms", True, "expected float, got bool True"),
    ],
)
def test_a_bad_batch_key_is_a_one_line_error_naming_it(section, key, value, message):
    with pytest.raises(ValueError) as info:
        serve_config({section: {key: value}})
    assert str(info.value) == f"[{section}] {key}: {message}"
