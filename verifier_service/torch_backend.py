"""The verifier on eager torch: the AR model's KV caches, stepped in ragged batches (see
`verifier_service.session`, which builds either backend and imports no torch itself)."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from core.logits_processors import Processing
from kernels import output_head, warm_up_head
from seq2seq_models.batch_graph import BATCH_INPUTS
from seq2seq_models.torch_engine import TorchBatchEngine
from seq2seq_models.transformer import Seq2SeqTransformer
from verifier_service.batch_session import BatchVerifier


class TorchEngine(TorchBatchEngine):
    """The batched decoder and the output head on eager torch (see the module docstring)."""

    processes_logits = True  # the head applies the rows' logits processors (kernels.reference)

    def __init__(self, model: Seq2SeqTransformer, head=output_head) -> None:
        super().__init__(model)
        self.head = head

    @torch.no_grad()
    def forward(
        self, feeds: dict[str, Any], top_k: int, processing: Processing | None = None
    ) -> tuple[Any, Any, np.ndarray, np.ndarray, np.ndarray]:
        rows, block_k, block_v = self.decode(feeds, BATCH_INPUTS)
        m = self.model
        targets = self.tensor(feeds["targets"])
        if processing is None:  # a head of another contract (tests pass their own) need not take processors
            out = self.head(rows, m.head_weight, m.out_bias, top_k, targets)
        else:
            out = self.head(rows, m.head_weight, m.out_bias, top_k, targets, processing=processing)
        return (block_k, block_v, out.topk_logprobs.cpu().numpy(), out.topk_ids.cpu().numpy(),
                out.target_logprobs.cpu().numpy())

    def warm_up_head(self, max_rows: int) -> int:
        """Compile the head's GPU kernels for up to `max_rows` rows a forward (`kernels.warm_up_head`;
        0 on the CPU, or when the head is not `output_head`'s automatic choice)."""
        if self.head is not output_head:
            return 0
        return warm_up_head(self.model.head_weight, self.model.out_bias, max_rows)


class LocalVerifier(BatchVerifier):
    """In-process verifier over one AR model (eager torch)."""

    backend = "torch"

    def __init__(self, model: Seq2SeqTransformer, head=output_head) -> None:
        super().__init__(model.config, TorchEngine(model, head))
        self.model = model
        self.head = head
        self.device = str(model.embed.weight.device)  # "cpu" or "cuda:N", for GetModelInfo.backend
        self.warm_up_head = self.engine.warm_up_head
