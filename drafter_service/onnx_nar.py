"""The NAR block drafter on ONNX Runtime: the ONNX `NarEngine` of `drafter_service.nar_batch`.

Graphs come from `seq2seq_models.onnx_export` (role "nar_drafter", exported on demand and cached by
bundle fingerprint). A draft feeds the committed tokens the cache does not hold yet followed by
k [MASK]s, in one call: the committed tokens attend causally, the masks see everything, and the
graph returns the masks' argmax ids. The drafts of concurrent sessions run as one call of the
ragged batched graph (`decoder_batch.onnx`, per-row `mask_from`); a lone draft runs through the
unpadded one-row graph (`decoder.onnx`), whose past and source are the row's slot of the drafter's
pool as it is (the graph masks them to `past_len` and `src_len`). Rows, their caches and
`draft_rows` are `nar_batch`'s, shared with the torch backend.

The graphs run through `seq2seq_models.ort_runner`, the verifier's runner; rows' K/V are host
arrays (on the CUDA provider they cross to the device on every call, as the verifier's do).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from drafter_service.nar_batch import BatchNarDrafter, NarRow
from seq2seq_models.onnx_model import OnnxModel
from seq2seq_models.ort_engine import OrtBatchEngine
from seq2seq_models.row_cache import RowBlock

if TYPE_CHECKING:
    from seq2seq_models.transformer import Seq2SeqTransformer

OnnxNarState = NarRow  # the per-session state both backends hand out


class OrtNarEngine(OrtBatchEngine):
    """The NAR drafter's graphs: the batched decoder, and the one-row graph for a lone row."""

    def forward(self, feeds: dict[str, Any]) -> tuple[Any, ...]:
        feeds = {name: value for name, value in feeds.items() if name != "targets"}
        return self.runner.decode_batch(feeds)

    def forward_one(self, block: RowBlock, mask_from: int) -> tuple[Any, ...]:
        """`forward` for a batch of one row, unpadded (`OrtBatchEngine.decode_one`)."""
        return self.decode_one(block, mask_from=mask_from)


class OnnxNarDrafter(OnnxModel, BatchNarDrafter):
    """The exported NAR drafter; `open` gives the per-source row a `DrafterSession` drafts with."""

    role = "nar_drafter"

    def __init__(self, model: Seq2SeqTransformer | None = None, **options: Any) -> None:
        """`options`: those of `OnnxModel` (fingerprint, cache_root, device, intra_op_threads,
        precision; or config and load instead of `model`)."""
        OnnxModel.__init__(self, model, **options)
        BatchNarDrafter.__init__(self, self.config, OrtNarEngine(self.runner, self.config.eos_id))
