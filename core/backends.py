"""The model backends the verifier and the NAR drafter run on, and the default one."""

from __future__ import annotations

BACKENDS = ("torch", "onnxruntime")
# ONNX Runtime is the default because it is faster on CPU (README "Model backends", BENCHMARKS.md).
DEFAULT_BACKEND = "onnxruntime"
