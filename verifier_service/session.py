"""The in-process verifier on either backend (`make_verifier`), and the session type both hand out.

`LocalVerifier` is the torch backend of `verifier_service.batch_session.BatchVerifier`: sessions,
`step_batch` and multi-row (beam) sessions are written once there; this module gives the torch
`Engine`, which runs `seq2seq_models.batch_graph.BatchedDecoder` eagerly in the model's own dtype and
device (float64 models make batched and one-row steps comparable exactly) and the output head of
`kernels.output_head` on the wanted rows. The gRPC servicer hosts the same sessions.

The torch classes live in `verifier_service.torch_backend` and are imported from here on first use
(`LocalVerifier`, `TorchEngine`): this module imports no torch, so a verifier on ONNX Runtime runs on
an install without it.
"""

from __future__ import annotations

from typing import Any

from core.backends import BACKENDS, DEFAULT_PRECISION, check_backend_installed, check_precision
from core.errors import invalid
from seq2seq_models.torch_threads import set_torch_threads
from verifier_service.batch_session import BatchSession
from verifier_service.model_verifier import ModelVerifier

__all__ = ["ModelVerifier", "VerifierSession", "make_verifier"]  # and LocalVerifier, TorchEngine: see __getattr__

VerifierSession = BatchSession  # the session type both backends hand out


def make_verifier(
    bundle, backend: str = "torch", head=None, device: str | None = None,
    precision: str = DEFAULT_PRECISION, **onnx_options,
):
    """The bundle's verifier on `backend`: "torch" (eager, `LocalVerifier`) or "onnxruntime"
    (`OnnxVerifier`, exported on first use and cached by bundle fingerprint; `onnx_options` go to
    `OnnxVerifier.from_bundle`: cache_root, intra_op_threads; on torch, intra_op_threads is torch's
    process-wide `set_num_threads`). `device` ("auto", "cpu", "cuda",
    "cuda:N"; None keeps each backend's default): where the model runs; a missing GPU is a ValueError.
    `precision` "int8" runs the int8 export (onnxruntime only; on torch a ValueError)."""
    if backend in BACKENDS:
        check_precision(backend, precision)
        check_backend_installed("verifier", backend)
    if backend == "torch":
        set_torch_threads(onnx_options.get("intra_op_threads"))
        from kernels import output_head
        from verifier_service.torch_backend import LocalVerifier

        model = bundle.verifier
        if device is not None:
            from seq2seq_models.ort_runner import resolve_device

            model = model.to(resolve_device(device))
        return LocalVerifier(model, head=head or output_head)
    if backend == "onnxruntime":
        from verifier_service.onnx_backend import OnnxVerifier  # onnxruntime is only needed here

        return OnnxVerifier.from_bundle(bundle, device=device, precision=precision, **onnx_options)
    raise invalid(f"unknown verifier backend {backend!r}; expected one of {', '.join(BACKENDS)}")


def __getattr__(name: str) -> Any:
    """`LocalVerifier` and `TorchEngine`, imported from `verifier_service.torch_backend` (and torch) on
    first use only."""
    if name in ("LocalVerifier", "TorchEngine"):
        from verifier_service import torch_backend

        return getattr(torch_backend, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
