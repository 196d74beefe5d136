"""Security end to end (README "Security"): TLS on every connection, mTLS between the gateway and the
model services, the gateway's bearer token, and the start-up warnings. Real certificates made at run
time by the `openssl` command, a real stack on loopback, real channels; nothing is mocked."""

from __future__ import annotations

import asyncio
import http.client
import json
import os
import ssl
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

import grpc
import pytest
import structlog
from grpc_health.v1 import health_pb2, health_pb2_grpc

from core.backends import DEFAULT_BACKEND
from decoding.config import DecodingConfig
from decoding.decode import decode
from drafter_service.session import LocalDrafter
from gateway.wire import overrides_to_wire
from protos.specdec.v1 import gateway_pb2, gateway_pb2_grpc, verifier_pb2, verifier_pb2_grpc
from serving.auth import MISSING_TOKEN, WRONG_TOKEN, bearer_metadata
from serving.host import ServiceHost
from serving.metrics import Registry
from serving.tls import ClientTLS, ServerTLS
from specdec.serve import ServiceStack
from tests.services.conftest import REPO
from verifier_service.session import make_verifier

TOKEN = "s3cret-token"
TEXT = "We have been living in this city."
OVERRIDES = {"mode": "gad", "k": 4, "max_new_tokens": 16}  # lossless: equals greedy


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True)


def _ca(d: Path, name: str) -> None:
    _openssl(
        "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
        "-keyout", f"{name}.key", "-out", f"{name}.pem", "-days", "1", "-subj", f"/CN={name}",
        "-addext", "basicConstraints=critical,CA:TRUE", "-addext", "keyUsage=critical,keyCertSign,cRLSign",
        cwd=d,
    )  # fmt: skip


def _leaf(d: Path, name: str, ca: str) -> None:
    """A certificate for 127.0.0.1 / localhost, good for both ends of a connection (server and client)."""
    (d / f"{name}.ext").write_text(
        "subjectAltName=IP:127.0.0.1,DNS:localhost\nextendedKeyUsage=serverAuth,clientAuth\n"
        "basicConstraints=CA:FALSE\nkeyUsage=digitalSignature\n"
    )
    _openssl(
        "req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
        "-keyout", f"{name}.key", "-out", f"{name}.csr", "-subj", f"/CN={name}", cwd=d,
    )  # fmt: skip
    _openssl(
        "x509", "-req", "-in", f"{name}.csr", "-CA", f"{ca}.pem", "-CAkey", f"{ca}.key", "-CAcreateserial",
        "-out", f"{name}.pem", "-days", "1", "-extfile", f"{name}.ext", cwd=d,
    )  # fmt: skip


@pytest.fixture(scope="module")
def pki(tmp_path_factory) -> Path:
    """ca signs server and client; rogue is another CA with its own client certificate."""
    d = tmp_path_factory.mktemp("pki")
    _ca(d, "ca")
    _leaf(d, "server", "ca")
    _leaf(d, "client", "ca")
    _ca(d, "rogue")
    _leaf(d, "rogue-client", "rogue")
    (d / "token").write_text(TOKEN + "\n")
    return d


@pytest.fixture(scope="module")
def secure(bundle_dir, pki):
    """The gateway serves TLS and wants the token; verifier and drafter require client certificates
    (mTLS), which the gateway presents."""
    server = {"tls_cert": str(pki / "server.pem"), "tls_key": str(pki / "server.key")}
    mtls = {**server, "tls_ca": str(pki / "ca.pem")}
    sections = {
        "verifier": {"address": "127.0.0.1:0", **mtls},
        "drafter": {"address": "127.0.0.1:0", **mtls},
        "gateway": {
            "address": "127.0.0.1:0",
            **server,
            "tls_peer_ca": str(pki / "ca.pem"),
            "tls_client_cert": str(pki / "client.pem"),
            "tls_client_key": str(pki / "client.key"),
            "auth_token_file": str(pki / "token"),
        },
    }
    with ServiceStack("all", bundle_dir, sections) as running:
        yield running


def _channel(address: str, pki: Path, *, ca: str = "ca", cert: str | None = None) -> grpc.Channel:
    tls = ClientTLS(str(pki / f"{ca}.pem"), cert and str(pki / f"{cert}.pem"), cert and str(pki / f"{cert}.key"))
    return grpc.secure_channel(address, tls.credentials())


def _generate(channel: grpc.Channel, metadata=()) -> gateway_pb2.GenerateResponse:
    request = gateway_pb2.GenerateRequest(text=TEXT, config=overrides_to_wire(OVERRIDES))
    return gateway_pb2_grpc.GatewayServiceStub(channel).Generate(request, timeout=60, metadata=metadata)


def _verifier_info(channel: grpc.Channel) -> str:
    stub = verifier_pb2_grpc.VerifierServiceStub(channel)
    return stub.GetModelInfo(verifier_pb2.VerifierServiceGetModelInfoRequest(), timeout=10).model_info.backend


def _code(call) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.RpcError) as info:
        call()
    return info.value.code(), info.value.details()


def test_a_tls_client_with_the_token_gets_the_in_process_output(secure, bundle, pki):
    drafter = LocalDrafter({r: bundle.models[r] for r in ("nar_drafter", "ar_drafter")})
    config = DecodingConfig().with_overrides(OVERRIDES)
    expected = decode(bundle.tokenizer.encode(TEXT), config, make_verifier(bundle, DEFAULT_BACKEND), drafter)
    with _channel(secure.running.addresses["gateway"], pki) as channel:
        response = _generate(channel, (bearer_metadata(TOKEN),))
    assert list(response.output_ids) == expected.output_ids
    assert response.text == bundle.tokenizer.decode(expected.output_ids)
    assert not response.stats.degraded  # the gateway reached the drafter over mTLS too


def test_a_plaintext_client_is_refused(secure):
    for name in ("gateway", "verifier", "drafter"):
        with grpc.insecure_channel(secure.running.addresses[name]) as channel:
            health = health_pb2_grpc.HealthStub(channel)
            code, _ = _code(lambda h=health: h.Check(health_pb2.HealthCheckRequest(), timeout=5))
            assert code == grpc.StatusCode.UNAVAILABLE, name


def test_a_client_that_does_not_trust_the_server_is_refused(secure, pki):
    with _channel(secure.running.addresses["gateway"], pki, ca="rogue") as channel:
        code, _ = _code(lambda: _generate(channel, (bearer_metadata(TOKEN),)))
    assert code == grpc.StatusCode.UNAVAILABLE


def test_mtls_refuses_a_client_without_a_certificate_of_its_ca(secure, pki):
    address = secure.running.addresses["verifier"]
    for cert in (None, "rogue-client"):
        with _channel(address, pki, cert=cert) as channel:
            code, _ = _code(lambda c=channel: _verifier_info(c))
            assert code == grpc.StatusCode.UNAVAILABLE, cert
    with _channel(address, pki, cert="client") as channel:
        assert _verifier_info(channel) == secure.running.verifier.model_info.backend


def test_the_gateway_refuses_a_missing_or_wrong_token_before_any_work(secure, pki):
    request = gateway_pb2.GenerateRequest(text=TEXT, config=overrides_to_wire(OVERRIDES))
    metrics = secure.running.gateway.registry
    before = metrics.render()
    with _channel(secure.running.addresses["gateway"], pki) as channel:
        stub = gateway_pb2_grpc.GatewayServiceStub(channel)
        cases = {
            (): MISSING_TOKEN,
            (("authorization", "Basic " + TOKEN),): MISSING_TOKEN,
            (bearer_metadata("wrong"),): WRONG_TOKEN,
            (bearer_metadata(TOKEN + "x"),): WRONG_TOKEN,
        }
        for metadata, message in cases.items():
            assert _code(lambda m=metadata: stub.Generate(request, timeout=10, metadata=m)) == (
                grpc.StatusCode.UNAUTHENTICATED,
                message,
            ), metadata
            assert _code(lambda m=metadata: list(stub.GenerateStream(request, timeout=10, metadata=m))) == (
                grpc.StatusCode.UNAUTHENTICATED,
                message,
            ), metadata
    assert metrics.render() == before  # refused before the servicer: no request was counted


def test_health_needs_no_token(secure, pki):
    with _channel(secure.running.addresses["gateway"], pki) as channel:
        status = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10).status
    assert status == health_pb2.HealthCheckResponse.SERVING


def _https(address: str, pki: Path, headers: dict[str, str], scheme: str = "https") -> tuple[int, dict]:
    body = json.dumps({"model": "specdec", "prompt": TEXT, "max_tokens": 16, "specdec": {"mode": "gad", "k": 4}})
    request = urllib.request.Request(f"{scheme}://{address}/v1/completions", data=body.encode(), headers=headers)
    context = ssl.create_default_context(cafile=str(pki / "ca.pem"))
    try:
        with urllib.request.urlopen(request, context=context if scheme == "https" else None, timeout=60) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def test_the_http_endpoints_share_the_certificate_and_the_token(secure, pki):
    """HTTPS with the gateway's certificate; the same bearer token; plaintext HTTP gets no answer."""
    address = secure.running.http_address
    with _channel(secure.running.addresses["gateway"], pki) as channel:
        expected = _generate(channel, (bearer_metadata(TOKEN),)).text
    status, answer = _https(address, pki, {"Authorization": f"Bearer {TOKEN}"})
    assert status == 200 and answer["choices"][0]["text"] == expected
    status, answer = _https(address, pki, {})
    assert status == 401 and answer["error"]["message"].startswith("missing bearer token")
    with pytest.raises((urllib.error.URLError, ConnectionError, http.client.HTTPException)):
        _https(address, pki, {"Authorization": f"Bearer {TOKEN}"}, scheme="http")


def _specdec_generate(address: str, *flags: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1"}
    overrides = ["--mode", OVERRIDES["mode"], "--k", "4", "--max-new-tokens", "16"]
    return subprocess.run(
        [sys.executable, "-m", "specdec", "generate", TEXT, "--addr", address, "--json", *overrides, *flags],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=60,
    )  # fmt: skip


def test_specdec_generate_with_tls_and_token(secure, pki):
    address = secure.running.addresses["gateway"]
    with _channel(address, pki) as channel:
        expected = list(_generate(channel, (bearer_metadata(TOKEN),)).output_ids)
    ok = _specdec_generate(address, "--tls-ca", str(pki / "ca.pem"), "--token", TOKEN)
    assert ok.returncode == 0, ok.stderr
    assert f'"output_ids": {expected}' in ok.stdout
    from_file = _specdec_generate(address, "--tls-ca", str(pki / "ca.pem"), "--token-file", str(pki / "token"))
    assert from_file.returncode == 0, from_file.stderr
    refused = _specdec_generate(address, "--tls-ca", str(pki / "ca.pem"))
    assert refused.returncode == 2
    assert refused.stderr.strip().splitlines()[-1] == f"specdec generate: error: UNAUTHENTICATED: {MISSING_TOKEN}"


def _start_logs(address: str, tls: ServerTLS | None, metrics_address: str | None = None) -> list[dict]:
    """The log events of a bare ServiceHost starting on `address` (no traffic is sent to it)."""

    async def run() -> None:
        host = ServiceHost("probe", [], Registry())
        await host.start(address, metrics_address, tls)
        await host.drain(0)

    with structlog.testing.capture_logs() as logs:
        asyncio.run(run())
    return logs


def test_binding_beyond_loopback_without_tls_logs_a_warning(pki):
    warned = _start_logs("0.0.0.0:0", None)
    assert [e for e in warned if e["log_level"] == "warning"] == [
        {
            "service": "probe",
            "address": "0.0.0.0:0",
            "hint": "set tls_cert and tls_key",
            "event": "plaintext_beyond_loopback",
            "log_level": "warning",
        }
    ]
    tls = ServerTLS(str(pki / "server.pem"), str(pki / "server.key"))
    for address, server_tls in (("0.0.0.0:0", tls), ("127.0.0.1:0", None), ("localhost:0", None)):
        logs = _start_logs(address, server_tls)
        assert [e["event"] for e in logs if e["log_level"] == "warning"] == [], address


def test_metrics_beyond_loopback_logs_a_warning():
    logs = _start_logs("127.0.0.1:0", None, metrics_address="0.0.0.0:0")
    assert [(e["event"], e.get("metrics_address")) for e in logs if e["log_level"] == "warning"] == [
        ("metrics_beyond_loopback", "0.0.0.0:0")
    ]
    assert [e["event"] for e in _start_logs("127.0.0.1:0", None, ":0") if e["log_level"] == "warning"] == []
