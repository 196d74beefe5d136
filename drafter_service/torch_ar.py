"""The small AR drafter on eager torch: a `PrefixState` per session, drafts by
`seq2seq_models.drafting` (the ONNX Runtime twin is `drafter_service.onnx_ar`)."""

from __future__ import annotations

import numpy as np

from core.sampling import SamplingParams
from seq2seq_models.drafting import beam_draft, sample_draft
from seq2seq_models.prefix_state import PrefixState
from seq2seq_models.transformer import Seq2SeqTransformer


class TorchArDrafter:
    backend = "torch"

    def __init__(self, model: Seq2SeqTransformer) -> None:
        self.model = model
        self.config = model.config
        self.device = str(model.embed.weight.device)

    @property
    def backend_label(self) -> str:
        return f"torch-{self.device}"

    def open(self, source_ids: list[int]) -> PrefixState:
        return PrefixState(self.model, source_ids)

    def beam(self, row: PrefixState, gamma: int, num_beams: int) -> tuple[list[int], list[float]]:
        return beam_draft(row.model, row.cache, gamma, num_beams)

    def sample(
        self, row: PrefixState, gamma: int, params: SamplingParams, rng: np.random.Generator
    ) -> tuple[list[int], list[np.ndarray]]:
        return sample_draft(row.model, row.cache, gamma, params, rng)
