"""`specdec evaluate`: the validation GLEU of a training run's verifier, on a real smoke run."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("ua_gec", reason="the training tests need the `ua-gec` package (extra `train`)")

from evaluation.gec_metrics import gleu
from evaluation.run_quality import looks_degenerate, spread
from seq2seq_models.tokenizer import Tokenizer
from seq2seq_models.transformer import Seq2SeqTransformer
from tests.test_batched_beam import greedy
from training.data import load_text_pairs
from training.pipeline import run_pipeline
from training.presets import get_preset

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("quality") / "run"
    run_pipeline(out, get_preset("smoke"), stop_after="verifier", echo=None)
    return out


def evaluate(*flags: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "specdec", "evaluate", *flags], capture_output=True, text=True,
                          cwd=REPO, timeout=300)


def test_evaluate_scores_the_verifiers_greedy_outputs_against_every_reference(run_dir):
    proc = evaluate("--out", str(run_dir), "--preset", "smoke", "--groups", "12", "--threads", "1")
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)

    # The expected report, built independently: groups of one source with one reference per
    # annotator, 12 spaced evenly over the file, each decoded one at a time by a plain greedy loop.
    groups: dict[tuple, list[str]] = {}
    for p in load_text_pairs(run_dir / "data" / "valid.text.jsonl"):
        groups.setdefault((p.doc_id, p.index, p.source), []).append(p.target)
    keys = list(groups)
    picked = [keys[i * len(keys) // 12] for i in range(12)]
    tokenizer = Tokenizer.load(run_dir / "data" / "tokenizer.model")
    model = Seq2SeqTransformer(get_preset("smoke").model_config("verifier", tokenizer.vocab_size))
    model.load_state_dict(torch.load(run_dir / "verifier" / "best.pt", weights_only=True))
    model.eval()
    sources, hyps, refs, short = [], [], [], 0
    with torch.no_grad():
        for key in picked:
            ids = tokenizer.encode(key[2])
            if not 0 < len(ids) <= model.config.max_len - 1:
                continue
            limit = min(int(1.5 * len(ids)) + 10, model.config.max_len - 1)
            sources.append(key[2])
            hyps.append(tokenizer.decode(greedy(model, ids, limit)))
            refs.append(groups[key])
            short += len(ids) <= 64
    assert sources, "the smoke split should have sources the smoke verifier takes"
    assert report["groups"] == len(sources) and report["beams"] == 1
    assert report["gleu"] == round(gleu(sources, hyps, refs), 2)
    assert report["source_gleu"] == round(gleu(sources, sources, refs), 2)
    assert report["short_groups"] == short
    assert report["weights"] == str(run_dir / "verifier" / "best.pt")
    assert len(report["examples"]) == min(report["degenerate"], 5)


@pytest.mark.slow  # in .ci/run's slow step: the default run stays a few minutes
def test_evaluate_scores_a_training_checkpoint_and_says_what_is_wrong(run_dir, tmp_path):
    # Mid-run, the weights the training is at: the model part of checkpoint.pt.
    proc = evaluate("--out", str(run_dir), "--preset", "smoke", "--weights", "verifier/checkpoint.pt", "--groups", "3")
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["weights"] == str(run_dir / "verifier" / "checkpoint.pt")

    proc = evaluate("--out", str(run_dir), "--preset", "smoke", "--weights", "nar_drafter/best.pt")
    assert proc.returncode == 2
    assert proc.stderr.strip() == (f"error: {run_dir / 'nar_drafter' / 'best.pt'} does not exist "
                                   f"(has the run reached that stage?)")
    other = tmp_path / "other.pt"
    torch.save(Seq2SeqTransformer(get_preset("base").model_config("verifier", 50)).state_dict(), other)
    proc = evaluate("--out", str(run_dir), "--preset", "smoke", "--weights", str(other))
    assert proc.returncode == 2
    assert proc.stderr.startswith(f"error: {other} does not hold the weights of the 'smoke' preset's verifier (")
    assert "tensors missing or of another shape)" in proc.stderr
    assert "Traceback" not in proc.stderr
    text = tmp_path / "text.pt"
    text.write_text("not weights\n")
    proc = evaluate("--out", str(run_dir), "--preset", "smoke", "--weights", str(text))
    assert proc.returncode == 2
    assert proc.stderr.strip() == f"error: {text} is not a file of torch weights (UnpicklingError)"
    assert evaluate("--out", str(run_dir), "--groups", "0").returncode == 2


def test_spread_takes_evenly_spaced_items_and_all_of_a_short_list():
    assert spread(list(range(10)), 5) == [0, 2, 4, 6, 8]
    assert spread(list(range(10)), 3) == [0, 3, 6]
    assert spread([1, 2], 5) == [1, 2]


def test_degenerate_outputs_are_repetitions_the_source_does_not_have():
    source = [5, 6, 7, 8, 9, 10, 11, 12]
    assert not looks_degenerate(source, source)
    assert looks_degenerate(source, [5, 6, 7, 8] * 4)  # one 4-gram four times
    assert not looks_degenerate(source, [5, 6, 7, 8] * 3)
    assert looks_degenerate(source, list(range(5, 28)))  # longer than 1.5 x 8 + 10 tokens
    assert not looks_degenerate(source, list(range(5, 27)))
    repeated = [5, 6, 7, 8] * 4  # a source that repeats itself may be copied
    assert not looks_degenerate(repeated, repeated)
