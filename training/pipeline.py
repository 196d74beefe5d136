"""The whole training run, stage by stage, in one command:

    python -m training.pipeline --out runs/ua-gec [--preset base|full|cpu|smoke] [--resume]

Stages: data -> tokenizer -> encode -> concat -> synthetic -> pretrain -> verifier -> distill ->
ar_drafter -> nar_drafter -> bundle. `concat` joins consecutive sentences of a document into long
pairs (presets with `concat_max_tokens`). `synthetic` corrupts the clean training targets with
UA-GEC's own kinds and rates of error (training/synthetic.py) and `pretrain` trains the verifier's
shape on those pairs and the real ones; `verifier` then fine-tunes those weights on the real pairs
(and the long ones). Presets without synthetic pairs skip both `synthetic` and `pretrain`, and
`verifier` starts from scratch. With `nar_from_ar_drafter` the NAR drafter starts from the AR
drafter's best weights (training/transfer.py says why).
A finished stage leaves `OUT/stages/<stage>.json` and is skipped on the next run; a training
stage interrupted by SIGTERM / Ctrl-C checkpoints and continues with `--resume`.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any, TextIO

import torch

from seq2seq_models.bundle import save_bundle
from training.arguments import SHIPPED_PRESET, STAGES, add_arguments
from training.beam_relabel import relabel_pairs
from training.checkpoint import Interrupted
from training.data import (
    TextPair,
    concatenate_pairs,
    encode_pairs,
    is_valid_doc,
    load_id_pairs,
    load_text_pairs,
    prepare_text_splits,
    write_id_pairs,
)
from training.model_card import render_model_card
from training.presets import ROLES, Preset, get_preset
from training.synthetic import learn_error_model, synthetic_pairs, ua_gec_edits
from training.tokenizer import TOKENIZER_FILE, train_shared_tokenizer
from training.train import JsonLog, load_best, train_role, training_seconds

SHIPPED_BUNDLE = Path(__file__).resolve().parent.parent / "bundles" / "ua-gec"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m training.pipeline", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    args = parser.parse_args(argv)
    return run_from_args(args, " ".join(["python -m training.pipeline", *(sys.argv[1:] if argv is None else argv)]))


def run_from_args(args: argparse.Namespace, command: str) -> int:
    configure_threads(args.threads)
    try:
        bundle = run_pipeline(
            Path(args.out), get_preset(args.preset, args.seed), resume=args.resume, device=args.device,
            bundle_out=args.bundle_out, stop_after=args.stop_after,
            command=command,
        )
    except Interrupted as exc:
        print(f"training interrupted: {exc}", file=sys.stderr)
        return 143
    if bundle is not None:
        print(bundle)
    return 0


def run_pipeline(
    out: Path,
    preset: Preset,
    resume: bool = False,
    device: str | None = None,
    bundle_out: str | Path | None = None,
    stop_after: str | None = None,
    command: str = "",
    echo: TextIO | None = sys.stdout,
) -> Path | None:
    """Run every unfinished stage in order; returns the bundle directory (None with stop_after)."""
    out.mkdir(parents=True, exist_ok=True)
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    log = JsonLog(out / "pipeline.log.jsonl", echo, preset=preset.name)
    data_dir = out / "data"
    stages = _Stages(out / "stages", log)

    def train_stage(role: str, train_files: Sequence[str], valid_file: str, init_from: Path | None = None) -> None:
        if stages.done(role):
            return
        tokenizer_vocab = stages.result("tokenizer")["vocab_size"]
        train_pairs = [pair for name in train_files for pair in load_id_pairs(data_dir / name)]
        result = train_role(
            role, preset.model_config(role, tokenizer_vocab), preset.training[role],
            train_pairs, load_id_pairs(data_dir / valid_file), out / role,
            resume=resume, device=device, echo=echo, init_from=init_from,
        )
        stages.finish(role, result)

    for stage in STAGES:
        if stages.done(stage):
            log.write(event="skip", stage=stage)
        else:
            log.write(event="stage", stage=stage)
            started = time.perf_counter()
            if stage == "data":
                paths = prepare_text_splits(data_dir, preset.max_pairs)
                stages.finish(stage, {name: len(load_text_pairs(p)) for name, p in paths.items()})
            elif stage == "tokenizer":
                train_text = load_text_pairs(data_dir / "train.text.jsonl")
                tok = train_shared_tokenizer(train_text, data_dir, preset.vocab_size)
                stages.finish(stage, {"vocab_size": tok.vocab_size, "fingerprint": tok.fingerprint})
            elif stage == "encode":
                tok = train_shared_tokenizer([], data_dir)  # already trained: loads it
                counts = {}
                for split in ("train", "valid"):
                    pairs = encode_pairs(load_text_pairs(data_dir / f"{split}.text.jsonl"), tok, preset.max_tokens)
                    write_id_pairs(data_dir / f"{split}.ids.jsonl", pairs)
                    counts[split] = len(pairs)
                stages.finish(stage, counts)
            elif stage == "concat":
                stages.finish(stage, make_concatenated_pairs(data_dir, preset) if preset.concat_max_tokens else
                              {"skipped": True})
            elif stage == "synthetic":
                stages.finish(stage, make_synthetic_pairs(data_dir, preset) if preset.synthetic_copies else
                              {"skipped": True})
            elif stage == "pretrain":
                if preset.synthetic_copies:
                    train_stage("pretrain", ["synthetic.ids.jsonl", "train.ids.jsonl"], "valid.ids.jsonl")
                else:
                    stages.finish(stage, {"skipped": True})
            elif stage == "verifier":
                pretrained = out / "pretrain" / "best.pt" if preset.synthetic_copies else None
                concatenated = ["train.concat.ids.jsonl"] if preset.concat_max_tokens else []
                train_stage("verifier", ["train.ids.jsonl", *concatenated], "valid.ids.jsonl", init_from=pretrained)
            elif stage == "distill":
                verifier = load_best(preset.model_config("verifier", stages.result("tokenizer")["vocab_size"]),
                                     out / "verifier").to(device)
                counts = {}
                for split in ("train", "valid"):
                    pairs = relabel_pairs(
                        verifier, load_id_pairs(data_dir / f"{split}.ids.jsonl"), data_dir / f"{split}.distill.jsonl",
                        num_beams=preset.distill_beams, max_tokens=preset.max_tokens, chunk_size=preset.distill_chunk,
                        log=lambda split=split, **r: log.write(split=split, **r),
                    )
                    counts[split] = len(pairs)
                stages.finish(stage, counts)
            elif stage == "ar_drafter":
                train_stage(stage, ["train.distill.jsonl"], "valid.distill.jsonl")
            elif stage == "nar_drafter":
                ar_drafter = out / "ar_drafter" / "best.pt" if preset.nar_from_ar_drafter else None
                train_stage(stage, ["train.distill.jsonl"], "valid.distill.jsonl", init_from=ar_drafter)
            elif stage == "bundle":
                target = Path(bundle_out) if bundle_out else (SHIPPED_BUNDLE if preset.name == SHIPPED_PRESET
                                                              else out / "bundle")
                assemble_bundle(out, preset, target, command, device)
                stages.finish(stage, {"path": str(target)})
            log.write(event="stage_done", stage=stage, seconds=round(time.perf_counter() - started, 2))
        if stage == stop_after:
            return None
    return Path(stages.result("bundle")["path"])


def make_concatenated_pairs(data_dir: Path, preset: Preset) -> dict[str, Any]:
    """The concat stage: long pairs of consecutive training sentences (`concatenate_pairs`)."""
    tok = train_shared_tokenizer([], data_dir)  # trained by the tokenizer stage: loads it
    pairs = concatenate_pairs(load_text_pairs(data_dir / "train.text.jsonl"), tok, preset.concat_max_tokens,
                              preset.seed)
    write_id_pairs(data_dir / "train.concat.ids.jsonl", pairs)
    lengths = sorted(len(p.source) + 1 for p in pairs)
    return {"pairs": len(pairs), "max_tokens": preset.concat_max_tokens,
            "median_source_tokens": lengths[len(lengths) // 2] if lengths else 0}


def make_synthetic_pairs(data_dir: Path, preset: Preset) -> dict[str, Any]:
    """The synthetic stage: learn UA-GEC's errors from its training documents, corrupt the unique
    clean training targets `preset.synthetic_copies` times, tokenise the pairs."""
    edits, words = ua_gec_edits("train", keep_doc=lambda doc_id: not is_valid_doc(doc_id))
    model = learn_error_model(edits, words)
    (data_dir / "error_model.json").write_text(json.dumps(model.to_json(), ensure_ascii=False) + "\n")
    clean = sorted({p.target for p in load_text_pairs(data_dir / "train.text.jsonl")})
    pairs = synthetic_pairs(clean, model, preset.synthetic_copies, preset.seed, preset.synthetic_scale)
    text_pairs = [TextPair(doc_id=f"synthetic-{i}", index=0, source=src, target=tgt)
                  for i, (src, tgt) in enumerate(pairs)]
    tok = train_shared_tokenizer([], data_dir)  # trained by the tokenizer stage: loads it
    encoded = encode_pairs(text_pairs, tok, preset.max_tokens)
    write_id_pairs(data_dir / "synthetic.ids.jsonl", encoded)
    changed = sum(p.source != p.target for p in text_pairs)
    return {"clean_sentences": len(clean), "pairs": len(encoded), "changed": round(changed / max(len(pairs), 1), 4),
            "annotated_words": words, "annotated_edits": len(edits),
            "rates": {t: round(model.rate(t), 5) for t in sorted(model.counts)}}


def assemble_bundle(out: Path, preset: Preset, target: Path, command: str, device: str) -> Path:
    """Save the best weights of the three roles as a bundle, with MODEL_CARD.md next to config.json."""
    data_dir = out / "data"
    tokenizer_bytes = (data_dir / TOKENIZER_FILE).read_bytes()
    vocab = json.loads((out / "stages" / "tokenizer.json").read_text())["vocab_size"]
    models, roles_info = {}, {}
    for role in ROLES:
        cfg = preset.model_config(role, vocab)
        models[role] = load_best(cfg, out / role)
        result = json.loads((out / role / "result.json").read_text())
        roles_info[role] = {**result, "architecture": cfg.to_dict()}
    data_counts = json.loads((out / "stages" / "data.json").read_text())
    encoded = json.loads((out / "stages" / "encode.json").read_text())
    distilled = json.loads((out / "stages" / "distill.json").read_text())
    metadata = {
        "kind": "trained",
        "dataset": "UA-GEC (CC-BY-4.0)",
        "preset": preset.name,
        "seed": preset.seed,
        "validation": {role: {k: info[k] for k in ("valid_loss", "valid_ppl", "valid_acc", "steps")}
                       for role, info in roles_info.items()},
    }
    save_bundle(target, tokenizer_bytes, models, name=f"ua-gec-{preset.name}", metadata=metadata,
                weights_dtype=preset.weights_dtype)
    stages = out / "stages"
    synthetic = json.loads((stages / "synthetic.json").read_text()) if (stages / "synthetic.json").is_file() else {}
    card = render_model_card({
        "name": f"ua-gec-{preset.name}",
        "vocab": vocab,
        "roles": roles_info,
        "synthetic": synthetic,
        "synthetic_copies": preset.synthetic_copies,
        "concat": json.loads((stages / "concat.json").read_text()) if (stages / "concat.json").is_file() else {},
        "pretrain": json.loads((out / "pretrain" / "result.json").read_text()) if synthetic.get("pairs") else None,
        "k_max": preset.training["nar_drafter"].nar_k_max,
        "nar_from_ar_drafter": preset.nar_from_ar_drafter,
        "glat": preset.training["nar_drafter"].glat_ratio,
        "beams": preset.distill_beams,
        "ua_gec_version": _package_version("ua-gec"),
        "max_tokens": preset.max_tokens,
        "n_train": encoded["train"],
        "n_valid": encoded["valid"],
        "n_test": data_counts["test"],
        "n_distilled": distilled["train"],
        "command": command,
        "preset": preset.name,
        "seed": preset.seed,
        "device": device,
        "hardware": hardware(device),
        "precision": training_precision(out),
        "stage_seconds": stage_seconds(out),
        "weights_dtype": preset.weights_dtype,
        "torch_version": torch.__version__,
        "finished": time.strftime("%Y-%m-%d", time.gmtime()),
    })
    (target / "MODEL_CARD.md").write_text(card)
    (target / "TRAINING.json").write_text(
        json.dumps({"preset": asdict(preset) | {"training": {r: asdict(c) for r, c in preset.training.items()}},
                    "results": roles_info}, indent=2, default=str) + "\n"
    )
    return target


def stage_seconds(out: Path) -> dict[str, float]:
    """Wall time of each finished stage but the bundle: training stages from their roles' logs
    (every resumed run counted), the others from the pipeline log."""
    seconds: dict[str, float] = {}
    log = out / "pipeline.log.jsonl"
    records = [json.loads(line) for line in log.read_text().splitlines()] if log.is_file() else []
    for record in records:
        if record.get("event") == "stage_done" and record["stage"] != "bundle":
            seconds[record["stage"]] = record["seconds"]
    for stage in seconds:
        if (out / stage / "log.jsonl").is_file():
            seconds[stage] = training_seconds(out / stage / "log.jsonl")
    return {stage: seconds[stage] for stage in STAGES if stage in seconds}


def training_precision(out: Path) -> str:
    """The training forward's arithmetic per training stage, as each run (resumed ones too) logged it."""
    per_stage: dict[str, set[str]] = {}
    for stage in STAGES:
        log = out / stage / "log.jsonl"
        if log.is_file():
            records = (json.loads(line) for line in log.read_text().splitlines())
            per_stage[stage] = {r["precision"] for r in records if r.get("event") == "start" and "precision" in r}
    kinds = {" and ".join(sorted(v)) for v in per_stage.values() if v}
    if not kinds:
        return "not recorded"
    if len(kinds) == 1 and all(per_stage.values()):
        return kinds.pop()
    return ", ".join(f"{stage} {' and '.join(sorted(v)) or 'not recorded'}" for stage, v in per_stage.items())


def hardware(device: str) -> str:
    """The accelerator, else the CPU model, and the torch threads: what the card's times were measured on."""
    if str(device).startswith("cuda"):
        return torch.cuda.get_device_name(torch.device(device))
    model = "unknown CPU"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{model}, {torch.get_num_threads()} torch threads, no GPU"


def configure_threads(threads: int | None = None) -> int:
    """Use the CPUs this process may run on (affinity / container limits), not the host's count."""
    if threads is None:
        try:
            threads = len(os.sched_getaffinity(0))
        except AttributeError:  # not on Linux
            threads = os.cpu_count() or 1
    torch.set_num_threads(max(1, threads))
    return threads


class _Stages:
    """Stage-completion markers: OUT/stages/<stage>.json with the stage's result."""

    def __init__(self, root: Path, log: JsonLog) -> None:
        self.root = root
        self.log = log
        root.mkdir(parents=True, exist_ok=True)

    def done(self, stage: str) -> bool:
        return (self.root / f"{stage}.json").is_file()

    def result(self, stage: str) -> dict[str, Any]:
        return json.loads((self.root / f"{stage}.json").read_text())

    def finish(self, stage: str, result: dict[str, Any]) -> None:
        tmp = self.root / f"{stage}.json.tmp"
        tmp.write_text(json.dumps(result, indent=2, default=str) + "\n")
        tmp.replace(self.root / f"{stage}.json")


def _package_version(name: str) -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(name)
    except PackageNotFoundError:
        return "unknown version"


if __name__ == "__main__":
    sys.exit(main())
