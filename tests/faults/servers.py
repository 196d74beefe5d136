"""Real `specdec serve` processes on free loopback ports, and their Prometheus metrics.

Shared by the cancellation, deadline and peer-fault tests: each test starts its own servers as
separate processes (so a fault can be injected into one of them with a signal) and reads what
they report through their metrics endpoints, the way an operator would.
"""

from __future__ import annotations

import os
import signal
import subprocess
import urllib.request
from pathlib import Path

from tests.services.conftest import AddressTaken, free_port, spawn_specdec, wait_ready_line

LOOP = "127.0.0.1"


def metrics(port: int) -> dict[str, float]:
    """One scrape: sample name (labels included, as rendered) -> value."""
    body = urllib.request.urlopen(f"http://{LOOP}:{port}/metrics", timeout=10).read().decode()
    out: dict[str, float] = {}
    for line in body.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            out[name] = float(value)
    return out


class Served:
    """One `specdec serve ROLE` process with its address and metrics port."""

    def __init__(self, role: str, bundle: Path, config: Path, address: str, metrics_port: int, *flags: str) -> None:
        self.role = role
        self.address = address
        self.metrics_port = metrics_port
        self._args = ("serve", role, "--bundle", str(bundle), "--config", str(config), *flags)
        self.proc: subprocess.Popen = spawn_specdec(*self._args)

    def wait_ready(self, timeout: float = 90.0) -> Served:
        wait_ready_line(self.proc, timeout)
        return self

    def restart(self) -> Served:
        self.kill()
        self.proc = spawn_specdec(*self._args)
        return self

    def metric(self, name: str) -> float:
        return metrics(self.metrics_port).get(name, 0.0)

    def signal(self, sig: signal.Signals) -> None:
        os.kill(self.proc.pid, sig)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)  # a stopped process must run to die promptly
            self.proc.kill()
        self.proc.wait(30)


def write_config(path: Path, gateway: dict[str, object] | None = None) -> dict[str, tuple[str, int]]:
    """A TOML config with free loopback ports for every service; role -> (address, metrics port)."""
    ports = {role: (f"{LOOP}:{free_port()}", free_port()) for role in ("verifier", "drafter", "gateway")}
    lines: list[str] = []
    for role, (address, metrics_port) in ports.items():
        lines += [f"[{role}]", f'address = "{address}"', f'metrics_address = "{LOOP}:{metrics_port}"']
        if role == "gateway":
            lines += [f'verifier_address = "{ports["verifier"][0]}"', f'drafter_address = "{ports["drafter"][0]}"']
            for key, value in (gateway or {}).items():
                lines.append(f"{key} = {value!r}" if not isinstance(value, str) else f'{key} = "{value}"')
        lines.append("")
    path.write_text("\n".join(lines))
    return ports


def serve_separately(bundle: Path, tmp: Path, gateway: dict[str, object] | None = None) -> dict[str, Served]:
    """Verifier, drafter and gateway as three processes (the gateway started last, once both are up)."""
    return _with_fresh_ports(lambda: _serve_separately(bundle, tmp, gateway))


def _serve_separately(bundle: Path, tmp: Path, gateway: dict[str, object] | None) -> dict[str, Served]:
    config = tmp / "specdec.toml"
    ports = write_config(config, gateway)
    served: dict[str, Served] = {}
    try:
        for role in ("verifier", "drafter"):
            served[role] = Served(role, bundle, config, *ports[role])
        for s in served.values():
            s.wait_ready()
        served["gateway"] = Served("gateway", bundle, config, *ports["gateway"]).wait_ready()
    except BaseException:
        stop_all(served)
        raise
    return served


def stop_all(served: dict[str, Served]) -> None:
    for s in served.values():
        s.kill()


def serve_all(bundle: Path, tmp: Path, gateway: dict[str, object] | None = None) -> Served:
    """`specdec serve all`: the three services in one process, as the issue's reproduction ran them."""
    return _with_fresh_ports(lambda: _serve_all(bundle, tmp, gateway))


def _serve_all(bundle: Path, tmp: Path, gateway: dict[str, object] | None) -> Served:
    config = tmp / "specdec-all.toml"
    ports = write_config(config, gateway)
    served = Served("all", bundle, config, *ports["gateway"])
    served.metrics_ports = {role: port for role, (_, port) in ports.items()}
    try:
        return served.wait_ready()
    except BaseException:
        served.kill()
        raise


def _with_fresh_ports(start):
    """`start()`, once more on newly picked ports if a port was taken between `free_port` picking it
    and the server binding it (another test's outgoing connection may get the same ephemeral port)."""
    try:
        return start()
    except AddressTaken:
        return start()
