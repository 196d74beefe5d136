"""The torch half of the batched engines: what both models' engines share (encoding a source, zero
K/V arrays, and one call of the batched decoder, `batch_graph.BatchedDecoder`) on eager torch. The
verifier's engines add the output head to a forward, the NAR drafter's the argmax over its mask
rows (`verifier_service.torch_backend`, `drafter_service.torch_nar`). The ONNX Runtime half is
`seq2seq_models.ort_engine`, which imports no torch."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from kernels.attention import EAGER
from seq2seq_models.batch_graph import BatchedDecoder
from seq2seq_models.row_cache import LAYERED, source_feeds
from seq2seq_models.transformer import Seq2SeqTransformer


class TorchBatchEngine:
    """The batched decoder run eagerly in the model's own dtype and device (float64 models make
    batched and one-row results comparable exactly); its pools' arrays are tensors there too
    (`row_cache.Arrays`)."""

    def __init__(self, model: Seq2SeqTransformer) -> None:
        self.model = model
        self.decoder = BatchedDecoder(model, EAGER)
        weight = model.embed.weight
        self._dtype, self._device = weight.dtype, weight.device

    @property
    def device(self) -> str:
        """"cpu" or "cuda:N": where the model runs."""
        return str(self._device)

    # torch's zeros are written as they are made (and a GPU's are real memory): no room beyond a layout.
    lazy = False

    def zeros(self, shape: tuple[int, ...]) -> torch.Tensor:
        return torch.zeros(shape, dtype=self._dtype, device=self._device)


    @torch.no_grad()
    def encode_batch(self, sources: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
        """The sources' cross-attention K [L, B, H, hd, S] (transposed) and V [L, B, H, S, hd], all
        in one encoder run (`row_cache.source_feeds`)."""
        m = self.model
        feeds = source_feeds(sources, m.config.eos_id)
        src = torch.from_numpy(feeds["src"]).to(self._device)
        # Sources of one length need no mask (and a lone one keeps the unmasked kernel it always had).
        mask = None if len({len(s) for s in sources}) == 1 else torch.from_numpy(feeds["src_mask"]).to(self._device)
        ks, vs = m.cross_kv(m.encode(src, mask))
        return torch.stack([k.transpose(-1, -2) for k in ks]).contiguous(), torch.stack(vs)

    def decode(self, feeds: dict[str, Any], names: Sequence[str]) -> tuple[torch.Tensor, Any, Any]:
        """The wanted rows' final states [R, D] and the block K/V, for the inputs `names` of `feeds`
        (each K/V stacked over the layers, handed over as one view per layer)."""
        args = [self.tensor(feeds[name]) for name in names]
        return self.decoder(*(a.unbind(0) if n in LAYERED else a for n, a in zip(names, args, strict=True)))

    def tensor(self, value: Any) -> torch.Tensor:
        return torch.from_numpy(value).to(self._device) if isinstance(value, np.ndarray) else value
