"""`specdec export-triton` and the pieces of the Triton path that run without the Triton binary:
the written config.pbtxt parses as Triton's ModelConfig, the gateway reads the verifier's ModelInfo
from it, the model's sequence table keeps the Verify semantics, and verifier_url is checked."""

from __future__ import annotations

import json

import pytest
from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2

from core.errors import SpecdecError, StatusCode
from gateway.config import GatewayConfig, verifier_of, verifier_target
from gateway.peers.triton import model_info
from specdec.cli import main
from verifier_service.session import make_verifier
from verifier_service.triton_export import TritonExportOptions, export_triton, onnx_config
from verifier_service.triton_model import SequenceTable, TableLimits, result_arrays


def parse(path) -> model_config_pb2.ModelConfig:
    return text_format.Parse(path.read_text(), model_config_pb2.ModelConfig())


def test_export_writes_a_sequence_model_triton_can_parse(bundle_dir, bundle, tmp_path, capsys):
    assert main(["export-triton", "--bundle", str(bundle_dir), "--out", str(tmp_path), "--max-sessions", "7"]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed["model"] == "specdec_verifier"
    model = tmp_path / "specdec_verifier"
    config = parse(model / "config.pbtxt")
    assert config.backend == "python" and config.max_batch_size == 0
    assert config.sequence_batching.HasField("oldest")
    assert config.sequence_batching.max_sequence_idle_microseconds >= 3600 * 10**6
    controls = {c.name: c.control[0].kind for c in config.sequence_batching.control_input}
    kinds = model_config_pb2.ModelSequenceBatching.Control
    assert controls == {
        "START": kinds.CONTROL_SEQUENCE_START, "END": kinds.CONTROL_SEQUENCE_END,
        "CORRID": kinds.CONTROL_SEQUENCE_CORRID,
    }
    assert [i.name for i in config.input] == [
        "SOURCE_IDS", "COMMITTED_LEN", "APPEND_IDS", "DRAFT_IDS", "TOP_K", "GREEDY_STEPS"
    ]
    assert all(i.optional for i in config.input)
    info = model_info(config.parameters, "specdec_verifier")
    cfg = bundle.verifier.config
    assert (info.vocab_size, info.eos_id, info.max_sessions) == (cfg.vocab_size, cfg.eos_id, 7)
    assert info.tokenizer_fingerprint == bundle.tokenizer.fingerprint
    assert "from verifier_service.triton_model import TritonPythonModel" in (model / "1" / "model.py").read_text()
    assert sorted(p.name for p in (model / "1" / "bundle").iterdir()) == [
        "config.json", "tokenizer.model", "verifier.safetensors"
    ]


def test_onnx_configs_follow_the_graphs(bundle_dir, tmp_path):
    export_triton(bundle_dir, tmp_path, TritonExportOptions(model="m", onnx=True))
    decoder = parse(tmp_path / "m_onnx_decoder" / "config.pbtxt")
    assert decoder.platform == "onnxruntime_onnx"
    assert [i.name for i in decoder.input][:2] == ["tokens", "past_len"]
    assert list(decoder.input[1].reshape.shape) == []  # a scalar input
    assert parse(tmp_path / "m_onnx_encoder" / "config.pbtxt").input[0].name == "src"
    assert onnx_config("x", tmp_path / "m_onnx_encoder" / "1" / "model.onnx").startswith("#")


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _table(bundle, clock, max_sessions=2) -> SequenceTable:
    verifier = make_verifier(bundle, "torch")
    limits = TableLimits(max_sessions, 10.0, 16, verifier.max_source_len, verifier.max_target_len, verifier.vocab_size)
    return SequenceTable(verifier, limits, clock)


def test_sequence_table_steps_like_the_native_session(bundle):
    clock = Clock()
    table = _table(bundle, clock)
    native = make_verifier(bundle, "torch").open([5, 6, 7])
    steps = [(0, [], [9, 10], 3), (1, [], [11], 3), (2, [12], [], 0), (0, [], [], 1)]
    for i, step in enumerate(steps):
        got = table.handle(1, start=i == 0, end=False, source=[5, 6, 7] if i == 0 else None, step=step)
        want = native.step(step[0], step[1], step[2], max(step[3], 1))
        assert got.top1 == want.top1 and got.topk_ids == want.topk_ids
    arrays = result_arrays(got, len(table.sessions))
    assert arrays["TOP1"].tolist() == got.top1 and arrays["SESSIONS"].tolist() == [1]
    assert table.handle(1, start=False, end=True, source=None, step=None) is None
    assert not table.sessions


def test_sequence_table_runs_greedy_steps_like_the_native_session(bundle):
    """GREEDY_STEPS: a run of plain AR steps answered once, as VerifyStep.greedy_steps; with a
    draft it is INVALID_ARGUMENT."""
    table = _table(bundle, Clock())
    native = make_verifier(bundle, "torch").open([5, 6, 7])
    got = table.handle(2, start=True, end=False, source=[5, 6, 7], step=(0, [], [], 2, 6))
    want = native.step_greedy(0, [], 6, 2)
    assert got.top1 == want.top1 and got.topk_ids == want.topk_ids and 1 <= len(got.top1) <= 6
    arrays = result_arrays(got, len(table.sessions))
    assert arrays["TOPK_IDS"].shape == (len(got.top1), 2)
    with pytest.raises(SpecdecError) as err:
        table.handle(2, start=False, end=True, source=None, step=(0, [], [9], 1, 3))
    assert err.value.code == StatusCode.INVALID_ARGUMENT
    assert not table.sessions


def test_sequence_table_errors_capacity_and_expiry(bundle):
    clock = Clock()
    table = _table(bundle, clock)
    with pytest.raises(SpecdecError) as info:
        table.handle(1, True, False, None, None)
    assert info.value.code == StatusCode.INVALID_ARGUMENT and not table.sessions
    with pytest.raises(SpecdecError) as info:
        table.handle(1, True, False, [5], (4, [], [], 1))
    assert info.value.code == StatusCode.FAILED_PRECONDITION and not table.sessions  # a failed start leaves nothing
    table.handle(1, True, False, [5], None)
    table.handle(2, True, False, [6], None)
    with pytest.raises(SpecdecError) as info:
        table.handle(3, True, False, [7], None)
    assert info.value.code == StatusCode.RESOURCE_EXHAUSTED
    clock.now = 11.0  # both idle past session_idle_s: expired on the next request
    with pytest.raises(SpecdecError) as info:
        table.handle(1, False, False, None, (0, [], [], 1))
    assert info.value.code == StatusCode.FAILED_PRECONDITION and "expired" in info.value.message
    assert not table.sessions
    assert table.handle(2, False, True, None, None) is None  # END of an expired sequence: quiet


def test_verifier_url():
    assert verifier_target("triton://127.0.0.1:8001/specdec_verifier").model == "specdec_verifier"
    assert verifier_target("grpc://127.0.0.1:50052").kind == "grpc"
    assert verifier_of(GatewayConfig()).address == GatewayConfig().verifier_address  # the default stays native
    assert verifier_of(GatewayConfig(verifier_url="triton://h:1/m")).kind == "triton"
    for bad in ("127.0.0.1:8001", "http://h:1/m", "triton://h:1", "triton://h/m", "grpc://h:1/m", "triton://h:x/m"):
        with pytest.raises(ValueError, match=r"\[gateway\] verifier_url"):
            GatewayConfig(verifier_url=bad)
