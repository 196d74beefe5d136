"""The small AR drafter on ONNX Runtime: its beam drafts (MJSD) and sampled drafts (speculative
sampling) equal the torch drafter's through rollbacks and appends, MJSD and speculative sampling
through it give the torch drafter's outputs, and the whole drafter runs on ONNX Runtime."""

from __future__ import annotations

import random

import numpy as np
import pytest

from core.sampling import SamplingParams
from decoding.config import DecodingConfig, Mode
from decoding.decode import decode
from drafter_service.onnx_ar import OnnxArDrafter, expand_beams
from seq2seq_models.beam_step import expand_beams as torch_expand_beams
from tests.checks import bundle_and_drafters_fixtures
from tests.zoo import FIRST_WORD
from verifier_service.session import make_verifier

bundle, drafters = bundle_and_drafters_fixtures(seed=11)


def _source(rng: random.Random, vocab: int) -> list[int]:
    return [rng.randrange(FIRST_WORD, vocab) for _ in range(rng.randint(1, 30))]


def test_every_drafter_role_runs_on_onnx_runtime(drafters):
    _, onnx_drafter = drafters
    assert isinstance(onnx_drafter.onnx_ar, OnnxArDrafter)
    assert onnx_drafter.backend == "onnxruntime"
    assert onnx_drafter.backend_name == "onnxruntime-cpu"
    assert drafters[0].backend_name == "torch-cpu"


@pytest.mark.parametrize("seed", range(4))
def test_beam_drafts_match_torch_through_rollbacks_and_appends(bundle, drafters, seed):
    torch_drafter, onnx_drafter = drafters
    rng = random.Random(seed)
    vocab = bundle.config("ar_drafter").vocab_size
    source = _source(rng, vocab)
    torch_session, onnx_session = torch_drafter.open(source), onnx_drafter.open(source)
    output: list[int] = []
    for step in range(10):
        committed = rng.randint(0, len(output))  # any rollback, also to 0
        append = [rng.randrange(FIRST_WORD, vocab) for _ in range(rng.randint(0, 4))]
        args = (committed, append, rng.randint(1, 8), rng.randint(1, 6))  # gamma, beams
        want, got = torch_session.draft_beam(*args), onnx_session.draft_beam(*args)
        assert got.ids == want.ids, (seed, step, args)
        np.testing.assert_allclose(got.cum_logq, want.cum_logq, rtol=1e-4, atol=1e-4)
        output = output[:committed] + append


@pytest.mark.parametrize("seed", range(3))
def test_sampled_drafts_match_torch(bundle, drafters, seed):
    torch_drafter, onnx_drafter = drafters
    rng = random.Random(100 + seed)
    vocab = bundle.config("ar_drafter").vocab_size
    source = _source(rng, vocab)
    torch_session, onnx_session = torch_drafter.open(source, seed=seed), onnx_drafter.open(source, seed=seed)
    output: list[int] = []
    for step in range(8):
        committed = rng.randint(0, len(output))
        append = [rng.randrange(FIRST_WORD, vocab) for _ in range(rng.randint(0, 3))]
        params = SamplingParams(temperature=rng.choice([0.7, 1.0, 1.5]), top_k=rng.choice([0, 5]), top_p=1.0)
        args = (committed, append, rng.randint(1, 6), params)
        want, got = torch_session.draft_sample(*args), onnx_session.draft_sample(*args)
        assert got.ids == want.ids, (seed, step)
        for (g_ids, g_p), (w_ids, w_p) in zip(got.q_rows, want.q_rows, strict=True):
            assert g_ids == w_ids
            np.testing.assert_allclose(g_p, w_p, rtol=1e-4, atol=1e-6)
        output = output[:committed] + append


def test_expand_beams_equals_the_torch_step_ties_included():
    import torch

    rng = np.random.default_rng(0)
    for trial in range(20):
        width, vocab = int(rng.integers(1, 5)), int(rng.integers(3, 9))
        # Rounded values make exact ties; finished beams make -inf ties.
        scores = np.round(rng.normal(size=width), 1)
        logp = np.round(rng.normal(size=(width, vocab)), 1)
        finished = rng.random(width) < 0.3
        want = torch_expand_beams(torch.tensor(scores)[None], torch.tensor(logp)[None],
                                  torch.tensor(finished)[None], width, 0)
        got = expand_beams(scores.copy(), logp.copy(), finished, width, 0)
        for g, w in zip(got, want, strict=True):
            np.testing.assert_array_equal(g, w[0].numpy(), err_msg=str(trial))


@pytest.mark.parametrize("mode", [Mode.MJSD, Mode.SPECULATIVE])
def test_mjsd_and_sampling_outputs_equal_torch(bundle, drafters, mode, tmp_path):
    torch_drafter, onnx_drafter = drafters
    verifier = make_verifier(bundle, "onnxruntime", cache_root=tmp_path)
    rng = random.Random(5)
    vocab = bundle.config("verifier").vocab_size
    config = DecodingConfig(mode=mode, max_new_tokens=24, seed=3)
    for _ in range(4):
        source = _source(rng, vocab)
        want = decode(source, config, verifier, torch_drafter)
        got = decode(source, config, verifier, onnx_drafter)
        assert got.output_ids == want.output_ids
