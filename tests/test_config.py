"""The service configuration (core.config): file, then environment, then flags; every section
checked the same way; the defaults held once. Real files, real subprocesses, real servers."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import grpc
import pytest

from core.backends import BACKENDS, DEFAULT_BACKEND
from core.config import DRAFTER_ADDRESS, GATEWAY_ADDRESS, VERIFIER_ADDRESS, load_sections
from core.errors import SpecdecError, StatusCode
from decoding.config import DecodingConfig, Mode
from gateway.config import GatewayConfig
from gateway.wire import overrides_to_wire
from protos.specdec.v1 import gateway_pb2, gateway_pb2_grpc
from seq2seq_models.bundle import make_tiny_bundle
from specdec.cli import build_parser
from specdec.serve import ServiceStack, config_keys, serve_config

ROOT = Path(__file__).resolve().parent.parent

FILE = """
[gateway]
workers = 3
fallback = "fail"
drafter_address = ""

[defaults]
mode = "iad"
tau = 2          # an int where a float is declared: taken as 2.0
seed = 7

[limits]
max_k = 20

[verifier]
address = "127.0.0.1:6000"
backend = "torch"
max_sessions = 5
max_source_len = 40

[drafter]
max_draft_len = 9
"""


@pytest.fixture()
def config_file(tmp_path: Path) -> Path:
    path = tmp_path / "specdec.toml"
    path.write_text(FILE)
    return path


def test_a_file_configures_every_section(config_file: Path) -> None:
    config = serve_config(load_sections(config_file, environ={}))
    g = config.gateway
    assert (g.workers, g.fallback, g.drafter_address) == (3, "fail", None)
    assert g.defaults == DecodingConfig(mode=Mode.IAD, tau=2.0, seed=7) and isinstance(g.defaults.tau, float)
    assert g.seed_from_defaults
    assert g.limits.max_k == 20 and g.limits.max_beta == 64
    assert (config.verifier.address, config.verifier.backend) == ("127.0.0.1:6000", "torch")
    assert (config.verifier_limits.max_sessions, config.verifier_limits.max_source_len) == (5, 40)
    assert (config.drafter.address, config.drafter.backend) == (DRAFTER_ADDRESS, DEFAULT_BACKEND)
    assert config.drafter_limits.max_draft_len == 9


def test_environment_beats_the_file_and_flags_beat_the_environment(config_file: Path) -> None:
    environ = {
        "SPECDEC__GATEWAY__WORKERS": "4",
        "SPECDEC__DEFAULTS__MODE": "gad++",  # not a TOML scalar: taken as a string
        "SPECDEC__VERIFIER__MAX_SESSIONS": "6",
        "SPECDEC__DRAFTER__ADDRESS": "127.0.0.1:7000",
        "UNRELATED": "x",
    }
    by_env = serve_config(load_sections(config_file, environ=environ))
    assert by_env.gateway.workers == 4 and by_env.gateway.defaults.mode == Mode.GAD_PLUS_PLUS
    assert by_env.verifier_limits.max_sessions == 6 and by_env.drafter.address == "127.0.0.1:7000"

    flags = {"gateway": {"workers": 5, "address": None}, "drafter": {"address": "127.0.0.1:7001"}}
    by_flags = serve_config(load_sections(config_file, environ=environ, overrides=flags))
    assert by_flags.gateway.workers == 5
    assert by_flags.gateway.address == GATEWAY_ADDRESS  # a None flag is "not given"
    assert by_flags.drafter.address == "127.0.0.1:7001"


UNKNOWN = [("gateway", "fallbak"), ("defaults", "block_size"), ("limits", "max_tau"), ("verifier", "max_sesions"),
           ("drafter", "max_source_len")]  # max_source_len is a verifier key, not a drafter one


@pytest.mark.parametrize(("section", "key"), UNKNOWN)
def test_an_unknown_key_is_a_one_line_error_naming_it(section: str, key: str) -> None:
    with pytest.raises(ValueError) as exc:
        serve_config(load_sections(environ={}, overrides={section: {key: 1}}))
    message = str(exc.value)
    assert f"[{section}] unknown key {key!r}" in message and "\n" not in message


BAD_VALUES = [
    ("gateway", "workers", "eight", "expected int, got str 'eight'"),
    ("gateway", "request_timeout_s", True, "expected float, got bool True"),
    ("gateway", "fallback", "retry", "must be one of ar, fail"),
    ("gateway", "greedy_chunk", -1, "must be at least 0; got -1"),
    ("gateway", "stream_greedy_chunk", 0, "must be at least 1; got 0"),
    ("defaults", "k", 2.5, "expected int, got float 2.5"),
    ("defaults", "mode", "fast", "must be one of ar, beam, iad, gad, gad++, mjsd, spec"),
    ("limits", "max_new_tokens", "256", "expected int, got str '256'"),
    ("verifier", "max_sessions", "64", "expected int, got str '64'"),
    ("verifier", "backend", "tensorflow", "must be one of torch, onnxruntime"),
    ("drafter", "max_draft_len", [8], "expected int, got list [8]"),
    ("drafter", "address", 50053, "expected str, got int 50053"),
]


@pytest.mark.parametrize(("section", "key", "value", "message"), BAD_VALUES, ids=[f"{b[0]}.{b[1]}" for b in BAD_VALUES])
def test_a_bad_value_is_a_one_line_error_naming_the_key(section: str, key: str, value, message: str) -> None:
    with pytest.raises(ValueError) as exc:
        serve_config(load_sections(environ={}, overrides={section: {key: value}}))
    assert str(exc.value).startswith(f"[{section}] {key}: {message}")
    assert "\n" not in str(exc.value)


def test_a_bad_environment_value_names_its_key_and_variable() -> None:
    with pytest.raises(ValueError, match=r"^\[verifier\] max_draft_len: expected int, got str 'many' \(set by the "
                       r"environment variable SPECDEC__VERIFIER__MAX_DRAFT_LEN\)$"):
        serve_config(load_sections(environ={"SPECDEC__VERIFIER__MAX_DRAFT_LEN": "many"}))
    with pytest.raises(ValueError, match=r"^\[gateway\] workers: must be at least 1; got 0 \(set by the environment "
                       r"variable SPECDEC__GATEWAY__WORKERS\)$"):
        serve_config(load_sections(environ={"SPECDEC__GATEWAY__WORKERS": "0"}))
    with pytest.raises(ValueError, match=r"^\[gateway\] unknown key 'wrkers'; .* \(set by the environment variable "
                       r"SPECDEC__GATEWAY__WRKERS\)$"):
        serve_config(load_sections(environ={"SPECDEC__GATEWAY__WRKERS": "2"}))
    # A flag over a bad variable: the flag's value is the one checked, and it is not the environment's.
    with pytest.raises(ValueError, match=r"^\[gateway\] workers: must be at least 1; got 0$"):
        serve_config(load_sections(environ={"SPECDEC__GATEWAY__WORKERS": "x"}, overrides={"gateway": {"workers": 0}}))


@pytest.mark.parametrize("name", ["SPECDEC__GATWAY__WORKERS", "SPECDEC__GATEWAY", "SPECDEC__LIMITS__"])
def test_an_unknown_environment_variable_is_refused_by_name(name: str) -> None:
    with pytest.raises(ValueError, match=rf"^environment variable {name}: not a setting; expected "
                       r"SPECDEC__<SECTION>__<KEY> with SECTION one of GATEWAY, DEFAULTS, LIMITS, VERIFIER, DRAFTER$"):
        load_sections(environ={name: "4", "SPECDEC_BUNDLE": "elsewhere"})  # one underscore: not a setting


def test_an_unknown_section_or_broken_file_is_an_error(tmp_path: Path) -> None:
    path = tmp_path / "c.toml"
    path.write_text("[gatway]\nworkers = 2\n")
    with pytest.raises(ValueError, match="unknown sections"):
        load_sections(path, environ={})
    path.write_text("[gateway\n")
    with pytest.raises(ValueError, match=str(path)):
        load_sections(path, environ={})


SERVE_ERRORS = [
    ("[verifier]\nmax_sesions = 3\n", "[verifier] unknown key 'max_sesions'"),
    ("[drafter]\nmax_sessions = \"many\"\n", "[drafter] max_sessions: expected int, got str 'many'"),
    ("[gateway]\nworkers = 1.5\n", "[gateway] workers: expected int, got float 1.5"),
]


@pytest.mark.parametrize(("text", "message"), SERVE_ERRORS, ids=["unknown-key", "bad-type", "other-section"])
def test_specdec_serve_reports_a_bad_config_in_one_line(tmp_path: Path, text: str, message: str) -> None:
    bad = tmp_path / "bad.toml"
    bad.write_text(text)
    env = {**os.environ, "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "specdec", "serve", "verifier", "--config", str(bad), "--bundle", str(tmp_path)],
        capture_output=True, text=True, env=env, cwd=ROOT, timeout=120,
    )
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"specdec serve: error: {message}")
    assert proc.stdout == ""


def test_the_defaults_are_held_once() -> None:
    assert (GatewayConfig().address, GatewayConfig().verifier_address, GatewayConfig().drafter_address) == (
        GATEWAY_ADDRESS, VERIFIER_ADDRESS, DRAFTER_ADDRESS,
    )
    config = serve_config({})
    assert (config.verifier.address, config.drafter.address) == (VERIFIER_ADDRESS, DRAFTER_ADDRESS)
    assert config.verifier.backend == config.drafter.backend == DEFAULT_BACKEND
    parser = build_parser()
    assert parser.parse_args(["generate", "x"]).addr == GATEWAY_ADDRESS
    # Nothing besides core/config.py spells an address or the backend list out.
    spelled = re.compile(r"127\.0\.0\.1:5005[123]|\[\"torch\", \"onnxruntime\"\]")
    sources = [p for package in ("core", "gateway", "specdec") for p in (ROOT / package).rglob("*.py")]
    offenders = [
        str(p.relative_to(ROOT))
        for p in sources
        if p != ROOT / "core" / "config.py" and spelled.search(p.read_text(encoding="utf-8"))
    ]
    assert offenders == []
    assert BACKENDS == ("torch", "onnxruntime")


# ---- security keys (README "Security") -------------------------------------------------------


@pytest.fixture()
def pem(tmp_path: Path) -> Path:
    """Stand-ins for PEM files: the config checks that they are readable and not empty; whether they
    hold real certificates is for gRPC at start-up (tests/services/test_tls.py)."""
    for name in ("cert.pem", "key.pem", "ca.pem", "token"):
        (tmp_path / name).write_text("x\n")
    (tmp_path / "empty").write_text("  \n")
    return tmp_path


def test_security_keys_come_from_the_file_and_the_environment(pem: Path) -> None:
    from serving.tls import ClientTLS, ServerTLS, peer_tls

    path = pem / "c.toml"
    path.write_text(
        f'[verifier]\ntls_cert = "{pem}/cert.pem"\ntls_key = "{pem}/key.pem"\ntls_ca = "{pem}/ca.pem"\n'
        f'[gateway]\ntls_peer_ca = "{pem}/ca.pem"\n'
    )
    environ = {
        "SPECDEC__GATEWAY__AUTH_TOKEN_FILE": f"{pem}/token",
        "SPECDEC__DRAFTER__TLS_CERT": f"{pem}/cert.pem",
        "SPECDEC__DRAFTER__TLS_KEY": f"{pem}/key.pem",
    }
    config = serve_config(load_sections(path, environ=environ))
    assert ServerTLS.of(config.verifier) == ServerTLS(f"{pem}/cert.pem", f"{pem}/key.pem", f"{pem}/ca.pem")
    assert ServerTLS.of(config.drafter) == ServerTLS(f"{pem}/cert.pem", f"{pem}/key.pem", None)
    assert ServerTLS.of(config.gateway) is None
    assert peer_tls(config.gateway) == ClientTLS(f"{pem}/ca.pem", None, None)
    assert (config.gateway.auth_token, config.gateway.auth_token_file) == (None, f"{pem}/token")
    plain = serve_config({})
    assert (ServerTLS.of(plain.verifier), ServerTLS.of(plain.gateway), peer_tls(plain.gateway)) == (None, None, None)
    assert (plain.gateway.auth_token, plain.gateway.auth_token_file) == (None, None)


SECURITY_ERRORS = [
    ("verifier", {"tls_cert": "cert.pem"}, "[verifier] tls_cert and tls_key go together: set both or neither"),
    ("drafter", {"tls_key": "key.pem"}, "[drafter] tls_cert and tls_key go together: set both or neither"),
    ("drafter", {"tls_ca": "ca.pem"}, "[drafter] tls_ca needs tls_cert: client certificates are checked only over TLS"),
    ("gateway", {"tls_client_cert": "cert.pem"},
     "[gateway] tls_client_cert and tls_client_key go together: set both or neither"),
    ("gateway", {"auth_token": "t", "auth_token_file": "token"},
     "[gateway] set auth_token or auth_token_file, not both"),
    ("gateway", {"auth_token": ""}, "[gateway] auth_token: must not be empty (leave it out for no token check)"),
    ("gateway", {"auth_token_file": "empty"}, "[gateway] auth_token_file: '{pem}/empty' is empty"),
    ("gateway", {"tls_peer_ca": "missing.pem"},
     "[gateway] tls_peer_ca: cannot read '{pem}/missing.pem' (No such file or directory)"),
    ("verifier", {"tls_cert": 1, "tls_key": "key.pem"}, "[verifier] tls_cert: expected str, got int 1"),
    ("gateway", {"auth_token": 123}, "[gateway] auth_token: expected str, got int 123"),
]


@pytest.mark.parametrize(("section", "table", "message"), SECURITY_ERRORS)
def test_a_bad_security_key_is_a_one_line_error_naming_it(pem: Path, section: str, table: dict, message: str) -> None:
    table = {k: f"{pem}/{v}" if isinstance(v, str) and k != "auth_token" else v for k, v in table.items()}
    with pytest.raises(ValueError) as exc:
        serve_config(load_sections(environ={}, overrides={section: table}))
    assert str(exc.value) == message.format(pem=pem)


def test_generate_takes_tls_and_token_flags() -> None:
    parser = build_parser()
    args = parser.parse_args(["generate", "x", "--tls-ca", "ca.pem", "--tls-cert", "c.pem", "--tls-key", "k.pem",
                              "--token", "t"])
    assert (args.tls, args.tls_ca, args.tls_cert, args.tls_key, args.token, args.token_file) == (
        False, "ca.pem", "c.pem", "k.pem", "t", None,
    )
    plain = parser.parse_args(["generate", "x"])
    assert (plain.tls, plain.tls_ca, plain.tls_cert, plain.tls_key, plain.token, plain.token_file) == (
        False, None, None, None, None, None,
    )
    with pytest.raises(SystemExit):  # one token source
        parser.parse_args(["generate", "x", "--token", "t", "--token-file", "f"])


# ---- fallback = "fail": no degrading to AR when the drafter is gone ---------------------------

TEXT = "We have been living in this city."
GAD = {"mode": "gad", "k": 4, "max_new_tokens": 12}


@pytest.fixture(scope="module")
def bundle_dir(tmp_path_factory) -> Path:
    return make_tiny_bundle(tmp_path_factory.mktemp("config-bundle"), seed=3)


def test_fallback_fail_refuses_to_start_without_the_drafter(bundle_dir: Path) -> None:
    with ServiceStack("verifier", bundle_dir, {"verifier": {"address": "127.0.0.1:0"}}) as verifier:
        gateway = ServiceStack("gateway", bundle_dir, _gateway_sections(verifier, _dead_address(), "fail"))
        try:
            with pytest.raises(SpecdecError) as exc:
                gateway.start()
            assert exc.value.code == StatusCode.UNAVAILABLE and "drafter at" in exc.value.message
        finally:
            gateway.stop()


def test_fallback_fail_answers_unavailable_once_the_drafter_is_gone(bundle_dir: Path) -> None:
    loopback = {"address": "127.0.0.1:0"}
    with ServiceStack("verifier", bundle_dir, {"verifier": loopback}) as verifier:
        drafter = ServiceStack("drafter", bundle_dir, {"drafter": loopback}).start()
        address = drafter.running.addresses["drafter"]
        gateway = ServiceStack("gateway", bundle_dir, _gateway_sections(verifier, address, "fail"))
        with gateway as g, grpc.insecure_channel(g.running.addresses["gateway"]) as channel:
            stub = gateway_pb2_grpc.GatewayServiceStub(channel)
            request = gateway_pb2.GenerateRequest(text=TEXT, config=overrides_to_wire(GAD))
            assert not stub.Generate(request, timeout=60).stats.degraded  # the drafter is up
            drafter.stop()  # now nothing listens at its address
            with pytest.raises(grpc.RpcError) as exc:
                stub.Generate(request, timeout=60)
            assert exc.value.code() == grpc.StatusCode.UNAVAILABLE
            assert "no fallback configured" in exc.value.details()
            # Modes that need no drafter still run.
            ar = gateway_pb2.GenerateRequest(text=TEXT, config=overrides_to_wire({"mode": "ar", "max_new_tokens": 12}))
            assert stub.Generate(ar, timeout=60).output_ids


def _gateway_sections(verifier: ServiceStack, drafter_address: str, fallback: str) -> dict:
    return {
        "gateway": {
            "address": "127.0.0.1:0",
            "verifier_address": verifier.running.addresses["verifier"],
            "drafter_address": drafter_address,
            "fallback": fallback,
            "startup_timeout_s": 1.0,
        }
    }


def _dead_address() -> str:
    import socket

    with socket.socket() as s:  # bound then closed: nothing listens there
        s.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{s.getsockname()[1]}"


def test_the_example_config_is_valid_and_sets_every_key_it_shows() -> None:
    """config/specdec.example.toml is what users copy: it must load, and what it sets must be used."""
    path = ROOT / "config" / "specdec.example.toml"
    sections = load_sections(path, environ={})
    config = serve_config(sections)
    assert config.verifier.address == sections["verifier"]["address"]
    assert config.drafter.device == sections["drafter"]["device"]
    assert config.gateway.max_text_chars == sections["gateway"]["max_text_chars"]
    assert config.gateway.defaults.mode == Mode(sections["defaults"]["mode"])


def _example_keys() -> dict[str, set[str]]:
    """The keys config/specdec.example.toml shows, set or commented out, by section."""
    keys: dict[str, set[str]] = {}
    section = None
    for line in (ROOT / "config" / "specdec.example.toml").read_text().splitlines():
        if match := re.match(r"\s*\[(\w+)\]", line):
            section = keys.setdefault(match.group(1), set())
        elif section is not None and (match := re.match(r"\s*#?\s*(\w+)\s*=", line)):
            section.add(match.group(1))
    return keys


def test_the_example_config_shows_exactly_the_keys_of_the_schema() -> None:
    """The example file claims to list every key: the schema and it cannot drift apart."""
    assert _example_keys() == config_keys()


def test_the_config_docstring_names_every_key() -> None:
    import core.config

    for section in ("gateway", "verifier", "drafter"):
        missing = {key for key in config_keys()[section] if not re.search(rf"\b{key}\b", core.config.__doc__ or "")}
        assert missing == set(), section
