"""The wire conventions (core.wire) and the request checks every edge shares (core.checks,
core.sampling.check_sampling): one rule, one status code, one message."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from core.checks import (
    check_bounded,
    check_draft_len,
    check_length,
    check_positive,
    check_session_step,
    check_source_ids,
    check_wire_top_k,
)
from core.errors import SpecdecError, StatusCode
from core.sampling import MIN_TEMPERATURE, SamplingParams, check_sampling, warp
from core.wire import (
    SPECIAL_ID_FIELDS,
    TOP1_ONLY,
    sampling_from_wire,
    sends_candidates,
    session_top_k,
    source_len_from_wire,
    source_len_to_wire,
    target_len_from_wire,
    target_len_to_wire,
)


class _Config:
    vocab_size = 50
    max_len = 10  # a model config: 9 source tokens plus EOS, 9 output tokens plus BOS


@given(st.integers(min_value=0, max_value=1 << 20))
def test_length_conversions_round_trip(n: int) -> None:
    assert source_len_from_wire(source_len_to_wire(n)) == n
    assert target_len_from_wire(target_len_to_wire(n)) == n


def test_a_model_configs_max_len_is_the_wire_value() -> None:
    # The wire counts the source's EOS and the decoder start token; a config's max_len does too.
    assert source_len_to_wire(_Config.max_len - 1) == _Config.max_len
    assert target_len_to_wire(_Config.max_len - 1) == _Config.max_len
    assert source_len_from_wire(_Config.max_len) == _Config.max_len - 1


def test_top_k_zero_on_the_wire_is_top1_without_lists() -> None:
    assert TOP1_ONLY == 0
    assert session_top_k(TOP1_ONLY) == 1 and not sends_candidates(TOP1_ONLY)
    assert session_top_k(7) == 7 and sends_candidates(7)


def test_top_p_zero_on_the_wire_is_off() -> None:
    assert sampling_from_wire(0.7, 5, 0.0) == SamplingParams(temperature=0.7, top_k=5, top_p=1.0)
    assert sampling_from_wire(1.0, 0, 0.9).top_p == 0.9


def _refused(fn, *args, **kwargs) -> SpecdecError:
    with pytest.raises(SpecdecError) as info:
        fn(*args, **kwargs)
    return info.value


@pytest.mark.parametrize(
    ("params", "message"),
    [
        (SamplingParams(temperature=-0.5), "temperature must be a finite number >= 0, got -0.5"),
        (SamplingParams(temperature=math.inf), "temperature must be a finite number >= 0, got inf"),
        (SamplingParams(temperature=math.nan), "temperature must be a finite number >= 0, got nan"),
        (SamplingParams(top_k=-1), "top_k must be >= 0 (0 = off), got -1"),
        (SamplingParams(top_p=0.0), "top_p must be in (0, 1], got 0.0"),
        (SamplingParams(top_p=1.5), "top_p must be in (0, 1], got 1.5"),
    ],
)
def test_check_sampling_refuses(params: SamplingParams, message: str) -> None:
    error = _refused(check_sampling, params)
    assert error.code == StatusCode.INVALID_ARGUMENT and error.message == message


@pytest.mark.parametrize("params", [SamplingParams(), SamplingParams(0.0, 0, 1.0), SamplingParams(2.0, 40, 0.01)])
def test_check_sampling_accepts(params: SamplingParams) -> None:
    check_sampling(params)


def test_source_check_names_what_it_checks() -> None:
    assert _refused(check_source_ids, [1] * 10, 50, 9).message == "source has 10 tokens; the limit is 9"
    assert _refused(check_source_ids, [], 50, 9, what="input").message == "input is empty"
    assert _refused(check_source_ids, [1, 50], 50, 9, ids_name="input_ids").message.startswith("input_ids has ids")
    check_source_ids([1] * 9, 50, 9)


def test_the_session_state_check() -> None:
    """The one check a session keeps: what it holds, and the model's length (max_len 10: 9 outputs)."""
    check_session_step(3, 3, 2, 4, _Config)
    assert _refused(check_session_step, 4, 3, 0, 0, _Config).code == StatusCode.FAILED_PRECONDITION
    assert _refused(check_session_step, -1, 3, 0, 0, _Config).code == StatusCode.FAILED_PRECONDITION
    refused = _refused(check_session_step, 3, 3, 2, 5, _Config)
    assert (refused.code, refused.message) == (StatusCode.OUT_OF_RANGE, "output would reach 10 tokens; the limit is 9")
    assert _refused(check_source_ids, [1] * 10, 50, 9).message == "source has 10 tokens; the limit is 9"
    assert _refused(check_source_ids, [1] * 10, 50, 9).code == StatusCode.OUT_OF_RANGE
    assert _refused(check_source_ids, [], 50, 9).code == StatusCode.INVALID_ARGUMENT


def test_wire_top_k_range() -> None:
    check_wire_top_k(0, 50)
    check_wire_top_k(50, 50)
    for bad in (-1, 51):
        error = _refused(check_wire_top_k, bad, 50)
        assert error.code == StatusCode.INVALID_ARGUMENT and error.message == f"top_k must be in [0, 50], got {bad}"


def test_draft_len_and_positive() -> None:
    check_draft_len(4, 4)
    assert _refused(check_draft_len, 5, 4).code == StatusCode.OUT_OF_RANGE
    check_positive(1, "k")
    assert _refused(check_positive, 0, "k").message == "k must be >= 1, got 0"


def test_special_id_fields_are_model_info_and_config_fields() -> None:
    from protos.specdec.v1 import common_pb2
    from seq2seq_models.config import ModelConfig

    config = ModelConfig(vocab_size=50)
    for name in SPECIAL_ID_FIELDS:
        assert name in common_pb2.ModelInfo.DESCRIPTOR.fields_by_name
        assert isinstance(getattr(config, name), int)


# ---- input limits (issue items 5 and 6) --------------------------------------------------------

_accepted_params = st.builds(
    SamplingParams,
    temperature=st.floats(min_value=0.0, allow_nan=False, allow_infinity=False),
    top_k=st.integers(min_value=0, max_value=64),
    top_p=st.floats(min_value=0.0, max_value=1.0, exclude_min=True, allow_nan=False),
)
# Log-probs as a model or the dense verifier rows give them: finite, with -inf for tokens left out.
_logprobs = st.lists(
    st.one_of(st.floats(min_value=-1e308, max_value=0.0, allow_nan=False), st.just(-math.inf)), min_size=1, max_size=64
).filter(lambda xs: any(math.isfinite(x) for x in xs))


@given(_logprobs, _accepted_params)
def test_warp_returns_finite_probabilities_summing_to_one(logprobs: list[float], params: SamplingParams) -> None:
    check_sampling(params, vocab_size=64)  # only parameters an edge accepts
    probs = warp(np.array(logprobs), params)
    assert np.all(np.isfinite(probs)) and np.all(probs >= 0)
    assert abs(probs.sum() - 1.0) < 1e-9


@pytest.mark.parametrize("temperature", [0.0, 5e-324, 1e-310, 1e-7])
def test_a_temperature_below_the_floor_is_argmax(temperature: float) -> None:
    logprobs = np.log(np.array([0.1, 0.6, 0.3]))
    assert temperature < MIN_TEMPERATURE
    assert warp(logprobs, SamplingParams(temperature=temperature)).tolist() == [0.0, 1.0, 0.0]


def test_sampling_top_k_is_bounded_by_the_vocabulary() -> None:
    check_sampling(SamplingParams(top_k=50), vocab_size=50)
    error = _refused(check_sampling, SamplingParams(top_k=51), vocab_size=50)
    assert (error.code, error.message) == (StatusCode.INVALID_ARGUMENT, "top_k must be in [0, 50] (0 = off), got 51")


def test_counts_have_a_floor_and_a_ceiling() -> None:
    check_bounded("num_beams", 16, 1, 16)
    low = _refused(check_bounded, "num_beams", 0, 1, 16)
    high = _refused(check_bounded, "num_beams", 8000, 1, 16)
    assert (low.code, low.message) == (StatusCode.INVALID_ARGUMENT, "num_beams must be >= 1, got 0")
    assert (high.code, high.message) == (StatusCode.OUT_OF_RANGE, "num_beams must be <= 16, got 8000")


def test_a_source_over_the_length_limit_is_refused_before_its_ids_are_checked() -> None:
    # Ids outside the vocabulary *and* too long: the length (O(1)) answers first.
    error = _refused(check_source_ids, [999] * 20, _Config.vocab_size, 9)
    assert (error.code, error.message) == (StatusCode.OUT_OF_RANGE, "source has 20 tokens; the limit is 9")
    error = _refused(check_length, [1] * 10, 9, "append_ids")
    assert (error.code, error.message) == (StatusCode.OUT_OF_RANGE, "append_ids has 10 tokens; the limit is 9")


def test_stats_are_named_alike_in_the_cli_grpc_and_kserve() -> None:
    """One naming scheme (DecodingStats' fields, times in ms, a total wall time) for `specdec decode`
    and `generate --json`, gRPC and the KServe response parameters."""
    from tritonclient.grpc import service_pb2

    from decoding.config import Mode
    from decoding.policies.loop import DecodeStats
    from gateway.kserve import _stats_parameters
    from gateway.wire import stats_dict, stats_record, stats_to_wire

    stats = DecodeStats(iterations=4, drafted_tokens=9, accepted_tokens=6, output_tokens=9, drafter_time_s=0.002,
                        first_draft_time_s=0.001, verifier_time_s=0.003, finish_reason="eos")
    record = stats_record(stats, Mode.GAD, 0.010)
    wire = stats_to_wire(stats, Mode.GAD, 0.010)
    assert list(record) == [f.name for f in wire.DESCRIPTOR.fields] and stats_dict(wire) == record
    response = service_pb2.ModelInferResponse()
    _stats_parameters(response, stats, Mode.GAD, 0.010)
    assert set(response.parameters) == set(record)
    assert record["total_time_ms"] == 10.0 and record["gateway_time_ms"] == 5.0 and record["first_draft_ms"] == 1.0
    assert record["mode"] == "gad" and response.parameters["mode"].string_param == "gad"
    assert not [name for name in record if name.endswith("_s")]


def test_plain_ar_commits_one_token_per_iteration() -> None:
    """mean_accepted_length counts the EOS the last step committed: AR is 1.0, not 24/25."""
    from decoding.policies.loop import DecodeStats

    assert DecodeStats(iterations=25, output_tokens=24, finish_reason="eos").mean_accepted_length == 1.0
    assert DecodeStats(iterations=24, output_tokens=24, finish_reason="length").mean_accepted_length == 1.0
    assert DecodeStats(iterations=4, output_tokens=11, finish_reason="eos").mean_accepted_length == 3.0
