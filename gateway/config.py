"""Service configuration: a TOML file, overridden by environment variables, overridden by flags.

One file configures all three services (see config/specdec.example.toml):

    [gateway]   address, verifier_address, drafter_address, metrics_address, workers,
                request_timeout_s, drafter_timeout_s, startup_timeout_s, drafter_retry_s,
                fallback ("ar": run plain AR through the verifier when the drafter fails;
                "fail": answer UNAVAILABLE)
    [defaults]  DecodingConfig fields (mode, k, beta, tau, ...): used for unset request fields
    [limits]    DecodingLimits fields (max_k, max_beta, ...): per-request bounds
    [verifier]  address, backend (torch | onnxruntime), metrics_address, max_sessions, max_draft_len,
                max_source_len
    [drafter]   address, metrics_address, max_sessions, max_draft_len

Environment: SPECDEC__<SECTION>__<KEY>=value (e.g. SPECDEC__GATEWAY__FALLBACK=fail,
SPECDEC__DEFAULTS__MODE=iad); values are parsed as TOML scalars, falling back to strings.
"""

from __future__ import annotations

import os
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from core.errors import invalid
from gateway.decoding_config import DecodingConfig, DecodingLimits

ENV_PREFIX = "SPECDEC__"
SECTIONS = ("gateway", "defaults", "limits", "verifier", "drafter")
FALLBACK_POLICIES = ("ar", "fail")


@dataclass(frozen=True)
class GatewayConfig:
    address: str = "127.0.0.1:50051"
    verifier_address: str = "127.0.0.1:50052"
    drafter_address: str | None = "127.0.0.1:50053"  # "" or None: no drafter (AR, beam, IAD only)
    metrics_address: str | None = None  # host:port of the Prometheus endpoint; None: off
    workers: int = 8  # requests decoded at once (each holds a worker thread)
    request_timeout_s: float = 120.0  # deadline when the client sets none
    drafter_timeout_s: float = 30.0  # the drafter's share of a request; past it, fall back
    startup_timeout_s: float = 60.0  # how long start-up waits for the verifier
    drafter_retry_s: float = 1.0  # after a drafter failure, skip it this long before retrying
    fallback: str = "ar"
    defaults: DecodingConfig = field(default_factory=DecodingConfig)
    seed_from_defaults: bool = False  # True when [defaults] sets a seed; else unset = fresh seed
    limits: DecodingLimits = field(default_factory=DecodingLimits)

    def __post_init__(self) -> None:
        if self.fallback not in FALLBACK_POLICIES:
            raise invalid(f"gateway.fallback must be one of {FALLBACK_POLICIES}, got {self.fallback!r}")


def load_sections(
    path: str | Path | None = None,
    environ: Mapping[str, str] | None = None,
    overrides: Mapping[str, Mapping[str, Any]] | None = None,
) -> dict[str, dict[str, Any]]:
    """The merged configuration: file, then environment, then `overrides` (flags; None ignored)."""
    sections: dict[str, dict[str, Any]] = {name: {} for name in SECTIONS}
    if path:
        data = tomllib.loads(Path(path).read_text())
        unknown = set(data) - set(SECTIONS)
        if unknown:
            raise ValueError(f"{path}: unknown sections {sorted(unknown)}; known: {list(SECTIONS)}")
        for name, table in data.items():
            sections[name].update(table)
    for key, value in (os.environ if environ is None else environ).items():
        if not key.startswith(ENV_PREFIX):
            continue
        section, _, name = key[len(ENV_PREFIX) :].lower().partition("__")
        if section in sections and name:
            sections[section][name] = _parse_scalar(value)
    for section, table in (overrides or {}).items():
        sections[section].update({k: v for k, v in table.items() if v is not None})
    return sections


def gateway_config(sections: Mapping[str, Mapping[str, Any]]) -> GatewayConfig:
    g = dict(sections.get("gateway", {}))
    _known(GatewayConfig, g, "gateway", exclude={"defaults", "limits", "seed_from_defaults"})
    defaults_table = dict(sections.get("defaults", {}))
    defaults = DecodingConfig().with_overrides(defaults_table)
    limits_table = dict(sections.get("limits", {}))
    _known(DecodingLimits, limits_table, "limits")
    if g.get("drafter_address") == "":
        g["drafter_address"] = None
    return GatewayConfig(
        **g,
        defaults=defaults,
        seed_from_defaults="seed" in defaults_table,
        limits=DecodingLimits(**limits_table),
    )


def _known(cls, table: Mapping[str, Any], section: str, exclude: set[str] | None = None) -> None:
    known = {f.name for f in fields(cls)} - (exclude or set())
    unknown = set(table) - known
    if unknown:
        raise ValueError(f"[{section}]: unknown keys {sorted(unknown)}; known: {sorted(known)}")


def _parse_scalar(text: str) -> Any:
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text
