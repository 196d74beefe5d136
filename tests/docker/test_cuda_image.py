"""The CUDA image (deploy/Dockerfile, VARIANT=cuda) on a machine without a GPU: it holds no torch, its
onnxruntime is onnxruntime-gpu with the CUDA provider whose libraries (the nvidia-* wheels) all load,
a GPU that is not there is the one-line start-up error, and on `--device cpu` it serves.

Builds `deploy/build-image.sh --variant cuda` (the nvidia wheels come from PyPI: ~3 GB on a cold cache;
measured times are printed as CUDA IMAGE TIMINGS). `.ci/run` runs it with the rest of tests/docker; alone:

    python -m pytest -q -n 0 -s -m docker tests/docker/test_cuda_image.py
"""

from __future__ import annotations

import json
import os
import sys
import time

import pytest

from tests.docker.test_compose_stack import ROOT, _docker_unavailable, _free_ports, _run

IMAGE = os.environ.get("SPECDEC_CUDA_IMAGE", "specdec:cuda")
# What the CUDA provider needs, checked without a GPU: preload_dlls finds the nvidia-* wheels' CUDA
# runtime, cuBLAS and cuDNN (they are mapped into the process after it), and with those wheels' folders
# on the loader's path every library the provider links resolves but the driver's libcuda.so.1, which the
# NVIDIA container toolkit mounts on a GPU host.
PROVIDER_LIBRARIES = """
import glob, json, os, subprocess, onnxruntime as ort
ort.preload_dlls()
maps = open("/proc/self/maps").read()
site = os.path.dirname(os.path.dirname(ort.__file__))
nvidia = glob.glob(os.path.join(site, "nvidia", "*", "lib")) + glob.glob(os.path.join(site, "nvidia", "*", "*", "lib"))
provider = os.path.join(os.path.dirname(ort.__file__), "capi", "libonnxruntime_providers_cuda.so")
ldd = subprocess.run(["ldd", provider], capture_output=True, text=True, check=True,
                     env={**os.environ, "LD_LIBRARY_PATH": ":".join(nvidia)}).stdout
print(json.dumps({
    "providers": ort.get_available_providers(),
    "preloaded": sorted(lib for lib in ("libcudart", "libcublas", "libcudnn") if lib + ".so" in maps),
    "unresolved": sorted(line.split()[0] for line in ldd.splitlines() if "not found" in line),
}))
"""


@pytest.fixture(scope="module")
def cuda_image() -> str:
    reason = _docker_unavailable()
    if reason:
        print(f"tests/docker skipped: {reason}", file=sys.__stderr__)
        pytest.skip(reason)
    started = time.monotonic()
    _run(str(ROOT / "deploy" / "build-image.sh"), "--variant", "cuda", "--tag", IMAGE, timeout=3600)
    build_s = time.monotonic() - started
    size = int(_run("docker", "image", "inspect", "-f", "{{.Size}}", IMAGE).stdout.strip())
    print("\nCUDA IMAGE TIMINGS " + json.dumps({"build_s": round(build_s, 1), "image_mb": round(size / 1e6)}),
          file=sys.__stderr__)
    return IMAGE


def _in_image(image: str, *cmd: str, entrypoint: str | None = None, timeout: float = 120):
    """`cmd` in a fresh container of `image` (removed after), host networking as the stack uses."""
    args = ["docker", "run", "--rm", "--network", "host"]
    if entrypoint:
        args += ["--entrypoint", entrypoint]
    return _run(*args, image, *cmd, timeout=timeout, check=False)


def test_the_cuda_image_holds_no_torch(cuda_image):
    proc = _in_image(cuda_image, "-c", "import torch", entrypoint="python")
    assert proc.returncode != 0
    assert "No module named 'torch'" in proc.stderr


def test_its_onnxruntime_has_the_cuda_provider_and_its_libraries(cuda_image):
    proc = _in_image(cuda_image, "-c", PROVIDER_LIBRARIES, entrypoint="python")
    assert proc.returncode == 0, proc.stderr
    found = json.loads(proc.stdout.strip().splitlines()[-1])
    assert "CUDAExecutionProvider" in found["providers"]
    assert found["preloaded"] == ["libcublas", "libcudart", "libcudnn"]
    assert found["unresolved"] == ["libcuda.so.1"], found
    pip = _in_image(cuda_image, "-m", "pip", "list", "--format=json", entrypoint="python")
    names = {p["name"].lower() for p in json.loads(pip.stdout)}
    assert "onnxruntime-gpu" in names and "onnxruntime" not in names and "torch" not in names


def test_a_missing_gpu_is_one_line_at_start_up(cuda_image):
    (port,) = _free_ports(1)
    proc = _in_image(cuda_image, "serve", "verifier", "--device", "cuda", "--verifier-addr", f"127.0.0.1:{port}")
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines() == [
        "specdec serve: error: [verifier] device: device 'cuda' does not exist: no CUDA device visible "
        "(no NVIDIA driver library libcuda.so.1, and no CUDA torch)"]


def test_on_the_cpu_it_serves(cuda_image):
    (port,) = _free_ports(1)
    name = f"specdec-cuda-test-{os.getpid()}"
    _run("docker", "run", "-d", "--name", name, "--network", "host", cuda_image,
         "serve", "verifier", "--device", "cpu", "--verifier-addr", f"127.0.0.1:{port}")
    try:
        deadline = time.monotonic() + 180
        while True:
            health = _run("docker", "exec", name, "specdec", "health", "--addr", f"127.0.0.1:{port}", check=False)
            if health.returncode == 0:
                break
            running = _run("docker", "inspect", "-f", "{{.State.Running}}", name).stdout.strip()
            if running != "true" or time.monotonic() > deadline:
                logs = _run("docker", "logs", "--tail", "40", name, check=False)
                raise AssertionError(f"never SERVING:\n{logs.stdout[-4000:]}{logs.stderr[-4000:]}")
            time.sleep(1)
        logs = _run("docker", "logs", name).stdout
        # JSON logs on stdout (beside the bound address, printed for whoever started the server); the
        # serving line says what runs where.
        entries = [json.loads(line) for line in logs.splitlines() if line.startswith("{")]
        serving = [entry for entry in entries if entry.get("event") == "serving"]
        assert [entry["backend"] for entry in serving] == ["onnxruntime-cpu"], logs[-3000:]
    finally:
        _run("docker", "rm", "-f", name, check=False)
    assert not _run("docker", "ps", "-aq", "--filter", f"name={name}").stdout.strip()
