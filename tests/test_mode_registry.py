"""The mode registry (decoding.modes) and the facts derived from it and from DecodingConfig's fields."""

from __future__ import annotations

from dataclasses import fields

import pytest

from decoding.config import DecodingConfig, Mode, wire_name
from decoding.modes import DRAFTER_MODES, LOSSLESS_MODES, MODES, DrafterMethod, ModeSpec, mode_names
from decoding.modes.ar import build as build_ar
from gateway.wire import MODE_TO_WIRE, WIRE_TO_MODE, overrides_from_wire, overrides_to_wire
from protos.specdec.v1 import gateway_pb2


def test_every_mode_has_a_registered_spec() -> None:
    assert list(MODES) == list(Mode)
    assert all(spec.mode == mode for mode, spec in MODES.items())
    assert mode_names() == ["ar", "beam", "iad", "gad", "gad++", "mjsd", "spec"]


def test_every_wire_mode_maps_to_a_mode_and_back() -> None:
    wire_values = [v.number for v in gateway_pb2.Mode.DESCRIPTOR.values if v.number != gateway_pb2.MODE_UNSPECIFIED]
    assert sorted(WIRE_TO_MODE) == sorted(wire_values)
    assert {WIRE_TO_MODE[MODE_TO_WIRE[mode]] for mode in Mode} == set(Mode)


def test_the_declared_guarantees_and_drafter_needs() -> None:
    assert {Mode.AR, Mode.IAD, Mode.GAD} == LOSSLESS_MODES
    assert {Mode.GAD, Mode.GAD_PLUS_PLUS, Mode.MJSD, Mode.SPECULATIVE} == DRAFTER_MODES
    methods = {mode: spec.drafter for mode, spec in MODES.items()}
    assert methods[Mode.GAD] == methods[Mode.GAD_PLUS_PLUS] == DrafterMethod.BLOCK
    assert (methods[Mode.MJSD], methods[Mode.SPECULATIVE]) == (DrafterMethod.BEAM, DrafterMethod.SAMPLE)
    config = DecodingConfig(beta=5)
    assert {mode: spec.top_k(config, 300) for mode, spec in MODES.items() if spec.build} == {
        Mode.AR: 1, Mode.IAD: 1, Mode.GAD: 1, Mode.GAD_PLUS_PLUS: 5, Mode.MJSD: 1, Mode.SPECULATIVE: 300,
    }
    assert [mode for mode, spec in MODES.items() if spec.run] == [Mode.BEAM]


def test_a_spec_declares_build_or_run() -> None:
    with pytest.raises(TypeError, match="exactly one"):
        ModeSpec(Mode.AR, wire="MODE_AR_GREEDY", lossless=True, drafter=DrafterMethod.NONE)
    with pytest.raises(TypeError, match="no drafter"):
        ModeSpec(Mode.AR, wire="MODE_AR_GREEDY", lossless=True, drafter=DrafterMethod.BLOCK, run=lambda *a: [])
    with pytest.raises(TypeError, match="exactly one"):
        ModeSpec(Mode.AR, "MODE_AR_GREEDY", True, DrafterMethod.NONE, build=build_ar, run=lambda *a: [])


def test_every_decoding_field_is_a_wire_field_and_back() -> None:
    ours = {wire_name(f) for f in fields(DecodingConfig)}
    assert ours == {f.name for f in gateway_pb2.DecodingConfig.DESCRIPTOR.fields}
    assert {wire_name(f): f.name for f in fields(DecodingConfig) if wire_name(f) != f.name} == {
        "block_size": "k", "top_beta": "beta", "mjsd_threshold": "threshold", "adaptive_k": "adaptive",
    }


def test_overrides_round_trip_through_the_wire() -> None:
    overrides = {"mode": Mode.MJSD, "k": 3, "beta": 2, "tau": 0.0, "num_beams": 2, "gamma": 5, "threshold": 0.5,
                 "beam_delta": 1.5, "beam_max_candidates": 3, "temperature": 0.7, "top_k": 0, "top_p": 0.9,
                 "seed": 11, "max_new_tokens": 30, "adaptive": True}
    wire = overrides_to_wire(overrides)
    assert (wire.block_size, wire.top_beta, wire.mjsd_threshold, wire.mode) == (3, 2, 0.5, gateway_pb2.MODE_MJSD)
    assert overrides_from_wire(wire) == overrides
    assert overrides_from_wire(overrides_to_wire({"k": 4, "seed": None})) == {"k": 4}
