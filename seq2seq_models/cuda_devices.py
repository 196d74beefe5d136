"""How many CUDA devices this process can use, counted without torch where ONNX Runtime runs them.

The CUDA image has no torch (deploy/Dockerfile), so the start-up device check (`ort_runner.require_device`)
asks the CUDA driver itself: `libcuda.so.1` through ctypes, `cuInit(0)` then `cuDeviceGetCount`. That
is the library the NVIDIA driver installs and the NVIDIA container toolkit mounts into containers,
and its count honours CUDA_VISIBLE_DEVICES as every CUDA program's does. Where the driver library is
absent but torch is importable, torch counts (a torch-only deployment keeps working); with neither,
there is no GPU. The torch backends count through torch alone: torch is what must see their GPU.

`cuInit` initialises the driver in this process. A process that then forks without exec cannot use
CUDA in the child; our services start their children with exec (`specdec serve all`), never plain fork.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

DRIVER_LIBRARY = "libcuda.so.1"
CUDA_SUCCESS = 0


@dataclass(frozen=True)
class GpuCount:
    """The CUDA devices visible to this process, and when there are none, why (for the error message)."""

    count: int
    why_none: str = ""


def count_gpus(onnx: bool, driver_library: str = DRIVER_LIBRARY) -> GpuCount:
    """The GPUs a backend can use: for ONNX Runtime (`onnx`) the driver's count, or torch's where the
    driver library cannot be loaded; for torch, torch's count."""
    if not onnx:
        return _torch_count("a CPU-only torch, or no GPU")
    driver = driver_count(driver_library)
    if driver is not None:
        return driver
    return _torch_count(f"no NVIDIA driver library {driver_library}, and no CUDA torch")


def driver_count(library: str = DRIVER_LIBRARY) -> GpuCount | None:
    """The CUDA driver's device count, or None when `library` cannot be loaded. A driver that loads but
    fails to initialise (no device, a driver older than it must be, ...) counts 0, saying which error."""
    try:
        cuda = ctypes.CDLL(library)
    except OSError:
        return None
    status = cuda.cuInit(0)
    if status != CUDA_SUCCESS:
        return GpuCount(0, f"cuInit failed: {_error_name(cuda, status)}")
    count = ctypes.c_int(0)
    status = cuda.cuDeviceGetCount(ctypes.byref(count))
    if status != CUDA_SUCCESS:
        return GpuCount(0, f"cuDeviceGetCount failed: {_error_name(cuda, status)}")
    return GpuCount(count.value, "" if count.value else "the CUDA driver reports 0 devices")


def _torch_count(why_none: str) -> GpuCount:
    try:
        import torch
    except ImportError:
        return GpuCount(0, why_none)
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    return GpuCount(count, "" if count else why_none)


def _error_name(cuda: ctypes.CDLL, status: int) -> str:
    """The CUresult's name (CUDA_ERROR_NO_DEVICE, ...), or its number where the driver cannot say."""
    name = ctypes.c_char_p()
    if cuda.cuGetErrorName(status, ctypes.byref(name)) == CUDA_SUCCESS and name.value:
        return name.value.decode()
    return f"CUresult {status}"
