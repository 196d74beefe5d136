"""The torch-free GPU count of the ONNX Runtime path (seq2seq_models/cuda_devices.py) and the start-up
errors built on it, on a machine without a GPU.

No NVIDIA driver is installed here, so the driver path is exercised through a stand-in libcuda.so.1
compiled from the C source below: it implements the three driver entry points the count calls, with
the device count and cuInit's result taken from the environment. It is found the way the real one is
(dlopen of "libcuda.so.1", here through LD_LIBRARY_PATH), so `specdec serve` in a child process runs the
same code it would on a GPU host.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from seq2seq_models.bundle import make_tiny_bundle
from seq2seq_models.cuda_devices import GpuCount, count_gpus, driver_count
from seq2seq_models.ort_runner import require_device, resolve_device

STUB_DRIVER = r"""
#include <stdlib.h>
static int env_int(const char *name, int fallback) {
    const char *v = getenv(name);
    return v ? atoi(v) : fallback;
}
int cuInit(unsigned int flags) { return flags ? 1 : env_int("STUB_CUINIT_RESULT", 0); }
int cuDeviceGetCount(int *count) { *count = env_int("STUB_CUDA_DEVICES", 0); return 0; }
int cuGetErrorName(int error, const char **name) {
    if (error == 100) { *name = "CUDA_ERROR_NO_DEVICE"; return 0; }
    return 1;  /* CUDA_ERROR_INVALID_VALUE: a code this stand-in cannot name */
}
"""


def _torch_sees_a_gpu() -> bool:
    import torch

    return torch.cuda.is_available()


@pytest.fixture(scope="module")
def stub_driver_dir(tmp_path_factory) -> Path:
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler to build the stand-in libcuda.so.1")
    out = tmp_path_factory.mktemp("stub-driver")
    (out / "stub.c").write_text(STUB_DRIVER)
    subprocess.run([cc, "-shared", "-fPIC", "-o", str(out / "libcuda.so.1"), str(out / "stub.c")], check=True)
    return out


@pytest.fixture(scope="module")
def bundle_dir(tmp_path_factory) -> Path:
    return make_tiny_bundle(tmp_path_factory.mktemp("bundle"), 5)


def _serve_verifier(bundle: Path, device: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "specdec", "serve", "verifier", "--bundle", str(bundle),
         "--verifier-addr", "127.0.0.1:0", "--device", device],
        capture_output=True, text=True, timeout=120, env={**os.environ, "PYTHONWARNINGS": "ignore", **env},
    )


# ---- without a driver library ------------------------------------------------------------------------


def test_a_driver_library_that_is_not_there_counts_as_none():
    assert driver_count("libcuda-not-installed.so.1") is None


def test_without_driver_or_cuda_torch_there_is_no_gpu_and_it_says_why():
    if _torch_sees_a_gpu():
        pytest.skip("torch sees a GPU here: the fallback would count it")
    assert count_gpus(onnx=True, driver_library="libcuda-not-installed.so.1") == GpuCount(
        0, "no NVIDIA driver library libcuda-not-installed.so.1, and no CUDA torch")
    assert count_gpus(onnx=False) == GpuCount(0, "a CPU-only torch, or no GPU")


def test_the_start_up_error_without_a_driver_is_exact():
    if _torch_sees_a_gpu() or driver_count() is not None:
        pytest.skip("this machine has a CUDA driver or a CUDA torch")
    with pytest.raises(ValueError) as err:
        require_device("cuda:3", onnx=True)
    assert str(err.value) == (
        "device 'cuda:3' does not exist: no CUDA device visible (no NVIDIA driver library libcuda.so.1, "
        "and no CUDA torch)")
    with pytest.raises(ValueError) as err:
        require_device("cuda", onnx=False)
    assert str(err.value) == "device 'cuda' does not exist: no CUDA device visible (a CPU-only torch, or no GPU)"


@pytest.mark.parametrize("device", ["cpu", "auto"])
def test_cpu_and_auto_need_no_gpu(device):
    require_device(device, onnx=True)  # no error: only a named GPU is checked
    if not _torch_sees_a_gpu() and driver_count() is None:
        assert resolve_device(device, onnx=True) == "cpu"


@pytest.mark.parametrize("bad", ["gpu", "cuda:", "cuda:-1", "cuda:1.0", "Cuda:0"])
def test_a_misspelt_device_is_refused_before_counting(bad):
    with pytest.raises(ValueError, match="must be auto"):
        require_device(bad, onnx=True)


# ---- the driver API, through the stand-in library -----------------------------------------------------


def test_the_driver_count_is_read_through_cu_device_get_count(stub_driver_dir, monkeypatch):
    library = str(stub_driver_dir / "libcuda.so.1")
    monkeypatch.setenv("STUB_CUDA_DEVICES", "2")
    assert driver_count(library) == GpuCount(2)
    assert count_gpus(onnx=True, driver_library=library) == GpuCount(2)
    monkeypatch.setenv("STUB_CUDA_DEVICES", "0")
    assert driver_count(library) == GpuCount(0, "the CUDA driver reports 0 devices")


def test_a_driver_that_fails_to_initialise_counts_zero_and_names_the_error(stub_driver_dir, monkeypatch):
    library = str(stub_driver_dir / "libcuda.so.1")
    monkeypatch.setenv("STUB_CUINIT_RESULT", "100")
    assert driver_count(library) == GpuCount(0, "cuInit failed: CUDA_ERROR_NO_DEVICE")
    monkeypatch.setenv("STUB_CUINIT_RESULT", "999")  # a code the library cannot name: its number
    assert driver_count(library) == GpuCount(0, "cuInit failed: CUresult 999")


def test_serve_counts_through_the_driver_and_fails_start_up_in_one_line(stub_driver_dir, bundle_dir):
    """`specdec serve verifier` on the ONNX Runtime backend finds libcuda.so.1 as it would on a GPU host:
    a GPU index past the count, and a driver with no device, are one-line errors (exit 2)."""
    env = {"LD_LIBRARY_PATH": str(stub_driver_dir), "STUB_CUDA_DEVICES": "2"}
    proc = _serve_verifier(bundle_dir, "cuda:3", env)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip().splitlines() == [
        "specdec serve: error: [verifier] device: device 'cuda:3' does not exist: 2 CUDA device(s) visible"]

    proc = _serve_verifier(bundle_dir, "cuda", {**env, "STUB_CUINIT_RESULT": "100"})
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip().splitlines() == [
        "specdec serve: error: [verifier] device: device 'cuda' does not exist: no CUDA device visible "
        "(cuInit failed: CUDA_ERROR_NO_DEVICE)"]


def test_a_counted_gpu_still_needs_the_cuda_provider(stub_driver_dir, bundle_dir):
    """GPU 1 of 2 exists by the driver's count; the CPU onnxruntime installed here has no CUDA provider,
    which is the next one-line error."""
    import onnxruntime as ort

    if "CUDAExecutionProvider" in ort.get_available_providers():
        pytest.skip("onnxruntime-gpu is installed here")
    proc = _serve_verifier(bundle_dir, "cuda:1", {"LD_LIBRARY_PATH": str(stub_driver_dir), "STUB_CUDA_DEVICES": "2"})
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip().splitlines() == [
        "specdec serve: error: [verifier] device: device 'cuda:1' needs onnxruntime-gpu "
        "(the CUDA execution provider is not installed)"]
