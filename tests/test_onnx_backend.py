"""The ONNX Runtime verifier backend: parity with torch, losslessness through it, export caching,
status codes. Runs on the tiny random bundle (fp32, the dtype the graphs are exported in)."""

from __future__ import annotations

import json
import random

import pytest
import torch

from core.errors import StatusCode
from core.interfaces import Draft
from decoding.config import DecodingConfig, Mode
from decoding.decode import decode
from drafter_service.session import LocalDrafter
from seq2seq_models.bundle import load_bundle, make_tiny_bundle
from seq2seq_models.onnx_export import ensure_export
from seq2seq_models.transformer import Seq2SeqTransformer
from specdec.cli import main as cli_main
from tests import zoo
from tests.checks import assert_gad_equals_greedy_on_random_sources, assert_verifier_status_codes, status_code
from verifier_service.onnx_backend import OnnxVerifier
from verifier_service.session import LocalVerifier, make_verifier

FIRST_WORD = 5


@pytest.fixture(scope="module")
def bundle(tmp_path_factory):
    return load_bundle(make_tiny_bundle(tmp_path_factory.mktemp("bundle"), seed=7))


@pytest.fixture(scope="module")
def onnx_verifier(bundle, tmp_path_factory):
    return make_verifier(bundle, "onnxruntime", cache_root=tmp_path_factory.mktemp("onnx"))


def _assert_same(ref, got, where) -> None:
    assert got.top1 == ref.top1, where
    assert got.topk_ids == ref.topk_ids, where
    for a, b in zip(ref.topk_logprobs, got.topk_logprobs, strict=True):
        assert b == pytest.approx(a, abs=1e-4), where
    assert got.draft_logprobs == pytest.approx(ref.draft_logprobs, abs=1e-4), where


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_steps_with_rollbacks_match_torch(bundle, onnx_verifier, seed):
    rng = random.Random(seed)
    vocab = bundle.verifier.config.vocab_size
    source = [rng.randrange(FIRST_WORD, vocab) for _ in range(rng.randint(1, 30))]
    torch_session = LocalVerifier(bundle.verifier).open(source)
    onnx_session = onnx_verifier.open(source)
    held = 0
    for step in range(12):
        # Keep any prefix of what the session holds (rollbacks, also below earlier commits), append
        # 0..2 final tokens and draft so that blocks of 1..10 tokens get scored.
        committed = rng.randint(0, held)
        append = [rng.randrange(FIRST_WORD, vocab) for _ in range(rng.randint(0, 2))]
        block = rng.randint(max(1, len(append)), 10)
        draft = [rng.randrange(FIRST_WORD, vocab) for _ in range(block - len(append))]
        top_k = rng.randint(1, 8)
        args = (committed, append, draft, top_k)
        _assert_same(torch_session.step(*args), onnx_session.step(*args), (seed, step, args))
        assert onnx_session.tokens == torch_session.tokens
        held = len(onnx_session.tokens)


def test_full_vocabulary_top_k_matches_torch(bundle, onnx_verifier):
    # Speculative sampling asks for the whole distribution.
    vocab = onnx_verifier.vocab_size
    ref = LocalVerifier(bundle.verifier).open([9, 10, 11]).step(0, [12], [13, 14], top_k=vocab)
    _assert_same(ref, onnx_verifier.open([9, 10, 11]).step(0, [12], [13, 14], top_k=vocab), "full vocab")


def test_a_model_without_a_bundle_matches_torch(tmp_path):
    # A zoo-shaped model (not from a bundle): exported under its weights' fingerprint.
    torch.manual_seed(11)
    model = Seq2SeqTransformer(zoo.config(d_model=24, layers=2, ffn=48)).eval()
    onnx_session = OnnxVerifier(model, cache_root=tmp_path).open([5, 6, 7, 8])
    torch_session = LocalVerifier(model).open([5, 6, 7, 8])
    for args in ((0, [], [9, 10, 11], 3), (1, [12], [13], 2), (0, [], [], 4), (0, [5, 6, 7], [8] * 7, 5)):
        _assert_same(torch_session.step(*args), onnx_session.step(*args), args)


def test_gad_through_onnx_equals_greedy_through_onnx(bundle, onnx_verifier):
    drafter = LocalDrafter({"nar_drafter": bundle.nar_drafter})
    assert_gad_equals_greedy_on_random_sources(onnx_verifier, drafter, seed=3, ks=(1, 4, 10))


def test_gad_with_partly_right_drafts_equals_greedy(bundle, onnx_verifier):
    # The random NAR drafter is almost never right; this one drafts the torch greedy output with
    # some tokens corrupted, so blocks are accepted partly and the ONNX cache rolls back a lot.
    rng = random.Random(5)
    vocab = onnx_verifier.vocab_size
    for _ in range(3):
        source = [rng.randrange(FIRST_WORD, vocab) for _ in range(rng.randint(3, 20))]
        greedy = decode(source, DecodingConfig(mode=Mode.AR, max_new_tokens=40), onnx_verifier).output_ids
        assert greedy == decode(source, DecodingConfig(mode=Mode.AR, max_new_tokens=40),
                                LocalVerifier(bundle.verifier)).output_ids
        drafter = _OracleDrafter(greedy, vocab, rng.randint(0, 1 << 30))
        gad = decode(source, DecodingConfig(mode=Mode.GAD, k=6, max_new_tokens=40), onnx_verifier, drafter)
        assert gad.output_ids == greedy
        assert gad.stats.accepted_tokens > 0


def test_export_is_cached_by_fingerprint(bundle, tmp_path):
    first = ensure_export(bundle.verifier, bundle.fingerprint, tmp_path)
    assert not first.reused and first.encoder.is_file() and first.decoder.is_file()
    stamp = first.decoder.stat().st_mtime_ns
    again = ensure_export(bundle.verifier, bundle.fingerprint, tmp_path)
    assert again.reused and again.directory == first.directory and again.decoder.stat().st_mtime_ns == stamp
    assert OnnxVerifier.from_bundle(bundle, cache_root=tmp_path).export.reused
    other = ensure_export(bundle.verifier, "f" * 64, tmp_path)
    assert not other.reused and other.directory != first.directory


def test_export_onnx_command(bundle, tmp_path, capsys):
    args = ["export-onnx", "--bundle", str(bundle.path), "--out", str(tmp_path)]
    assert cli_main(args) == 0
    first = json.loads(capsys.readouterr().out)
    assert cli_main(args) == 0
    second = json.loads(capsys.readouterr().out)
    assert first["fingerprint"] == second["fingerprint"] == bundle.fingerprint
    assert set(first["exports"]) == {"verifier", "nar_drafter", "ar_drafter"}
    for role, export in first["exports"].items():
        assert (export["reused"], second["exports"][role]["reused"]) == (False, True)
        assert export["directory"] == second["exports"][role]["directory"]


@pytest.mark.parametrize("backend", ["torch", "onnxruntime"])
def test_status_codes_match_torch(bundle, onnx_verifier, backend):
    verifier = LocalVerifier(bundle.verifier) if backend == "torch" else onnx_verifier
    assert_verifier_status_codes(verifier)
    assert status_code(lambda: make_verifier(bundle, "tensorrt")) == StatusCode.INVALID_ARGUMENT


class _OracleDrafter:
    """Drafts the known greedy output, with each token corrupted with probability 1/4."""

    def __init__(self, target: list[int], vocab_size: int, seed: int) -> None:
        self.vocab_size = vocab_size
        self._target = target
        self._rng = random.Random(seed)

    def open(self, source_ids: list[int], seed: int = 0) -> _OracleDrafter:
        self._prefix: list[int] = []
        return self

    def draft_block(self, committed_len: int, append_ids: list[int], k: int) -> Draft:
        self._prefix = [*self._prefix[:committed_len], *append_ids]
        n = len(self._prefix)
        ids = list(self._target[n : n + k])
        ids = [FIRST_WORD + (t + 1 - FIRST_WORD) % (self.vocab_size - FIRST_WORD) if self._rng.random() < 0.25 else t
               for t in ids]
        return Draft(ids=ids + [self.vocab_size - 1] * (k - len(ids)))

    def close(self) -> None:
        pass


def test_the_step_graph_equals_the_batched_graph(onnx_verifier):
    """One-token blocks run through `decoder_step.onnx`; on the same feeds it gives what the batched
    graph gives (the rows of different pasts and sources, padding masked alike)."""
    import numpy as np

    from core.interfaces import StepCall
    from seq2seq_models.row_cache import per_layer

    rng = random.Random(3)
    vocab = onnx_verifier.vocab_size
    sessions = [onnx_verifier.open([rng.randrange(FIRST_WORD, vocab) for _ in range(rng.randint(1, 20))])
                for _ in range(5)]
    prefixes = [[rng.randrange(FIRST_WORD, vocab) for _ in range(rng.randint(1, 9))] for _ in sessions]
    onnx_verifier.step_batch([(s, StepCall(0, p, [], 1)) for s, p in zip(sessions, prefixes, strict=True)])
    runner = onnx_verifier.engine.runner
    assert runner.step_decoder is not None
    captured: dict = {}
    original = runner.decode_batch
    runner.decode_batch = lambda feeds: captured.update(feeds) or original(feeds)
    try:
        calls = [StepCall(len(p), [rng.randrange(FIRST_WORD, vocab)], [], 4) for p in prefixes]  # AR steps
        onnx_verifier.step_batch(list(zip(sessions, calls, strict=True)))
    finally:
        runner.decode_batch = original
    assert captured["tokens"].shape == (5, 1)
    feeds = per_layer(captured)
    for step, batched in zip(runner.step_decoder.run(None, feeds), runner.batch_decoder.run(None, feeds), strict=True):
        assert step.shape == batched.shape
        if step.dtype.kind == "f":
            np.testing.assert_allclose(step, batched, atol=1e-5, rtol=1e-5)
        else:
            np.testing.assert_array_equal(step, batched)
    for s in sessions:
        s.close()


def test_sessions_keep_the_attention_scale_out_of_the_scores_matmul(onnx_verifier, tmp_path):
    """Sessions run the graphs without ONNX Runtime's MatMulScaleFusion: the attention's scores stay a
    MatMul (a FusedMatMul with the scale folded in is slower: BENCHMARKS.md, "Attention matmuls
    (CPU)"), although the fusion would apply to the exported graphs."""
    import onnx
    import onnxruntime as ort

    from seq2seq_models.ort_runner import inference_session

    export = onnx_verifier.export
    for path in (export.step_decoder, export.batch_decoder, export.encoder):
        ours = tmp_path / f"ours-{path.name}"
        inference_session(path, 1, ["CPUExecutionProvider"], optimized_to=ours)
        assert not [n for n in onnx.load(str(ours)).graph.node if n.op_type == "FusedMatMul"], path.name
    fused = tmp_path / "default.onnx"
    opts = ort.SessionOptions()
    opts.optimized_model_filepath = str(fused)
    ort.InferenceSession(str(export.step_decoder), opts, providers=["CPUExecutionProvider"])
    assert [n for n in onnx.load(str(fused)).graph.node if n.op_type == "FusedMatMul"]  # what it would make
