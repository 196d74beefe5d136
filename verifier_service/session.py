"""The in-process verifier on eager torch: the AR model's KV caches, stepped in ragged batches.

`LocalVerifier` is the torch backend of `verifier_service.batch_session.BatchVerifier`: sessions,
`step_batch` and multi-row (beam) sessions are written once there; this module gives the torch
`Engine`, which runs `seq2seq_models.batch_graph.BatchedDecoder` eagerly in the model's own dtype and
device (float64 models make batched and one-row steps comparable exactly) and the output head of
`kernels.output_head` on the wanted rows. The gRPC servicer hosts the same sessions.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from core.backends import BACKENDS, DEFAULT_PRECISION, check_precision
from core.errors import invalid
from kernels import output_head
from seq2seq_models.batch_graph import BATCH_INPUTS
from seq2seq_models.engines import TorchBatchEngine
from seq2seq_models.torch_threads import set_torch_threads
from seq2seq_models.transformer import Seq2SeqTransformer
from verifier_service.batch_session import BatchSession, BatchVerifier
from verifier_service.model_verifier import ModelVerifier

__all__ = ["LocalVerifier", "ModelVerifier", "TorchEngine", "VerifierSession", "make_verifier"]

VerifierSession = BatchSession  # the session type both backends hand out


class TorchEngine(TorchBatchEngine):
    """The batched decoder and the output head on eager torch (see the module docstring)."""

    def __init__(self, model: Seq2SeqTransformer, head=output_head) -> None:
        super().__init__(model)
        self.head = head

    @torch.no_grad()
    def forward(self, feeds: dict[str, Any], top_k: int) -> tuple[Any, Any, np.ndarray, np.ndarray, np.ndarray]:
        rows, block_k, block_v = self.decode(feeds, BATCH_INPUTS)
        m = self.model
        out = self.head(rows, m.embed.weight, m.out_bias, top_k, self.tensor(feeds["targets"]))
        return (block_k, block_v, out.topk_logprobs.cpu().numpy(), out.topk_ids.cpu().numpy(),
                out.target_logprobs.cpu().numpy())


class LocalVerifier(BatchVerifier):
    """In-process verifier over one AR model (eager torch)."""

    backend = "torch"

    def __init__(self, model: Seq2SeqTransformer, head=output_head) -> None:
        super().__init__(model.config, TorchEngine(model, head))
        self.model = model
        self.head = head
        self.device = str(model.embed.weight.device)  # "cpu" or "cuda:N", for GetModelInfo.backend


def make_verifier(
    bundle, backend: str = "torch", head=output_head, device: str | None = None,
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
    if backend == "torch":
        set_torch_threads(onnx_options.get("intra_op_threads"))
        model = bundle.verifier
        if device is not None:
            from seq2seq_models.ort_runner import resolve_device

            model = model.to(resolve_device(device))
        return LocalVerifier(model, head=head)
    if backend == "onnxruntime":
        from verifier_service.onnx_backend import OnnxVerifier  # onnxruntime is only needed here

        return OnnxVerifier.from_bundle(bundle, device=device, precision=precision, **onnx_options)
    raise invalid(f"unknown verifier backend {backend!r}; expected one of {', '.join(BACKENDS)}")
