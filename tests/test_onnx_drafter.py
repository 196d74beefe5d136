"""The NAR drafter on ONNX Runtime: its drafts equal the torch drafter's through any sequence of
rollbacks and appends, GAD through it equals greedy (property-tested), exports are cached per role,
and it refuses what the torch drafter refuses, the same way."""

from __future__ import annotations

import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from core.errors import StatusCode
from decoding.config import DecodingConfig, Mode
from decoding.decode import decode
from drafter_service.onnx_nar import OnnxNarDrafter
from drafter_service.session import LocalDrafter, make_drafter
from seq2seq_models.bundle import load_bundle
from seq2seq_models.onnx_export import ensure_export
from tests.checks import assert_gad_equals_greedy_on_random_sources, bundle_and_drafters_fixtures, status_code
from tests.property import examples
from tests.zoo import FIRST_WORD, MAX_LEN, model_pool, random_source
from tests.zoo import sources as zoo_sources
from verifier_service.session import LocalVerifier

bundle, drafters = bundle_and_drafters_fixtures(seed=7)


@pytest.fixture(scope="module")
def zoo_nar(tmp_path_factory) -> dict[int, OnnxNarDrafter]:
    """The zoo trios' NAR drafters on ONNX Runtime (exported from their float64 weights as float32)."""
    root = tmp_path_factory.mktemp("zoo-onnx")
    return {i: OnnxNarDrafter(trio.nar_drafter, cache_root=root) for i, trio in enumerate(model_pool())}


@pytest.mark.parametrize("seed", range(4))
def test_drafts_match_torch_through_rollbacks_and_appends(bundle, drafters, seed):
    torch_drafter, onnx_drafter = drafters
    assert (torch_drafter.backend, onnx_drafter.backend) == ("torch", "onnxruntime")
    rng = random.Random(seed)
    vocab = bundle.nar_drafter.config.vocab_size
    source = [rng.randrange(FIRST_WORD, vocab) for _ in range(rng.randint(1, 40))]
    torch_session, onnx_session = torch_drafter.open(source), onnx_drafter.open(source)
    output: list[int] = []
    for step in range(15):
        # Any rollback (also to 0), 0..4 appended tokens, blocks of 1..16 masks.
        committed = rng.randint(0, len(output))
        append = [rng.randrange(FIRST_WORD, vocab) for _ in range(rng.randint(0, 4))]
        k = rng.randint(1, 16)
        args = (committed, append, k)
        assert onnx_session.draft_block(*args).ids == torch_session.draft_block(*args).ids, (seed, step, args)
        output = output[:committed] + append
    assert onnx_session.cache_bytes > 0


def test_a_draft_past_the_length_limit_is_cut_like_torch(bundle, drafters):
    limit = bundle.nar_drafter.config.max_len - 1
    prefix = [FIRST_WORD] * (limit - 3)
    steps = [((0, prefix, 10), 3), ((limit - 3, [], 10), 3), ((limit - 3, [6, 7, 8], 4), 0), ((limit - 5, [], 2), 2)]
    sessions = [d.open([5, 6]) for d in drafters]
    for args, length in steps:
        want, got = (s.draft_block(*args).ids for s in sessions)
        assert got == want and len(got) == length, args


def test_gad_through_the_onnx_drafter_equals_greedy_on_the_bundle(bundle, drafters):
    _, onnx_drafter = drafters
    assert_gad_equals_greedy_on_random_sources(LocalVerifier(bundle.verifier), onnx_drafter, seed=2, ks=(1, 5, 12))


@settings(max_examples=examples(100), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(trio=st.integers(0, 3), source=zoo_sources(), max_new=st.integers(1, MAX_LEN - 1), k=st.integers(1, 25))
def test_gad_through_the_onnx_drafter_equals_greedy(zoo_nar, trio, source, max_new, k):
    models = model_pool()[trio]
    verifier = LocalVerifier(models.verifier)
    drafter = LocalDrafter(models.drafter_models(), onnx_nar=zoo_nar[trio])
    greedy = decode(source, DecodingConfig(mode=Mode.AR, max_new_tokens=max_new), verifier)
    gad = decode(source, DecodingConfig(mode=Mode.GAD, max_new_tokens=max_new, k=k), verifier, drafter)
    assert gad.output_ids == greedy.output_ids
    assert gad.stats.finish_reason == greedy.stats.finish_reason


def test_the_trained_zoo_drafter_is_accepted_through_onnx(zoo_nar):
    """The property above is only worth something if ONNX drafts are really accepted."""
    import torch

    models = model_pool()[0]
    verifier = LocalVerifier(models.verifier)
    drafter = LocalDrafter(models.drafter_models(), onnx_nar=zoo_nar[0])
    gen = torch.Generator().manual_seed(0)
    accepted, longest = 0, 0
    for _ in range(10):
        config = DecodingConfig(mode=Mode.GAD, k=8, max_new_tokens=40)
        result = decode(random_source(gen, 12), config, verifier, drafter)
        accepted += result.stats.accepted_tokens
        longest = max(longest, len(result.stats.accepted_per_position))
    assert accepted >= 10
    assert longest >= 3


def test_exports_are_cached_per_role(bundle, tmp_path):
    verifier = ensure_export(bundle.verifier, bundle.fingerprint, tmp_path)
    nar = ensure_export(bundle.nar_drafter, bundle.fingerprint, tmp_path, role="nar_drafter")
    assert not nar.reused and nar.directory != verifier.directory
    assert OnnxNarDrafter.from_bundle(bundle, cache_root=tmp_path).export.reused
    assert ensure_export(bundle.verifier, bundle.fingerprint, tmp_path).reused
    ar = ensure_export(bundle.ar_drafter, bundle.fingerprint, tmp_path, role="ar_drafter")
    assert not ar.reused and ar.directory not in (verifier.directory, nar.directory)
    with pytest.raises(ValueError, match="no ONNX export for role"):
        ensure_export(bundle.ar_drafter, bundle.fingerprint, tmp_path, role="encoder")


@pytest.mark.parametrize("backend", ["torch", "onnxruntime"])
def test_status_codes_match_torch(bundle, drafters, backend):
    drafter = drafters[0] if backend == "torch" else drafters[1]
    session = drafter.open([5, 6])
    session.draft_block(0, [7, 8], 3)
    assert status_code(lambda: session.draft_block(3, [], 2)) == StatusCode.FAILED_PRECONDITION
    too_long = [5] * (bundle.nar_drafter.config.max_len)
    assert status_code(lambda: session.draft_block(0, too_long, 1)) == StatusCode.OUT_OF_RANGE
    # After those refusals the session still drafts, from where it was.
    assert len(session.draft_block(2, [], 2).ids) == 2
    assert status_code(lambda: make_drafter(bundle, "tensorrt")) == StatusCode.INVALID_ARGUMENT


def test_a_bundle_loaded_without_drafters_has_no_drafter(bundle):
    assert make_drafter(load_bundle(bundle.path, roles=["verifier"]), "onnxruntime") is None
