"""The verifier on ONNX Runtime: the same `Verifier`/`VerifierSession` contract as the torch backend.

Graphs come from `seq2seq_models.onnx_export` (exported on demand, cached by fingerprint). Sessions,
`step_batch` and multi-row sessions are `verifier_service.batch_session`'s, shared with the torch
backend; this module gives the ONNX Runtime `Engine`: a forward is one call of the ragged batched
decoder (`decoder_batch.onnx`, with the fused head inside), over the rows of every session in the
batch. The rows' K/V live in the verifier's host pool (`seq2seq_models.row_cache.KVPool`): the graph
returns only the block's K/V, which the host appends, and a rollback is a smaller past length.

The graphs run through `seq2seq_models.ort_runner`: the CPU execution provider by default; with
onnxruntime-gpu and a visible GPU the CUDA provider (the batched decoder's K/V cross to the device
on every call there; the caches are host arrays).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from core.logits_processors import LOGIT_PROCESSING_INPUTS, Processing, processing_feeds
from seq2seq_models.onnx_model import OnnxModel
from seq2seq_models.ort_engine import OrtBatchEngine
from seq2seq_models.row_cache import RowBlock
from verifier_service.batch_session import BatchSession, BatchVerifier

if TYPE_CHECKING:
    from seq2seq_models.transformer import Seq2SeqTransformer

OnnxVerifierSession = BatchSession  # the session type both backends hand out


class OrtEngine(OrtBatchEngine):
    """The verifier's graphs: the batched decoder with the fused head, and the one-row graph for a lone
    row; both heads apply the rows' logits processors (the one-row graph's, logit-space rows only)."""

    processes_logits = True  # the batched graph's head applies them (kernels.graph_head)

    def forward(self, feeds: dict[str, Any], top_k: int, processing: Processing | None = None) -> tuple[Any, ...]:
        rows = len(feeds["targets"])
        return self.runner.decode_batch({**feeds, "top_k": np.array([top_k], np.int64),
                                         **processing_feeds(processing, rows)})

    def forward_one(self, block: RowBlock, top_k: int, processing: Processing | None = None) -> tuple[Any, ...]:
        """`forward` for a batch of one row, unpadded (`OrtBatchEngine.decode_one`): with logits
        processors through the one-row graph that takes them."""
        feeds = {} if processing is None else processing_feeds(processing, len(block.targets), LOGIT_PROCESSING_INPUTS)
        return self.decode_one(block, processing is not None, head_from=block.head_from, targets=block.targets,
                               top_k=[top_k], **feeds)


class OnnxVerifier(OnnxModel, BatchVerifier):
    """In-process verifier running the exported graphs on ONNX Runtime."""

    role = "verifier"
    default_device = "auto"  # the CUDA provider when onnxruntime-gpu sees a GPU

    def __init__(self, model: Seq2SeqTransformer | None = None, **options: Any) -> None:
        """`options`: those of `OnnxModel` (fingerprint, cache_root, device, intra_op_threads,
        precision; or config and load instead of `model`)."""
        OnnxModel.__init__(self, model, **options)
        BatchVerifier.__init__(self, self.config, OrtEngine(self.runner, self.config.eos_id))
