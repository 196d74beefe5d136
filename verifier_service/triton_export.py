"""The Triton Inference Server model repository of a bundle's verifier (`specdec export-triton --out DIR`):

    DIR/<model>/config.pbtxt          Python backend, sequence batcher (oldest), START/END/CORRID
    DIR/<model>/1/model.py            imports verifier_service.triton_model.TritonPythonModel
    DIR/<model>/1/bundle/             the verifier's weights, tokenizer and config.json
    DIR/<model>_onnx_encoder/...      with --onnx: the exported ONNX graphs on Triton's onnxruntime
    DIR/<model>_onnx_decoder/...      backend (config.pbtxt read off the graphs' own inputs/outputs)

The Python-backend model runs on any Triton, CPU or GPU, with specdec, torch and numpy<2 importable
by the backend's interpreter (deploy/triton/setup.sh). The gateway reaches it with
`verifier_url = "triton://HOST:PORT/<model>"` (gateway.peers.triton), and reads the verifier's
ModelInfo (vocabulary, special ids, fingerprints, limits) from the config's `parameters`.

The ONNX models are single forward steps: the caller holds the KV cache (past_k / past_v in,
present_k / present_v out), so they are for GPU images with the onnxruntime backend that want to
drive the cache themselves; the stateful verifier the gateway uses is the Python-backend model.
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path

from core.wire import SPECIAL_ID_FIELDS, source_len_to_wire, target_len_to_wire

DEFAULT_MODEL = "specdec_verifier"
# How long Triton keeps an idle sequence's slot; the model expires its own state sooner
# (session_idle_s), since Triton does not tell the model when a sequence times out.
MAX_SEQUENCE_IDLE_S = 3600
MODEL_PY = '"""Triton Python-backend entry point; the model is verifier_service.triton_model."""\n\n' \
    "from verifier_service.triton_model import TritonPythonModel  # noqa: F401\n"


@dataclass(frozen=True)
class TritonExportOptions:
    model: str = DEFAULT_MODEL
    backend: str = "torch"  # the verifier backend inside the model: torch | onnxruntime
    device: str = "cpu"
    instance_kind: str = "KIND_CPU"  # KIND_GPU on a GPU image
    max_sessions: int = 64
    session_idle_s: float = 300.0
    max_draft_len: int = 128
    threads: int = 1
    onnx: bool = False


def export_triton(bundle_dir: str | Path, out: str | Path, options: TritonExportOptions | None = None) -> Path:
    """Write the model repository into `out` (created; an existing model directory is replaced)."""
    from seq2seq_models.bundle import load_bundle

    options = options or TritonExportOptions()
    bundle_dir, out = Path(bundle_dir), Path(out)
    bundle = load_bundle(bundle_dir, roles=["verifier"])
    model_dir = out / options.model
    if model_dir.exists():
        shutil.rmtree(model_dir)
    version = model_dir / "1"
    (version / "bundle").mkdir(parents=True)
    _copy_verifier_bundle(bundle_dir, version / "bundle")
    (version / "model.py").write_text(MODEL_PY)
    cfg = bundle.verifier.config
    info = {
        "vocab_size": cfg.vocab_size,
        "source_vocab_size": cfg.source_vocab_size if cfg.source_vocab_size != cfg.vocab_size else 0,
        **{name: getattr(cfg, name) for name in SPECIAL_ID_FIELDS},
        "tokenizer_fingerprint": bundle.tokenizer.fingerprint,
        "bundle_fingerprint": bundle.fingerprint,
        "max_source_len": source_len_to_wire(cfg.max_len - 1),
        "max_target_len": target_len_to_wire(cfg.max_len - 1),
        "max_top_k": cfg.vocab_size,
    }
    (model_dir / "config.pbtxt").write_text(verifier_config(options, info))
    if options.onnx:
        export_onnx_models(bundle, out, options.model)
    return model_dir


def verifier_config(options: TritonExportOptions, info: dict[str, object]) -> str:
    """config.pbtxt of the stateful Python-backend verifier."""
    params = {
        **{k: str(v) for k, v in info.items()},
        "backend": options.backend,
        "device": options.device,
        "max_sessions": str(options.max_sessions),
        "session_idle_s": str(options.session_idle_s),
        "max_draft_len": str(options.max_draft_len),
        "threads": str(options.threads),
        "bundle_dir": "bundle",
    }
    inputs = [
        _tensor("SOURCE_IDS", "TYPE_INT64", "[ -1 ]", optional=True),
        _tensor("COMMITTED_LEN", "TYPE_INT64", "[ 1 ]", optional=True),
        _tensor("APPEND_IDS", "TYPE_INT64", "[ -1 ]", optional=True),
        _tensor("DRAFT_IDS", "TYPE_INT64", "[ -1 ]", optional=True),
        _tensor("TOP_K", "TYPE_INT64", "[ 1 ]", optional=True),
        _tensor("GREEDY_STEPS", "TYPE_INT64", "[ 1 ]", optional=True),
    ]
    outputs = [
        _tensor("TOP1", "TYPE_INT64", "[ -1 ]"),
        _tensor("TOPK_IDS", "TYPE_INT64", "[ -1, -1 ]"),
        _tensor("TOPK_LOGPROBS", "TYPE_FP32", "[ -1, -1 ]"),
        _tensor("DRAFT_LOGPROBS", "TYPE_FP32", "[ -1 ]"),
        _tensor("SESSIONS", "TYPE_INT64", "[ 1 ]"),
    ]
    controls = "\n".join(
        f'    {{ name: "{name}" control [ {{ kind: {kind} {value} }} ] }},'
        for name, kind, value in (
            ("START", "CONTROL_SEQUENCE_START", "int32_false_true: [ 0, 1 ]"),
            ("END", "CONTROL_SEQUENCE_END", "int32_false_true: [ 0, 1 ]"),
            ("CORRID", "CONTROL_SEQUENCE_CORRID", "data_type: TYPE_UINT64"),
        )
    ).rstrip(",")
    input_rows, output_rows = ",\n".join(inputs), ",\n".join(outputs)
    parameters = "\n".join(f'parameters {{ key: "{k}" value {{ string_value: "{v}" }} }}' for k, v in params.items())
    return f"""# specdec verifier (specdec export-triton): one sequence = one verifier session.
name: "{options.model}"
backend: "python"
max_batch_size: 0
input [
{input_rows}
]
output [
{output_rows}
]
# oldest: sequences interleave on the instance (direct would serialise them per slot).
sequence_batching {{
  max_sequence_idle_microseconds: {MAX_SEQUENCE_IDLE_S * 1_000_000}
  oldest {{ max_candidate_sequences: {options.max_sessions} }}
  control_input [
{controls}
  ]
}}
instance_group [ {{ count: 1, kind: {options.instance_kind} }} ]
{parameters}
"""


def export_onnx_models(bundle, out: Path, model: str) -> list[Path]:
    """The bundle's ONNX encoder and decoder step under `out`, each with a config.pbtxt for Triton's
    onnxruntime backend, its inputs and outputs read off the graph (names, types, dynamic dims)."""
    from seq2seq_models.onnx_export import DECODER_FILE, ENCODER_FILE, export_model

    export = export_model(bundle.verifier, "verifier", bundle.fingerprint)
    written = []
    for part, file in (("encoder", ENCODER_FILE), ("decoder", DECODER_FILE)):
        name = f"{model}_onnx_{part}"
        directory = out / name
        if directory.exists():
            shutil.rmtree(directory)
        (directory / "1").mkdir(parents=True)
        shutil.copyfile(export.directory / file, directory / "1" / "model.onnx")
        (directory / "config.pbtxt").write_text(onnx_config(name, directory / "1" / "model.onnx"))
        written.append(directory)
    return written


def onnx_config(name: str, graph_path: Path) -> str:
    import onnx

    graph = onnx.load(str(graph_path), load_external_data=False).graph
    types = {
        onnx.TensorProto.FLOAT: "TYPE_FP32", onnx.TensorProto.INT64: "TYPE_INT64",
        onnx.TensorProto.INT32: "TYPE_INT32", onnx.TensorProto.FLOAT16: "TYPE_FP16",
        onnx.TensorProto.BOOL: "TYPE_BOOL",
    }

    def tensors(values) -> str:
        rows = []
        for v in values:
            t = v.type.tensor_type
            dims = [d.dim_value if d.HasField("dim_value") else -1 for d in t.shape.dim]
            # A scalar is dims [ 1 ] with reshape { shape: [] } in Triton.
            shape = f"[ {', '.join(map(str, dims))} ]" if dims else "[ 1 ] reshape: { shape: [ ] }"
            rows.append(f'  {{ name: "{v.name}" data_type: {types[t.elem_type]} dims: {shape} }}')
        return ",\n".join(rows)

    return f"""# Triton onnxruntime backend: one stateless forward; the caller holds the cache.
name: "{name}"
platform: "onnxruntime_onnx"
max_batch_size: 0
input [
{tensors(graph.input)}
]
output [
{tensors(graph.output)}
]
instance_group [ {{ count: 1, kind: KIND_GPU }} ]
"""


def _copy_verifier_bundle(src: Path, dst: Path) -> None:
    import json

    config = json.loads((src / "config.json").read_text())
    shutil.copyfile(src / "config.json", dst / "config.json")
    shutil.copyfile(src / config["tokenizer"]["file"], dst / config["tokenizer"]["file"])
    entry = config["models"]["verifier"]
    shutil.copyfile(src / entry["file"], dst / entry["file"])


def _tensor(name: str, data_type: str, dims: str, optional: bool = False) -> str:
    extra = " optional: true" if optional else ""
    return f'  {{ name: "{name}" data_type: {data_type} dims: {dims}{extra} }}'
