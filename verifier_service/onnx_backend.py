"""The verifier on ONNX Runtime: the same `Verifier`/`VerifierSession` contract as the torch backend.

Graphs come from `seq2seq_models.onnx_export` (exported on demand, cached by fingerprint). Sessions,
`step_batch` and multi-row sessions are `verifier_service.batch_session`'s, shared with the torch
backend; this module gives the ONNX Runtime `Engine`: a forward is one call of the ragged batched
decoder (`decoder_batch.onnx`, with the fused head inside), over the rows of every session in the
batch. Each row's K/V live in a host capacity buffer (`seq2seq_models.row_cache.RowKV`): the graph
returns only the block's K/V, which the host appends, and a rollback is a smaller past length.

The graphs run through `seq2seq_models.ort_runner`: the CPU execution provider by default; with
onnxruntime-gpu and a visible GPU the CUDA provider (the batched decoder's K/V cross to the device
on every call there; the caches are host arrays).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from seq2seq_models.onnx_model import OnnxModel
from seq2seq_models.ort_runner import OrtRunner
from seq2seq_models.row_cache import Cross, RowBlock
from seq2seq_models.transformer import Seq2SeqTransformer
from verifier_service.batch_session import BatchSession, BatchVerifier

OnnxVerifierSession = BatchSession  # the session type both backends hand out


class OrtEngine:
    """The batched decoder graph on an `OrtRunner`; K/V arrays are float32 numpy."""

    def __init__(self, runner: OrtRunner, eos_id: int) -> None:
        self.runner = runner
        self.eos_id = eos_id

    @staticmethod
    def zeros(shape: tuple[int, ...]) -> np.ndarray:
        return np.zeros(shape, np.float32)

    def encode(self, source_ids: list[int]) -> Cross:
        k, v = self.runner.encode(source_ids, self.eos_id)
        return Cross(_host(k), _host(v))

    def forward(self, feeds: dict[str, Any], top_k: int) -> tuple[Any, ...]:
        return self.runner.decode_batch({**feeds, "top_k": np.array([top_k], np.int64)})

    def forward_one(self, block: RowBlock, cross: Cross, top_k: int) -> tuple[Any, ...]:
        """A forward of one row through the one-row graph (`decoder.onnx`): no padding, no masks
        and no gather; its past is the row's capacity buffer itself (the graph slices it to
        `past_len`). A lone request (one client) is the most common batch, and the batched graph's
        masking and gathers cost it ~10-25% (bench/bench_batch_forward.py). Same outputs as
        `forward` for a batch of one, with block_k/v [L, 1, H, T, hd]."""
        kv = block.kv
        past = (kv.k[:, None], kv.v[:, None])  # views: [L, 1, H, capacity, hd]
        present_k, present_v, topk_lp, topk_ids, target_lp = self.runner.decode(
            past, (cross.k, cross.v), tokens=[block.fed], past_len=block.past_len,
            head_from=block.head_from, targets=block.targets, top_k=[top_k],
        )
        start = block.past_len
        return _host(present_k)[:, :, :, start:], _host(present_v)[:, :, :, start:], topk_lp, topk_ids, target_lp


class OnnxVerifier(OnnxModel, BatchVerifier):
    """In-process verifier running the exported graphs on ONNX Runtime."""

    role = "verifier"
    default_device = "auto"  # the CUDA provider when onnxruntime-gpu sees a GPU

    def __init__(self, model: Seq2SeqTransformer, **options: Any) -> None:
        """`options`: those of `OnnxModel` (fingerprint, cache_root, device, intra_op_threads,
        precision)."""
        OnnxModel.__init__(self, model, **options)
        BatchVerifier.__init__(self, model.config, OrtEngine(self.runner, model.config.eos_id))


def _host(t: Any) -> np.ndarray:
    return t if isinstance(t, np.ndarray) else t.numpy()  # a CUDA runner's OrtValue
