"""The ONNX Runtime half of the batched engines (`seq2seq_models.torch_engine` is the torch half):
encoding sources and one call of the one-row graph over a pool slot on an `OrtRunner`. Imports no
torch, so the ONNX serving path of verifier and drafters runs on an install without it."""

from __future__ import annotations

from typing import Any

import numpy as np

from seq2seq_models.ort_runner import OrtRunner
from seq2seq_models.row_cache import NumpyArrays, RowBlock


class OrtBatchEngine(NumpyArrays):
    """A role's graphs on an `OrtRunner`; K/V arrays are float32 numpy on the host."""

    def __init__(self, runner: OrtRunner, eos_id: int) -> None:
        self.runner = runner
        self.eos_id = eos_id

    @property
    def device(self) -> str:
        """"cpu" or "cuda:N": where the graphs run."""
        return self.runner.device

    def encode_batch(self, sources: list[list[int]]) -> tuple[np.ndarray, np.ndarray]:
        """The sources' cross-attention keys [L, B, H, hd, S] (transposed, `kernels.attention.KeysT`)
        and values [L, B, H, S, hd], all in one run of the encoder graph."""
        return self.runner.encode_batch(sources, self.eos_id)

    def decode_one(self, block: RowBlock, processing: bool = False, **feeds: Any) -> tuple[Any, ...]:
        """One row through the one-row graph (`decoder.onnx`): no padding, masks or gather; its past
        and source are the row's slot of its pool as it is (the graph masks them to `past_len` and
        `src_len`). A lone request is the most common batch, and the batched graph's masking would
        slow it (BENCHMARKS.md, "Model backends: notes"). Returns the block's keys [L, 1, H, hd, T],
        values [L, 1, H, T, hd] and the graph's other outputs, as host arrays. `processing`: through
        the graph with logits processors (the verifier's), `feeds` holding them."""
        slot = block.slot
        pool, i = slot.pool, slot.index
        return self.runner.decode_row({
            "tokens": [block.fed], "past_len": block.past_len,
            "past_k": pool.k[:, i : i + 1], "past_v": pool.v[:, i : i + 1],
            "cross_k": pool.ck[:, i : i + 1], "cross_v": pool.cv[:, i : i + 1], "src_len": slot.src_len,
            **feeds,
        }, processing)
