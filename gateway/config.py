"""The gateway's own configuration: the [gateway], [defaults] and [limits] sections.

Loading (file -> environment -> flags) and the per-key checks live in `core.config`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from core.config import (
    DRAFTER_ADDRESS,
    GATEWAY_ADDRESS,
    HTTP_ADDRESS,
    VERIFIER_ADDRESS,
    check_security_keys,
    parse_section,
)
from decoding.config import DecodingConfig, DecodingLimits, layered_defaults
from gateway.peers.dns import parse_targets

FALLBACK_POLICIES = ("ar", "fail")


@dataclass(frozen=True)
class GatewayConfig:
    address: str = GATEWAY_ADDRESS
    # The HTTP endpoints (gateway/web: KServe v2 REST, OpenAI-style /v1/completions, LibreTranslate's
    # /translate, the playground at /), with the same admission, limits, TLS and token as gRPC.
    # "" or None: off.
    http_address: str | None = HTTP_ADDRESS
    # LibreTranslate's codes ("SOURCE:TARGET", e.g. "en:de") of a model whose tokenizer has no language
    # codes; a many-to-many model's come from its tokenizer. "": undeclared (/translate refuses).
    language_pair: str = ""
    # The verifier replicas: a comma-separated list of gRPC targets, each one server or a
    # `dns:///NAME:PORT` (`dns://DNS-SERVER/NAME:PORT`) name for all the addresses it resolves to
    # (gateway.peers.replicas). The same for drafter_address.
    verifier_address: str = VERIFIER_ADDRESS
    # Where the verifier runs, as a URL: "grpc://HOST:PORT" (a specdec verifier, the same as
    # verifier_address) or "triton://HOST:PORT/MODEL" (the model `specdec export-triton` writes, on a
    # Triton Inference Server). None: verifier_address.
    verifier_url: str | None = None
    drafter_address: str | None = DRAFTER_ADDRESS  # "" or None: no drafter (AR, beam, IAD only)
    kserve_model: str = "specdec"  # the model name the KServe v2 endpoint (gateway/kserve.py) serves
    metrics_address: str | None = None  # host:port of the Prometheus endpoint; None: off
    workers: int = 8  # requests decoded at once (each holds a worker thread)
    # Admission (gateway/admission.py): requests that cannot get a worker and their verifier /
    # drafter sessions wait in a queue of at most max_queued, past it RESOURCE_EXHAUSTED; one
    # client (x-client-id metadata, else the peer's host) has at most max_per_client requests in
    # the gateway, running or queued.
    max_queued: int = 64
    max_per_client: int = 16
    request_timeout_s: float = 120.0  # deadline when the client sets none
    drafter_timeout_s: float = 30.0  # the drafter's share of a request; past it, fall back
    startup_timeout_s: float = 60.0  # how long start-up waits for each peer (the verifier, then the drafter)
    drafter_retry_s: float = 1.0  # after a drafter failure, skip it this long before retrying
    replica_retry_s: float = 1.0  # after a session failed on a verifier replica, no new ones there this long
    resolve_interval_s: float = 5.0  # how often the dns: names of the replica addresses are resolved again
    # SIGTERM: in-flight requests get drain_grace_s to finish, then are cancelled (UNAVAILABLE); new
    # requests are answered UNAVAILABLE by the handler for at least drain_notice_s before the listener
    # closes, and until no call has arrived for drain_quiet_s (within the grace): grpc ends a call that
    # races the listener's close CANCELLED, without a handler (gateway/arrivals.py).
    drain_grace_s: float = 10.0
    drain_notice_s: float = 0.5
    drain_quiet_s: float = 0.25
    # "ar": degrade to plain AR through the verifier when the drafter fails; "fail": UNAVAILABLE.
    fallback: str = field(default="ar", metadata={"choices": FALLBACK_POLICIES})
    # AR steps the verifier runs per round trip at most (VerifyStep.greedy_steps): the AR
    # baseline, and AR after a drafter failure, without a round trip per token. greedy_chunk is
    # Generate's (0: no limit, the whole output in one run; 1: a round trip per step);
    # stream_greedy_chunk is GenerateStream's, whose tokens reach the client a run at a time
    # (its first runs are 1 and 4 steps, so the first token is not delayed).
    greedy_chunk: int = 0
    stream_greedy_chunk: int = 16
    # Security (docs/deploy.md, "Security"; core.config.check_security_keys checks them together).
    tls_cert: str | None = None  # PEM certificate chain; with tls_key the gateway speaks TLS only
    tls_key: str | None = None
    tls_ca: str | None = None  # clients must present a certificate this CA signed (mTLS)
    tls_peer_ca: str | None = None  # CA that signed the verifier's and drafter's certificates
    tls_client_cert: str | None = None  # certificate the gateway presents to them (their mTLS)
    tls_client_key: str | None = None
    auth_token: str | None = None  # clients must send `authorization: Bearer <token>`
    auth_token_file: str | None = None  # the same, read from a file (keeps it out of env and ps)
    # Input limits, checked before any work (decoding.request): a request's bytes (gRPC refuses more
    # with RESOURCE_EXHAUSTED before parsing it) and a text's characters (more is OUT_OF_RANGE,
    # before tokenising).
    max_request_bytes: int = 1024 * 1024
    max_text_chars: int = 16384
    defaults: DecodingConfig = field(default_factory=DecodingConfig)
    seed_from_defaults: bool = False  # True when [defaults] sets a seed; else unset = fresh seed
    # The keys [defaults] sets, which stay over the bundle's decoding defaults (`with_bundle_defaults`).
    defaults_given: tuple[tuple[str, Any], ...] = ()
    limits: DecodingLimits = field(default_factory=DecodingLimits)

    def __post_init__(self) -> None:
        if self.verifier_url is not None:
            verifier_target(self.verifier_url)  # a malformed URL fails at start-up, naming the key
        parse_targets(self.verifier_address, "verifier_address")  # a malformed list or name, likewise
        if self.drafter_address:
            parse_targets(self.drafter_address, "drafter_address")
        if self.resolve_interval_s <= 0:
            raise ValueError(f"[gateway] resolve_interval_s: must be positive; got {self.resolve_interval_s}")
        if self.http_address:
            _check_host_port("http_address", self.http_address)
        if self.language_pair and (self.language_pair.count(":") != 1 or not all(self.language_pair.split(":"))):
            raise ValueError(f'[gateway] language_pair: expected "SOURCE:TARGET" (e.g. "en:de"), '
                             f"got {self.language_pair!r}")
        if not self.kserve_model:
            raise ValueError("[gateway] kserve_model: must not be empty")
        for name, least in (("workers", 1), ("max_queued", 0), ("max_per_client", 1), ("greedy_chunk", 0),
                            ("stream_greedy_chunk", 1)):
            if getattr(self, name) < least:
                raise ValueError(f"[gateway] {name}: must be at least {least}; got {getattr(self, name)}")


def _check_host_port(key: str, address: str) -> None:
    _, sep, port = address.rpartition(":")
    if not sep or not port.isdigit() or int(port) > 65535:
        raise ValueError(f"[gateway] {key}: expected HOST:PORT, got {address!r}")


@dataclass(frozen=True)
class VerifierTarget:
    """Where the gateway's verifier runs: `kind` "grpc" (specdec.v1 VerifierService) or "triton"."""

    kind: str
    address: str  # host:port
    model: str = ""  # the Triton model name (kind "triton")


def verifier_target(url: str) -> VerifierTarget:
    """Parse `verifier_url` (ValueError naming the key when it is malformed)."""
    scheme, sep, rest = url.partition("://")
    if not sep or scheme not in ("grpc", "triton"):
        raise ValueError(f"[gateway] verifier_url: expected grpc://HOST:PORT or triton://HOST:PORT/MODEL, got {url!r}")
    address, _, model = rest.partition("/")
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"[gateway] verifier_url: {url!r} needs HOST:PORT")
    if scheme == "triton" and (not model or "/" in model):
        raise ValueError(f"[gateway] verifier_url: {url!r} needs the model name: triton://HOST:PORT/MODEL")
    if scheme == "grpc" and model:
        raise ValueError(f"[gateway] verifier_url: {url!r}: a grpc:// verifier has no model path")
    return VerifierTarget(scheme, address, model)


def verifier_of(config: GatewayConfig) -> VerifierTarget:
    """The verifier a gateway config names: `verifier_url` when set, else `verifier_address`."""
    if config.verifier_url is None:
        return VerifierTarget("grpc", config.verifier_address)
    return verifier_target(config.verifier_url)


# Fields that the [gateway] table may not set: they come from [defaults] and [limits].
FROM_OTHER_SECTIONS = {"defaults", "limits", "seed_from_defaults", "defaults_given"}


def gateway_config(sections: Mapping[str, Mapping[str, Any]]) -> GatewayConfig:
    """The [gateway], [defaults] and [limits] sections, checked key by key (ValueError)."""
    (g,) = parse_section("gateway", sections.get("gateway", {}), GatewayConfig, exclude=FROM_OTHER_SECTIONS)
    (defaults,) = parse_section("defaults", sections.get("defaults", {}), DecodingConfig)
    (limits,) = parse_section("limits", sections.get("limits", {}), DecodingLimits)
    check_security_keys("gateway", g)
    for key in ("drafter_address", "http_address"):
        if g.get(key) == "":
            g[key] = None
    return GatewayConfig(
        **g,
        defaults=DecodingConfig(**defaults),
        seed_from_defaults="seed" in defaults,
        defaults_given=tuple(defaults.items()),
        limits=DecodingLimits(**limits),
    )


def with_bundle_defaults(config: GatewayConfig, bundle_defaults: Mapping[str, Any]) -> GatewayConfig:
    """`config` with the bundle's decoding defaults (an imported checkpoint's generation settings)
    under its [defaults]: a request's unset fields take [defaults], else the bundle's, else
    DecodingConfig's own."""
    if not bundle_defaults:
        return config
    return replace(config, defaults=layered_defaults(bundle_defaults, dict(config.defaults_given)))
