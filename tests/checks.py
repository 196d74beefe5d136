"""Assertions more than one test file makes, against any verifier or drafter implementation, the
implementations they compare, and a seeded random load model for adaptive requests."""

from __future__ import annotations

import random

import pytest

from core.errors import SpecdecError, StatusCode
from decoding.config import DecodingConfig, Mode
from decoding.decode import decode
from decoding.policies.adaptive import LoadModel
from drafter_service.session import LocalDrafter, make_drafter
from seq2seq_models.bundle import load_bundle, make_tiny_bundle
from tests.zoo import FIRST_WORD


def status_code(fn) -> StatusCode:
    """The status code of the SpecdecError `fn()` raises (fails if it raises none)."""
    with pytest.raises(SpecdecError) as info:
        fn()
    return info.value.code


def assert_verifier_status_codes(verifier) -> None:
    """What a verifier session refuses, with which code; a refusal leaves the session usable.

    Sessions trust what the edges checked (ids, top_k, source: tests/services/test_errors.py and
    tests/test_cli.py refuse those); they keep the checks that need their state."""
    session = verifier.open([5, 6])
    session.step(0, [7], [8, 9], top_k=1)
    # The session has seen 3 tokens: keeping 4 is out of step.
    assert status_code(lambda: session.step(4, [], [], top_k=1)) == StatusCode.FAILED_PRECONDITION
    assert status_code(lambda: session.step(-1, [], [], top_k=1)) == StatusCode.FAILED_PRECONDITION
    too_long = [5] * verifier.max_target_len
    assert status_code(lambda: session.step(0, too_long, [5], top_k=1)) == StatusCode.OUT_OF_RANGE
    # After those refusals the session still works, from where it was.
    assert len(session.step(3, [], [], top_k=2).top1) == 1


def assert_gad_equals_greedy_on_random_sources(
    verifier, drafter, seed: int, ks: tuple[int, ...], sources: int = 4, max_new: int = 30
) -> None:
    """GAD with each block size in `ks` gives the greedy output, on `sources` seeded random sources."""
    rng = random.Random(seed)
    for _ in range(sources):
        source = [rng.randrange(FIRST_WORD, verifier.vocab_size) for _ in range(rng.randint(3, 20))]
        greedy = decode(source, DecodingConfig(mode=Mode.AR, max_new_tokens=max_new), verifier).output_ids
        for k in ks:
            gad = decode(source, DecodingConfig(mode=Mode.GAD, k=k, max_new_tokens=max_new), verifier, drafter)
            assert gad.output_ids == greedy, (source, k)


def bundle_and_drafters_fixtures(seed: int):
    """Module fixtures `bundle` (a tiny bundle made with `seed`) and `drafters` (its drafters on torch and
    on ONNX Runtime, to compare), for a test module to bind by those names."""

    @pytest.fixture(scope="module")
    def bundle(tmp_path_factory):
        return load_bundle(make_tiny_bundle(tmp_path_factory.mktemp("bundle"), seed=seed))

    @pytest.fixture(scope="module")
    def drafters(bundle, tmp_path_factory) -> tuple[LocalDrafter | None, LocalDrafter | None]:
        cache_root = tmp_path_factory.mktemp("onnx")
        return make_drafter(bundle, "torch"), make_drafter(bundle, "onnxruntime", cache_root=cache_root)

    return bundle, drafters


class RandomK(LoadModel):
    """Block lengths drawn from a stream seeded with `seed`: any k in 0..k_max alike or, given
    `zero_share`, k = 0 that share of the time and otherwise any k in 1..k_max."""

    def __init__(self, seed: int, zero_share: float | None = None) -> None:
        super().__init__()
        self.rng = random.Random(seed)
        self.zero_share = zero_share

    def choose(self, mode: str, a: float, k_max: int, rows: int) -> int:
        if self.zero_share is None:
            return self.rng.randint(0, k_max)
        return 0 if self.rng.random() < self.zero_share else self.rng.randint(1, k_max)
