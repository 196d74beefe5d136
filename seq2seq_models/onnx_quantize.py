"""int8 exports: an fp32 export's graphs (encoder, decoder, decoder_batch) dynamically quantized by
ONNX Runtime, made once and cached beside the fp32 export (`<fingerprint>-<role>-int8-v<format>`).

Dynamic quantization (`onnxruntime.quantization.quantize_dynamic`): the weights of every MatMul and
Gemm whose weight is an initializer are stored as int8 (per tensor, symmetric), and their
activations are quantized to uint8 at run time (DynamicQuantizeLinear -> MatMulInteger). So the
projections, the feed-forward layers and the output head's logits run in int8; the attention's
activation-by-activation products (Q.K, P.V), softmax, layer norms, the embedding lookup and the
fused head's log-softmax / TopK / gathers stay float32, and every graph keeps its inputs and outputs
exactly (names, dtypes: `topk_ids` and `draft_ids` int64, K/V float32), so the backends run an int8
export unchanged. No op type was excluded: every MatMul/Gemm of these graphs quantizes.

Static quantization would need calibration data per bundle; dynamic needs nothing but the graph.
The pre-processing step ORT suggests (symbolic shape inference + graph optimisation) is skipped:
ORT optimises the graph again when a session opens, and these graphs have dynamic shapes.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

from seq2seq_models.onnx_export import (
    BATCH_DECODER_FILE,
    DECODER_FILE,
    ENCODER_FILE,
    EXPORT_FORMAT,
    MANIFEST_FILE,
    OnnxExport,
    export_dir,
)

INT8_OP_TYPES = ("MatMul", "Gemm")
QUANT_FORMAT = 1  # bump when the quantization recipe changes, so stale int8 caches are not reused


def int8_role(role: str) -> str:
    """The cache directory role of `role`'s int8 export, e.g. "verifier-int8"."""
    return f"{role}-int8"


def ensure_int8(export: OnnxExport, role: str, force: bool = False) -> OnnxExport:
    """The int8 twin of the fp32 `export` of `role`, quantized now unless already cached beside it."""
    directory = export_dir(export.directory.parent, export.fingerprint, int8_role(role))
    manifest = directory / MANIFEST_FILE
    if not force and manifest.is_file():
        data = json.loads(manifest.read_text())
        if (data.get("fingerprint") == export.fingerprint and data.get("format") == EXPORT_FORMAT
                and data.get("quant_format") == QUANT_FORMAT):
            return OnnxExport(directory, export.fingerprint, reused=True)
    tmp = directory.with_name(directory.name + f".tmp{os.getpid()}")
    tmp.mkdir(parents=True, exist_ok=True)
    for name in (ENCODER_FILE, DECODER_FILE, BATCH_DECODER_FILE):
        if (export.directory / name).is_file():
            quantize_graph(export.directory / name, tmp / name)
    import onnxruntime

    (tmp / MANIFEST_FILE).write_text(json.dumps({
        "fingerprint": export.fingerprint, "role": role, "format": EXPORT_FORMAT, "precision": "int8",
        "quant_format": QUANT_FORMAT, "source": export.directory.name,
        "quantization": {"method": "dynamic", "weight_type": "QInt8", "op_types": list(INT8_OP_TYPES)},
        "onnxruntime": onnxruntime.__version__,
    }, indent=2) + "\n")
    # Written aside then renamed, as the fp32 export is, so a concurrent reader never sees half of it.
    if directory.exists():
        for f in directory.iterdir():
            f.unlink()
        directory.rmdir()
    try:
        tmp.rename(directory)
    except OSError:  # another process renamed its copy first: use that one
        for f in tmp.iterdir():
            f.unlink()
        tmp.rmdir()
    return OnnxExport(directory, export.fingerprint, reused=False)


def quantize_graph(source: Path, out: Path) -> None:
    """`source` with its weight MatMuls/Gemms in int8, written to `out`."""
    from onnxruntime.quantization import QuantType, quantize_dynamic

    root = logging.getLogger()
    quiet = _DropPreprocessHint()
    root.addFilter(quiet)  # quantize_dynamic logs a pre-processing hint on every call (skipped on purpose)
    try:
        quantize_dynamic(str(source), str(out), op_types_to_quantize=list(INT8_OP_TYPES), weight_type=QuantType.QInt8)
    finally:
        root.removeFilter(quiet)


class _DropPreprocessHint(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return "pre-processing before quantization" not in record.getMessage()
