"""The NAR block drafter on ONNX Runtime: the ONNX `NarEngine` of `drafter_service.nar_batch`.

Graphs come from `seq2seq_models.onnx_export` (role "nar_drafter", exported on demand and cached by
bundle fingerprint). A draft feeds the committed tokens the cache does not hold yet followed by
k [MASK]s, in one call: the committed tokens attend causally, the masks see everything, and the
graph returns the masks' argmax ids. The drafts of concurrent sessions run as one call of the
ragged batched graph (`decoder_batch.onnx`, per-row `mask_from`); a lone draft runs through the
unpadded one-row graph (`decoder.onnx`), whose past is the row's capacity buffer itself (the graph
slices it to `past_len`). Rows, their caches and `draft_rows` are `nar_batch`'s, shared with the
torch backend.

The graphs run through `seq2seq_models.ort_runner`, the verifier's runner; rows' K/V are host
arrays (on the CUDA provider they cross to the device on every call, as the verifier's do).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from drafter_service.nar_batch import BatchNarDrafter, NarRow
from seq2seq_models.onnx_model import OnnxModel
from seq2seq_models.ort_runner import OrtRunner
from seq2seq_models.row_cache import Cross, RowBlock
from seq2seq_models.transformer import Seq2SeqTransformer

OnnxNarState = NarRow  # the per-session state both backends hand out


class OrtNarEngine:
    """The NAR drafter's graphs on an `OrtRunner`; K/V arrays are float32 numpy."""

    def __init__(self, runner: OrtRunner, eos_id: int) -> None:
        self.runner = runner
        self.eos_id = eos_id

    @staticmethod
    def zeros(shape: tuple[int, ...]) -> np.ndarray:
        return np.zeros(shape, np.float32)

    def encode(self, source_ids: list[int]) -> Cross:
        k, v = self.runner.encode(source_ids, self.eos_id)
        return Cross(_host(k), _host(v))

    def forward(self, feeds: dict[str, Any]) -> tuple[Any, ...]:
        feeds = {name: value for name, value in feeds.items() if name != "targets"}
        return self.runner.decode_batch(feeds)

    def forward_one(self, block: RowBlock, cross: Cross, mask_from: int) -> tuple[Any, ...]:
        """One row through the one-row graph: no padding, masks or gather (a lone session is the
        most common batch). Same outputs as `forward` for a batch of one."""
        kv = block.kv
        past = (kv.k[:, None], kv.v[:, None])  # views: [L, 1, H, capacity, hd]
        present_k, present_v, ids = self.runner.decode(
            past, (cross.k, cross.v), tokens=[block.fed], past_len=block.past_len, mask_from=mask_from
        )
        start = block.past_len
        return _host(present_k)[:, :, :, start:], _host(present_v)[:, :, :, start:], _host(ids)


class OnnxNarDrafter(OnnxModel, BatchNarDrafter):
    """The exported NAR drafter; `open` gives the per-source row a `DrafterSession` drafts with."""

    role = "nar_drafter"

    def __init__(self, model: Seq2SeqTransformer, **options: Any) -> None:
        """`options`: those of `OnnxModel` (fingerprint, cache_root, device, intra_op_threads,
        precision)."""
        OnnxModel.__init__(self, model, **options)
        BatchNarDrafter.__init__(self, model.config, OrtNarEngine(self.runner, model.config.eos_id))


def _host(t: Any) -> np.ndarray:
    return t if isinstance(t, np.ndarray) else t.numpy()  # a CUDA runner's OrtValue
