"""int8 exports: an fp32 export's graphs (encoder, decoder, decoder_batch) with their weight
matrices in int8, made once and cached beside the fp32 export (`<fingerprint>-<role>-int8-v<format>`).

Dynamic int8 with a scale per activation ROW: every MatMul/Gemm by a float weight initializer
(projections, feed-forward layers, the output head) becomes U8S8 `MatMulIntegerToFloat` (ONNX
Runtime's contrib op: the int8 GEMM and the rescaling by the row's and the column's scale in one
kernel) on weights quantized per output column (symmetric int8) and activations quantized at run
time per row (per token: symmetric, scale max|x|/127, rounded to uint8 with zero point 128). A
Gemm's bias stays an Add after it: the op scales its own bias input by the row scales too when those
are per row. Two forms of the same values: graphs of many activation rows (encoder, batched decoder)
quantize by one per-row `QuantizeLinear` over the rows reshaped to two axes; graphs of few rows (the
one-row and one-token step decoders) skip the reshapes and zero-point tensors at the cost of one
more pass over the activations (BENCHMARKS.md, "int8 quantization forms (CPU)").
The attention's activation-by-activation products, softmax, layer norms, the embedding lookup and
the fused head's log-softmax / TopK / gathers stay float32; every graph keeps its inputs and
outputs exactly (names and dtypes: `topk_ids`, `draft_ids` int64; K/V float32), so the backends run
an int8 export unchanged.

Why not `onnxruntime.quantization.quantize_dynamic`: it quantizes activations per TENSOR (one scale
over all the block's rows, DynamicQuantizeLinear), so a position's logits depend on the other
tokens in the same forward: a GAD block of k drafted tokens and a greedy step of one token see the
same position differently, and so do a batch and a lone row. On the tiny bundle, GAD/IAD differed
from greedy on that very verifier in 78 of 120 decodes. With one scale per row, a row's int8
inputs, its exact int32 accumulation and its rescaling depend on that row alone, so IAD/GAD equal
greedy on the int8 verifier and a batched forward equals one-row forwards, but at near-ties: the
float32 work between the int8 matmuls (attention) is ~1e-7 apart for a block and a lone token, and
where that moves an activation across a rounding step of its row's scale, a log-prob moves by up to
~0.02 on the tiny bundle (tests/test_int8.py).

Static quantization would need calibration data per bundle; this needs nothing but the graph.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from seq2seq_models.onnx_cache import (
    BATCH_DECODER_FILE,
    DECODER_FILE,
    ENCODER_FILE,
    EXPORT_FORMAT,
    MANIFEST_FILE,
    PROCESSING_DECODER_FILE,
    STEP_DECODER_FILE,
    OnnxExport,
    export_dir,
)

INT8_OP_TYPES = ("MatMul", "Gemm")
# Graphs whose forwards hold few activation rows (one row's block, or one token for each of a few
# rows): there the per-op cost of the quantization's shape bookkeeping weighs more than a pass over
# the activations, so they take the form without it (`_lean_quantized`).
FEW_ROW_FILES = (DECODER_FILE, PROCESSING_DECODER_FILE, STEP_DECODER_FILE)
QUANT_FORMAT = 5  # bump when the quantization recipe changes, so stale int8 caches are not reused


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
    for name in (ENCODER_FILE, DECODER_FILE, PROCESSING_DECODER_FILE, BATCH_DECODER_FILE, STEP_DECODER_FILE):
        if (export.directory / name).is_file():
            quantize_graph(export.directory / name, tmp / name, lean=name in FEW_ROW_FILES)
    import onnxruntime

    (tmp / MANIFEST_FILE).write_text(json.dumps({
        "fingerprint": export.fingerprint, "role": role, "format": EXPORT_FORMAT, "precision": "int8",
        "quant_format": QUANT_FORMAT, "source": export.directory.name,
        "quantization": {"method": "dynamic, per-row activation scales", "weights": "int8 per column",
                         "op_types": list(INT8_OP_TYPES)},
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


def quantize_graph(source: Path, out: Path, lean: bool = False) -> int:
    """`source` with every MatMul/Gemm by a float weight initializer in row-wise int8 (see the module
    docstring), written to `out`; returns how many nodes were quantized. `lean`: each in the form of
    `_lean_quantized` (the same values, fewer ops), else `_rows_quantized`."""
    import numpy as np
    import onnx
    from onnx import helper, numpy_helper

    model = onnx.load(str(source))
    graph = model.graph
    inits = {t.name: t for t in graph.initializer}
    nodes: list = []
    done = 0
    for node in graph.node:
        weight = _weight_of(node, inits)
        if weight is None:
            nodes.append(node)
            continue
        w = numpy_helper.to_array(inits[node.input[1]]).astype(np.float32)
        if node.op_type == "Gemm" and _attr(node, "transB", 0):
            w = w.T
        w_scale = np.maximum(np.abs(w).max(axis=0), 1e-12) / 127.0  # per output column
        w_q = np.clip(np.round(w / w_scale), -127, 127).astype(np.int8)
        p = f"{node.name or node.output[0]}_int8"
        graph.initializer.extend([
            numpy_helper.from_array(w_q, f"{p}_w"), numpy_helper.from_array(w_scale.astype(np.float32), f"{p}_ws"),
        ])
        bias = node.input[2] if node.op_type == "Gemm" and len(node.input) > 2 and node.input[2] else ""
        y = f"{p}_yb" if bias else node.output[0]
        quantized, extra = (_lean_quantized if lean else _rows_quantized)(p, node.input[0], y, w.shape)
        nodes += quantized
        graph.initializer.extend(extra)
        if bias:
            nodes.append(helper.make_node("Add", [y, bias], [node.output[0]]))
        done += 1
    graph.initializer.extend([
        numpy_helper.from_array(np.array(1 / 127.0, np.float32), "int8_inv127"),
        numpy_helper.from_array(np.array(1e-30, np.float32), "int8_eps"),
        numpy_helper.from_array(np.array(128, np.uint8), "int8_zp128"),
        numpy_helper.from_array(np.array(0, np.int8), "int8_zp0"),
        numpy_helper.from_array(np.array([-1], np.int64), "int8_flat"),
        numpy_helper.from_array(np.array(1.0, np.float32), "int8_one"),
    ])
    del graph.node[:]
    graph.node.extend(nodes)
    used = {i for n in graph.node for i in n.input}
    keep = [t for t in graph.initializer if t.name in used]  # fp32 weights no node reads any more
    del graph.initializer[:]
    graph.initializer.extend(keep)
    if not any(o.domain == "com.microsoft" for o in model.opset_import):
        model.opset_import.append(helper.make_opsetid("com.microsoft", 1))
    onnx.save(model, str(out))
    return done


def _rows_quantized(p: str, x: str, y: str, shape: tuple[int, int]) -> tuple[list, list]:
    """`y = x @ W` for the int8 weight `{p}_w` of `shape` [K, N]: `x`'s rows (whatever its leading
    axes: a [B, T, K] block is B * T rows) quantized by one per-row QuantizeLinear, the product
    reshaped back to `x`'s leading axes. One pass over the activations: the form for large inputs."""
    import numpy as np
    from onnx import helper, numpy_helper

    c = {name: f"{p}_{name}" for name in ("x2", "abs", "amax", "s", "sx", "sflat", "zp", "q", "y2", "shape", "lead",
                                         "yshape")}
    nodes = [
        helper.make_node("Reshape", [x, f"{p}_rows"], [c["x2"]]),
        *_row_scale(c["x2"], c),
        helper.make_node("Reshape", [c["sx"], "int8_flat"], [c["sflat"]]),
        # QuantizeLinear along the rows takes a zero point per row: 128 each (uint8, U8S8).
        helper.make_node("Shape", [c["sflat"]], [c["shape"]]),
        helper.make_node("ConstantOfShape", [c["shape"]], [c["zp"]],
                         value=numpy_helper.from_array(np.array([128], np.uint8))),
        helper.make_node("QuantizeLinear", [c["x2"], c["sflat"], c["zp"]], [c["q"]], axis=0),
        helper.make_node("MatMulIntegerToFloat", [c["q"], f"{p}_w", c["sx"], f"{p}_ws", "int8_zp128", "int8_zp0"],
                         [c["y2"]], domain="com.microsoft"),
        # Back to the input's leading axes with the weight's columns.
        helper.make_node("Shape", [x], [c["lead"]], end=-1),
        helper.make_node("Concat", [c["lead"], f"{p}_n"], [c["yshape"]], axis=0),
        helper.make_node("Reshape", [c["y2"], c["yshape"]], [y]),
    ]
    return nodes, [numpy_helper.from_array(np.array([shape[1]], np.int64), f"{p}_n"),
                   numpy_helper.from_array(np.array([-1, shape[0]], np.int64), f"{p}_rows")]


def _lean_quantized(p: str, x: str, y: str, shape: tuple[int, int]) -> tuple[list, list]:
    """`_rows_quantized` without reshapes or a zero-point tensor: the scales keep `x`'s leading axes
    ([B, T, 1]), which the op's rescaling broadcasts over the output's columns, and `x / scale` is
    rounded around 128 by a QuantizeLinear of scale 1, which gives the same uint8 values. Half the
    ops, one more pass over the activations: the form for graphs of few rows (`FEW_ROW_FILES`)."""
    from onnx import helper

    c = {name: f"{p}_{name}" for name in ("abs", "amax", "s", "sx", "xs", "q")}
    return [
        *_row_scale(x, c),
        helper.make_node("Div", [x, c["sx"]], [c["xs"]]),
        helper.make_node("QuantizeLinear", [c["xs"], "int8_one", "int8_zp128"], [c["q"]]),
        helper.make_node("MatMulIntegerToFloat", [c["q"], f"{p}_w", c["sx"], f"{p}_ws", "int8_zp128", "int8_zp0"],
                         [y], domain="com.microsoft"),
    ], []


def _row_scale(x: str, c: dict[str, str]) -> list:
    """Each row's symmetric scale, max|x| / 127, into `c["sx"]` (keeping the row's axes)."""
    from onnx import helper

    return [
        helper.make_node("Abs", [x], [c["abs"]]),
        helper.make_node("ReduceMax", [c["abs"]], [c["amax"]], axes=[-1], keepdims=1),
        helper.make_node("Mul", [c["amax"], "int8_inv127"], [c["s"]]),
        helper.make_node("Max", [c["s"], "int8_eps"], [c["sx"]]),  # an all-zero row: any scale
    ]


def _weight_of(node, inits):
    """The float weight initializer a MatMul/Gemm multiplies by, when it is one this rewrite handles."""
    from onnx import TensorProto

    if node.op_type not in INT8_OP_TYPES or len(node.input) < 2 or node.input[1] not in inits:
        return None
    t = inits[node.input[1]]
    if t.data_type != TensorProto.FLOAT or len(t.dims) != 2:
        return None
    if node.op_type == "Gemm" and (_attr(node, "transA", 0) or _attr(node, "alpha", 1.0) != 1.0
                                   or _attr(node, "beta", 1.0) != 1.0):
        return None
    return t


def _attr(node, name, default):
    from onnx import helper

    for a in node.attribute:
        if a.name == name:
            return helper.get_attribute_value(a)
    return default
