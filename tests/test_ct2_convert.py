"""bench/ct2_convert.py is exact: a tiny random bundle's verifier converted to CTranslate2 scores
every token as the torch model does and decodes greedy to the same ids as specdec's greedy.

CTranslate2 is the `bench` extra (`pip install -e '.[bench]'`, which .ci/run installs); without it
these tests skip and say so."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytest.importorskip("ctranslate2", reason="ctranslate2 is not installed (the bench extra: pip install -e '.[bench]')")

from bench.ct2_convert import convert, greedy, open_translator, token_log_probs, vocabulary
from decoding.config import DecodingConfig, Mode
from decoding.decode import decode
from seq2seq_models.bundle import load_bundle, make_tiny_bundle
from verifier_service.session import make_verifier

MAX_NEW = 24
CORPUS = Path(__file__).resolve().parents[1] / "seq2seq_models" / "data" / "tiny_corpus.txt"


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    root = tmp_path_factory.mktemp("ct2")
    bundle = load_bundle(make_tiny_bundle(root / "bundle", seed=5), roles=("verifier",))
    return bundle, convert(bundle, root / "model")


def _sources(bundle, n: int = 12) -> list[list[int]]:
    lines = [line for line in CORPUS.read_text().splitlines() if line.strip()]
    return [ids for ids in (bundle.tokenizer.encode(line) for line in lines[:n]) if ids]


def test_token_log_probs_match_the_torch_model(converted) -> None:
    bundle, model_dir = converted
    model, cfg = bundle.verifier, bundle.verifier.config
    vocab = vocabulary(bundle)
    translator = open_translator(model_dir)
    gen = torch.Generator().manual_seed(0)
    for source in _sources(bundle):
        # A target of random tokens (no specials): every position's distribution is compared.
        target = torch.randint(5, cfg.vocab_size, (len(source) + 3,), generator=gen).tolist()
        src = torch.tensor([[*source, cfg.eos_id]])
        tgt = torch.tensor([[cfg.bos_id, *target]])
        with torch.no_grad():
            logp = model(src, torch.ones_like(src, dtype=torch.bool), tgt).log_softmax(-1)[0]
        expected = logp.gather(1, torch.tensor([*target, cfg.eos_id])[:, None])[:, 0]
        got = torch.tensor(token_log_probs(translator, vocab, source, target, cfg.eos_id))
        torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("backend", ["torch", "onnxruntime"])
def test_greedy_equals_specdec_greedy(converted, backend) -> None:
    bundle, model_dir = converted
    verifier = make_verifier(bundle, backend, device="cpu")
    vocab = vocabulary(bundle)
    translator = open_translator(model_dir)
    config = DecodingConfig(mode=Mode.AR, max_new_tokens=MAX_NEW)
    eos = bundle.verifier.config.eos_id
    sources = _sources(bundle)
    assert len(sources) >= 8
    for source in sources:
        assert greedy(translator, vocab, source, MAX_NEW, eos) == decode(source, config, verifier).output_ids


def test_a_conversion_is_reused_only_for_its_own_bundle(converted, tmp_path) -> None:
    bundle, model_dir = converted
    stamp = model_dir / "specdec_fingerprint"
    assert stamp.read_text() == bundle.fingerprint
    before = (model_dir / "model.bin").stat().st_mtime_ns
    assert convert(bundle, model_dir) == model_dir
    assert (model_dir / "model.bin").stat().st_mtime_ns == before  # kept
    stamp.write_text("another bundle")
    convert(bundle, model_dir)
    assert stamp.read_text() == bundle.fingerprint  # rewritten
