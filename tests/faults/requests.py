"""The gateway requests the fault tests send."""

from __future__ import annotations

from gateway.wire import overrides_to_wire
from protos.specdec.v1 import gateway_pb2

# ~200 input tokens and the longest output: on the tiny bundle about 0.6 s alone, several seconds with
# 8 decoding at once, so a cancel, deadline or shutdown always lands while it decodes.
LONG = gateway_pb2.GenerateRequest(
    input_ids=[10 + (i * 7) % 140 for i in range(200)],
    config=overrides_to_wire({"mode": "gad", "k": 4, "max_new_tokens": 255, "seed": 1}),
)
SHORT = gateway_pb2.GenerateRequest(
    text="We have been living.", config=overrides_to_wire({"mode": "gad", "k": 4, "max_new_tokens": 8, "seed": 1})
)
