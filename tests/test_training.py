"""The training pipeline: UA-GEC pairs and split, the smoke run end to end, exact resume."""

from __future__ import annotations

import json
import os
import signal
from dataclasses import replace
from pathlib import Path

import pytest
import torch

pytest.importorskip("ua_gec", reason="the training tests need the `ua-gec` package (extra `train`)")

from seq2seq_models.bundle import ROLES, load_bundle
from seq2seq_models.config import ModelConfig
from seq2seq_models.tokenizer import Tokenizer
from seq2seq_models.transformer import Seq2SeqTransformer
from training.arguments import STAGES
from training.batching import IGNORE, nar_tensors, token_batches
from training.beam_relabel import relabel_pairs
from training.checkpoint import Interrupted
from training.data import (
    IdPair,
    concatenate_pairs,
    is_valid_doc,
    iter_pairs,
    load_id_pairs,
    load_test_set,
    normalise,
    split_train_valid,
)
from training.pipeline import run_pipeline
from training.presets import get_preset
from training.train import TrainConfig, train_role, uses_bfloat16
from training.transfer import load_initial_weights

BUNDLE_TOKENIZER = Path(__file__).resolve().parent.parent / "bundles" / "ua-gec" / "tokenizer.model"


@pytest.fixture(scope="module")
def train_pairs():
    return list(iter_pairs("train"))


def test_pairs_are_aligned_sentences(train_pairs):
    from ua_gec import Corpus

    doc = next(iter(Corpus(partition="train")))
    first = [p for p in train_pairs if p.doc_id == str(doc.doc_id) and p.annotator == doc.meta.annotator_id]
    expected = [(normalise(s), normalise(t)) for s, t in zip(doc.source_sentences, doc.target_sentences, strict=True)]
    assert [(p.source, p.target) for p in first] == [(s, t) for s, t in expected if s and t]
    assert [p.index for p in first] == sorted(p.index for p in first)
    assert len(train_pairs) > 30_000
    for p in train_pairs:
        assert p.source and p.target
        assert p.source == " ".join(p.source.split())
        assert p.target == " ".join(p.target.split())
    changed = sum(p.source != p.target for p in train_pairs)
    assert 0.2 < changed / len(train_pairs) < 0.9  # GEC: many sentences change, many are copied


def test_valid_split_is_disjoint_deterministic_and_about_five_percent(train_pairs):
    train, valid = split_train_valid(train_pairs)
    again_train, again_valid = split_train_valid(reversed(train_pairs))
    assert {(p.doc_id, p.index) for p in valid} == {(p.doc_id, p.index) for p in again_valid}
    assert len(train) == len(again_train)
    assert not {p.doc_id for p in train} & {p.doc_id for p in valid}
    assert 0.02 < len(valid) / len(train_pairs) < 0.09
    assert all(is_valid_doc(p.doc_id) for p in valid)


def test_test_set_groups_both_annotators_references():
    items = load_test_set()
    assert len(items) > 2000
    assert sum(len(item.references) == 2 for item in items) > 0.8 * len(items)
    assert all(item.source and all(item.references) for item in items)


def test_concatenated_pairs_join_consecutive_sentences_of_one_document_within_the_budget(train_pairs):
    tok = Tokenizer.load(BUNDLE_TOKENIZER)
    pairs = [p for i, p in enumerate(train_pairs[:450]) if i % 9 != 4]  # gaps: sentences not consecutive
    long = concatenate_pairs(pairs, tok, max_tokens=96, seed=1)
    # Every window of 2+ consecutive sentences of one (document, annotator), by its encoding.
    docs: dict[tuple[str, int], list] = {}
    for p in pairs:
        docs.setdefault((p.doc_id, p.annotator), []).append(p)
    windows = {}
    for key, doc in docs.items():
        doc.sort(key=lambda p: p.index)
        for i in range(len(doc)):
            for j in range(i + 2, len(doc) + 1):
                run = doc[i:j]
                if run[-1].index - run[0].index != len(run) - 1:
                    break
                src = tuple(tok.encode(" ".join(p.source for p in run)))
                tgt = tuple(tok.encode(" ".join(p.target for p in run)))
                windows.setdefault((src, tgt), []).append({(key, p.index) for p in run})
    used: set = set()
    for p in long:
        # Such a window (both annotators of a document may have made the same text), whose sentences
        # no other long pair took.
        sentences = next(s for s in windows[(tuple(p.source), tuple(p.target))] if not s & used)
        used |= sentences
        assert max(len(p.source), len(p.target)) + 1 <= 96
    assert len(long) > 20 and max(len(p.source) for p in long) > 60
    assert long == concatenate_pairs(pairs, tok, max_tokens=96, seed=1)
    assert long != concatenate_pairs(pairs, tok, max_tokens=96, seed=2)


def test_token_batches_respect_budget_and_cover_every_pair():
    gen = torch.Generator().manual_seed(0)
    pairs = [IdPair([5] * int(n), [6] * int(m)) for n, m in torch.randint(1, 40, (200, 2), generator=gen)]
    batches = token_batches(pairs, max_tokens=300, seed=3, epoch=0)
    assert sorted(i for b in batches for i in b) == list(range(200))
    for b in batches:
        longest = max(max(len(pairs[i].source), len(pairs[i].target)) + 1 for i in b)
        assert longest * len(b) <= 300 or len(b) == 1
    assert batches == token_batches(pairs, max_tokens=300, seed=3, epoch=0)
    assert batches != token_batches(pairs, max_tokens=300, seed=3, epoch=1)


def test_initial_weights_fill_a_deeper_model_layer_by_layer_and_refuse_another_width():
    shallow = Seq2SeqTransformer(ModelConfig(vocab_size=40, d_model=16, n_heads=2, encoder_layers=3, decoder_layers=1,
                                             ffn_dim=32, max_len=32)).state_dict()
    deep = Seq2SeqTransformer(ModelConfig(vocab_size=40, d_model=16, n_heads=2, encoder_layers=6, decoder_layers=2,
                                          ffn_dim=32, max_len=32))
    assert load_initial_weights(deep, shallow) == {"encoder_layers": [0, 0, 1, 1, 2, 2], "decoder_layers": [0, 0]}
    loaded = deep.state_dict()
    for i, j in enumerate([0, 0, 1, 1, 2, 2]):
        name = "attn.q_proj.weight"
        assert torch.equal(loaded[f"encoder_layers.{i}.{name}"], shallow[f"encoder_layers.{j}.{name}"])
    name = "cross_attn.k_proj.weight"
    assert torch.equal(loaded[f"decoder_layers.1.{name}"], shallow[f"decoder_layers.0.{name}"])
    assert torch.equal(loaded["embed.weight"], shallow["embed.weight"])
    # The same shape is a plain copy; a deeper source or another width is refused with the reason.
    same = Seq2SeqTransformer(ModelConfig(vocab_size=40, d_model=16, n_heads=2, encoder_layers=6, decoder_layers=2,
                                          ffn_dim=32, max_len=32))
    assert load_initial_weights(same, loaded) == {"encoder_layers": list(range(6)), "decoder_layers": [0, 1]}
    assert all(torch.equal(t, loaded[k]) for k, t in same.state_dict().items())
    shallow_model = Seq2SeqTransformer(ModelConfig(vocab_size=40, d_model=16, n_heads=2, encoder_layers=3,
                                                   decoder_layers=1, ffn_dim=32, max_len=32))
    with pytest.raises(ValueError, match="cannot initialise 3 encoder_layers from 6"):
        load_initial_weights(shallow_model, loaded)
    wide = Seq2SeqTransformer(ModelConfig(vocab_size=40, d_model=32, n_heads=2, encoder_layers=6, decoder_layers=2,
                                          ffn_dim=32, max_len=32))
    with pytest.raises(ValueError, match="widths differ"):
        load_initial_weights(wide, loaded)


def test_nar_rows_match_the_inference_layout():
    cfg = ModelConfig(vocab_size=20, d_model=8, n_heads=2, encoder_layers=1, decoder_layers=1, ffn_dim=8, max_len=64)
    pairs = [IdPair([5, 6], [7, 8, 9, 10, 11]), IdPair([5], [12])]
    dec_in, labels, mask = nar_tensors(pairs, cfg, k=3, generator=torch.Generator().manual_seed(1))
    for row in range(2):
        n = int((dec_in[row] == cfg.mask_id).nonzero()[0])  # BOS + prefix length
        assert dec_in[row, 0] == cfg.bos_id
        assert (dec_in[row, n : n + 3] == cfg.mask_id).all()
        assert mask[row, n : n + 3, : n + 3].all() and not mask[row, n : n + 3, n + 3 :].any()
        assert torch.equal(mask[row, :n, :n], torch.ones(n, n, dtype=torch.bool).tril())
        full = [*pairs[row].target, cfg.eos_id]
        block = full[n - 1 : n + 2]
        assert labels[row, n : n + len(block)].tolist() == block
        assert (labels[row, n + len(block) :] == IGNORE).all()


def test_distillation_stops_on_sigterm_between_chunks_and_resumes_to_the_same_pairs(tmp_path):
    cfg = ModelConfig(vocab_size=30, d_model=16, n_heads=2, encoder_layers=1, decoder_layers=1, ffn_dim=32, max_len=32)
    torch.manual_seed(0)
    model = Seq2SeqTransformer(cfg)
    gen = torch.Generator().manual_seed(1)
    pairs = [IdPair(torch.randint(4, 30, (int(n),), generator=gen).tolist(), [5])
             for n in torch.randint(2, 10, (12,), generator=gen)]
    whole = relabel_pairs(model, pairs, tmp_path / "whole.jsonl", num_beams=1, max_tokens=32, chunk_size=4)

    def terminate_after_the_first_chunk(**record):
        if record["done"] == 4:
            os.kill(os.getpid(), signal.SIGTERM)

    out = tmp_path / "run.jsonl"
    with pytest.raises(Interrupted, match="stopped at 4 of 12 pairs"):
        relabel_pairs(model, pairs, out, num_beams=1, max_tokens=32, chunk_size=4, log=terminate_after_the_first_chunk)
    partial = tmp_path / "run.jsonl.partial"
    assert len(partial.read_text().splitlines()) == 4 and not out.exists()
    with partial.open("a") as f:
        f.write('{"i": 7, "tar')  # a process killed while writing a line
    assert relabel_pairs(model, pairs, out, num_beams=1, max_tokens=32, chunk_size=4) == whole
    assert not partial.exists() and out.is_file()


def test_smoke_pipeline_writes_a_loadable_bundle(tmp_path):
    out = tmp_path / "run"
    bundle_dir = run_pipeline(out, get_preset("smoke"), echo=None)
    assert bundle_dir == out / "bundle"
    bundle = load_bundle(bundle_dir)
    assert set(bundle.models) == set(ROLES)
    trained_tokenizer = Tokenizer.load(out / "data" / "tokenizer.model")
    assert bundle.tokenizer.fingerprint == trained_tokenizer.fingerprint
    assert json.loads((out / "stages" / "tokenizer.json").read_text())["fingerprint"] == trained_tokenizer.fingerprint
    card = (bundle_dir / "MODEL_CARD.md").read_text()
    assert "CC-BY-4.0" in card and "verifier" in card
    # The card states the training arithmetic each run logged (bfloat16 where this CPU has it).
    precision = "bfloat16 autocast" if uses_bfloat16("auto", torch.device("cpu")) else "float32"
    assert f"Training forward: {precision} (weights" in card
    assert set(bundle.metadata["validation"]) == set(ROLES)
    # Every stage is finished: a second run skips them all and returns the same bundle.
    assert run_pipeline(out, get_preset("smoke"), echo=None) == bundle_dir
    log = [json.loads(line) for line in (out / "pipeline.log.jsonl").read_text().splitlines()]
    assert sum(r["event"] == "skip" for r in log) == len(STAGES)


@pytest.mark.parametrize("objective", ["ar", "nar"])
def test_resume_reproduces_the_uninterrupted_run(tmp_path, objective):
    cfg = ModelConfig(vocab_size=30, d_model=16, n_heads=2, encoder_layers=1, decoder_layers=1, ffn_dim=32, max_len=64)
    gen = torch.Generator().manual_seed(5)
    pairs = []
    for _ in range(60):
        src = torch.randint(5, 30, (int(torch.randint(2, 12, (1,), generator=gen)),), generator=gen).tolist()
        pairs.append(IdPair(src, [t if t != 9 else 10 for t in src]))
    config = TrainConfig(objective=objective, max_steps=6, max_tokens=120, peak_lr=3e-3, warmup_steps=2,
                         log_every=1, eval_every=4, checkpoint_every=2, nar_k_max=4, eval_max_pairs=10)
    train_role("x", cfg, config, pairs[:50], pairs[50:], tmp_path / "straight", echo=None)
    train_role("x", cfg, replace(config, max_steps=3), pairs[:50], pairs[50:], tmp_path / "split", echo=None)
    with pytest.raises(FileExistsError):
        train_role("x", cfg, config, pairs[:50], pairs[50:], tmp_path / "split", echo=None)
    resumed = train_role("x", cfg, config, pairs[:50], pairs[50:], tmp_path / "split", resume=True, echo=None)

    straight = torch.load(tmp_path / "straight" / "checkpoint.pt", weights_only=False)
    split = torch.load(tmp_path / "split" / "checkpoint.pt", weights_only=False)
    assert split["step"] == straight["step"] == 6
    for name, tensor in straight["model"].items():
        assert torch.equal(tensor, split["model"][name]), name
    assert resumed["valid_loss"] == json.loads((tmp_path / "straight" / "result.json").read_text())["valid_loss"]
    # Resuming a finished run trains nothing and reports the same place in the data.
    again = train_role("x", cfg, config, pairs[:50], pairs[50:], tmp_path / "split", resume=True, echo=None)
    assert again["steps"] == 6 and again["epochs"] == resumed["epochs"]


def test_a_float16_bundle_is_half_the_size_and_loads_its_rounded_weights_as_float32(tmp_path):
    from seq2seq_models.bundle import make_tiny_bundle, save_bundle

    tiny = load_bundle(make_tiny_bundle(tmp_path / "tiny", seed=3))
    models = {role: tiny.models[role] for role in ROLES}
    tokenizer_bytes = (tmp_path / "tiny" / "tokenizer.model").read_bytes()
    half = load_bundle(save_bundle(tmp_path / "half", tokenizer_bytes, models, name="half", weights_dtype="float16"))
    for role in ROLES:
        full_size = (tmp_path / "tiny" / f"{role}.safetensors").stat().st_size
        assert (tmp_path / "half" / f"{role}.safetensors").stat().st_size < 0.55 * full_size
        loaded = half.models[role].state_dict()
        for name, tensor in models[role].state_dict().items():
            assert loaded[name].dtype == torch.float32
            assert torch.equal(loaded[name], tensor.half().float()), (role, name)
    assert json.loads((tmp_path / "half" / "config.json").read_text())["models"]["verifier"]["dtype"] == "float16"
    with pytest.raises(ValueError, match="weights_dtype"):
        save_bundle(tmp_path / "bad", tokenizer_bytes, models, name="bad", weights_dtype="int8")


def test_bfloat16_mixed_precision_trains_float32_weights_and_changes_the_arithmetic(tmp_path):
    cfg = ModelConfig(vocab_size=30, d_model=16, n_heads=2, encoder_layers=1, decoder_layers=1, ffn_dim=32, max_len=64)
    gen = torch.Generator().manual_seed(9)
    pairs = [IdPair(src, src) for src in
             (torch.randint(5, 30, (int(torch.randint(2, 10, (1,), generator=gen)),), generator=gen).tolist()
              for _ in range(40))]
    config = TrainConfig(max_steps=4, max_tokens=120, peak_lr=3e-3, warmup_steps=2, log_every=1, eval_every=4,
                         checkpoint_every=4, eval_max_pairs=10)
    results = {}
    for precision in ("off", "bf16"):
        results[precision] = train_role("x", cfg, replace(config, mixed_precision=precision), pairs[:30], pairs[30:],
                                        tmp_path / precision, echo=None)
        state = torch.load(tmp_path / precision / "checkpoint.pt", weights_only=False)["model"]
        assert all(t.dtype == torch.float32 for t in state.values())
    assert all(torch.isfinite(torch.tensor(r["valid_loss"])) for r in results.values())
    assert results["off"]["valid_loss"] != results["bf16"]["valid_loss"]
    # "auto" on the CPU is bfloat16 where oneDNN has bfloat16 arithmetic (this 2-core Zen 4 does), else
    # float32: the same run as one of the two, and the log says which.
    auto = train_role("x", cfg, replace(config, mixed_precision="auto"), pairs[:30], pairs[30:], tmp_path / "auto",
                      echo=None)
    cpu_bf16 = uses_bfloat16("auto", torch.device("cpu"))
    assert auto["valid_loss"] == results["bf16" if cpu_bf16 else "off"]["valid_loss"]
    start = json.loads((tmp_path / "auto" / "log.jsonl").read_text().splitlines()[0])
    assert start["precision"] == ("bfloat16 autocast" if cpu_bf16 else "float32")
    assert uses_bfloat16("auto", torch.device("cuda")) and uses_bfloat16("bf16", torch.device("cpu"))
    assert not uses_bfloat16("off", torch.device("cuda"))
    with pytest.raises(ValueError, match="mixed_precision"):
        TrainConfig(mixed_precision="fp8")


# At the lower rate the average of steps 4-8 is worse than step 8 alone; at the higher it is better.
@pytest.mark.parametrize(("peak_lr", "kept"), [(3e-3, False), (3e-2, True)])
def test_checkpoint_averaging_averages_the_last_checkpoint_steps_and_keeps_the_better(tmp_path, peak_lr, kept):
    cfg = ModelConfig(vocab_size=30, d_model=16, n_heads=2, encoder_layers=1, decoder_layers=1, ffn_dim=32, max_len=64)
    gen = torch.Generator().manual_seed(11)
    pairs = [IdPair(src, [t if t != 7 else 8 for t in src]) for src in
             (torch.randint(5, 30, (int(torch.randint(2, 10, (1,), generator=gen)),), generator=gen).tolist()
              for _ in range(50))]
    config = TrainConfig(max_steps=8, max_tokens=120, peak_lr=peak_lr, warmup_steps=2, log_every=1, eval_every=4,
                         checkpoint_every=2, eval_max_pairs=10, average_last=3)
    result = train_role("x", cfg, config, pairs[:40], pairs[40:], tmp_path / "run", echo=None)

    snapshots = sorted((tmp_path / "run" / "snapshots").glob("*.pt"))
    assert [p.name for p in snapshots] == ["step-0000004.pt", "step-0000006.pt", "step-0000008.pt"]
    states = [torch.load(p, weights_only=True) for p in snapshots]
    final = torch.load(tmp_path / "run" / "checkpoint.pt", weights_only=False)["model"]
    assert all(torch.equal(states[-1][k], final[k]) for k in final)
    log = [json.loads(line) for line in (tmp_path / "run" / "log.jsonl").read_text().splitlines()]
    evals = [r["valid_loss"] for r in log if r["event"] == "eval"]
    (average,) = [r for r in log if r["event"] == "average"]
    assert average["steps"] == [4, 6, 8]
    assert average["kept"] is kept
    assert kept == (average["valid_loss"] < min(evals))
    assert result["average"] == {k: average[k] for k in ("steps", "valid_loss", "valid_ppl", "valid_acc", "kept")}
    assert result["best_valid_loss"] == min([*evals, average["valid_loss"]])
    best = torch.load(tmp_path / "run" / "best.pt", weights_only=True)
    mean = {k: sum(s[k].double() for s in states) / 3 for k in final}
    is_mean = all(torch.allclose(best[k].double(), mean[k], atol=1e-6) for k in final)
    assert is_mean is kept

    # Without it, no snapshots and no average; the final weights' run is otherwise the same.
    plain = train_role("x", cfg, replace(config, average_last=0), pairs[:40], pairs[40:], tmp_path / "plain",
                       echo=None)
    assert not (tmp_path / "plain" / "snapshots").exists()
    assert plain["valid_loss"] == result["valid_loss"] and plain["average"] is None


@pytest.mark.slow  # in .ci/run's slow step: the default run stays a few minutes
def test_continuation_trains_a_bundles_verifier_on_and_keeps_its_drafters_byte_for_byte(tmp_path):
    from training.continuation import continue_verifier

    source = run_pipeline(tmp_path / "run", get_preset("smoke"), echo=None)
    target = continue_verifier(source, tmp_path / "more", tmp_path / "continued", steps=8, peak_lr=3e-3,
                               warmup_steps=2, checkpoint_every=2, command="python -m training.continuation (test)")
    before, after = load_bundle(source), load_bundle(target)  # also checks every file against config.json
    assert after.tokenizer.fingerprint == before.tokenizer.fingerprint
    for role in ("nar_drafter", "ar_drafter"):
        assert (target / f"{role}.safetensors").read_bytes() == (source / f"{role}.safetensors").read_bytes()
    old, new = before.verifier.state_dict(), after.verifier.state_dict()
    assert any(not torch.equal(old[name], new[name]) for name in old)
    for path in target.glob("*.safetensors"):
        assert path.stat().st_mode & 0o777 == 0o644  # readable by the images' non-root user
    (leg,) = after.metadata["continued"]
    validation = after.metadata["validation"]["verifier"]
    assert leg["steps"] == 8 and validation["steps"] == before.metadata["validation"]["verifier"]["steps"] + 8
    card = (target / "MODEL_CARD.md").read_text()
    assert "## Verifier continued" in card and "python -m training.continuation (test)" in card
    row = next(line for line in card.splitlines() if line.startswith("| verifier |"))
    scores = validation["valid_loss"], validation["valid_ppl"], validation["valid_acc"]
    assert row.endswith("| {:.3f} | {:.2f} | {:.3f} |".format(*scores))

    # A continued bundle continues again: the legs chain in its metadata and in one section of its card.
    again = continue_verifier(target, tmp_path / "more2", tmp_path / "continued2", steps=2, peak_lr=3e-3,
                              warmup_steps=1, checkpoint_every=2, command="python -m training.continuation (leg 2)")
    legs = load_bundle(again).metadata["continued"]
    assert [leg["from"] for leg in legs] == [str(source), str(target)] and legs[1]["valid_before"]["steps"] == (
        validation["steps"])
    assert load_bundle(again).metadata["validation"]["verifier"]["steps"] == validation["steps"] + 2
    card = (again / "MODEL_CARD.md").read_text()
    assert card.count("## Verifier continued") == 1 and "Leg 2:" in card
    assert card.index("(test)") < card.index("(leg 2)") < card.index("## Licence")
    for role in ("nar_drafter", "ar_drafter"):
        assert (again / f"{role}.safetensors").read_bytes() == (source / f"{role}.safetensors").read_bytes()
    with pytest.raises(ValueError, match="must differ"):
        continue_verifier(source, tmp_path / "again", source, steps=2)
    with pytest.raises(ValueError, match="multiple of"):
        continue_verifier(source, tmp_path / "again", tmp_path / "other", steps=9, checkpoint_every=2)



@pytest.mark.slow  # in .ci/run's slow step: the default run stays a few minutes
def test_redistill_trains_the_drafters_on_from_their_weights_on_the_verifiers_outputs(tmp_path):
    from training.continuation import _leg_paragraph, continue_verifier
    from training.redistill import final_lr, main, redistill_drafters

    source = run_pipeline(tmp_path / "run", get_preset("smoke"), echo=None)
    target = tmp_path / "redistilled"
    argv = ["--from", str(source), "--out", str(tmp_path / "rd"), "--bundle-out", str(target), "--ar-steps", "4",
            "--nar-steps", "2", "--warmup-steps", "1", "--checkpoint-every", "2", "--threads", "1"]
    before_threads = torch.get_num_threads()
    try:
        assert main(argv) == 0  # the command line, as a user runs it
    finally:
        torch.set_num_threads(before_threads)  # the worker's other tests keep theirs
    before, after = load_bundle(source), load_bundle(target)
    assert (target / "verifier.safetensors").read_bytes() == (source / "verifier.safetensors").read_bytes()
    assert after.tokenizer.fingerprint == before.tokenizer.fingerprint
    # The targets are the shipped verifier's own search outputs on the sources.
    data = tmp_path / "rd" / "data"
    sources = load_id_pairs(data / "valid.ids.jsonl")
    preset = get_preset("smoke")
    expected = relabel_pairs(before.verifier, sources, tmp_path / "check.jsonl", num_beams=preset.distill_beams,
                             max_tokens=preset.max_tokens, chunk_size=preset.distill_chunk)
    assert load_id_pairs(data / "valid.distill.jsonl") == expected
    (leg,) = after.metadata["redistilled"]
    for role, steps in (("ar_drafter", 4), ("nar_drafter", 2)):
        old, new = before.models[role].state_dict(), after.models[role].state_dict()
        assert any(not torch.equal(old[name], new[name]) for name in old)
        # Each drafter started from its own shipped weights, not from scratch or from the other one.
        start = json.loads((tmp_path / "rd" / role / "log.jsonl").read_text().splitlines()[0])
        assert start["init_from"] == str(tmp_path / "rd" / "init" / f"{role}.pt")
        init = torch.load(start["init_from"], weights_only=True)
        assert all(torch.equal(init[name], old[name].float()) for name in old)
        assert after.metadata["validation"][role]["steps"] == before.metadata["validation"][role]["steps"] + steps
        assert leg["roles"][role]["peak_lr"] == pytest.approx(final_lr(preset, role))
    card = (target / "MODEL_CARD.md").read_text()
    assert "## Drafters re-distilled" in card and f"python -m training.redistill {' '.join(argv)}" in card
    assert f"Distilled training targets: {leg['pairs']['train']} pairs (re-distilled" in card
    for role in ("ar_drafter", "nar_drafter"):
        row = next(line for line in card.splitlines() if line.startswith(f"| {role} |"))
        assert row.endswith(f"| {after.metadata['validation'][role]['valid_acc']:.3f} |")
    with pytest.raises(ValueError, match="must differ"):
        redistill_drafters(source, tmp_path / "again", source, steps={"ar_drafter": 2, "nar_drafter": 2})

    # The verifier continued after the re-distillation: its leg opens a section below the drafters' and
    # says that the drafters it copies were re-distilled from an earlier verifier of the bundle.
    continued = continue_verifier(target, tmp_path / "cont", tmp_path / "continued", steps=2, peak_lr=3e-3,
                                  warmup_steps=1, checkpoint_every=2, command="python -m training.continuation (after)")
    (leg,) = load_bundle(continued).metadata["continued"]
    assert leg["drafters_redistilled"] is True
    card = (continued / "MODEL_CARD.md").read_text()
    assert card.index("## Drafters re-distilled") < card.index("## Verifier continued") < card.index("(after)") < (
        card.index("## Licence"))
    later = _leg_paragraph(leg | {"from": "x"}, 3)
    assert "re-distilled from an earlier verifier" in later and "before the first leg" not in later
    assert later.lstrip().startswith("Leg 3: the verifier of leg 2,")
    for role in ("nar_drafter", "ar_drafter"):
        assert (continued / f"{role}.safetensors").read_bytes() == (target / f"{role}.safetensors").read_bytes()
