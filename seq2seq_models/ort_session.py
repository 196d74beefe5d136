"""ONNX Runtime sessions as every backend of this project opens them (verifier and drafter alike)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any


def inference_session(path: Path, intra_op_threads: int | None, providers: list) -> Any:
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    opts.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    # One step is a chain of small ops: parallelism only pays inside ops, and more threads
    # than cores makes ORT's spinning pool fight the Python thread.
    opts.intra_op_num_threads = intra_op_threads or max(1, min(os.cpu_count() or 1, 8))
    opts.inter_op_num_threads = 1
    # Idle ORT workers would otherwise spin between steps and steal the cores the Python side
    # (accept loop, the other model, torch) needs; a step is long enough that waking them is cheap.
    opts.add_session_config_entry("session.intra_op.allow_spinning", "0")
    opts.log_severity_level = 3
    return ort.InferenceSession(str(path), opts, providers=providers)


def cuda_available() -> bool:
    """onnxruntime-gpu with the CUDA provider, and a GPU torch can see."""
    try:
        import onnxruntime as ort
        import torch
    except ImportError:
        return False
    return "CUDAExecutionProvider" in ort.get_available_providers() and torch.cuda.is_available()
