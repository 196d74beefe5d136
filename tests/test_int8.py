"""int8 models (precision "int8"): the ONNX graphs with int8 weight matmuls, row-wise activation
scales. Losslessness is against the verifier that runs: IAD and GAD on the int8 verifier equal
greedy on the int8 verifier but at near-ties (see `NEAR_TIE`); batched forwards equal one-row ones;
int8 on torch is a config error."""

from __future__ import annotations

import asyncio
import random

import numpy as np
import onnx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from core.backends import backend_label
from core.interfaces import StepCall
from decoding.config import DecodingConfig, Mode
from decoding.decode import decode
from drafter_service.server import DrafterLimits, DrafterServer
from drafter_service.session import make_drafter
from seq2seq_models.bundle import load_bundle, make_tiny_bundle
from seq2seq_models.onnx_export import (
    BATCH_DECODER_FILE,
    DECODER_FILE,
    ENCODER_FILE,
    PROCESSING_DECODER_FILE,
    STEP_DECODER_FILE,
    ensure_export,
)
from seq2seq_models.onnx_quantize import ensure_int8, quantize_graph
from seq2seq_models.ort_runner import inference_session
from specdec.cli import main as cli_main
from specdec.serve import serve_config
from verifier_service.server import VerifierLimits, VerifierServer
from verifier_service.session import make_verifier

FIRST_WORD = 5
PROPERTY = settings(
    max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture]
)


@pytest.fixture(scope="module")
def bundle(tmp_path_factory):
    return load_bundle(make_tiny_bundle(tmp_path_factory.mktemp("bundle"), seed=5))


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return tmp_path_factory.mktemp("onnx")


@pytest.fixture(scope="module")
def v8(bundle, cache):
    return make_verifier(bundle, "onnxruntime", device="cpu", precision="int8", cache_root=cache)


@pytest.fixture(scope="module")
def v32(bundle, cache):
    return make_verifier(bundle, "onnxruntime", device="cpu", cache_root=cache)


@pytest.fixture(scope="module")
def d8(bundle, cache):
    return make_drafter(bundle, "onnxruntime", device="cpu", precision="int8", cache_root=cache)


@pytest.mark.parametrize("role", ["verifier", "nar_drafter"])
def test_int8_graphs_keep_every_input_and_output(bundle, cache, role):
    fp32 = ensure_export(bundle.models[role], bundle.fingerprint, cache, role=role)
    int8 = ensure_int8(fp32, role)
    assert int8.directory.parent == fp32.directory.parent and f"-{role}-int8-" in int8.directory.name
    assert ensure_int8(fp32, role).reused  # made once, cached
    files = [ENCODER_FILE, DECODER_FILE, BATCH_DECODER_FILE, *([PROCESSING_DECODER_FILE] if role == "verifier" else [])]
    for name in files:
        a, b = onnx.load(str(fp32.directory / name)).graph, onnx.load(str(int8.directory / name)).graph
        assert [(i.name, i.type) for i in a.input] == [(i.name, i.type) for i in b.input], name
        assert [(o.name, o.type.tensor_type.elem_type) for o in a.output] == [
            (o.name, o.type.tensor_type.elem_type) for o in b.output
        ], name
        ops = [n.op_type for n in b.node]
        assert "MatMulIntegerToFloat" in ops, name
        # Every weight matmul went int8: what stays MatMul multiplies two activations (attention).
        weights = {t.name for t in b.initializer}
        assert not [n for n in b.node if n.op_type in ("MatMul", "Gemm") and n.input[1] in weights], name


@pytest.mark.parametrize("name", [STEP_DECODER_FILE, DECODER_FILE])
def test_the_lean_int8_form_gives_the_rows_forms_outputs(bundle, cache, v8, tmp_path, name):
    """The few-row graphs' quantization without reshapes or zero-point tensors (`_lean_quantized`)
    runs fewer ops and computes the very values of the per-row QuantizeLinear form, on the inputs
    real steps feed it."""
    fp32 = ensure_export(bundle.models["verifier"], bundle.fingerprint, cache, role="verifier")
    quantize_graph(fp32.directory / name, tmp_path / "rows.onnx", lean=False)
    quantize_graph(fp32.directory / name, tmp_path / "lean.onnx", lean=True)
    rows, lean = (onnx.load(str(tmp_path / f)).graph for f in ("rows.onnx", "lean.onnx"))
    quantizing = [n.op_type for n in lean.node if "_int8_" in n.output[0]]
    assert len(lean.node) < len(rows.node) and "MatMulIntegerToFloat" in quantizing
    assert not {"Reshape", "Shape", "ConstantOfShape", "Concat"} & set(quantizing)
    runner = v8.engine.runner
    session = runner.step_decoder if name == STEP_DECODER_FILE else runner.decoder
    feeds: list[dict] = []
    run = session.run
    session.run = lambda outputs, inputs, *a: feeds.append(dict(inputs)) or run(outputs, inputs, *a)
    try:
        rng = random.Random(3)
        sessions = [v8.open([rng.randrange(FIRST_WORD, v8.vocab_size) for _ in range(rng.randint(1, 12))])
                    for _ in range(3 if name == STEP_DECODER_FILE else 1)]
        for step in range(3):
            v8.step_batch([(s, StepCall(step, [rng.randrange(FIRST_WORD, v8.vocab_size)], [], 2)) for s in sessions])
    finally:
        del session.run  # the class's own again
    for s in sessions:
        s.close()
    assert feeds
    a, b = (inference_session(tmp_path / f, 1, ["CPUExecutionProvider"]) for f in ("rows.onnx", "lean.onnx"))
    for inputs in feeds:
        for x, y in zip(a.run(None, inputs), b.run(None, inputs), strict=True):
            assert x.dtype == y.dtype and np.array_equal(x, y, equal_nan=x.dtype.kind == "f")


def test_int8_steps_are_close_to_fp32_and_not_the_same(v8, v32):
    # The int8 graphs really run (logprobs differ) and stay near fp32 (the same model, quantized).
    r8 = v8.open([9, 10, 11]).step(0, [12], [13, 14], top_k=5)
    r32 = v32.open([9, 10, 11]).step(0, [12], [13, 14], top_k=5)
    assert r8.topk_logprobs != r32.topk_logprobs
    assert [row[0] for row in r8.topk_logprobs] == pytest.approx([row[0] for row in r32.topk_logprobs], abs=0.2)
    assert all(isinstance(i, int) and 0 <= i < v8.vocab_size for row in r8.topk_ids for i in row)


def test_int8_greedy_gives_valid_ids(v8):
    out = decode([7, 8, 9, 10], DecodingConfig(mode=Mode.AR, max_new_tokens=20), v8).output_ids
    assert out and all(0 <= i < v8.vocab_size for i in out)


# A row's int8 inputs depend on that row alone, but the float32 work between the int8 matmuls does
# not come out bit-identical for a block and for a lone token (attention over a block is one matrix
# product, over one token another: ~1e-7 apart), and where that moves an activation across a rounding
# step of its row's int8 scale, a log-prob moves by up to ~0.02 on this tiny model (seen: source
# [14, 11, 14, 13, 100], GAD k=1, 25 tokens, top-2 gap 0.014 at the last one). So where GAD or IAD
# differs from greedy on the int8 verifier, the first difference must be such a near-tie.
NEAR_TIE = 0.05


@PROPERTY
@given(
    source=st.lists(st.integers(FIRST_WORD, 159), min_size=1, max_size=24),
    k=st.integers(1, 12),
    max_new=st.integers(1, 40),
)
def test_iad_and_gad_on_int8_equal_int8_greedy(v8, d8, source, k, max_new):
    greedy = decode(source, DecodingConfig(mode=Mode.AR, max_new_tokens=max_new), v8).output_ids
    for mode in (Mode.GAD, Mode.IAD):
        got = decode(source, DecodingConfig(mode=mode, k=k, max_new_tokens=max_new), v8, d8).output_ids
        _assert_equal_but_near_ties(v8, source, got, greedy, (mode, k))


def _assert_equal_but_near_ties(verifier, source: list[int], got: list[int], greedy: list[int], context) -> None:
    """`got` equals `greedy`, or their first difference is a near-tie of greedy's step there."""
    if got == greedy:
        return
    pairs = zip(got, greedy, strict=False)
    at = next((i for i, (a, b) in enumerate(pairs) if a != b), min(len(got), len(greedy)))
    gap = _greedy_top2_gap(verifier, source, greedy[:at])
    assert gap < NEAR_TIE, (context, at, gap)


def _greedy_top2_gap(verifier, source: list[int], prefix: list[int]) -> float:
    """The int8 verifier's top-2 log-prob gap for the token after `prefix`, stepped as greedy steps."""
    session = verifier.open(source)
    result = session.step(0, [], [], 2)
    for i, token in enumerate(prefix):
        result = session.step(i, [token], [], 2)
    session.close()
    first, second = result.topk_logprobs[-1][:2]
    return first - second


def test_a_difference_from_int8_greedy_is_a_near_tie(v8, d8):
    """The case the property test found: GAD k=1 parts from int8 greedy at its last token, where
    greedy's top two are 0.014 apart. It may or may not differ on another host's kernels; if it
    does, the difference is that near-tie."""
    source = [14, 11, 14, 13, 100]
    greedy = decode(source, DecodingConfig(mode=Mode.AR, max_new_tokens=25), v8).output_ids
    got = decode(source, DecodingConfig(mode=Mode.GAD, k=1, max_new_tokens=25), v8, d8).output_ids
    _assert_equal_but_near_ties(v8, source, got, greedy, "GAD k=1")


@pytest.mark.parametrize("seed", [0, 1])
def test_batched_int8_steps_equal_one_row_steps(v8, seed):
    rng = random.Random(seed)
    vocab = v8.vocab_size
    sources = [[rng.randrange(FIRST_WORD, vocab) for _ in range(rng.randint(1, 20))] for _ in range(4)]
    batched = [v8.open(s) for s in sources]
    alone = [v8.open(s) for s in sources]
    for _ in range(6):
        calls = []
        for session in batched:
            append = [rng.randrange(FIRST_WORD, vocab) for _ in range(rng.randint(0, 2))]
            draft = [rng.randrange(FIRST_WORD, vocab) for _ in range(rng.randint(1 if not append else 0, 6))]
            calls.append(StepCall(rng.randint(0, len(session.tokens)), append, draft, 3))
        results = v8.step_batch(list(zip(batched, calls, strict=True)))
        for got, session, call in zip(results, alone, calls, strict=True):
            ref = session.step(call.committed_len, call.append_ids, call.draft_ids, call.top_k)
            assert got.top1 == ref.top1 and got.topk_ids == ref.topk_ids
            assert got.batch_rows == len(calls)


def test_model_info_says_int8(bundle, cache, monkeypatch):
    monkeypatch.setenv("SPECDEC_ONNX_CACHE", str(cache))

    async def backends() -> tuple[str, str]:
        # Inside a running loop: a service makes its grpc.aio server when constructed, and the
        # main thread may have no event loop left (another test's asyncio.run closed it).
        verifier = VerifierServer(bundle, VerifierLimits(), "onnxruntime", "cpu", "int8")
        drafter = DrafterServer(bundle, DrafterLimits(), "onnxruntime", "cpu", "int8")
        return verifier.model_info.backend, drafter.model_info.backend

    verifier_backend, drafter_backend = asyncio.run(backends())
    assert verifier_backend == "onnxruntime-cpu-int8"
    assert drafter_backend == "nar_drafter:onnxruntime-cpu-int8,ar_drafter:onnxruntime-cpu"
    assert backend_label("onnxruntime", "cuda:1") == "onnxruntime-cuda:1"


@pytest.mark.parametrize("section", ["verifier", "drafter"])
def test_int8_on_torch_is_a_config_error(section):
    with pytest.raises(ValueError, match=rf"^\[{section}\] precision: precision int8 needs backend onnxruntime"):
        serve_config({section: {"backend": "torch", "precision": "int8"}})
    with pytest.raises(ValueError, match=rf"\[{section}\] precision: must be one of fp32, int8"):
        serve_config({section: {"precision": "int4"}})
    assert serve_config({section: {"precision": "int8"}}).verifier.precision == (
        "int8" if section == "verifier" else "fp32"
    )


def test_make_verifier_and_drafter_refuse_int8_on_torch(bundle):
    with pytest.raises(ValueError, match="needs backend onnxruntime"):
        make_verifier(bundle, "torch", precision="int8")
    with pytest.raises(ValueError, match="needs backend onnxruntime"):
        make_drafter(bundle, "torch", precision="int8")


def test_decode_cli_refuses_int8_on_torch(bundle, capsys):
    assert cli_main(["decode", "--bundle", str(bundle.path), "--backend", "torch", "--precision", "int8"]) == 2
    assert "precision int8 needs backend onnxruntime" in capsys.readouterr().err
