"""The model backends the verifier and the NAR drafter run on, the default one, and their precisions."""

from __future__ import annotations

BACKENDS = ("torch", "onnxruntime")
# ONNX Runtime is the default because it is faster on CPU (README "Model backends", BENCHMARKS.md).
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
