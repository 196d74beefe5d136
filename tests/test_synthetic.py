"""Synthetic UA-GEC-style errors (training/synthetic.py) and the pipeline's synthetic / pretrain stages."""

from __future__ import annotations

import json
import random
from collections import Counter

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from training.synthetic import ErrorModel, corrupt, learn_error_model, synthetic_pairs


def test_the_model_keeps_each_types_rate_and_its_edits_reversed():
    edits = [
        ("Punctuation", "", ","),  # a comma left out: corrupting deletes one
        ("Punctuation", "", ","),
        ("Punctuation", ",", ""),  # an extra comma: corrupting inserts one
        ("Spelling", "у", "в"),
        ("Spelling", "превіт", "привіт"),
        ("G/Case", "братові", "братом"),
        ("F/Style", "x", "x"),  # no change: not an edit
    ]
    model = learn_error_model(edits, words=60)
    assert model.counts == Counter({"Punctuation": 3, "Spelling": 2, "G/Case": 1})
    assert model.rate("Punctuation") == 3 / 60
    assert model.replace["Punctuation"][","] == Counter({"": 2})
    assert model.insert["Punctuation"] == Counter({",": 1})
    assert model.replace["Spelling"]["в"] == Counter({"у": 1})
    assert model.suffix["G/Case"] == Counter({("ом", "ові"): 1})
    assert model.suffix["Spelling"] == Counter()  # "привіт"/"превіт" differ after 2 letters: no rule
    # Spelling corrections of one letter, in words of any length: the substitutions typos draw from.
    assert model.letters == Counter({("и", "е"): 1, ("в", "у"): 1})


def test_the_model_survives_json():
    model = learn_error_model([("Punctuation", "", ","), ("G/Case", "братові", "братом"), ("Spelling", "є", "е"),
                               ("Punctuation", ";", "")], words=10)
    again = ErrorModel.from_json(json.loads(json.dumps(model.to_json(), ensure_ascii=False)))
    assert again.to_json() == model.to_json()
    rng_a, rng_b = random.Random(3), random.Random(3)
    sentence = "Я бачив його з братом, а потім пішов додому."
    assert corrupt(sentence, model, rng_a, scale=5) == corrupt(sentence, again, rng_b, scale=5)


def test_a_left_out_comma_is_deleted_keeping_the_spacing():
    model = learn_error_model([("Punctuation", "", ",")], words=1)  # rate 1 a word: every comma goes
    assert corrupt("Я знаю, що ти прийдеш, друже.", model, random.Random(0), scale=3) == "Я знаю що ти прийдеш друже."


def test_an_ending_rule_reaches_words_the_corpus_never_corrected():
    model = learn_error_model([("G/Case", "братові", "братом")], words=1)
    assert corrupt("Говорю з сусідом.", model, random.Random(1), scale=5) == "Говорю з сусідові."
    assert corrupt("Говорю з учителем.", model, random.Random(1), scale=5) == "Говорю з учителем."  # not "-ом"


def test_inserted_punctuation_attaches_to_a_word_and_an_inserted_word_stands_alone():
    comma = learn_error_model([("Punctuation", ",", "")], words=100)
    out = corrupt("Він сказав що прийде", comma, random.Random(0), scale=100)
    assert "," in out and " ," not in out and out.replace(",", "") == "Він сказав що прийде"
    word = learn_error_model([("F/Repetition", "дуже", "")], words=100)
    out = corrupt("Це гарний день", word, random.Random(0), scale=100)
    assert "дуже" in out.split() and [w for w in out.split() if w != "дуже"] == ["Це", "гарний", "день"]


def test_a_capitalised_word_is_replaced_by_a_capitalised_error():
    model = learn_error_model([("Spelling", "у", "в")], words=1)
    assert corrupt("В лісі.", model, random.Random(0), scale=5).startswith("У ")


def test_synthetic_pairs_are_reproducible_and_each_copy_draws_anew():
    model = learn_error_model([("Punctuation", "", ","), ("Spelling", "у", "в")] * 3, words=20)
    sentences = ["Я знаю, що в лісі, мабуть, темно.", "Привіт, світе."]
    pairs = synthetic_pairs(sentences, model, copies=3, seed=7)
    assert pairs == synthetic_pairs(sentences, model, copies=3, seed=7)
    assert [clean for _, clean in pairs] == sentences * 3
    assert len({src for src, clean in pairs if clean == sentences[0]}) > 1
    assert synthetic_pairs(sentences, model, copies=1, seed=8) != synthetic_pairs(sentences, model, copies=1, seed=7)


@pytest.fixture(scope="module")
def ua_gec_model():
    pytest.importorskip("ua_gec", reason="needs the `ua-gec` package (extra `train`)")
    from training.data import is_valid_doc
    from training.synthetic import ua_gec_edits

    edits, words = ua_gec_edits("train", keep_doc=lambda doc_id: not is_valid_doc(doc_id))
    return learn_error_model(edits, words)


def test_ua_gec_errors_come_at_the_corpus_rates(ua_gec_model):
    # Punctuation and spelling are UA-GEC's most frequent error types, a few in a hundred words.
    top = sorted(ua_gec_model.counts, key=ua_gec_model.counts.__getitem__, reverse=True)[:2]
    assert top == ["Punctuation", "Spelling"]
    assert 0.02 < ua_gec_model.rate("Punctuation") < 0.08
    # About half of the real training sentences have an error; the synthetic ones likewise.
    from training.data import iter_pairs, split_train_valid

    train, _ = split_train_valid(iter_pairs("train"))
    clean = sorted({p.target for p in train})[:2000]
    pairs = synthetic_pairs(clean, ua_gec_model, copies=1, seed=1)
    changed = sum(src != tgt for src, tgt in pairs) / len(pairs)
    real = sum(p.source != p.target for p in train) / len(train)
    assert abs(changed - real) < 0.15, (changed, real)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.sampled_from(["Я", "знаю", ",", "що", "в", "лісі", "темно", ".", "братом", "—", "«так»", "2026"]),
                min_size=1, max_size=20), st.integers(0, 2**32 - 1), st.floats(0, 4))
def test_corruption_never_fails_and_leaves_no_stray_spaces(ua_gec_model, words, seed, scale):
    sentence = " ".join(words)
    out = corrupt(sentence, ua_gec_model, random.Random(seed), scale)
    assert out == " ".join(out.split())
    assert corrupt(sentence, ua_gec_model, random.Random(seed), 0.0) == sentence


def test_the_synthetic_pipeline_pretrains_the_verifier_and_fine_tunes_from_it(tmp_path):
    pytest.importorskip("ua_gec", reason="needs the `ua-gec` package (extra `train`)")
    from seq2seq_models.bundle import load_bundle
    from training.pipeline import run_pipeline
    from training.presets import get_preset

    out = tmp_path / "run"
    bundle_dir = run_pipeline(out, get_preset("smoke-synthetic"), echo=None)
    stages = {name: json.loads((out / "stages" / f"{name}.json").read_text()) for name in ("synthetic", "pretrain")}
    assert stages["synthetic"]["pairs"] > 0 and 0 < stages["synthetic"]["changed"] < 1
    assert stages["pretrain"]["steps"] == get_preset("smoke-synthetic").training["pretrain"].max_steps
    # The verifier's fine-tuning pairs include long ones of consecutive sentences; the card says so.
    concat = json.loads((out / "stages" / "concat.json").read_text())
    assert concat["pairs"] > 0 and concat["max_tokens"] == 96
    assert f"include {concat['pairs']} long ones" in (bundle_dir / "MODEL_CARD.md").read_text()
    starts = [json.loads(line) for line in (out / "verifier" / "log.jsonl").read_text().splitlines()]
    assert starts[0]["event"] == "start" and starts[0]["init_from"] == str(out / "pretrain" / "best.pt")
    # The verifier's first checkpointed weights moved from the pre-trained ones, not from a fresh init.
    pretrained = torch.load(out / "pretrain" / "best.pt", weights_only=True)
    verifier = load_bundle(bundle_dir).verifier.state_dict()
    drift = max(float((verifier[k] - pretrained[k]).abs().max()) for k in pretrained)
    assert 0 < drift < 0.1
    # Its last two checkpoints (steps 3 and 6) were averaged; the card says so when the average shipped.
    average = json.loads((out / "verifier" / "result.json").read_text())["average"]
    assert average["steps"] == [3, 6]
    card = (bundle_dir / "MODEL_CARD.md").read_text()
    assert ("the average of the weights at steps 3, 6" in card) is average["kept"]
    # The NAR drafter (2+2 layers) started from the AR drafter's best weights (1+1 layers, each used twice).
    nar_start = json.loads((out / "nar_drafter" / "log.jsonl").read_text().splitlines()[0])
    assert nar_start["init_from"] == str(out / "ar_drafter" / "best.pt")
    assert nar_start["init_layers"] == {"encoder_layers": [0, 0], "decoder_layers": [0, 0]}
    ar_drafter = torch.load(out / "ar_drafter" / "best.pt", weights_only=True)
    nar = load_bundle(bundle_dir).nar_drafter.state_dict()
    drift = nar["encoder_layers.1.ffn.up.weight"] - ar_drafter["encoder_layers.0.ffn.up.weight"]
    assert 0 < float(drift.abs().max()) < 0.1
    assert "It started from the AR drafter's best weights" in (bundle_dir / "MODEL_CARD.md").read_text()
