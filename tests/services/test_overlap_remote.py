"""Overlapped drafting and pre-verify over gRPC, through real services on loopback (the tiny random bundle).

Through the gateway, the overlapped loop equals the plain loop token for token, step for step, for
GAD, GAD++ and MJSD, and so does the pre-verified loop (with overlap or without) for GAD and GAD++;
their counts reach the response's stats and the gateway's Prometheus counters. Driven directly over
`gateway.peers.remote`'s sessions (the gateway's own path), the drafter stream never has a call in flight
at its close."""

from __future__ import annotations

import grpc
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from decoding.config import DecodingConfig, Mode
from decoding.decode import decode
from gateway.peers.remote import RemoteDrafter, RemoteVerifier, fetch_drafter_info, fetch_verifier_info
from gateway.wire import overrides_to_wire
from protos.specdec.v1 import gateway_pb2
from tests.recording import RecordingDrafter
from tests.services.conftest import scrape

FIRST_WORD = 5  # the tiny bundle's ids below are specials (pad, unk, bos, eos, mask)
VOCAB = 160

REMOTE = settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                          HealthCheck.function_scoped_fixture])


def _params() -> st.SearchStrategy[dict]:
    return st.one_of(
        st.fixed_dictionaries({"mode": st.just("gad"), "k": st.integers(1, 12)}),
        st.fixed_dictionaries({"mode": st.just("gad++"), "k": st.integers(1, 12), "beta": st.integers(1, 8),
                               "tau": st.sampled_from([0.5, 2.0, 100.0])}),
        st.fixed_dictionaries({"mode": st.just("mjsd"), "gamma": st.integers(1, 5), "num_beams": st.integers(1, 3),
                               "threshold": st.sampled_from([0.01, 0.2, 1.0])}),
    )


def _generate(gateway, ids: list[int], overrides: dict) -> gateway_pb2.GenerateResponse:
    request = gateway_pb2.GenerateRequest(input_ids=ids, config=overrides_to_wire(overrides))
    return gateway.Generate(request, timeout=60)


def _assert_same_generate(plain: gateway_pb2.GenerateResponse, other: gateway_pb2.GenerateResponse):
    """`other` decoded as the plain loop (nothing drafted ahead) did, token for token, step for step;
    both responses' stats."""
    assert list(other.output_ids) == list(plain.output_ids)
    a, b = plain.stats, other.stats
    assert not a.degraded and not b.degraded
    assert (b.iterations, b.drafted_tokens, b.accepted_tokens, b.finish_reason) == (
        a.iterations, a.drafted_tokens, a.accepted_tokens, a.finish_reason
    )
    assert list(b.accepted_per_position) == list(a.accepted_per_position)
    assert a.predrafts == a.predrafts_used == a.preverified == a.preverify_cuts == 0
    return a, b


@REMOTE
@given(ids=st.lists(st.integers(FIRST_WORD, VOCAB - 1), min_size=1, max_size=40),
       max_new=st.integers(1, 48), params=_params())
def test_overlapped_generate_equals_plain_generate(gateway, ids, max_new, params):
    off = {} if params["mode"] == "mjsd" else {"preverify": False}  # MJSD has no pre-verify to turn off
    plain = _generate(gateway, ids, {**params, "max_new_tokens": max_new, "overlap": False, **off})
    overlapped = _generate(gateway, ids, {**params, "max_new_tokens": max_new, "overlap": True, **off})
    a, b = _assert_same_generate(plain, overlapped)
    assert 0 <= b.predrafts_used <= b.predrafts <= b.iterations
    for s in (a, b):  # the first draft's wait (a drafter round trip when max_new leaves room for one)
        assert s.first_draft_ms <= s.drafter_time_ms
        assert s.first_draft_ms > 0 if max_new > 1 else s.first_draft_ms >= 0


def test_overlap_is_off_by_default_and_when_asked_for_its_counts_reach_the_metrics(stack, gateway):
    unset, asked = _counts_reach_the_metrics(stack, gateway, 1, "overlap", ("predrafts", "predrafts_used"))
    assert unset.predrafts == unset.preverified == 0
    assert asked.predrafts > 0


def test_remote_sessions_never_overlap_calls_on_the_drafter_stream(stack):
    addresses = stack.running.addresses
    with grpc.insecure_channel(addresses["verifier"]) as vc, grpc.insecure_channel(addresses["drafter"]) as dc:
        verifier = RemoteVerifier(vc, fetch_verifier_info(vc))
        drafter = RemoteDrafter(dc, fetch_drafter_info(dc))
        ids = list(range(FIRST_WORD, FIRST_WORD + 30))
        for mode, params in ((Mode.GAD, {"k": 1}), (Mode.GAD_PLUS_PLUS, {"k": 2, "beta": 8, "tau": 100.0}),
                             (Mode.MJSD, {"gamma": 2, "threshold": 0.01})):
            outputs = []
            for ahead in ({"overlap": False, "preverify": False}, {"overlap": True, "preverify": False},
                          {"overlap": False, "preverify": True}, {"overlap": True, "preverify": True}):
                recording = RecordingDrafter(drafter)
                config = DecodingConfig(mode=mode, max_new_tokens=40, **params, **ahead)
                result = decode(ids, config, verifier, recording)
                outputs.append(result.output_ids)
                (record,) = recording.records
                assert record.most_in_flight == 1 and record.in_flight_at_close == 0
                assert record.calls_after_close == 0
                pooled = result.stats.predrafts > 0 or result.stats.preverified > 0
                assert bool(record.on_predraft_thread()) == pooled
            assert all(output == outputs[0] for output in outputs)


def _preverify_params() -> st.SearchStrategy[dict]:
    return st.one_of(
        st.fixed_dictionaries({"mode": st.just("gad"), "k": st.integers(1, 12)}),
        st.fixed_dictionaries({"mode": st.just("gad++"), "k": st.integers(1, 12), "beta": st.integers(1, 8),
                               "tau": st.sampled_from([0.5, 2.0, 100.0])}),
    )


@REMOTE
@given(ids=st.lists(st.integers(FIRST_WORD, VOCAB - 1), min_size=1, max_size=40),
       max_new=st.integers(1, 48), params=_preverify_params(), overlap=st.booleans())
def test_preverified_generate_equals_plain_generate(gateway, ids, max_new, params, overlap):
    plain = _generate(gateway, ids, {**params, "max_new_tokens": max_new, "preverify": False, "overlap": False})
    pre = _generate(gateway, ids, {**params, "max_new_tokens": max_new, "preverify": True, "overlap": overlap})
    _a, b = _assert_same_generate(plain, pre)
    assert 0 <= b.preverify_cuts <= b.preverified <= b.iterations
    assert 0 <= b.predrafts_used <= b.predrafts <= (b.iterations if overlap else 0)


def test_preverify_is_off_by_default_and_when_asked_for_its_counts_reach_the_metrics(stack, gateway):
    unset, asked = _counts_reach_the_metrics(stack, gateway, 4, "preverify", ("preverified", "preverify_cuts"))
    assert unset.preverified == 0
    # The tiny random bundle's drafter is rarely right: most blocks are cut at their first token.
    assert asked.preverified > 0 and asked.preverify_cuts > 0


def _counts_reach_the_metrics(stack, gateway, k: int, option: str, counts: tuple[str, ...]):
    """The stats of a GAD request without `option` and of one with it, once each of `counts` (a
    stats field) has grown its gateway series `specdec_gateway_<count>_total` by the second's."""
    port = stack.running.gateway.host.metrics_port
    ids = list(range(FIRST_WORD, FIRST_WORD + 30))
    unset = _generate(gateway, ids, {"mode": "gad", "k": k, "max_new_tokens": 40})
    before = scrape(port)
    asked = _generate(gateway, ids, {"mode": "gad", "k": k, "max_new_tokens": 40, option: True})
    after = scrape(port)
    keys = {count: f'specdec_gateway_{count}_total{{mode="gad"}}' for count in counts}
    grown = {count: after[key] - before.get(key, 0.0) for count, key in keys.items()}
    assert grown == {count: getattr(asked.stats, count) for count in counts}
    return unset.stats, asked.stats
