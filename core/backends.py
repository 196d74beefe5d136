"""The model backends the verifier and the drafters run on, the default one, and their precisions."""

from __future__ import annotations

import importlib

BACKENDS = ("torch", "onnxruntime")
# ONNX Runtime is the default because it is faster than torch eager on the CPU (BENCHMARKS.md,
# "Verifier backends (CPU)").
DEFAULT_BACKEND = "onnxruntime"
# "int8": ONNX Runtime dynamic quantization of the exported graphs (seq2seq_models.onnx_quantize).
PRECISIONS = ("fp32", "int8")
DEFAULT_PRECISION = "fp32"


def check_precision(backend: str, precision: str) -> None:
    """A one-line ValueError when `precision` cannot run on `backend`: int8 exists only as quantized
    ONNX graphs, so it needs the onnxruntime backend."""
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {', '.join(PRECISIONS)}; got {precision!r}")
    if precision != DEFAULT_PRECISION and backend != "onnxruntime":
        raise ValueError(f"precision {precision} needs backend onnxruntime (the {backend} backend runs fp32 only)")


def backend_label(backend: str, device: str, precision: str = DEFAULT_PRECISION) -> str:
    """What GetModelInfo.backend says: "torch-cpu", "onnxruntime-cuda:1", "onnxruntime-cpu-int8"."""
    label = f"{backend}-{device}"
    return label if precision == DEFAULT_PRECISION else f"{label}-{precision}"


# The package each backend imports, and how to get it (the runtime image installs no torch).
BACKEND_PACKAGES = {
    "torch": ("torch", "pip install \"specdec[torch]\" (torch==2.13.0; or the image's build stage), or set backend = "
              "\"onnxruntime\""),
    "onnxruntime": ("onnxruntime", "pip install onnxruntime (onnxruntime-gpu for CUDA)"),
}


def check_backend_installed(section: str, backend: str) -> None:
    """A one-line ValueError naming `[section] backend` and how to get it when its package is not
    installed here, so a service refuses to start with that line instead of an ImportError trace."""
    package, how = BACKEND_PACKAGES.get(backend, (None, ""))
    if package is None:
        return
    try:  # imported, not only looked up: the backend imports it next anyway, and a broken install counts
        importlib.import_module(package)
    except ImportError:
        missing = f"[{section}] backend = {backend!r} needs {package}, which is not installed here: {how}"
        raise ValueError(missing) from None
