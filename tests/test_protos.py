"""The specdec.v1 wire contracts (protos/) and their generated Python stubs."""

from __future__ import annotations

import shutil
import subprocess
import sys
from collections.abc import Iterator
from concurrent import futures
from pathlib import Path
from types import ModuleType

import grpc
import pytest

from protos import build
from protos.specdec.v1 import (
    common_pb2,
    drafter_pb2,
    drafter_pb2_grpc,
    gateway_pb2,
    gateway_pb2_grpc,
    verifier_pb2,
    verifier_pb2_grpc,
)

REPO_ROOT = Path(__file__).resolve().parent.parent
PROTO_ROOT = REPO_ROOT / "protos"
MODULES: tuple[ModuleType, ...] = (common_pb2, gateway_pb2, verifier_pb2, drafter_pb2)


# --- the stubs -------------------------------------------------------------------------------


def test_stubs_are_built_and_fresh() -> None:
    assert not build.stubs_are_stale()
    for module in MODULES:
        assert module.DESCRIPTOR.package == "specdec.v1"
        assert module.DESCRIPTOR.name == f"specdec/v1/{module.__name__.rsplit('.', 1)[1][:-4]}.proto"
        assert module.__name__.startswith("protos.specdec.v1.")


def test_generated_imports_resolve_inside_protos_package() -> None:
    for path in (PROTO_ROOT / "specdec" / "v1").glob("*_pb2*.py*"):
        for line in path.read_text().splitlines():
            assert not line.startswith(("from specdec", "import specdec")), f"{path.name}: {line}"


def test_build_check_cli_reports_up_to_date() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "protos.build", "--check"],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_services_match_design() -> None:
    expected = {
        "specdec.v1.GatewayService": {
            "Generate": ("GenerateRequest", "GenerateResponse", False, False),
            "GenerateStream": ("GenerateRequest", "GenerateResponse", False, True),
        },
        "specdec.v1.VerifierService": {
            "Verify": ("VerifyRequest", "VerifyResponse", True, True),
            "GetModelInfo": (
                "VerifierServiceGetModelInfoRequest",
                "VerifierServiceGetModelInfoResponse",
                False,
                False,
            ),
        },
        "specdec.v1.DrafterService": {
            "Draft": ("DraftRequest", "DraftResponse", True, True),
            "GetModelInfo": (
                "DrafterServiceGetModelInfoRequest",
                "DrafterServiceGetModelInfoResponse",
                False,
                False,
            ),
        },
    }
    services = {
        svc.full_name: svc for module in MODULES for svc in module.DESCRIPTOR.services_by_name.values()
    }
    assert set(services) == set(expected)
    for name, methods in expected.items():
        actual = {
            m.name: (m.input_type.name, m.output_type.name, m.client_streaming, m.server_streaming)
            for m in services[name].methods
        }
        assert actual == methods, name


def test_mode_enum() -> None:
    assert [v.name for v in gateway_pb2.Mode.DESCRIPTOR.values] == [
        "MODE_UNSPECIFIED",
        "MODE_AR_GREEDY",
        "MODE_AR_BEAM",
        "MODE_IAD",
        "MODE_GAD",
        "MODE_GAD_PLUS_PLUS",
        "MODE_MJSD",
        "MODE_SPECULATIVE_SAMPLING",
    ]
    assert gateway_pb2.MODE_UNSPECIFIED == 0


# --- DecodingConfig: unset must differ from zero, so every field is `optional` --------------


def test_every_decoding_config_field_has_presence() -> None:
    for field in gateway_pb2.DecodingConfig.DESCRIPTOR.fields:
        assert field.has_presence, f"DecodingConfig.{field.name} must be `optional`"


# --- the stubs over a real channel -----------------------------------------------------------

_INFO = common_pb2.ModelInfo(
    vocab_size=32,
    pad_id=0,
    unk_id=1,
    bos_id=2,
    eos_id=3,
    mask_id=4,
    tokenizer_fingerprint="tok",
    bundle_fingerprint="bundle",
    max_source_len=64,
    max_target_len=64,
    backend="test",
    roles=[common_pb2.MODEL_ROLE_VERIFIER],
    max_draft_len=16,
    max_top_k=8,
)


class _Verifier(verifier_pb2_grpc.VerifierServiceServicer):
    """Echo verifier: top1 at each position is the drafted token + 1."""

    def Verify(
        self, request_iterator: Iterator[verifier_pb2.VerifyRequest], context: grpc.ServicerContext
    ) -> Iterator[verifier_pb2.VerifyResponse]:
        first = next(request_iterator)
        if first.WhichOneof("kind") != "open":
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "first message must be open")
        yield verifier_pb2.VerifyResponse(
            opened=verifier_pb2.VerifyOpened(source_len=len(first.open.source_ids), max_output_len=63)
        )
        committed = 0
        for req in request_iterator:
            committed = req.step.committed_len + len(req.step.append_ids)
            positions = [
                verifier_pb2.Position(top1=d + 1, draft_logprob=-float(i))
                for i, d in enumerate(req.step.draft_ids)
            ]
            positions.append(verifier_pb2.Position(top1=0))
            yield verifier_pb2.VerifyResponse(
                step=verifier_pb2.VerifyStepResult(committed_len=committed, positions=positions)
            )

    def GetModelInfo(
        self, request: verifier_pb2.VerifierServiceGetModelInfoRequest, context: grpc.ServicerContext
    ) -> verifier_pb2.VerifierServiceGetModelInfoResponse:
        return verifier_pb2.VerifierServiceGetModelInfoResponse(model_info=_INFO)


class _Drafter(drafter_pb2_grpc.DrafterServiceServicer):
    def Draft(
        self, request_iterator: Iterator[drafter_pb2.DraftRequest], context: grpc.ServicerContext
    ) -> Iterator[drafter_pb2.DraftResponse]:
        first = next(request_iterator)
        yield drafter_pb2.DraftResponse(opened=drafter_pb2.DraftOpened(source_len=len(first.open.source_ids)))
        for req in request_iterator:
            yield drafter_pb2.DraftResponse(
                result=drafter_pb2.DraftResult(
                    committed_len=req.step.committed_len + len(req.step.append_ids),
                    ids=list(range(req.step.block.k)),
                )
            )


class _Gateway(gateway_pb2_grpc.GatewayServiceServicer):
    def GenerateStream(
        self, request: gateway_pb2.GenerateRequest, context: grpc.ServicerContext
    ) -> Iterator[gateway_pb2.GenerateResponse]:
        for token in request.input_ids:
            yield gateway_pb2.GenerateResponse(output_ids=[token])
        yield gateway_pb2.GenerateResponse(
            final=True,
            stats=gateway_pb2.DecodingStats(iterations=len(request.input_ids), finish_reason="eos"),
        )


@pytest.fixture(scope="module")
def channel() -> Iterator[grpc.Channel]:
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    verifier_pb2_grpc.add_VerifierServiceServicer_to_server(_Verifier(), server)
    drafter_pb2_grpc.add_DrafterServiceServicer_to_server(_Drafter(), server)
    gateway_pb2_grpc.add_GatewayServiceServicer_to_server(_Gateway(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as chan:
            yield chan
    finally:
        server.stop(grace=None)


def test_verify_session_over_grpc(channel: grpc.Channel) -> None:
    stub = verifier_pb2_grpc.VerifierServiceStub(channel)
    requests = [
        verifier_pb2.VerifyRequest(open=verifier_pb2.VerifyOpen(source_ids=[9, 8, 3])),
        verifier_pb2.VerifyRequest(step=verifier_pb2.VerifyStep(committed_len=0, draft_ids=[5, 6], top_k=0)),
        verifier_pb2.VerifyRequest(
            step=verifier_pb2.VerifyStep(committed_len=1, append_ids=[7], draft_ids=[])
        ),
    ]
    responses = list(stub.Verify(iter(requests), timeout=10))
    assert [r.WhichOneof("kind") for r in responses] == ["opened", "step", "step"]
    assert responses[0].opened.source_len == 3
    assert [p.top1 for p in responses[1].step.positions] == [6, 7, 0]
    assert [p.HasField("draft_logprob") for p in responses[1].step.positions] == [True, True, False]
    assert responses[2].step.committed_len == 2
    assert (
        stub.GetModelInfo(verifier_pb2.VerifierServiceGetModelInfoRequest(), timeout=10).model_info == _INFO
    )


def test_verify_rejects_step_first(channel: grpc.Channel) -> None:
    stub = verifier_pb2_grpc.VerifierServiceStub(channel)
    with pytest.raises(grpc.RpcError) as err:
        list(stub.Verify(iter([verifier_pb2.VerifyRequest(step=verifier_pb2.VerifyStep())]), timeout=10))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_draft_session_over_grpc(channel: grpc.Channel) -> None:
    stub = drafter_pb2_grpc.DrafterServiceStub(channel)
    requests = [
        drafter_pb2.DraftRequest(open=drafter_pb2.DraftOpen(source_ids=[9, 3])),
        drafter_pb2.DraftRequest(
            step=drafter_pb2.DraftStep(committed_len=0, block=drafter_pb2.BlockDraft(k=3))
        ),
    ]
    responses = list(stub.Draft(iter(requests), timeout=10))
    assert responses[0].opened.source_len == 2
    assert list(responses[1].result.ids) == [0, 1, 2]


def test_generate_stream_over_grpc(channel: grpc.Channel) -> None:
    stub = gateway_pb2_grpc.GatewayServiceStub(channel)
    chunks = list(stub.GenerateStream(gateway_pb2.GenerateRequest(input_ids=[4, 5, 3]), timeout=10))
    assert [c.final for c in chunks] == [False, False, False, True]
    assert [i for c in chunks for i in c.output_ids] == [4, 5, 3]
    assert chunks[-1].stats.finish_reason == "eos"


# --- the build step --------------------------------------------------------------------------


def test_fix_imports() -> None:
    source = (
        "from google.protobuf import descriptor as _descriptor\n"
        "from specdec.v1 import common_pb2 as specdec_dot_v1_dot_common__pb2\n"
        "import specdec.v1.other_pb2\n"
        "from specdecx import y\n"
    )
    fixed = build.fix_imports(source, {"specdec"}, "protos")
    assert fixed.splitlines() == [
        "from google.protobuf import descriptor as _descriptor",
        "from protos.specdec.v1 import common_pb2 as specdec_dot_v1_dot_common__pb2",
        "import protos.specdec.v1.other_pb2",
        "from specdecx import y",
    ]


def test_generate_and_staleness_in_a_copy(tmp_path: Path) -> None:
    root = tmp_path / "protos"
    (root / "specdec" / "v1").mkdir(parents=True)
    for proto in build.proto_files(PROTO_ROOT):
        shutil.copy(proto, root / proto.relative_to(PROTO_ROOT))
    protos = build.proto_files(root)
    assert len(protos) == 4
    assert build.stubs_are_stale(root)

    assert build.ensure_stubs(root) is True
    outputs = build.expected_outputs(protos)
    assert all(p.is_file() for p in outputs)
    assert not build.stubs_are_stale(root)
    assert build.ensure_stubs(root) is False  # up to date: nothing to do
    assert not list(root.glob(".stubs-build-*"))  # the temporary directory is gone
    assert "from protos.specdec.v1 import common_pb2" in (root / "specdec/v1/verifier_pb2.py").read_text()

    gateway = root / "specdec" / "v1" / "gateway.proto"
    gateway.write_text(gateway.read_text() + "\n// changed\n")
    assert build.stubs_are_stale(root)
    assert build.ensure_stubs(root) is True
    assert not build.stubs_are_stale(root)

    outputs[0].unlink()
    assert build.stubs_are_stale(root)


def test_stale_stubs_that_cannot_be_rebuilt(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    root = tmp_path / "protos"
    (root / "specdec" / "v1").mkdir(parents=True)
    for proto in build.proto_files(PROTO_ROOT):
        shutil.copy(proto, root / proto.relative_to(PROTO_ROOT))
    build.ensure_stubs(root)
    (root / "specdec" / "v1" / build.STAMP_NAME).unlink()  # now stale

    def fail(root: Path = PROTO_ROOT, py_package: str = build.PY_PACKAGE) -> list[Path]:
        raise build.StubBuildError("no grpcio-tools here")

    monkeypatch.setattr(build, "generate_stubs", fail)
    # A complete older set is used, with a warning...
    with pytest.warns(RuntimeWarning, match="out of date"):
        assert build.ensure_stubs(root) is False
    # ...but missing stubs are an error, and so is a forced rebuild.
    with pytest.raises(build.StubBuildError, match="no grpcio-tools"):
        build.ensure_stubs(root, force=True)
    next(root.glob("specdec/v1/*_pb2.py")).unlink()
    with pytest.raises(build.StubBuildError, match="cannot build"):
        build.ensure_stubs(root)


def test_protoc_errors_are_reported(tmp_path: Path) -> None:
    root = tmp_path / "protos"
    (root / "specdec" / "v1").mkdir(parents=True)
    (root / "specdec" / "v1" / "broken.proto").write_text(
        'syntax = "proto3";\npackage specdec.v1;\nmessage {\n'
    )
    with pytest.raises(build.StubBuildError, match="protoc failed"):
        build.ensure_stubs(root)


# --- buf -------------------------------------------------------------------------------------

_BUF = shutil.which("buf")
_needs_buf = pytest.mark.skipif(
    _BUF is None, reason="`buf` is not on PATH (install: npm install -g @bufbuild/buf)"
)


@_needs_buf
def test_buf_lint() -> None:
    assert _BUF is not None
    proc = subprocess.run([_BUF, "lint"], cwd=PROTO_ROOT, capture_output=True, text=True, check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr


@_needs_buf
def test_buf_format() -> None:
    assert _BUF is not None
    proc = subprocess.run(
        [_BUF, "format", "--diff", "--exit-code"], cwd=PROTO_ROOT, capture_output=True, text=True, check=False
    )
    assert proc.returncode == 0, "run `buf format -w` in protos/:\n" + proc.stdout + proc.stderr
