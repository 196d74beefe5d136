"""`specdec serve all --processes`: the verifier and the drafter as child processes of the gateway's.

The stack answers as the one-process one does (GAD through it equals greedy in-process, with the
drafter used), the parent's flags reach the children, SIGTERM stops all three, and a child that
cannot start makes the parent exit with a line saying which, leaving nothing running.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import grpc

from decoding.config import DecodingConfig, Mode
from decoding.decode import decode
from protos.specdec.v1 import gateway_pb2, gateway_pb2_grpc
from seq2seq_models.bundle import load_bundle
from tests.services.conftest import REPO
from verifier_service.session import make_verifier

TEXT = "We have been living in this city."
ADDRESSES = ["--gateway-addr", "127.0.0.1:0", "--verifier-addr", "127.0.0.1:0", "--drafter-addr", "127.0.0.1:0"]


def test_the_three_processes_serve_and_stop_together(bundle_dir, tmp_path):
    proc = _serve(bundle_dir, tmp_path, "--max-batch-rows", "4")
    try:
        assert proc.stdout is not None
        address = proc.stdout.readline().strip()
        assert address, f"serve all --processes exited with {proc.poll()}"
        children = _children(proc.pid)
        roles = sorted(next(r for r in ("verifier", "drafter") if f"serve {r}" in cmd) for cmd in children.values())
        assert roles == ["drafter", "verifier"]
        assert all("--max-batch-rows 4" in cmd for cmd in children.values())  # the parent's flags
        reply = _gad(address, 16)
    finally:
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(timeout=60)
    assert code == 0
    assert not reply.stats.degraded  # the drafter process was used
    bundle = load_bundle(bundle_dir)
    source = bundle.tokenizer.encode(TEXT)
    greedy = decode(source, DecodingConfig(mode=Mode.AR, max_new_tokens=16), make_verifier(bundle, "onnxruntime"), None)
    assert list(reply.output_ids) == greedy.output_ids
    _gone(children)


def test_a_child_that_cannot_start_stops_the_parent_with_a_reason(bundle_dir, tmp_path):
    # A socket in a folder that does not exist: only the verifier's own bind can find that out.
    unbindable = f"unix://{tmp_path}/missing/verifier.sock"
    proc = _serve(bundle_dir, tmp_path, "--verifier-addr", unbindable, stderr=subprocess.PIPE)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode != 0
    assert "before it was serving" in err and "specdec serve verifier exited" in err


def test_a_missing_device_stops_the_parent_before_any_child_starts(bundle_dir, tmp_path):
    proc = _serve(bundle_dir, tmp_path, "--device", "cuda:7", stderr=subprocess.PIPE)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode != 0
    assert "device 'cuda:7' does not exist" in err and "specdec serve verifier exited" not in err


def _gad(address: str, max_new_tokens: int) -> gateway_pb2.GenerateResponse:
    with grpc.insecure_channel(address) as channel:
        stub = gateway_pb2_grpc.GatewayServiceStub(channel)
        config = gateway_pb2.DecodingConfig(mode=gateway_pb2.MODE_GAD, block_size=4, max_new_tokens=max_new_tokens)
        return stub.Generate(gateway_pb2.GenerateRequest(text=TEXT, config=config), timeout=60)


def _serve(bundle_dir: Path, tmp_path: Path, *flags: str, stderr=subprocess.DEVNULL) -> subprocess.Popen:
    config = tmp_path / "loopback.toml"
    config.write_text("".join(f'[{s}]\nmetrics_address = "127.0.0.1:0"\n' for s in ("gateway", "verifier", "drafter")))
    cmd = [sys.executable, "-m", "specdec", "serve", "all", "--processes", "--bundle", str(bundle_dir),
           "--config", str(config), *ADDRESSES, *flags]
    env = {**os.environ, "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1"}
    return subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=stderr, text=True)


def _children(pid: int) -> dict[int, str]:
    """The direct children of `pid` and their command lines (from /proc)."""
    out = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            ppid = int(stat.rsplit(")", 1)[1].split()[1])
            if ppid == pid:
                out[int(entry.name)] = (entry / "cmdline").read_text().replace("\0", " ")
        except (OSError, ValueError, IndexError):
            continue
    return out


def _gone(children: dict[int, str], timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while any(Path(f"/proc/{pid}").exists() and _alive(pid) for pid in children):
        assert time.monotonic() < deadline, f"children still running: {children}"
        time.sleep(0.1)


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def test_unix_socket_addresses_serve_without_a_plaintext_warning(bundle_dir, tmp_path):
    """`unix:///path` for every service (peers on one host): the stack answers, the gateway's
    printed address is the socket, and no listener is reported as plaintext beyond loopback."""
    sockets = {role: f"unix://{tmp_path}/{role}.sock" for role in ("gateway", "verifier", "drafter")}
    cmd = [sys.executable, "-m", "specdec", "serve", "all", "--processes", "--bundle", str(bundle_dir),
           *(x for role, a in sockets.items() for x in (f"--{role}-addr", a))]
    env = {**os.environ, "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1"}
    log = tmp_path / "serve.log"
    with log.open("w") as err:
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=err, text=True)
        try:
            assert proc.stdout is not None
            address = proc.stdout.readline().strip()
            assert address == sockets["gateway"]
            reply = _gad(address, 12)
        finally:
            proc.send_signal(signal.SIGTERM)
            proc.wait(timeout=60)
    assert reply.output_ids and not reply.stats.degraded  # the drafter, too, answered on its socket
    assert "plaintext_beyond_loopback" not in log.read_text()
