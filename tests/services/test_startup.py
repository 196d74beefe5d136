"""Start-up as a user meets it: a taken address is an error naming it and starts nothing; the metrics
flags; a gateway waiting for an unreachable peer says what it waits for and stops on SIGTERM."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from core.errors import BindError
from serving.host import ServiceHost
from serving.metrics import Registry
from specdec.serve import ServiceStack
from tests.services.conftest import REPO, free_port, scrape, wait_ready_line, wait_until


def _serve(*args: str, stderr) -> subprocess.Popen:
    env = {**os.environ, "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1"}
    return subprocess.Popen(
        [sys.executable, "-m", "specdec", "serve", *args], cwd=REPO, env=env, stdout=subprocess.PIPE,
        stderr=stderr, text=True,
    )


def _run_serve(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1"}
    return subprocess.run(
        [sys.executable, "-m", "specdec", "serve", *args], cwd=REPO, env=env, capture_output=True, text=True,
        timeout=120,
    )


def test_a_taken_port_is_refused_not_shared() -> None:
    """grpc sets SO_REUSEPORT by default: a second server on a taken port would share it."""

    async def main() -> None:
        first = ServiceHost("first", [], Registry())
        port = await first.start("127.0.0.1:0", "127.0.0.1:0")
        try:
            second = ServiceHost("second", [], Registry())
            with pytest.raises(BindError, match=rf"^second: cannot listen on 127\.0\.0\.1:{port}: the address is "
                               "already in use$"):
                await second.start(f"127.0.0.1:{port}")
            third = ServiceHost("third", [], Registry())
            taken = f"127.0.0.1:{first.metrics_port}"
            with pytest.raises(BindError, match=rf"^third: cannot serve metrics on {taken}: "):
                await third.start("127.0.0.1:0", taken)
        finally:
            await first.drain(0)

    asyncio.run(main())


def test_serve_on_a_taken_address_is_an_error_naming_it_and_metrics_flags_serve(bundle_dir: Path, tmp_path: Path):
    ports = {role: free_port() for role in ("gateway", "verifier", "drafter")}
    metrics = {role: free_port() for role in ports}
    flags = [f"--{role}-{kind}addr=127.0.0.1:{port}"
             for role in ports for kind, port in (("", ports[role]), ("metrics-", metrics[role]))]
    log = tmp_path / "first.log"
    with log.open("w") as stderr:
        first = _serve("all", "--bundle", str(bundle_dir), *flags, stderr=stderr)
    try:
        assert wait_ready_line(first) == f"127.0.0.1:{ports['gateway']}"
        for role, port in metrics.items():
            assert any(name.startswith(f"specdec_{role}_") for name in scrape(port)), role
        serving = [json.loads(line) for line in log.read_text().splitlines() if '"serving"' in line]
        assert sorted(line["metrics"] for line in serving) == sorted(
            f"http://127.0.0.1:{port}/metrics" for port in metrics.values()
        )

        # The same gateway address again: refused before any model loads, naming the address.
        started = time.monotonic()
        second = _run_serve("all", "--bundle", str(bundle_dir), f"--gateway-addr=127.0.0.1:{ports['gateway']}",
                            "--verifier-addr=127.0.0.1:0", "--drafter-addr=127.0.0.1:0")
        assert second.returncode == 2 and second.stdout == ""
        assert second.stderr.strip() == (f"specdec serve: error: [gateway] address: cannot listen on "
                                         f"127.0.0.1:{ports['gateway']}: the address is already in use")
        assert time.monotonic() - started < 60
        # A taken metrics port, for one service alone.
        third = _run_serve("verifier", "--bundle", str(bundle_dir), "--verifier-addr=127.0.0.1:0",
                           f"--metrics-addr=127.0.0.1:{metrics['drafter']}")
        assert third.returncode == 2 and third.stdout == ""
        assert f"[verifier] metrics_address: cannot listen on 127.0.0.1:{metrics['drafter']}" in third.stderr
        # --metrics-addr names one role's endpoint.
        fourth = _run_serve("all", "--bundle", str(bundle_dir), "--metrics-addr=127.0.0.1:0")
        assert fourth.returncode == 2 and "with `all` give --gateway-metrics-addr" in fourth.stderr
        assert first.poll() is None  # the first stack is untouched
    finally:
        first.send_signal(signal.SIGTERM)
        first.wait(60)


def test_metrics_are_off_unless_set_and_the_log_says_so():
    """The `listening` and `serving` log lines say where metrics are, or that they are off."""
    import structlog

    async def main(metrics_address: str | None) -> list[str]:
        host = ServiceHost("svc", [], Registry())
        with structlog.testing.capture_logs() as logs:
            await host.start("127.0.0.1:0", metrics_address)
            await host.set_serving()
        await host.drain(0)
        return [e["metrics"] for e in logs if e["event"] in ("listening", "serving")]

    assert asyncio.run(main(None)) == ["off", "off"]
    port = free_port()
    assert asyncio.run(main(f"127.0.0.1:{port}")) == [f"http://127.0.0.1:{port}/metrics"] * 2


def test_gateway_waiting_for_a_drafter_says_so_and_stops_on_sigterm(bundle_dir: Path, tmp_path: Path):
    with socket.socket() as nobody:  # bound, never listening: connections to it are refused
        nobody.bind(("127.0.0.1", 0))
        drafter = f"127.0.0.1:{nobody.getsockname()[1]}"
        with ServiceStack("verifier", bundle_dir, {"verifier": {"address": "127.0.0.1:0"}}) as v:
            log = tmp_path / "gateway.log"
            with log.open("w") as stderr:
                gateway = _serve("gateway", "--bundle", str(bundle_dir), "--gateway-addr=127.0.0.1:0",
                                 f"--verifier-addr={v.running.addresses['verifier']}", f"--drafter-addr={drafter}",
                                 stderr=stderr)
            try:

                def waiting() -> list[dict]:
                    lines = [json.loads(x) for x in log.read_text().splitlines() if x.startswith("{")]
                    return [x for x in lines if x["event"] == "waiting_for_peer"]

                assert wait_until(lambda: bool(waiting()), timeout=60), log.read_text()
                assert {(x["peer"], x["address"]) for x in waiting()} == {("drafter", drafter)}
                stopped = time.monotonic()
                gateway.send_signal(signal.SIGTERM)
                assert gateway.wait(10) == 0
                assert time.monotonic() - stopped < 5
                assert gateway.stdout is not None and gateway.stdout.read() == ""  # it never served
            finally:
                gateway.kill()
                gateway.wait(10)
