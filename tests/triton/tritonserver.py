"""Start the real `tritonserver` (nvidia-pytriton's binary, set up by deploy/triton/setup.sh) on
loopback ports with a model repository, for the `triton` tests and bench/bench_services.py."""

from __future__ import annotations

import os
import socket
import subprocess
import sysconfig
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
VENV_ENV = "SPECDEC_TRITON_VENV"


def triton_venv() -> Path:
    return Path(os.environ.get(VENV_ENV) or REPO / ".triton-venv")


def why_not_runnable() -> str | None:
    """None when the server can start here, else the reason (printed by the skipping tests)."""
    venv = triton_venv()
    binary = _triton_dir(venv) / "bin" / "tritonserver"
    if not binary.is_file():
        return f"no tritonserver under {venv} (run deploy/triton/setup.sh, or set {VENV_ENV})"
    if not (_triton_dir(venv) / "backends" / "python" / "triton_python_backend_stub").is_file():
        return f"the Python backend stub is not installed in {venv} (run deploy/triton/setup.sh)"
    pth = list(_site(venv).glob("specdec-checkout.pth"))
    if not pth or Path(pth[0].read_text().strip()) != REPO:
        return f"{venv} does not import this checkout ({REPO}); run deploy/triton/setup.sh {venv}"
    return None


@dataclass
class TritonServer:
    process: subprocess.Popen
    grpc_address: str
    log: Path

    def url(self, model: str) -> str:
        return f"triton://{self.grpc_address}/{model}"

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(15)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(10)


def start_triton(repository: Path, log: Path, timeout: float = 120.0) -> TritonServer:
    """tritonserver on a free loopback port, gRPC only; returns once it listens (models loaded)."""
    venv = triton_venv()
    triton = _triton_dir(venv)
    port = _free_port()
    args = [
        str(triton / "bin" / "tritonserver"), "--model-repository", str(repository),
        "--backend-directory", str(triton / "backends"), "--cache-directory", str(triton / "caches"),
        "--grpc-address", "127.0.0.1", "--grpc-port", str(port), "--allow-http", "false",
        "--allow-metrics", "false", "--allow-gpu-metrics", "false", "--pinned-memory-pool-byte-size", "0",
        "--disable-auto-complete-config", "--exit-timeout-secs", "5", "--log-verbose", "0",
    ]
    # The Python backend's stub runs the first python3 on PATH: the venv's (numpy < 2, torch, specdec).
    env = {**os.environ, "PATH": f"{venv / 'bin'}:{os.environ.get('PATH', '')}", "OMP_NUM_THREADS": "1"}
    env.pop("PYTHONPATH", None)
    handle = log.open("w")
    process = subprocess.Popen(args, stdout=handle, stderr=subprocess.STDOUT, env=env, cwd=repository)
    server = TritonServer(process, f"127.0.0.1:{port}", log)
    deadline = time.monotonic() + timeout
    # Wait for the listening socket rather than connecting: a connect loop on a free ephemeral port
    # can connect the port to itself and make the server fail to bind.
    while not _listening(port):
        if process.poll() is not None:
            raise RuntimeError(f"tritonserver exited with {process.returncode}:\n{log.read_text()[-4000:]}")
        if time.monotonic() > deadline:
            server.stop()
            raise RuntimeError(f"tritonserver did not listen within {timeout:.0f}s:\n{log.read_text()[-4000:]}")
        time.sleep(0.1)
    return server


def _triton_dir(venv: Path) -> Path:
    return _site(venv) / "pytriton" / "tritonserver"


def _site(venv: Path) -> Path:
    version = sysconfig.get_python_version()
    return venv / "lib" / f"python{version}" / "site-packages"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _listening(port: int) -> bool:
    """Whether some socket listens on the port (/proc/net/tcp and tcp6, state 0A = LISTEN; gRPC may
    bind 127.0.0.1 as the v4-mapped address of an IPv6 socket)."""
    lines: list[str] = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines += Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
    for line in lines:
        local, state = line.split()[1], line.split()[3]
        if state == "0A" and int(local.rsplit(":", 1)[1], 16) == port:
            return True
    return False
