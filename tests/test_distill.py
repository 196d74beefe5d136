"""`specdec distill` end to end: a Marian model trained here with `transformers` on a copy-with-edits
task, imported without tokenizer files (ids only), distilled into an NAR drafter from its own greedy
outputs; GAD with that drafter equals greedy on held-out sources and accepts several tokens an
iteration. Also: resuming continues the training, the new bundle keeps the verifier's ids, and bad
sources are one-line errors."""

from __future__ import annotations

import json
import random
import re
import time
from pathlib import Path

import pytest

transformers = pytest.importorskip("transformers", reason="the verifier is built with transformers (the hf extra)")

import torch  # noqa: E402

from decoding.config import DecodingConfig  # noqa: E402
from decoding.decode import decode  # noqa: E402
from drafter_service.session import make_drafter  # noqa: E402
from seq2seq_models.bundle import load_bundle, make_tiny_bundle  # noqa: E402
from specdec.cli import main as cli_main  # noqa: E402
from verifier_service.session import make_verifier  # noqa: E402

VOCAB, EOS, PAD = 128, 0, 127  # Marian's layout: EOS 0, the decoder starts from PAD (the last id)
CONTENT = range(3, 103)
# The task: copy the source, except that ids 3..12 become id + 100 and id 13 is dropped.
RENAMED, DROPPED = range(3, 13), 13
# The verifier's training: HF_STEPS (under a minute on the CI machine). The time bound is a safety
# net only: a verifier cut short by a busy machine gives other labels, and the drafter's acceptance
# moves with them, so the step count is what makes the test repeatable.
HF_STEPS, HF_SECONDS = 600, 180.0
DISTILL_SOURCES, DISTILL_STEPS, K = 1500, 450, 8
# A drafter of the verifier's width (64) learns fast at a learning rate above the default's; small
# batches, more steps. The shape is given: this verifier is so small that the default (a share of its
# parameters) would be too narrow to learn the task in DISTILL_STEPS.
DISTILL_FLAGS = ["--k-max", str(K), "--batch-tokens", "1024", "--lr", "3e-3", "--warmup", "30",
                 "--nar-layers", "2,1", "--nar-width", "64"]
HELD_OUT = 24
MAX_NEW = 40


def edit(source: list[int]) -> list[int]:
    return [t + 100 if t in RENAMED else t for t in source if t != DROPPED]


def random_source(rng: random.Random) -> list[int]:
    return [rng.choice(CONTENT) for _ in range(rng.randint(5, 16))]


@pytest.fixture(scope="module")
def distilled(tmp_path_factory) -> dict:
    """The imported verifier's bundle, and the bundle `specdec distill` made from it (timed)."""
    root = tmp_path_factory.mktemp("distill")
    started = time.perf_counter()
    model, steps, loss = _train_verifier()
    trained = time.perf_counter() - started
    model.save_pretrained(root / "hf")
    assert cli_main(["import-hf", "--model", str(root / "hf"), "--out", str(root / "bundle")]) == 0
    rng = random.Random(1)
    lines = [" ".join(map(str, random_source(rng))) for _ in range(DISTILL_SOURCES)]
    (root / "sources.txt").write_text("\n".join(lines) + "\n")
    started = time.perf_counter()
    code = cli_main(["distill", "--bundle", str(root / "bundle"), "--sources", str(root / "sources.txt"), "--ids",
                     "--out", str(root / "distilled"), "--work", str(root / "work"), "--device", "cpu",
                     *DISTILL_FLAGS, "--steps", str(DISTILL_STEPS)])
    assert code == 0
    print(f"\nverifier: {steps} steps in {trained:.0f} s (loss {loss:.3f}); "
          f"distill: {time.perf_counter() - started:.0f} s")
    return {"root": root, "bundle": root / "bundle", "out": root / "distilled", "work": root / "work"}


@pytest.mark.slow
def test_gad_with_the_distilled_drafter_equals_greedy_and_accepts_3_tokens_an_iteration(distilled):
    bundle = load_bundle(distilled["out"])
    assert sorted(bundle.models) == ["nar_drafter", "verifier"]
    verifier = make_verifier(bundle, "torch")
    drafter = make_drafter(bundle, "torch")
    rng = random.Random(99)  # not the distillation's seed: held-out sources
    accepted = iterations = exact = 0
    for _ in range(HELD_OUT):
        source = random_source(rng)
        greedy = decode(source, DecodingConfig(mode="ar", max_new_tokens=MAX_NEW), verifier)
        gad = decode(source, DecodingConfig(mode="gad", k=K, max_new_tokens=MAX_NEW), verifier, drafter)
        assert gad.output_ids == greedy.output_ids, source
        exact += greedy.output_ids == edit(source)
        accepted += gad.stats.accepted_tokens
        iterations += gad.stats.iterations
    per_iteration = accepted / iterations
    print(f"\nGAD k={K}: {per_iteration:.2f} accepted draft tokens an iteration over {HELD_OUT} held-out sources "
          f"(the verifier's greedy is the exact edit on {exact})")
    assert per_iteration >= 3.0
    assert exact >= HELD_OUT // 2  # the verifier learnt the task: its greedy output is a near-copy


@pytest.mark.slow
def test_the_new_bundle_keeps_the_verifier_and_its_ids_and_has_a_card(distilled):
    old = json.loads((distilled["bundle"] / "config.json").read_text())
    new = json.loads((distilled["out"] / "config.json").read_text())
    assert new["special_ids"] == old["special_ids"] and new["tokenizer"] == old["tokenizer"]
    assert new["models"]["verifier"]["sha256"] == old["models"]["verifier"]["sha256"]
    nar = new["models"]["nar_drafter"]["architecture"]
    assert nar["encoder_layers"] > nar["decoder_layers"]  # deep encoder, shallow decoder
    assert {k: nar[f"{k}_id"] for k in ("pad", "unk", "bos", "eos", "mask")} == old["special_ids"]
    record = new["metadata"]["distill"]
    assert record["sources"]["kept"] == DISTILL_SOURCES and record["roles"]["nar_drafter"]["steps"] == DISTILL_STEPS
    assert "copied from the verifier's" in record["roles"]["nar_drafter"]["embeddings"]
    card = (distilled["out"] / "MODEL_CARD.md").read_text()
    assert "## Distilled drafters" in card and "| nar_drafter | GAD / GAD++ drafter | " in card, card


@pytest.mark.slow
def test_a_rerun_continues_from_the_work_directory_and_adds_an_ar_drafter(distilled, tmp_path):
    """More steps on the same work directory resume the NAR drafter's checkpoint rather than starting
    again, the labels are not made again, and `--ar-drafter` adds a small AR drafter that MJSD and
    GAD both run with, equal to greedy."""
    labels = (distilled["work"] / "targets.jsonl").stat().st_mtime_ns
    sources = distilled["root"] / "sources.txt"
    code = cli_main(["distill", "--bundle", str(distilled["bundle"]), "--sources", str(sources), "--ids",
                     "--out", str(tmp_path / "more"), "--work", str(distilled["work"]), "--device", "cpu",
                     *DISTILL_FLAGS, "--steps", str(DISTILL_STEPS + 20), "--ar-drafter", "--ar-steps", "40"])
    assert code == 0
    log = [json.loads(line) for line in (distilled["work"] / "nar_drafter" / "log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in log if r["event"] == "start"] == [0, DISTILL_STEPS]
    assert (distilled["work"] / "targets.jsonl").stat().st_mtime_ns == labels
    config = json.loads((tmp_path / "more" / "config.json").read_text())
    assert config["metadata"]["distill"]["roles"]["nar_drafter"]["steps"] == DISTILL_STEPS + 20
    assert config["metadata"]["distill"]["roles"]["ar_drafter"]["steps"] == 40
    assert f"--steps {DISTILL_STEPS + 20}" in config["metadata"]["distill"]["command"]
    bundle = load_bundle(tmp_path / "more")
    verifier = make_verifier(bundle, "torch")
    drafter = make_drafter(bundle, "torch")
    rng = random.Random(7)
    for _ in range(4):
        source = random_source(rng)
        greedy = decode(source, DecodingConfig(mode="ar", max_new_tokens=MAX_NEW), verifier).output_ids
        for mode in ("mjsd", "gad"):
            assert decode(source, DecodingConfig(mode=mode, k=K, max_new_tokens=MAX_NEW), verifier,
                          drafter).output_ids == greedy, mode


@pytest.mark.parametrize(
    ("content", "flags", "message"),
    [
        (None, ["--ids"], "no such file"),
        ("", ["--ids"], "no source lines"),
        ("\n  \n", ["--ids"], "no source lines"),
        ("5 6 7\n5 x 7\n", ["--ids"], "line 2: not space-separated token ids"),
        ("5 6 99999\n", ["--ids"], "line 1: id 99999 is outside the vocabulary"),
        ("5 6 7\n", ["--ids", "--k-max", "200"], "--k-max 200 leaves too little"),
        ("5 6 7\n", ["--ids", "--steps", "0"], "--steps must be at least 1"),
    ],
)
def test_bad_sources_and_settings_are_one_line(tmp_path, capsys, content, flags, message):
    bundle = make_tiny_bundle(tmp_path / "bundle", seed=0)
    sources = tmp_path / "sources.txt"
    if content is not None:
        sources.write_text(content)
    capsys.readouterr()
    code = cli_main(["distill", "--bundle", str(bundle), "--sources", str(sources), "--out", str(tmp_path / "out"),
                     "--device", "cpu", *flags])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1 and message in err, err
    assert not (tmp_path / "out").exists()


@pytest.mark.slow
def test_an_existing_out_and_an_ids_only_bundle_without_ids_are_one_line(distilled, tmp_path, capsys):
    sources = distilled["root"] / "sources.txt"
    capsys.readouterr()
    code = cli_main(["distill", "--bundle", str(distilled["bundle"]), "--sources", str(sources), "--ids",
                     "--out", str(distilled["bundle"])])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1 and "exists" in err, err
    code = cli_main(["distill", "--bundle", str(distilled["bundle"]), "--sources", str(sources),
                     "--out", str(tmp_path / "out")])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1 and "pass --ids" in err, err


def _train_verifier():
    """A small Marian model trained on the copy-with-edits task for HF_STEPS (or HF_SECONDS)."""
    t = transformers
    cfg = t.MarianConfig(
        vocab_size=VOCAB, d_model=64, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
        decoder_attention_heads=4, encoder_ffn_dim=128, decoder_ffn_dim=128, max_position_embeddings=64,
        dropout=0.0, attention_dropout=0.0, activation_dropout=0.0, pad_token_id=PAD, eos_token_id=EOS,
        decoder_start_token_id=PAD, forced_eos_token_id=None, bos_token_id=None,
        # Token embeddings scaled by sqrt(d) stand out against the sinusoids: the model learns to copy in
        # a few hundred steps rather than sitting on the unigram plateau.
        scale_embedding=True,
    )
    torch.manual_seed(0)
    model = t.MarianMTModel(cfg)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    rng = random.Random(0)
    started = time.perf_counter()
    step, loss = 0, float("nan")
    while step < HF_STEPS and time.perf_counter() - started < HF_SECONDS:
        sources = [random_source(rng) for _ in range(64)]
        targets = [[*edit(s), EOS] for s in sources]
        ids = torch.full((64, max(map(len, sources)) + 1), PAD)
        labels = torch.full((64, max(map(len, targets))), -100)
        for i, (s, tgt) in enumerate(zip(sources, targets, strict=True)):
            ids[i, : len(s) + 1] = torch.tensor([*s, EOS])
            labels[i, : len(tgt)] = torch.tensor(tgt)
        out = model(input_ids=ids, attention_mask=(ids != PAD).long(), labels=labels)
        optimizer.zero_grad()
        out.loss.backward()
        optimizer.step()
        step, loss = step + 1, float(out.loss.detach())
    return model.eval(), step, loss


def test_a_bundle_of_our_own_takes_text_sources_and_gets_its_drafters_replaced(tmp_path):
    """Text lines through the bundle's SentencePiece tokenizer; the new bundle is written by
    `save_bundle` with the old tokenizer, and its NAR drafter is the distilled one."""
    bundle = make_tiny_bundle(tmp_path / "bundle", seed=0)
    corpus = (Path(__file__).resolve().parents[1] / "seq2seq_models" / "data" / "tiny_corpus.txt").read_text()
    (tmp_path / "sources.txt").write_text(corpus)
    code = cli_main(["distill", "--bundle", str(bundle), "--sources", str(tmp_path / "sources.txt"),
                     "--out", str(tmp_path / "out"), "--device", "cpu", "--steps", "3", "--k-max", "4",
                     "--nar-layers", "2,1", "--nar-width", "32"])
    assert code == 0
    old = json.loads((bundle / "config.json").read_text())
    new = json.loads((tmp_path / "out" / "config.json").read_text())
    assert new["tokenizer"] == old["tokenizer"] and new["special_ids"] == old["special_ids"]
    assert new["models"]["nar_drafter"]["sha256"] != old["models"]["nar_drafter"]["sha256"]
    assert new["models"]["ar_drafter"]["sha256"] == old["models"]["ar_drafter"]["sha256"]
    assert "projected onto their 32 leading principal directions" in new["metadata"]["distill"]["roles"][
        "nar_drafter"]["embeddings"]
    loaded = load_bundle(tmp_path / "out")
    verifier, drafter = make_verifier(loaded, "torch"), make_drafter(loaded, "torch")
    source = loaded.tokenizer.encode(corpus.splitlines()[0])
    greedy = decode(source, DecodingConfig(mode="ar", max_new_tokens=12), verifier).output_ids
    assert decode(source, DecodingConfig(mode="gad", k=4, max_new_tokens=12), verifier, drafter).output_ids == greedy


@pytest.mark.parametrize(
    ("vocab", "width", "layers"),
    [(8000, 256, 3), (58101, 512, 6), (32128, 512, 6)],  # a small Marian, opus-mt-base's shape, t5-small-like
)
def test_the_default_drafters_are_a_share_of_the_verifier(vocab, width, layers):
    """Sized from the verifier: the NAR drafter within NAR_SHARE of its parameters (embeddings and
    head included) with the verifier's encoder depth and a shallow decoder, the AR drafter within
    AR_SHARE; both as wide as that allows, never wider than the verifier."""
    from seq2seq_models.config import ModelConfig
    from training.drafter_distillation.drafter_models import (
        AR_SHARE,
        NAR_SHARE,
        WIDTH_STEP,
        default_ar_shape,
        default_nar_shape,
        drafter_config,
        parameter_count,
    )

    verifier = ModelConfig(vocab_size=vocab, d_model=width, n_heads=8, encoder_layers=layers, decoder_layers=layers,
                           ffn_dim=4 * width)
    params = parameter_count(verifier)
    for shape, share in ((default_nar_shape(verifier, params), NAR_SHARE), (default_ar_shape(verifier, params),
                                                                             AR_SHARE)):
        encoder, decoder, drafter_width = shape
        assert parameter_count(drafter_config(verifier, *shape)) <= share * params, shape
        wider = drafter_config(verifier, encoder, decoder, drafter_width + WIDTH_STEP)
        assert drafter_width + WIDTH_STEP > width or parameter_count(wider) > share * params, shape
    encoder, decoder, _ = default_nar_shape(verifier, params)
    assert encoder == layers and decoder == min(2, layers // 3)


def test_the_plan_is_told_before_anything_is_trained(tmp_path, capsys):
    """Each drafter's shape, its share of the verifier and its steps with a time estimate come first,
    before the labelling and the training."""
    bundle = make_tiny_bundle(tmp_path / "bundle", seed=0)
    corpus = (Path(__file__).resolve().parents[1] / "seq2seq_models" / "data" / "tiny_corpus.txt").read_text()
    (tmp_path / "sources.txt").write_text(corpus)
    capsys.readouterr()
    assert cli_main(["distill", "--bundle", str(bundle), "--sources", str(tmp_path / "sources.txt"), "--out",
                     str(tmp_path / "out"), "--device", "cpu", "--steps", "2", "--k-max", "4", "--ar-drafter",
                     "--ar-steps", "2"]) == 0
    lines = capsys.readouterr().err.splitlines()
    plan = (r"specdec distill: {}: \d\+\d layers of width \d+, [\d.]+M parameters \(\d+% of the verifier's "
            r"[\d.]+M\); 2 steps, about [\d.]+ (s|min|h)$")
    assert re.match(plan.format("nar_drafter"), lines[0]), lines
    assert re.match(plan.format("ar_drafter"), lines[1]), lines
    assert "sources labelled" in lines[2], lines


@pytest.mark.parametrize("first", [[], [7]])
def test_the_labels_are_the_verifiers_greedy_outputs(tmp_path, first):
    """`greedy_outputs` (batched, sources of different lengths) equals the AR mode one source at a
    time, after a forced first token too, up to the same length limit."""
    from training.drafter_distillation.greedy_labels import greedy_outputs

    bundle = load_bundle(make_tiny_bundle(tmp_path / "bundle", seed=3))
    verifier = make_verifier(bundle, "torch")
    rng = random.Random(5)
    sources = [[rng.randrange(5, bundle.config("verifier").vocab_size) for _ in range(rng.randint(1, 12))]
               for _ in range(12)]
    limit = 20
    labels = greedy_outputs(bundle.verifier, sources, max_tokens=limit, first=first, batch_tokens=40)
    for source, label in zip(sources, labels, strict=True):
        greedy = decode(source, DecodingConfig(mode="ar", max_new_tokens=limit), verifier, prefix=list(first) or None)
        assert label == greedy.output_ids, source
