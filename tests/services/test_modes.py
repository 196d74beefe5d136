"""Every mode through the services equals the in-process `decode()`; streams concatenate."""

from __future__ import annotations

import pytest

from core.backends import DEFAULT_BACKEND
from decoding.config import DecodingConfig, Mode
from decoding.decode import decode
from drafter_service.session import LocalDrafter
from gateway.wire import overrides_to_wire
from protos.specdec.v1 import gateway_pb2
from specdec.client import generate
from verifier_service.session import make_verifier

TEXTS = ["We have been living in this city.", "Я хочу подякувати вам за вашу допомогу."]
MODES = {
    Mode.AR: {},
    Mode.BEAM: {"num_beams": 3},
    Mode.IAD: {"k": 6},
    Mode.GAD: {"k": 4},
    Mode.GAD_PLUS_PLUS: {"k": 4, "beta": 3, "tau": 2.0},
    Mode.MJSD: {"gamma": 3, "num_beams": 2, "threshold": 0.2},
    Mode.SPECULATIVE: {"gamma": 3, "temperature": 0.9, "top_k": 20, "top_p": 0.95},
}


def _overrides(mode: Mode) -> dict:
    return {"mode": mode.value, **MODES[mode], "max_new_tokens": 24, "seed": 5}


def _in_process(bundle, text: str, overrides: dict):
    drafter = LocalDrafter({r: bundle.models[r] for r in ("nar_drafter", "ar_drafter")})
    config = DecodingConfig().with_overrides(overrides)
    # The stack serves the verifier on the default backend; compare with the same one in-process.
    verifier = make_verifier(bundle, DEFAULT_BACKEND)
    return decode(bundle.tokenizer.encode(text), config, verifier, drafter)


@pytest.mark.parametrize("mode", list(MODES), ids=lambda m: m.value)
def test_service_output_equals_in_process_decode(stack, gateway, bundle, mode):
    for text in TEXTS:
        overrides = _overrides(mode)
        expected = _in_process(bundle, text, overrides)
        response = gateway.Generate(
            gateway_pb2.GenerateRequest(text=text, config=overrides_to_wire(overrides)), timeout=60
        )
        assert list(response.output_ids) == expected.output_ids
        assert response.text == bundle.tokenizer.decode(expected.output_ids)
        assert response.final and not response.stats.degraded
        assert response.stats.iterations == expected.stats.iterations
        assert response.stats.accepted_tokens == expected.stats.accepted_tokens


@pytest.mark.parametrize("mode", [Mode.AR, Mode.GAD, Mode.BEAM, Mode.SPECULATIVE], ids=lambda m: m.value)
def test_stream_chunks_concatenate_to_generate(gateway, mode):
    request = gateway_pb2.GenerateRequest(text=TEXTS[0], config=overrides_to_wire(_overrides(mode)))
    whole = gateway.Generate(request, timeout=60)
    chunks = list(gateway.GenerateStream(request, timeout=60))
    assert [c.final for c in chunks] == [False] * (len(chunks) - 1) + [True]
    assert [i for c in chunks for i in c.output_ids] == list(whole.output_ids)
    assert "".join(c.text for c in chunks) == whole.text
    assert chunks[-1].stats.iterations == whole.stats.iterations


def test_input_ids_equal_text(gateway, bundle):
    ids = bundle.tokenizer.encode(TEXTS[0])
    config = overrides_to_wire(_overrides(Mode.GAD))
    by_text = gateway.Generate(gateway_pb2.GenerateRequest(text=TEXTS[0], config=config), timeout=60)
    by_ids = gateway.Generate(gateway_pb2.GenerateRequest(input_ids=ids, config=config), timeout=60)
    assert list(by_ids.output_ids) == list(by_text.output_ids)


def test_client_returns_the_decode_record(stack, bundle):
    overrides = _overrides(Mode.GAD)
    record = generate(stack.running.addresses["gateway"], TEXTS[0], overrides, timeout=60)
    expected = _in_process(bundle, TEXTS[0], overrides)
    assert record["output_ids"] == expected.output_ids
    assert set(record) == {"output_ids", "text", "stats"}
    assert list(record["stats"]) == list(gateway_pb2.DecodingStats.DESCRIPTOR.fields_by_name)
    assert record["stats"]["iterations"] == expected.stats.iterations
