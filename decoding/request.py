"""One request, prepared once: from what a caller sent to what the decode loop needs.

Every door runs the same `prepare()`: the gateway's `Generate` / `GenerateStream` and KServe
endpoints, `specdec decode`, and the Python API. It checks what costs nothing first (which input is
set, the text's characters, the ids' count), then the decoding config (the parameters the mode
reads, the defaults, the limits), the forced first tokens (a target language), and only then
tokenises. What differs between the doors is in `Policy`: the defaults and limits they apply, and
whether an unset seed is a fresh random one (the gateway) or the default (reproducible runs).
"""

from __future__ import annotations

import secrets
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from core.checks import check_ids, check_length
from core.errors import SpecdecError, StatusCode, invalid, out_of_range
from decoding.config import DecodingConfig, DecodingLimits, Mode, parse_mode, validate
from decoding.modes import DRAFTER_MODES, check_applicable


@dataclass(frozen=True)
class Request:
    """What a caller asks for: `text` or `input_ids` (not both), decoding parameters that override
    the defaults (None values are unset), a many-to-many model's target language ("" = its default),
    and a target prefix, text or ids (not both), that the output must start with (after the target
    language's code)."""

    text: str = ""
    input_ids: Sequence[int] = ()
    overrides: Mapping[str, Any] = field(default_factory=dict)
    target_lang: str = ""
    target_prefix: str = ""
    target_prefix_ids: Sequence[int] = ()


@dataclass(frozen=True)
class ModelLimits:
    """What `prepare` reads off the model it decodes with (a `core.interfaces.Verifier`, or the
    verifier's ModelInfo converted by `core.wire`)."""

    vocab_size: int
    max_source_len: int
    max_target_len: int

    @classmethod
    def of(cls, verifier: Any) -> ModelLimits:
        return cls(verifier.vocab_size, verifier.max_source_len, verifier.max_target_len)


@dataclass(frozen=True)
class Policy:
    """How one door prepares requests: its defaults and limits, its text size limit (None: none),
    whether an unset seed draws a fresh one, whether a drafter is there for the drafter modes
    (without one they are refused here unless `fallback` lets the door run them as AR), and whether
    errors name parameters as CLI flags."""

    defaults: DecodingConfig = field(default_factory=DecodingConfig)
    limits: DecodingLimits = field(default_factory=DecodingLimits)
    max_text_chars: int | None = None
    fresh_seed: bool = False
    has_drafter: bool = True
    fallback: bool = False
    flags: bool = False


@dataclass(frozen=True)
class Prepared:
    """A request ready to decode: its source ids, its decoding config, and the output's forced first
    tokens, a target language's code and the target prefix (committed before decoding:
    `decode(..., prefix=first)`)."""

    source: list[int]
    config: DecodingConfig
    first: list[int]


class Tokenizer(Protocol):
    """What `prepare` needs of a tokenizer (`seq2seq_models.tokenizer.Tokenizer`, an imported
    checkpoint's `HfTokenizer`)."""

    def encode(self, text: str) -> list[int]: ...

    def encode_target(self, text: str) -> list[int]: ...

    def first_tokens(self, target_lang: str) -> list[int]: ...


def prepare(request: Request, model: ModelLimits, policy: Policy, tokenizer: Tokenizer) -> Prepared:
    """The request checked and tokenised, or a `SpecdecError` with its status code (INVALID_ARGUMENT,
    OUT_OF_RANGE, FAILED_PRECONDITION) and a message."""
    check_input_size(request, model, policy)
    config = prepare_config(request.overrides, model, policy)
    first = forced_first_tokens(tokenizer, request.target_lang, config)
    first += target_prefix(request, tokenizer, model)
    if len(first) >= config.max_new_tokens:
        raise out_of_range(f"max_new_tokens {config.max_new_tokens} leaves no room after the output's "
                           f"{len(first)} forced first tokens (target language and prefix)")
    source = source_ids(request, tokenizer, model)
    return Prepared(source, config, first)


def check_input_size(request: Request, model: ModelLimits, policy: Policy) -> None:
    """The checks that cost nothing, made before any per-token work."""
    # Each read of a protobuf string field builds a new str: callers pass it once, read once here.
    chars = len(request.text)
    if chars and len(request.input_ids):
        raise invalid("set either text or input_ids, not both")
    if request.target_prefix and len(request.target_prefix_ids):
        raise invalid("set either target_prefix or target_prefix_ids, not both")
    if policy.max_text_chars is not None and len(request.target_prefix) > policy.max_text_chars:
        raise out_of_range(f"target_prefix has {len(request.target_prefix)} characters; "
                           f"the limit is {policy.max_text_chars}")
    check_length(request.target_prefix_ids, model.max_target_len, "target_prefix_ids")
    if policy.max_text_chars is not None and chars > policy.max_text_chars:
        raise out_of_range(f"text has {chars} characters; the limit is {policy.max_text_chars}")
    check_length(request.input_ids, model.max_source_len, "input")


def prepare_config(overrides: Mapping[str, Any], model: ModelLimits, policy: Policy) -> DecodingConfig:
    """The request's decoding config: only parameters its mode reads, the door's defaults for the
    rest (an unset max_new_tokens never asks for more than the model takes), within the limits."""
    given = {k: v for k, v in overrides.items() if v is not None}
    mode = parse_mode(given.get("mode", policy.defaults.mode))
    check_applicable(given, mode, flags=policy.flags)
    if mode in DRAFTER_MODES and not policy.has_drafter and not policy.fallback:
        raise SpecdecError(StatusCode.FAILED_PRECONDITION, f"mode {mode.value} needs a drafter and there is none: "
                           f"use mode {Mode.AR.value} or {Mode.IAD.value}")
    if "seed" not in given and policy.fresh_seed:
        given["seed"] = secrets.randbits(63)  # unset seed: a fresh one per request
    if "max_new_tokens" not in given:  # a default never asks for more than the model and the limits allow
        most = min(model.max_target_len, policy.limits.max_new_tokens)
        given["max_new_tokens"] = min(policy.defaults.max_new_tokens, most)
    config = policy.defaults.with_overrides(given)
    validate(config, policy.limits, model.max_target_len, model.vocab_size)
    return config


def forced_first_tokens(tokenizer: Tokenizer, target_lang: str, config: DecodingConfig) -> list[int]:
    """The output's forced first tokens: the code of the request's target language, or the model's
    default (an imported many-to-many checkpoint's forced_bos_token_id); INVALID_ARGUMENT for a
    code the model does not have."""
    try:
        first = tokenizer.first_tokens(target_lang)
    except ValueError as exc:
        raise invalid(str(exc)) from None
    if first and len(first) >= config.max_new_tokens:
        raise out_of_range(f"max_new_tokens {config.max_new_tokens} leaves no room after the forced first token")
    return first


def target_prefix(request: Request, tokenizer: Tokenizer, model: ModelLimits) -> list[int]:
    """The request's target prefix as ids: its ids (checked against the vocabulary), or its text
    encoded as the output's tokenizer encodes a target (no framing)."""
    if request.target_prefix:
        try:
            ids = tokenizer.encode_target(request.target_prefix)
        except ValueError as exc:  # an ids-only bundle has no tokenizer to encode with
            raise invalid(str(exc)) from None
    else:
        ids = list(request.target_prefix_ids)
    check_length(ids, model.max_target_len, "target_prefix")
    check_ids(ids, model.vocab_size, "target_prefix_ids")
    return ids


def source_ids(request: Request, tokenizer: Tokenizer, model: ModelLimits) -> list[int]:
    """The request's source ids: its input_ids, or its text encoded (INVALID_ARGUMENT when empty).
    The ids' values are checked by `decode()`."""
    if request.text:
        try:
            ids = tokenizer.encode(request.text)
        except ValueError as exc:  # an ids-only bundle has no tokenizer to encode with
            raise invalid(str(exc)) from None
        check_length(ids, model.max_source_len, "input")
    else:
        ids = list(request.input_ids)
    if not ids:
        raise invalid("input is empty")
    return ids
