"""CTranslate2 as the independent reference for `specdec import-hf`: a small random-weight checkpoint
of each family, built here with `transformers` as the hub's are (bench/hf_checkpoints.py), is imported
by specdec and converted by CTranslate2's own Transformers converter; both greedy decodes agree.

Needs `ctranslate2` (the bench extra) and `transformers`; without either these tests skip and say so."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("ctranslate2", reason="ctranslate2 is not installed (the bench extra: pip install -e '.[bench]')")
pytest.importorskip("transformers", reason="import-hf and CTranslate2's converter need transformers")

from bench.bench_hf_ctranslate2 import (
    NEAR_TIE,
    Ct2Model,
    convert,
    hf_top2_gap,
    import_bundle,
    random_sources,
)
from bench.hf_checkpoints import FAMILIES, Shape, build
from decoding.config import DecodingConfig, layered_defaults
from decoding.decode import decode
from seq2seq_models.bundle import bundle_decoding_defaults, load_bundle
from verifier_service.session import make_verifier

MAX_NEW = 16
SOURCES = 8


@pytest.mark.slow  # in .ci/run's slow step: the default run stays a few minutes
@pytest.mark.parametrize("backend", ["torch", "onnxruntime"])
@pytest.mark.parametrize("family", FAMILIES)
def test_ctranslate2_greedy_equals_specdec_greedy(family, backend, tmp_path):
    hf_dir = build(family, tmp_path / "hf", seed=FAMILIES.index(family) + 1)
    import_bundle(hf_dir, tmp_path / "bundle")
    convert(hf_dir, tmp_path / "ct2")
    bundle = load_bundle(tmp_path / "bundle", roles=("verifier",))
    cfg = bundle.config("verifier")
    ct2 = Ct2Model(tmp_path / "ct2")
    verifier = make_verifier(bundle, backend, cache_root=tmp_path / "onnx")
    config = _config(tmp_path / "bundle")
    same, hf = 0, None
    for source in random_sources(bundle, len(ct2.source_vocab), SOURCES, seed=3, max_len=20):
        ours = decode(source, config, verifier).output_ids
        theirs = ct2.greedy(source, cfg.eos_id, cfg.bos_id, MAX_NEW)
        if ours == theirs:
            same += 1
            continue
        import transformers

        hf = hf or transformers.AutoModelForSeq2SeqLM.from_pretrained(str(hf_dir)).eval()
        at = next((i for i, (a, b) in enumerate(zip(ours, theirs, strict=False)) if a != b),
                  min(len(ours), len(theirs)))
        gap = hf_top2_gap(hf, source, ours[:at], cfg)
        assert gap < NEAR_TIE, (
            f"{family}/{backend} source {source}: specdec {ours} vs CTranslate2 {theirs} (HF top-2 gap {gap:.2e})")
    # A near-tie excuses one source, not the comparison.
    assert same >= SOURCES - 1, f"{family}/{backend}: equal on only {same}/{SOURCES} sources"


@pytest.mark.parametrize("backend", ["torch", "onnxruntime"])
def test_a_t5_decoder_deeper_than_its_encoder_equals_ctranslate2(backend, tmp_path):
    """`num_decoder_layers` above `num_layers`: transformers' generate() overruns its own KV cache
    there, so CTranslate2 is the reference (it converts this shape faithfully; for BART-style
    encoder and decoder head counts that differ it takes the encoder's for both, so it is not one)."""
    hf_dir = build("t5", tmp_path / "hf", Shape(layers=1, decoder_layers=3), seed=5)
    import_bundle(hf_dir, tmp_path / "bundle")
    convert(hf_dir, tmp_path / "ct2")
    bundle = load_bundle(tmp_path / "bundle", roles=("verifier",))
    cfg = bundle.config("verifier")
    assert (cfg.encoder_layers, cfg.decoder_layers) == (1, 3)
    ct2 = Ct2Model(tmp_path / "ct2")
    verifier = make_verifier(bundle, backend, cache_root=tmp_path / "onnx")
    config = _config(tmp_path / "bundle")
    for source in random_sources(bundle, len(ct2.source_vocab), SOURCES, seed=3, max_len=20):
        assert decode(source, config, verifier).output_ids == ct2.greedy(source, cfg.eos_id, cfg.bos_id, MAX_NEW)


def test_marians_forbidden_padding_token_is_never_emitted(tmp_path):
    """opus-mt's generation config forbids its padding token (`bad_words_ids`); CTranslate2 drops it
    from the vocabulary. With the token's bias raised so that it would win every step, specdec's greedy
    still equals CTranslate2's and `generate`'s, and never emits it."""
    import torch
    import transformers

    hf_dir = build("marian", tmp_path / "hf", seed=1)
    model = transformers.AutoModelForSeq2SeqLM.from_pretrained(str(hf_dir)).eval()
    pad = model.config.pad_token_id
    assert model.generation_config.bad_words_ids == [[pad]]
    with torch.no_grad():
        model.final_logits_bias[0, pad] = 50.0
    model.save_pretrained(hf_dir)
    import_bundle(hf_dir, tmp_path / "bundle")
    convert(hf_dir, tmp_path / "ct2")
    bundle = load_bundle(tmp_path / "bundle", roles=("verifier",))
    cfg = bundle.config("verifier")
    ct2 = Ct2Model(tmp_path / "ct2")
    config = _config(tmp_path / "bundle")
    for backend in ("torch", "onnxruntime"):
        verifier = make_verifier(bundle, backend, cache_root=tmp_path / "onnx")
        for source in random_sources(bundle, len(ct2.source_vocab), 3, seed=4, max_len=12):
            ours = decode(source, config, verifier).output_ids
            with torch.no_grad():
                want = model.generate(torch.tensor([[*source, cfg.eos_id]]), do_sample=False, num_beams=1,
                                      max_new_tokens=MAX_NEW)[0, 1:].tolist()
            want = want[: want.index(cfg.eos_id)] if cfg.eos_id in want else want
            assert pad not in ours, (backend, source, ours)
            assert ours == ct2.greedy(source, cfg.eos_id, cfg.bos_id, MAX_NEW) == want, (backend, source)


def _config(bundle_dir: Path) -> DecodingConfig:
    """Greedy with the checkpoint's generation settings in force (Marian's banned padding token), as
    generate() and CTranslate2 decode it."""
    return layered_defaults(bundle_decoding_defaults(bundle_dir), {"mode": "ar", "max_new_tokens": MAX_NEW})
