"""`docker-compose config` (the real tool) accepts both compose files as written, and in the GPU
file the verifier and the drafter reserve different GPUs."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _config(compose_file: str, **env: str) -> str:
    if shutil.which("docker-compose") is None:
        pytest.skip("docker-compose is not installed")
    proc = subprocess.run(
        ["docker-compose", "-f", compose_file, "config"], cwd=ROOT, capture_output=True, text=True, timeout=60,
        env={**os.environ, **env},
    )
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def _device_ids(rendered: str, service: str) -> list[str]:
    """The device_ids under `service` in `docker-compose config` output (YAML, services indented by 2)."""
    block = re.search(rf"^  {service}:\n((?:    .*\n|\n)*)", rendered, re.M)
    assert block, f"no service {service} in:\n{rendered}"
    ids = re.search(r"device_ids:\n((?:\s+- .*\n)+)", block.group(1))
    assert ids, f"{service} reserves no device:\n{block.group(1)}"
    return [line.strip().lstrip("- ").strip("'\"") for line in ids.group(1).splitlines()]


def test_the_gpu_file_is_valid_and_pins_the_two_models_to_different_gpus() -> None:
    rendered = _config("docker-compose.yml")
    assert _device_ids(rendered, "verifier") == ["0"]
    assert _device_ids(rendered, "drafter") == ["1"]
    moved = _config("docker-compose.yml", VERIFIER_GPU="2", DRAFTER_GPU="3")
    assert (_device_ids(moved, "verifier"), _device_ids(moved, "drafter")) == (["2"], ["3"])


def test_the_cpu_file_is_valid_and_reserves_no_gpu() -> None:
    assert "device_ids" not in _config("docker-compose.cpu.yml")
