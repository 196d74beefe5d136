"""Real servers on ephemeral loopback ports, real channels, the tiny random bundle."""

from __future__ import annotations

import os
import queue
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import grpc
import pytest

from protos.specdec.v1 import drafter_pb2, drafter_pb2_grpc, gateway_pb2_grpc, verifier_pb2, verifier_pb2_grpc
from seq2seq_models.bundle import load_bundle, make_tiny_bundle
from specdec.serve import ServiceStack

LOOPBACK = {
    "verifier": {"address": "127.0.0.1:0", "metrics_address": "127.0.0.1:0"},
    "drafter": {"address": "127.0.0.1:0", "metrics_address": "127.0.0.1:0"},
    "gateway": {"address": "127.0.0.1:0", "metrics_address": "127.0.0.1:0", "drafter_retry_s": 0.2},
}
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="session")
def bundle_dir(tmp_path_factory) -> Path:
    return make_tiny_bundle(tmp_path_factory.mktemp("services-bundle"), seed=3)


@pytest.fixture(scope="session")
def bundle(bundle_dir):
    return load_bundle(bundle_dir)


@pytest.fixture(scope="session")
def stack(bundle_dir):
    with ServiceStack("all", bundle_dir, LOOPBACK) as running:
        yield running


def _channel_fixture(role: str):
    """A session fixture `<role>_channel`: one loopback channel to the shared stack's `role` server."""

    @pytest.fixture(scope="session", name=f"{role}_channel")
    def channel(stack):
        with grpc.insecure_channel(stack.running.addresses[role]) as opened:
            yield opened

    return channel


gateway_channel = _channel_fixture("gateway")
verifier_channel = _channel_fixture("verifier")


@pytest.fixture(scope="session")
def gateway(gateway_channel):
    return gateway_pb2_grpc.GatewayServiceStub(gateway_channel)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class AddressTaken(AssertionError):
    """A server refused to start because a port picked by `free_port` was taken before it bound."""


def spawn_specdec(*args: str) -> subprocess.Popen:
    """`specdec ARGS` in a child process; its stderr goes to a temporary file (`proc.stderr_log`), so a
    server that dies before its ready line says why, without a pipe nobody reads filling up."""
    env = {**os.environ, "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1"}
    log = tempfile.TemporaryFile(mode="w+")  # noqa: SIM115 (open for as long as the process runs)
    proc = subprocess.Popen(
        [sys.executable, "-m", "specdec", *args], cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=log, text=True,
    )
    proc.stderr_log = log  # type: ignore[attr-defined]
    return proc


def wait_ready_line(proc: subprocess.Popen, timeout: float = 60.0) -> str:
    """The address a `specdec serve` prints once everything is SERVING.

    The line is read on a daemon thread: `readline()` on the pipe blocks for as long as a hung
    server keeps it open, so waiting for it here would hang the whole suite. On a timeout the
    process is killed (which closes the pipe and ends the reader) and the test fails.
    """
    assert proc.stdout is not None
    lines: queue.SimpleQueue[str] = queue.SimpleQueue()
    threading.Thread(target=lambda: lines.put(proc.stdout.readline()), daemon=True).start()
    try:
        line = lines.get(timeout=timeout)
    except queue.Empty:
        proc.kill()
        proc.wait(10)
        raise AssertionError(f"`specdec serve` printed no ready line within {timeout:.0f}s; killed it") from None
    if not line:
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
        why = _stderr_tail(proc)
        error = AddressTaken if "already in use" in why else AssertionError
        raise error(f"server closed its stdout (exit status {proc.poll()}) before printing its ready line: {why}")
    return line.strip()


def _stderr_tail(proc: subprocess.Popen, chars: int = 2000) -> str:
    log = getattr(proc, "stderr_log", None)
    if log is None:
        return "(stderr not kept)"
    log.seek(0)
    return log.read()[-chars:].strip()


def wait_until(predicate, timeout: float = 10.0) -> bool:
    """Poll `predicate` until it holds or `timeout` seconds pass; its last value."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.02)
    return predicate()


def verifier_info(address: str):
    with grpc.insecure_channel(address) as channel:
        stub = verifier_pb2_grpc.VerifierServiceStub(channel)
        return stub.GetModelInfo(verifier_pb2.VerifierServiceGetModelInfoRequest(), timeout=30).model_info


def drafter_info(address: str):
    with grpc.insecure_channel(address) as channel:
        stub = drafter_pb2_grpc.DrafterServiceStub(channel)
        return stub.GetModelInfo(drafter_pb2.DrafterServiceGetModelInfoRequest(), timeout=30).model_info


def scrape(port: int) -> dict[str, float]:
    """A metrics endpoint's samples on loopback, by series (name and labels as rendered)."""
    import urllib.request

    body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    samples = {}
    for line in body.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            samples[name] = float(value)
    return samples


def verify_stream(channel, source: list[int], *steps: verifier_pb2.VerifyStep):
    """A raw Verify stream on `channel`: `open` of `source`, then `steps`; its responses (30 s deadline)."""
    stub = verifier_pb2_grpc.VerifierServiceStub(channel)
    requests = [verifier_pb2.VerifyRequest(open=verifier_pb2.VerifyOpen(source_ids=source))]
    requests += [verifier_pb2.VerifyRequest(step=s) for s in steps]
    return stub.Verify(iter(requests), timeout=30)
