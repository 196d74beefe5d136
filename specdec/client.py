"""`specdec generate`: one call to a running gateway (`specdec.remote_engine`); `--json` prints
`specdec decode`'s record."""

from __future__ import annotations

import json
from typing import Any

from serving.tls import ClientTLS
from specdec.remote_engine import CallError, RemoteEngine

__all__ = ["CallError", "degraded_note", "format_record", "generate"]


def generate(
    address: str,
    text: str,
    overrides: dict[str, Any],
    timeout: float | None = None,
    input_ids: list[int] | None = None,
    request_id: str | None = None,
    tls: ClientTLS | None = None,
    token: str | None = None,
    target_lang: str = "",
    target_prefix: str | list[int] = "",
) -> dict[str, Any]:
    """Generate once; returns {"output_ids", "text", "stats", ...} as `specdec decode` prints it.
    `tls`: connect over TLS (None: plaintext); `token`: the gateway's bearer token; `target_lang`:
    a many-to-many model's target language code (empty: the model's default); `target_prefix`: text
    or ids the output starts with."""
    with RemoteEngine(address, timeout=timeout, tls=tls, token=token) as engine:
        wanted = engine.request(input_ids or text, target_lang, overrides, target_prefix)
        output = engine.call(wanted, request_id)
    return output.record()


def format_record(record: dict[str, Any], as_json: bool) -> str:
    """The record as JSON, or its text; an n-best list as one line per hypothesis, its score first."""
    if as_json:
        return json.dumps(record, ensure_ascii=False)
    if len(record.get("hypotheses", [])) > 1:
        return "\n".join(f"{h['score']:.6f}\t{h['text']}" for h in record["hypotheses"])
    return record["text"]


def degraded_note(record: dict[str, Any]) -> str | None:
    """The line plain output adds (on stderr, apart from the text) when the gateway fell back to AR."""
    if not record["stats"].get("degraded"):
        return None
    return "degraded: the drafter was unavailable, so the gateway decoded as plain AR through the verifier"
