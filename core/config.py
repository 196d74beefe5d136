"""Service configuration: a TOML file, overridden by environment variables, overridden by flags.

One file configures all three services (see config/specdec.example.toml, which lists every key):

    [gateway]   address, http_address ("" turns the HTTP endpoints off), language_pair,
                verifier_address, verifier_url (grpc:// or triton://), drafter_address,
                kserve_model, metrics_address, workers, max_queued, max_per_client, request_timeout_s,
                drafter_timeout_s, startup_timeout_s, drafter_retry_s, replica_retry_s, resolve_interval_s,
                drain_grace_s, drain_notice_s, drain_quiet_s, fallback ("ar": run plain AR through the
                verifier when the drafter fails; "fail": answer UNAVAILABLE), greedy_chunk, stream_greedy_chunk,
                max_request_bytes, max_text_chars, the TLS keys below, tls_peer_ca, tls_client_cert,
                tls_client_key (the gateway's channels to verifier and drafter), auth_token or
                auth_token_file (clients must send `authorization: Bearer <token>`)
    [defaults]  DecodingConfig fields (mode, k, beta, tau, ...): used for unset request fields
    [limits]    DecodingLimits fields (max_k, max_beta, ...): per-request bounds
    [verifier]  address, backend (torch | onnxruntime), device (auto | cpu | cuda | cuda:N),
                precision (fp32 | int8; int8 needs backend onnxruntime), metrics_address, max_sessions,
                session_idle_s, max_draft_len, max_source_len, max_batch_rows, max_batch_tokens,
                batch_wait_ms (the batching scheduler), intra_op_threads (0: chosen, see core/threads.py),
                model_workers (copies of the model, each a worker thread with its share of the threads),
                placement (length | sessions: which worker a new session takes)
    [drafter]   address, backend, device, precision (of the NAR drafter), metrics_address, max_sessions,
                session_idle_s, max_draft_len, max_beams, max_batch_rows, max_batch_tokens, batch_wait_ms,
                intra_op_threads
    every server: tls_cert + tls_key (PEM paths: serve TLS), tls_ca (PEM path: require client
                certificates this CA signed, i.e. mTLS)

Environment: SPECDEC__<SECTION>__<KEY>=value (e.g. SPECDEC__GATEWAY__FALLBACK=fail,
SPECDEC__DEFAULTS__MODE=iad); values are parsed as TOML scalars, falling back to strings. A
SPECDEC__ variable that names no section is an error, and an error in a value set by a variable names it.

Every section is checked the same way, by `parse_section`, against the dataclasses that declare its
keys: an unknown key or a value of the wrong type is a one-line ValueError naming section and key.
"""

from __future__ import annotations

import os
import tomllib
import types
import typing
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field, fields
from enum import Enum
from pathlib import Path
from typing import Any

from core.backends import BACKENDS, DEFAULT_BACKEND, DEFAULT_PRECISION, PRECISIONS, check_precision
from core.threads import AUTO

ENV_PREFIX = "SPECDEC__"
SECTIONS = ("gateway", "defaults", "limits", "verifier", "drafter")

# The default listen addresses, held here only: the gateway, the CLI and serve all read them.
GATEWAY_ADDRESS = "127.0.0.1:50051"
# The gateway's HTTP endpoints (KServe v2 REST, OpenAI-style completions, LibreTranslate, the
# playground): the port Triton's and vLLM's HTTP endpoints use by default.
HTTP_ADDRESS = "127.0.0.1:8000"
VERIFIER_ADDRESS = "127.0.0.1:50052"
DRAFTER_ADDRESS = "127.0.0.1:50053"
SERVICE_ADDRESSES = {"verifier": VERIFIER_ADDRESS, "drafter": DRAFTER_ADDRESS}


DEVICE_HELP = "auto (the first GPU when torch and onnxruntime-gpu see one, else cpu), cpu, cuda or cuda:N"


def parse_device(text: str) -> tuple[str, int | None]:
    """A device name as ("auto" | "cpu" | "cuda", index or None), or a ValueError. Only the spelling is
    checked here (no torch in core); whether the GPU exists is checked as the service starts."""
    kind, sep, index = text.partition(":")
    if kind in ("auto", "cpu") and not sep:
        return kind, None
    if kind == "cuda" and not sep:
        return "cuda", 0  # torch and ONNX Runtime both take plain "cuda" as the first GPU
    if kind == "cuda" and index.isdigit():
        return "cuda", int(index)
    raise ValueError(f"must be {DEVICE_HELP}; got {text!r}")


def device_arg(text: str) -> str:
    """`parse_device` as an argparse `type`: the name back, or argparse's one-line error."""
    import argparse

    try:
        parse_device(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


def check_threads(value: int) -> None:
    if value < 0:
        raise ValueError(f"must be 0 (chosen) or a positive number of threads; got {value}")


@dataclass(frozen=True)
class ServiceSection:
    """The keys [verifier] and [drafter] share; the rest of each section is the service's limits."""

    address: str
    backend: str = field(default=DEFAULT_BACKEND, metadata={"choices": BACKENDS})
    # Where the models run; one service, one device (docker-compose.yml pins each to its own GPU).
    device: str = field(default="auto", metadata={"check": parse_device})
    # fp32, or int8: the ONNX graphs dynamically quantized (onnxruntime backend only).
    precision: str = field(default=DEFAULT_PRECISION, metadata={"choices": PRECISIONS})
    metrics_address: str | None = None  # host:port of the Prometheus endpoint; None: off
    # ONNX Runtime intra-op threads of each session (torch's set_num_threads on the torch backend);
    # 0: chosen by core/threads.py (all usable CPUs alone, a split when serve all hosts both models).
    intra_op_threads: int = field(default=AUTO, metadata={"check": check_threads})
    tls_cert: str | None = None  # PEM certificate chain; with tls_key the server speaks TLS only
    tls_key: str | None = None  # PEM private key of tls_cert
    tls_ca: str | None = None  # PEM CA bundle: clients must present a certificate it signed (mTLS)


def check_service_precision(section: str, values: Mapping[str, Any]) -> None:
    """[verifier] / [drafter] precision against the section's backend, after their types: a
    ValueError naming the section (int8 on torch is a config error, not a silent fp32)."""
    try:
        check_precision(values.get("backend", DEFAULT_BACKEND), values.get("precision", DEFAULT_PRECISION))
    except ValueError as exc:
        raise ValueError(f"[{section}] precision: {exc}") from None


# Keys that must be set together, and keys that only mean something with another one set.
_PAIRS = (("tls_cert", "tls_key"), ("tls_client_cert", "tls_client_key"))
_NEEDS = {"tls_ca": "tls_cert"}
_FILES = ("tls_cert", "tls_key", "tls_ca", "tls_peer_ca", "tls_client_cert", "tls_client_key", "auth_token_file")


def check_security_keys(section: str, values: Mapping[str, Any]) -> None:
    """The TLS and token keys of one section, after their types: pairs set together, files readable,
    one token source. A ValueError naming `[section] key`, before any server starts."""
    for a, b in _PAIRS:
        if bool(values.get(a)) != bool(values.get(b)):
            raise ValueError(f"[{section}] {a} and {b} go together: set both or neither")
    for key, needed in _NEEDS.items():
        if values.get(key) and not values.get(needed):
            raise ValueError(f"[{section}] {key} needs {needed}: client certificates are checked only over TLS")
    if values.get("auth_token") is not None and values.get("auth_token_file") is not None:
        raise ValueError(f"[{section}] set auth_token or auth_token_file, not both")
    if values.get("auth_token") == "":
        raise ValueError(f"[{section}] auth_token: must not be empty (leave it out for no token check)")
    for key in _FILES:
        path = values.get(key)
        if path is None:
            continue
        try:
            with open(path, "rb") as f:
                empty = not f.read().strip()
        except OSError as exc:
            raise ValueError(f"[{section}] {key}: cannot read {path!r} ({exc.strerror})") from None
        if empty:
            raise ValueError(f"[{section}] {key}: {path!r} is empty")


def load_sections(
    path: str | Path | None = None,
    environ: Mapping[str, str] | None = None,
    overrides: Mapping[str, Mapping[str, Any]] | None = None,
) -> dict[str, dict[str, Any]]:
    """The merged configuration: file, then environment, then `overrides` (flags; None ignored).
    Section names are checked here; keys and values by `parse_section`."""
    sections: dict[str, dict[str, Any]] = {name: Section() for name in SECTIONS}
    if path:
        try:
            data = tomllib.loads(Path(path).read_text())
        except tomllib.TOMLDecodeError as exc:
            raise ValueError(f"{path}: {exc}") from None
        unknown = set(data) - set(SECTIONS)
        if unknown:
            raise ValueError(f"{path}: unknown sections {sorted(unknown)}; known: {list(SECTIONS)}")
        for name, table in data.items():
            if not isinstance(table, dict):
                raise ValueError(f"{path}: [{name}] must be a table, got {table!r}")
            sections[name].update(table)
    for key, value in sorted((os.environ if environ is None else environ).items()):
        if not key.startswith(ENV_PREFIX):
            continue
        section, _, name = key[len(ENV_PREFIX) :].lower().partition("__")
        if section not in sections or not name:
            # A misspelt variable must not be silently ignored while the same typo in the file is an error.
            raise ValueError(
                f"environment variable {key}: not a setting; expected {ENV_PREFIX}<SECTION>__<KEY> with SECTION "
                f"one of {', '.join(s.upper() for s in SECTIONS)}"
            )
        sections[section][name] = _parse_scalar(value)
        sections[section].origins[name] = key
    for section, table in (overrides or {}).items():
        given = {k: v for k, v in table.items() if v is not None}
        sections[section].update(given)
        for k in given:
            getattr(sections[section], "origins", {}).pop(k, None)
    return sections


class Section(dict):
    """One section's merged keys; `origins` names the environment variable of each key set by one."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.origins: dict[str, str] = {}


def with_origin(exc: ValueError, sections: Mapping[str, Mapping[str, Any]]) -> ValueError:
    """`exc` (a config error that starts "[section] key") saying which environment variable set the
    key, when one did; else `exc` itself."""
    message = str(exc)
    section, close, rest = message.removeprefix("[").partition("] ")
    key = rest.split(":", 1)[0].split(" ", 1)[0]
    if rest.startswith("unknown key "):
        key = rest.removeprefix("unknown key ").split(";", 1)[0].strip("'\"")
    origin = getattr(sections.get(section), "origins", {}).get(key) if message.startswith("[") and close else None
    if origin is None:
        return exc
    return ValueError(f"{message} (set by the environment variable {origin})")


def parse_section(
    section: str, table: Mapping[str, Any], *schemas: type, exclude: Collection[str] = ()
) -> list[dict[str, Any]]:
    """`table` split by the dataclass among `schemas` that declares each key (one kwargs dict per
    schema, in order), every value type-checked against its field. `exclude` names fields that
    the file may not set (ones the caller fills in)."""
    owners: dict[str, tuple[int, Any, Any, Callable[[Any], Any] | None]] = {}
    for index, schema in enumerate(schemas):
        hints = typing.get_type_hints(schema)
        for f in fields(schema):
            if f.name not in exclude:
                owners.setdefault(f.name, (index, hints[f.name], f.metadata.get("choices"), f.metadata.get("check")))
    out: list[dict[str, Any]] = [{} for _ in schemas]
    for key, value in table.items():
        if key not in owners:
            raise ValueError(f"[{section}] unknown key {key!r}; known: {', '.join(sorted(owners))}")
        index, hint, choices, check = owners[key]
        out[index][key] = check_value(f"[{section}] {key}", value, hint, choices)
        if check is not None and out[index][key] is not None:
            # A field's own check (e.g. the device spelling): its ValueError gets the key's name.
            try:
                check(out[index][key])
            except ValueError as exc:
                raise ValueError(f"[{section}] {key}: {exc}") from None
    return out


def check_value(where: str, value: Any, hint: Any, choices: tuple | None = None) -> Any:
    """`value` converted to `hint` (int -> float, str -> an Enum), or a ValueError naming `where`."""
    allowed = _union_members(hint)
    if value is None and type(None) in allowed:
        return None
    for kind in allowed:
        converted = _convert(value, kind)
        if converted is not _NO:
            if choices is not None and converted not in choices:
                raise ValueError(f"{where}: must be one of {', '.join(map(str, choices))}; got {value!r}")
            return converted
    names = " or ".join(getattr(k, "__name__", str(k)) for k in allowed if k is not type(None))
    if any(isinstance(k, type) and issubclass(k, Enum) for k in allowed):
        options = ", ".join(str(m.value) for k in allowed if issubclass(k, Enum) for m in k)
        raise ValueError(f"{where}: must be one of {options}; got {value!r}")
    raise ValueError(f"{where}: expected {names}, got {type(value).__name__} {value!r}")


# ----------------------------------------------------------------------------------------------

_NO = object()  # "does not convert" (None is a legal value)


def _union_members(hint: Any) -> tuple:
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        return typing.get_args(hint)
    return (hint,)


def _convert(value: Any, kind: Any) -> Any:
    if kind is type(None):
        return _NO  # None itself was let through before
    # bool is an int subclass: `workers = true` must not pass as 1.
    if kind is bool:
        return value if isinstance(value, bool) else _NO
    if kind is int:
        return value if isinstance(value, int) and not isinstance(value, bool) else _NO
    if kind is float:
        return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else _NO
    if isinstance(kind, type) and issubclass(kind, Enum):
        try:
            return kind(value)
        except ValueError:
            return _NO
    if kind is str:
        return value if isinstance(value, str) else _NO
    return value  # a type this checker does not know: the dataclass takes it as it is


def _parse_scalar(text: str) -> Any:
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text
