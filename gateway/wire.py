"""Conversions between the gateway's wire messages and the library's config and stats."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import fields
from typing import Any

from core.errors import invalid
from decoding.config import ID_LISTS, DecodingConfig, Mode, parse_ids, wire_name
from decoding.modes import MODES
from decoding.policies.loop import DecodeResult, DecodeStats
from decoding.report import Stats, request_stats
from protos.specdec.v1 import common_pb2, gateway_pb2

# Both derived from the mode registry and DecodingConfig's field metadata; nothing is listed here.
MODE_TO_WIRE = {mode: gateway_pb2.Mode.Value(spec.wire) for mode, spec in MODES.items()}
WIRE_TO_MODE = {v: k for k, v in MODE_TO_WIRE.items()}
# gateway.proto DecodingConfig field -> DecodingConfig field; the mode travels as an enum, apart, and
# the token lists as TokenSequence (ids) or TokenSequences (sequences of ids) messages.
_FIELDS = {wire_name(f): f.name for f in fields(DecodingConfig) if f.name != "mode" and f.name not in ID_LISTS}
_LISTS = {wire_name(f): f.name for f in fields(DecodingConfig) if f.name in ID_LISTS}


def overrides_from_wire(config: gateway_pb2.DecodingConfig) -> dict[str, Any]:
    """The fields the request set (proto3 `optional` presence), as DecodingConfig overrides."""
    out: dict[str, Any] = {}
    if config.HasField("mode") and config.mode != gateway_pb2.MODE_UNSPECIFIED:
        if config.mode not in WIRE_TO_MODE:
            raise invalid(f"unknown mode {config.mode}")
        out["mode"] = WIRE_TO_MODE[config.mode]
    for wire, name in _FIELDS.items():
        if config.HasField(wire):
            out[name] = getattr(config, wire)
    for wire, name in _LISTS.items():
        if config.HasField(wire):
            ids = getattr(config, wire)
            out[name] = [list(s.ids) for s in ids.sequences] if ID_LISTS[name] == 2 else list(ids.ids)
    return out


def overrides_to_wire(overrides: dict[str, Any]) -> gateway_pb2.DecodingConfig:
    """The inverse, for clients (`specdec generate`); None values stay unset."""
    config = gateway_pb2.DecodingConfig()
    if overrides.get("mode") is not None:
        config.mode = MODE_TO_WIRE[Mode(overrides["mode"])]
    for wire, name in _FIELDS.items():
        if overrides.get(name) is not None:
            setattr(config, wire, overrides[name])
    for wire, name in _LISTS.items():
        if overrides.get(name) is not None:
            values = parse_ids(name, overrides[name], ID_LISTS[name])
            message = getattr(config, wire)
            message.SetInParent()  # set, even to no ids (overriding a default)
            if ID_LISTS[name] == 2:
                message.sequences.extend(common_pb2.TokenSequence(ids=ids) for ids in values)
            else:
                message.ids.extend(values)
    return config


def hypotheses_to_wire(result: DecodeResult, decode_text: Callable[[list[int]], str]) -> list[gateway_pb2.Hypothesis]:
    """A beam search's n-best list as GenerateResponse.hypotheses (other modes: none)."""
    return [gateway_pb2.Hypothesis(text=decode_text(h.output_ids), output_ids=h.output_ids, score=h.score,
                                   finish_reason=h.finish_reason, token_logprobs=h.token_logprobs)
            for h in result.hypotheses]


def stats_record(stats: DecodeStats, mode: Mode, total_s: float) -> dict[str, Any]:
    """The stats as `specdec decode` and `specdec generate --json` print them (`decoding.report.Stats`)."""
    return request_stats(stats, mode, total_s).record()


def stats_dict(stats: gateway_pb2.DecodingStats) -> dict[str, Any]:
    """A DecodingStats message as a dict of its fields (lists for repeated ones, the mode by name)."""
    return report_from_wire(stats).record()


def stats_to_wire(stats: DecodeStats, mode: Mode, total_s: float) -> gateway_pb2.DecodingStats:
    return report_to_wire(request_stats(stats, mode, total_s))


def report_to_wire(report: Stats) -> gateway_pb2.DecodingStats:
    values = {f.name: getattr(report, f.name) for f in fields(Stats) if f.name != "mode"}
    return gateway_pb2.DecodingStats(**values, mode=MODE_TO_WIRE[Mode(report.mode)])


def report_from_wire(stats: gateway_pb2.DecodingStats) -> Stats:
    values: dict[str, Any] = {}
    for f in stats.DESCRIPTOR.fields:
        value = getattr(stats, f.name)
        if f.name == "mode":
            value = WIRE_TO_MODE[value].value if value in WIRE_TO_MODE else ""
        elif f.is_repeated:
            value = list(value)
        values[f.name] = value
    return Stats(**values)


def stats_from_wire(stats: gateway_pb2.DecodingStats, output_tokens: int) -> DecodeStats:
    return DecodeStats(
        iterations=stats.iterations,
        drafted_tokens=stats.drafted_tokens,
        accepted_tokens=stats.accepted_tokens,
        accepted_per_position=list(stats.accepted_per_position),
        steps_per_draft_length=list(stats.steps_per_draft_length),
        predrafts=stats.predrafts,
        predrafts_used=stats.predrafts_used,
        predraft_wait_s=stats.predraft_wait_ms / 1e3,
        preverified=stats.preverified,
        preverify_cuts=stats.preverify_cuts,
        output_tokens=output_tokens,
        drafter_time_s=stats.drafter_time_ms / 1e3,
        first_draft_time_s=stats.first_draft_ms / 1e3,
        verifier_time_s=stats.verifier_time_ms / 1e3,
        degraded=stats.degraded,
        finish_reason=stats.finish_reason,
    )
