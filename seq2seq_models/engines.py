"""What the batched engines of both models share: encoding a source, zero K/V arrays, and one call of
the batched decoder (`batch_graph.BatchedDecoder`) or of the one-row graph, on eager torch and on
ONNX Runtime. The verifier's engines add the output head to a forward, the NAR drafter's the argmax
over its mask rows (`verifier_service.session`, `verifier_service.onnx_backend`,
`drafter_service.nar_batch`, `drafter_service.onnx_nar`)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from kernels.attention import EAGER
from seq2seq_models.batch_graph import BatchedDecoder
from seq2seq_models.ort_runner import OrtRunner
from seq2seq_models.row_cache import Cross, RowBlock
from seq2seq_models.transformer import Seq2SeqTransformer


class TorchBatchEngine:
    """The batched decoder run eagerly in the model's own dtype and device (float64 models make
    batched and one-row results comparable exactly)."""

    def __init__(self, model: Seq2SeqTransformer) -> None:
        self.model = model
        self.decoder = BatchedDecoder(model, EAGER)
        weight = model.embed.weight
        self._dtype, self._device = weight.dtype, weight.device

    def zeros(self, shape: tuple[int, ...]) -> torch.Tensor:
        return torch.zeros(shape, dtype=self._dtype, device=self._device)

    @torch.no_grad()
    def encode(self, source_ids: list[int]) -> Cross:
        m = self.model
        src = torch.tensor([[*source_ids, m.config.eos_id]], device=self._device)
        ks, vs = m.cross_kv(m.encode(src, None))
        return Cross(torch.stack(ks), torch.stack(vs))

    def decode(self, feeds: dict[str, Any], names: Sequence[str]) -> tuple[torch.Tensor, Any, Any]:
        """The wanted rows' final states [R, D] and the block K/V, for the inputs `names` of `feeds`."""
        return self.decoder(*(self.tensor(feeds[name]) for name in names))

    def tensor(self, value: Any) -> torch.Tensor:
        return torch.from_numpy(value).to(self._device) if isinstance(value, np.ndarray) else value


class OrtBatchEngine:
    """A role's graphs on an `OrtRunner`; K/V arrays are float32 numpy on the host."""

    def __init__(self, runner: OrtRunner, eos_id: int) -> None:
        self.runner = runner
        self.eos_id = eos_id

    @staticmethod
    def zeros(shape: tuple[int, ...]) -> np.ndarray:
        return np.zeros(shape, np.float32)

    def encode(self, source_ids: list[int]) -> Cross:
        k, v = self.runner.encode(source_ids, self.eos_id)
        return Cross(host(k), host(v))

    def decode_one(self, block: RowBlock, cross: Cross, **feeds: Any) -> tuple[Any, ...]:
        """One row through the one-row graph (`decoder.onnx`): no padding, masks or gather; its past
        is the row's capacity buffer itself (the graph slices it to `past_len`). A lone request is
        the most common batch, and the batched graph's masking and gathers cost it 10-25%
        (bench/bench_batch_forward.py). Returns the block's K/V [L, 1, H, T, hd] and the graph's
        other outputs, as host arrays."""
        kv = block.kv
        past = (kv.k[:, None], kv.v[:, None])  # views: [L, 1, H, capacity, hd]
        present_k, present_v, *rest = self.runner.decode(
            past, (cross.k, cross.v), tokens=[block.fed], past_len=block.past_len, **feeds
        )
        start = block.past_len
        return host(present_k)[:, :, :, start:], host(present_v)[:, :, :, start:], *(host(r) for r in rest)


def host(t: Any) -> np.ndarray:
    return t if isinstance(t, np.ndarray) else t.numpy()  # a CUDA runner's OrtValue
