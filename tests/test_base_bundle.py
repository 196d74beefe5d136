"""The Transformer-base UA-GEC bundle (`bundles/ua-gec-base`, preset `base`): its budget, its card,
drafters a fraction of the verifier's size, and lossless modes that agree on real test sentences."""

from __future__ import annotations

from pathlib import Path

import pytest

from drafter_service.session import LocalDrafter
from gateway.decode import decode
from gateway.decoding_config import DecodingConfig, Mode
from seq2seq_models.bundle import load_bundle
from tests.test_shipped_bundle import BUDGET_BYTES
from training.data import load_test_set
from verifier_service.session import make_verifier

BASE_BUNDLE = Path(__file__).resolve().parents[1] / "bundles" / "ua-gec-base"


@pytest.fixture(scope="module")
def bundle():
    return load_bundle(BASE_BUNDLE)  # also checks every file against its fingerprint


def test_the_base_bundle_fits_the_budget_and_its_card_tells_how_it_was_made(bundle):
    files = [p for p in BASE_BUNDLE.iterdir() if p.is_file()]
    assert sum(p.stat().st_size for p in files) <= BUDGET_BYTES
    assert bundle.metadata["kind"] == "trained" and bundle.metadata["preset"] == "base"
    card = (BASE_BUNDLE / "MODEL_CARD.md").read_text()
    for needed in ("CC-BY-4.0", "python -m training.pipeline", "--preset base", "Synthetic pre-training pairs",
                   "Wall time per stage", "Hardware:", "It started from the AR drafter's best weights"):
        assert needed in card, needed
    for role, scores in bundle.metadata["validation"].items():
        assert f"| {role} |" in card and f"{scores['valid_acc']:.3f}" in card


def test_each_drafter_is_at_most_a_fifth_of_the_verifier(bundle):
    def params(model) -> int:
        return sum(p.numel() for p in model.parameters())

    verifier = params(bundle.verifier)
    assert verifier > 40_000_000  # Transformer-base: 6+6 layers of width 512
    for drafter in (bundle.nar_drafter, bundle.ar_drafter):
        assert params(drafter) <= verifier / 5


def test_iad_and_gad_give_greedys_tokens_on_test_sentences(bundle):
    verifier = make_verifier(bundle, "torch")
    drafter = LocalDrafter({"nar_drafter": bundle.nar_drafter, "ar_drafter": bundle.ar_drafter})
    fits = (i.source for i in load_test_set() if len(bundle.tokenizer.encode(i.source)) <= 64)
    sentences = [next(fits) for _ in range(6)]
    outputs = {}
    for config in (DecodingConfig(mode=Mode.AR), DecodingConfig(mode=Mode.IAD, k=10),
                   DecodingConfig(mode=Mode.GAD, k=10)):
        outputs[config.mode] = [decode(bundle.tokenizer.encode(s), config, verifier, drafter) for s in sentences]
    greedy = [r.output_ids for r in outputs[Mode.AR]]
    assert [r.output_ids for r in outputs[Mode.IAD]] == greedy
    assert [r.output_ids for r in outputs[Mode.GAD]] == greedy
    # The NAR drafter is a real drafter: GAD needs far fewer verifier iterations than greedy's tokens.
    iterations = sum(r.stats.iterations for r in outputs[Mode.GAD])
    assert iterations < 0.5 * sum(len(ids) for ids in greedy)
