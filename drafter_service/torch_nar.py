"""The NAR drafter's `NarEngine` on eager torch (`drafter_service.nar_batch` holds what both backends
share; kept apart so the ONNX Runtime drafter imports no torch)."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from drafter_service.nar_batch import BatchNarDrafter
from seq2seq_models.batch_graph import NAR_BATCH_INPUTS
from seq2seq_models.torch_engine import TorchBatchEngine
from seq2seq_models.transformer import Seq2SeqTransformer


class TorchNarEngine(TorchBatchEngine):
    """The batched NAR forward on eager torch, in the model's own dtype and device (float64 models
    make batched and one-row drafts comparable exactly)."""

    @torch.no_grad()
    def forward(self, feeds: dict[str, Any]) -> tuple[Any, Any, np.ndarray]:
        rows, block_k, block_v = self.decode(feeds, NAR_BATCH_INPUTS)
        ids = self.model.logits(rows).argmax(-1)  # ties: the lowest id
        return block_k, block_v, ids.cpu().numpy()


def torch_nar_drafter(model: Seq2SeqTransformer) -> BatchNarDrafter:
    """The NAR drafter on eager torch."""
    return BatchNarDrafter(model.config, TorchNarEngine(model))
