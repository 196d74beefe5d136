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
from google.protobuf import json_format, message_factory
from google.protobuf.descriptor import Descriptor, FieldDescriptor, OneofDescriptor
from google.protobuf.message import Message

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


def _all_messages() -> list[Descriptor]:
    found: list[Descriptor] = []

    def walk(desc: Descriptor) -> None:
        found.append(desc)
        for nested in desc.nested_types:
            walk(nested)

    for module in MODULES:
        for desc in module.DESCRIPTOR.message_types_by_name.values():
            walk(desc)
    return found


ALL_MESSAGES = _all_messages()


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


# --- serialisation ---------------------------------------------------------------------------

_SCALARS: dict[int, object] = {
    FieldDescriptor.TYPE_INT32: 7,
    FieldDescriptor.TYPE_INT64: -(2**40),
    FieldDescriptor.TYPE_UINT32: 2**31 + 3,
    FieldDescriptor.TYPE_UINT64: 2**63 + 5,
    FieldDescriptor.TYPE_FLOAT: -0.25,  # exactly representable in fp32
    FieldDescriptor.TYPE_DOUBLE: 0.1,
    FieldDescriptor.TYPE_BOOL: True,
    FieldDescriptor.TYPE_STRING: "tok ✓",
    FieldDescriptor.TYPE_BYTES: b"\x00\xff",
}


def _real_oneofs(desc: Descriptor) -> list[OneofDescriptor]:
    """The message's oneofs, without the one-member synthetic oneofs of proto3 `optional` fields."""
    return [o for o in desc.oneofs if not (len(o.fields) == 1 and o.name == "_" + o.fields[0].name)]


def _value(field: FieldDescriptor) -> object:
    if field.type == FieldDescriptor.TYPE_ENUM:
        return field.enum_type.values[-1].number
    return _SCALARS[field.type]


def _populate(msg: Message, variant: int, depth: int = 0) -> None:
    """Set every field of ``msg`` (for each real oneof: member ``variant`` modulo its size)."""
    skipped = {
        f.name
        for o in _real_oneofs(msg.DESCRIPTOR)
        for f in o.fields
        if f.name != o.fields[variant % len(o.fields)].name
    }
    for field in msg.DESCRIPTOR.fields:
        if field.name in skipped:
            continue
        if field.type == FieldDescriptor.TYPE_MESSAGE:
            if field.is_repeated:
                for _ in range(2):
                    _populate(getattr(msg, field.name).add(), variant, depth + 1)
            else:
                sub = getattr(msg, field.name)
                sub.SetInParent()
                if depth < 4:
                    _populate(sub, variant, depth + 1)
        elif field.is_repeated:
            getattr(msg, field.name).extend([_value(field), _value(field)])
        else:
            setattr(msg, field.name, _value(field))


def _variants(desc: Descriptor) -> range:
    return range(max((len(o.fields) for o in _real_oneofs(desc)), default=1))


@pytest.mark.parametrize(
    ("desc", "variant"),
    [(d, v) for d in ALL_MESSAGES for v in _variants(d)],
    ids=lambda x: x.name if isinstance(x, Descriptor) else str(x),
)
def test_every_message_round_trips(desc: Descriptor, variant: int) -> None:
    cls = message_factory.GetMessageClass(desc)
    msg = cls()
    _populate(msg, variant)
    data = msg.SerializeToString()
    back = cls.FromString(data)
    assert back == msg
    assert back.ListFields() == msg.ListFields()
    # JSON is what `buf curl` and grpcurl users type.
    assert json_format.Parse(json_format.MessageToJson(msg), cls()) == msg
    # Every field that _populate set is really on the wire.
    expected_set = {f.name for f in desc.fields} - {
        f.name
        for o in _real_oneofs(desc)
        for f in o.fields
        if f.name != o.fields[variant % len(o.fields)].name
    }
    assert {f.name for f, _ in back.ListFields()} == expected_set


def test_verify_step_round_trip() -> None:
    request = verifier_pb2.VerifyRequest(
        step=verifier_pb2.VerifyStep(committed_len=5, append_ids=[17], draft_ids=[8, 9], top_k=3)
    )
    back = verifier_pb2.VerifyRequest.FromString(request.SerializeToString())
    assert back.WhichOneof("kind") == "step"
    assert list(back.step.append_ids) == [17]
    assert list(back.step.draft_ids) == [8, 9]

    positions = [
        verifier_pb2.Position(
            top1=8, topk_ids=[8, 4, 2], topk_logprobs=[-0.5, -1.5, -2.0], draft_logprob=-0.5
        ),
        verifier_pb2.Position(
            top1=3, topk_ids=[3, 9, 1], topk_logprobs=[-0.25, -1.0, -4.0], draft_logprob=-1.0
        ),
        verifier_pb2.Position(top1=5, topk_ids=[5, 6, 7], topk_logprobs=[-0.125, -3.0, -3.5]),  # one past
    ]
    response = verifier_pb2.VerifyResponse(
        step=verifier_pb2.VerifyStepResult(committed_len=6, positions=positions)
    )
    back_resp = verifier_pb2.VerifyResponse.FromString(response.SerializeToString())
    assert back_resp == response
    assert len(back_resp.step.positions) == len(request.step.draft_ids) + 1
    assert [p.HasField("draft_logprob") for p in back_resp.step.positions] == [True, True, False]
    assert back_resp.step.positions[1].draft_logprob == -1.0
    # A draft log-prob of exactly 0.0 (certainty) is still present, not "unset".
    zero = verifier_pb2.Position.FromString(verifier_pb2.Position(draft_logprob=0.0).SerializeToString())
    assert zero.HasField("draft_logprob")


def test_draft_messages_round_trip() -> None:
    open_req = drafter_pb2.DraftRequest(open=drafter_pb2.DraftOpen(source_ids=[5, 6, 3], seed=0))
    back_open = drafter_pb2.DraftRequest.FromString(open_req.SerializeToString())
    assert back_open.open.HasField("seed") and back_open.open.seed == 0
    assert not drafter_pb2.DraftOpen(source_ids=[5]).HasField("seed")

    for kind, payload in [
        ("block", {"block": drafter_pb2.BlockDraft(k=4)}),
        ("beam", {"beam": drafter_pb2.BeamDraft(gamma=5, num_beams=4)}),
        ("sample", {"sample": drafter_pb2.SampleDraft(gamma=3, temperature=0.7, top_k=50, top_p=0.9)}),
    ]:
        req = drafter_pb2.DraftRequest(
            step=drafter_pb2.DraftStep(committed_len=2, append_ids=[11], **payload)
        )
        back = drafter_pb2.DraftRequest.FromString(req.SerializeToString())
        assert back.step.WhichOneof("method") == kind
        assert back == req
    # Warping parameters are double: they arrive exactly as written.
    sample = drafter_pb2.SampleDraft(temperature=0.7, top_p=0.9)
    back_sample = drafter_pb2.SampleDraft.FromString(sample.SerializeToString())
    assert back_sample.temperature == 0.7 and back_sample.top_p == 0.9

    result = drafter_pb2.DraftResponse(
        result=drafter_pb2.DraftResult(
            committed_len=3,
            ids=[4, 8],
            q_rows=[
                drafter_pb2.ProbRow(ids=[4, 2], probs=[0.75, 0.25]),
                drafter_pb2.ProbRow(ids=[8], probs=[1.0]),
            ],
        )
    )
    back_result = drafter_pb2.DraftResponse.FromString(result.SerializeToString())
    assert back_result == result
    assert [list(r.probs) for r in back_result.result.q_rows] == [[0.75, 0.25], [1.0]]


def test_generate_messages_round_trip() -> None:
    req = gateway_pb2.GenerateRequest(
        text="Привіт світ",
        config=gateway_pb2.DecodingConfig(
            mode=gateway_pb2.MODE_GAD_PLUS_PLUS, block_size=5, top_beta=3, tau=2.0
        ),
    )
    assert gateway_pb2.GenerateRequest.FromString(req.SerializeToString()) == req
    # What a `buf curl` user types.
    parsed = json_format.Parse(
        '{"input_ids": [5, 6, 3], "config": {"mode": "MODE_MJSD", "gamma": 4, "mjsd_threshold": 0.3}}',
        gateway_pb2.GenerateRequest(),
    )
    assert list(parsed.input_ids) == [5, 6, 3]
    assert parsed.config.mode == gateway_pb2.MODE_MJSD
    assert parsed.config.HasField("gamma") and not parsed.config.HasField("block_size")

    stats = gateway_pb2.DecodingStats(
        iterations=4,
        drafted_tokens=12,
        accepted_tokens=7,
        accepted_per_position=[4, 2, 1],
        mean_accepted_length=2.75,
        drafter_time_ms=1.5,
        verifier_time_ms=8.25,
        gateway_time_ms=0.5,
        degraded=False,
        finish_reason="eos",
        mode=gateway_pb2.MODE_GAD,
    )
    chunks = [
        gateway_pb2.GenerateResponse(text="При", output_ids=[10, 11]),
        gateway_pb2.GenerateResponse(text="віт", output_ids=[12, 3], final=True, stats=stats),
    ]
    back = [gateway_pb2.GenerateResponse.FromString(c.SerializeToString()) for c in chunks]
    assert back == chunks
    assert [c.final for c in back] == [False, True]
    assert not back[0].HasField("stats") and back[1].HasField("stats")
    assert [i for c in back for i in c.output_ids] == [10, 11, 12, 3]


# --- DecodingConfig: unset differs from zero -------------------------------------------------


def test_every_decoding_config_field_has_presence() -> None:
    for field in gateway_pb2.DecodingConfig.DESCRIPTOR.fields:
        assert field.has_presence, f"DecodingConfig.{field.name} must be `optional`"


@pytest.mark.parametrize("field", [f.name for f in gateway_pb2.DecodingConfig.DESCRIPTOR.fields])
def test_decoding_config_zero_is_not_unset(field: str) -> None:
    unset = gateway_pb2.DecodingConfig()
    assert not unset.HasField(field)
    assert unset.SerializeToString() == b""

    zero = gateway_pb2.DecodingConfig(**{field: 0})
    assert zero.HasField(field)
    data = zero.SerializeToString()
    assert data != b""
    back = gateway_pb2.DecodingConfig.FromString(data)
    assert back.HasField(field) and getattr(back, field) == 0
    assert [f.name for f, _ in back.ListFields()] == [field]
    # JSON keeps the explicit zero too.
    assert json_format.Parse(json_format.MessageToJson(zero), gateway_pb2.DecodingConfig()).HasField(field)

    back.ClearField(field)
    assert not back.HasField(field)


def test_generate_request_without_config() -> None:
    req = gateway_pb2.GenerateRequest.FromString(gateway_pb2.GenerateRequest(text="a").SerializeToString())
    assert not req.HasField("config")
    assert not req.config.HasField("mode")  # reading the default config never marks it set
    assert not req.HasField("config")


def test_oneofs_are_exclusive() -> None:
    req = verifier_pb2.VerifyRequest(open=verifier_pb2.VerifyOpen(source_ids=[1, 2]))
    assert req.WhichOneof("kind") == "open"
    req.step.committed_len = 0
    req.step.SetInParent()
    assert req.WhichOneof("kind") == "step"
    assert not req.HasField("open")
    assert verifier_pb2.VerifyRequest().WhichOneof("kind") is None


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
    # Unimplemented RPCs of the generated base class answer UNIMPLEMENTED.
    with pytest.raises(grpc.RpcError) as err:
        stub.GetModelInfo(drafter_pb2.DrafterServiceGetModelInfoRequest(), timeout=10)
    assert err.value.code() == grpc.StatusCode.UNIMPLEMENTED


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
