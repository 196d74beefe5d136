"""The deployment's fast checks (no Docker): the compose files' GPU pinning and start-up order, the
`specdec health` subcommand against a real server, and `--device` (validation, the start-up error
on a machine without the GPU it names, the device in GetModelInfo.backend). tests/docker runs the
stack itself."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from core.config import load_sections, parse_device
from seq2seq_models.bundle import make_tiny_bundle
from specdec.serve import ServiceStack, serve_config

ROOT = Path(__file__).resolve().parent.parent


def _specdec(*args: str, env: dict[str, str] | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "specdec", *args], capture_output=True, text=True, timeout=timeout,
        env={**os.environ, "PYTHONWARNINGS": "ignore", **(env or {})},
    )


def _services(name: str) -> dict:
    """A compose file's services with the base file's settings under `extends` merged in (as compose does)."""
    services = yaml.safe_load((ROOT / name).read_text())["services"]
    out = {}
    for svc, spec in services.items():
        ext = spec.get("extends")
        merged: dict = {}
        if ext:
            base = yaml.safe_load((ROOT / ext["file"]).read_text())["services"][ext["service"]]
            merged = {k: v for k, v in base.items()}
            merged["environment"] = {**base.get("environment", {}), **spec.get("environment", {})}
        out[svc] = {**merged, **{k: v for k, v in spec.items() if k not in ("extends", "environment")},
                    "environment": merged.get("environment", spec.get("environment", {}))}
    return out


@pytest.fixture(scope="module")
def bundle_dir(tmp_path_factory) -> Path:
    return make_tiny_bundle(tmp_path_factory.mktemp("bundle"), 5)


# ---- compose files ---------------------------------------------------------------------------------


def _gpu_ids(service: dict) -> list[str]:
    devices = service["deploy"]["resources"]["reservations"]["devices"]
    assert [d["driver"] for d in devices] == ["nvidia"] and devices[0]["capabilities"] == ["gpu"]
    return devices[0]["device_ids"]


def test_compose_pins_verifier_and_drafter_to_different_gpus():
    services = _services("docker-compose.yml")
    assert set(services) == {"verifier", "drafter", "gateway"}
    verifier, drafter = _gpu_ids(services["verifier"]), _gpu_ids(services["drafter"])
    # The defaults of ${VERIFIER_GPU:-0} and ${DRAFTER_GPU:-1}: compose's interpolation default.
    defaults = [v.split(":-")[1].rstrip("}") if ":-" in v else v for v in (verifier[0], drafter[0])]
    assert defaults == ["0", "1"]
    assert services["verifier"]["environment"]["SPECDEC__VERIFIER__DEVICE"] == "cuda"
    assert services["drafter"]["environment"]["SPECDEC__DRAFTER__DEVICE"] == "cuda"
    assert "deploy" not in services["gateway"]


@pytest.mark.parametrize("name", ["docker-compose.yml", "docker-compose.cpu.yml"])
def test_compose_gateway_waits_for_healthy_peers_and_everything_stays_on_loopback(name):
    services = _services(name)
    assert services["gateway"]["depends_on"] == {
        "verifier": {"condition": "service_healthy"}, "drafter": {"condition": "service_healthy"}
    }
    for svc, spec in services.items():
        assert spec["network_mode"] == "host", svc
        assert spec["healthcheck"]["test"][:3] == ["CMD", "specdec", "health"], svc
        assert "stop_grace_period" in spec, svc
        for key, value in spec["environment"].items():
            if key.endswith("__ADDRESS"):
                assert value.startswith(("127.0.0.1:", "verifier:", "drafter:")), (svc, key, value)
    assert sorted(services["gateway"]["extra_hosts"]) == ["drafter:127.0.0.1", "verifier:127.0.0.1"]


def test_cpu_compose_reserves_no_gpu():
    services = _services("docker-compose.cpu.yml")
    for svc in ("verifier", "drafter"):
        assert "deploy" not in services[svc]
        assert services[svc]["environment"][f"SPECDEC__{svc.upper()}__DEVICE"] == "cpu"


def test_the_image_copies_every_package_the_wheel_installs():
    """deploy/Dockerfile builds the wheel from the packages it copies, past .dockerignore: a package
    pyproject lists but the image leaves out fails the image's import check, not this machine's."""
    import tomllib

    included = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]["find"]["include"]
    packages = {pattern.rstrip("*") for pattern in included}
    copied = {line.split()[1] for line in (ROOT / "deploy" / "Dockerfile").read_text().splitlines()
              if line.startswith("COPY ") and not line.startswith("COPY --")}
    ignore = (ROOT / ".dockerignore").read_text().splitlines()
    let_in = {line[1:].rstrip("/") for line in ignore if line.startswith("!")}
    assert packages <= copied and packages <= let_in, (packages - copied, packages - let_in)


def test_stack_config_file_is_valid():
    sections = load_sections(ROOT / "deploy" / "specdec.toml", environ={})
    config = serve_config(sections)
    assert config.verifier.backend == config.drafter.backend == "onnxruntime"


# ---- --device ----------------------------------------------------------------------------------------


@pytest.mark.parametrize(("text", "parsed"), [("cpu", ("cpu", None)), ("auto", ("auto", None)),
                                              ("cuda", ("cuda", 0)), ("cuda:3", ("cuda", 3))])
def test_device_names_parse(text, parsed):
    assert parse_device(text) == parsed


@pytest.mark.parametrize("bad", ["gpu", "cuda:", "cuda:x", "cpu:0", "CUDA"])
def test_a_bad_device_is_a_config_error_naming_the_key(bad):
    with pytest.raises(ValueError, match=r"\[drafter\] device: must be auto"):
        serve_config(load_sections(None, environ={"SPECDEC__DRAFTER__DEVICE": bad}))


@pytest.mark.parametrize(("role", "flags"), [("verifier", ["--device", "cuda"]),
                                              ("drafter", ["--device", "cuda:1", "--backend", "torch"])])
def test_a_missing_gpu_fails_start_up_in_one_line(bundle_dir, role, flags):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU: the error path needs one that does not exist")
    proc = _specdec("serve", role, "--bundle", str(bundle_dir), "--verifier-addr", "127.0.0.1:0",
                    "--drafter-addr", "127.0.0.1:0", *flags)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert f"[{role}] device: device '{flags[1]}' does not exist" in lines[0]


def test_the_device_is_reported_in_model_info(bundle_dir):
    from protos.specdec.v1 import drafter_pb2, drafter_pb2_grpc, verifier_pb2, verifier_pb2_grpc
    from serving.tls import open_channel

    sections = {
        "verifier": {"address": "127.0.0.1:0", "device": "cpu"},
        "drafter": {"address": "127.0.0.1:0", "device": "cpu"},
        "gateway": {"address": "127.0.0.1:0"},
    }
    with ServiceStack("all", bundle_dir, sections) as stack:
        addresses = stack.running.addresses
        with open_channel(addresses["verifier"], None, []) as ch:
            stub = verifier_pb2_grpc.VerifierServiceStub(ch)
            info = stub.GetModelInfo(verifier_pb2.VerifierServiceGetModelInfoRequest()).model_info
        assert info.backend == "onnxruntime-cpu"
        with open_channel(addresses["drafter"], None, []) as ch:
            stub = drafter_pb2_grpc.DrafterServiceStub(ch)
            info = stub.GetModelInfo(drafter_pb2.DrafterServiceGetModelInfoRequest()).model_info
        assert info.backend == "onnxruntime-cpu"

        # ---- specdec health against the same real servers ----
        for role in ("verifier", "drafter", "gateway"):
            proc = _specdec("health", "--addr", addresses[role])
            assert proc.returncode == 0, proc.stderr
            assert proc.stdout.strip() == f"{addresses[role]}: SERVING"
        gateway = addresses["gateway"]
    # Stopped: the same address now refuses, in one line and a non-zero exit.
    proc = _specdec("health", "--addr", gateway, "--timeout", "2")
    assert proc.returncode == 1
    assert proc.stderr.count("\n") == 1 and proc.stderr.startswith(f"specdec health: error: {gateway}: UNAVAILABLE")


def test_health_reports_a_service_that_is_not_serving(bundle_dir):
    """A named service the server does not know is NOT_FOUND; unknown != healthy."""
    with ServiceStack("verifier", bundle_dir, {"verifier": {"address": "127.0.0.1:0"}}) as stack:
        addr = stack.running.addresses["verifier"]
        proc = _specdec("health", "--addr", addr, "--service", "no.such.Service")
    assert proc.returncode == 1
    assert proc.stderr.startswith(f"specdec health: error: {addr}: NOT_FOUND")
