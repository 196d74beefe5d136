"""The ONNX Runtime half of the batched engines (`seq2seq_models.torch_engine` is the torch half):
encoding a source and one call of the one-row graph on an `OrtRunner`. Imports no torch, so the
ONNX serving path of verifier and drafters runs on an install without it."""

from __future__ import annotations

from typing import Any

import numpy as np

from seq2seq_models.ort_runner import OrtRunner
from seq2seq_models.row_cache import Cross, RowBlock, split_sources


class OrtBatchEngine:
    """A role's graphs on an `OrtRunner`; K/V arrays are float32 numpy on the host."""

    def __init__(self, runner: OrtRunner, eos_id: int) -> None:
        self.runner = runner
        self.eos_id = eos_id

    @property
    def device(self) -> str:
        """"cpu" or "cuda:N": where the graphs run."""
        return self.runner.device

    @staticmethod
    def zeros(shape: tuple[int, ...]) -> np.ndarray:
        return np.zeros(shape, np.float32)

    def encode_batch(self, sources: list[list[int]]) -> list[Cross]:
        """Each source's cross-attention K/V, all in one run of the encoder graph."""
        k, v = self.runner.encode_batch(sources, self.eos_id)
        return split_sources(k, v, sources, np.ascontiguousarray)

    def decode_one(self, block: RowBlock, cross: Cross, processing: bool = False, **feeds: Any) -> tuple[Any, ...]:
        """One row through the one-row graph (`decoder.onnx`): no padding, masks or gather; its past
        is the row's capacity buffer itself (the graph slices it to `past_len`). A lone request is
        the most common batch, and the batched graph's masking and gathers would slow it
        (BENCHMARKS.md, "Model backends: notes"). Returns the block's K/V [L, 1, H, T, hd] and the graph's
        other outputs, as host arrays. `processing`: through the graph with logits processors (the
        verifier's), `feeds` holding them."""
        kv = block.kv
        past = (kv.k[:, None], kv.v[:, None])  # views: [L, 1, H, capacity, hd]
        present_k, present_v, *rest = self.runner.decode(
            past, (cross.k, cross.v), processing, tokens=[block.fed], past_len=block.past_len, **feeds
        )
        start = block.past_len
        return host(present_k)[:, :, :, start:], host(present_v)[:, :, :, start:], *(host(r) for r in rest)


def host(t: Any) -> np.ndarray:
    return t if isinstance(t, np.ndarray) else t.numpy()  # a CUDA runner's OrtValue
