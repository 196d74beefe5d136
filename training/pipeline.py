"""The whole training run, stage by stage, in one command:

    python -m training.pipeline --out runs/ua-gec [--preset full|cpu|smoke] [--resume]

Stages: data -> tokenizer -> encode -> verifier -> distill -> nar_drafter -> ar_drafter -> bundle.
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
from training.arguments import STAGES, add_arguments
from training.checkpoint import Interrupted
from training.data import (
    encode_pairs,
    load_id_pairs,
    load_text_pairs,
    prepare_text_splits,
    write_id_pairs,
)
from training.distill import distill_pairs
from training.model_card import render_model_card
from training.presets import ROLES, Preset, get_preset
from training.tokenizer import TOKENIZER_FILE, train_shared_tokenizer
from training.train import JsonLog, load_best, train_role

DEFAULT_FULL_BUNDLE = Path(__file__).resolve().parent.parent / "bundles" / "ua-gec"


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

    def train_stage(role: str, train_file: str, valid_file: str) -> None:
        if stages.done(role):
            return
        tokenizer_vocab = stages.result("tokenizer")["vocab_size"]
        result = train_role(
            role, preset.model_config(role, tokenizer_vocab), preset.training[role],
            load_id_pairs(data_dir / train_file), load_id_pairs(data_dir / valid_file), out / role,
            resume=resume, device=device, echo=echo,
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
            elif stage == "verifier":
                train_stage("verifier", "train.ids.jsonl", "valid.ids.jsonl")
            elif stage == "distill":
                verifier = load_best(preset.model_config("verifier", stages.result("tokenizer")["vocab_size"]),
                                     out / "verifier").to(device)
                counts = {}
                for split in ("train", "valid"):
                    pairs = distill_pairs(
                        verifier, load_id_pairs(data_dir / f"{split}.ids.jsonl"), data_dir / f"{split}.distill.jsonl",
                        num_beams=preset.distill_beams, max_tokens=preset.max_tokens, chunk_size=preset.distill_chunk,
                        log=lambda split=split, **r: log.write(split=split, **r),
                    )
                    counts[split] = len(pairs)
                stages.finish(stage, counts)
            elif stage in ("nar_drafter", "ar_drafter"):
                train_stage(stage, "train.distill.jsonl", "valid.distill.jsonl")
            elif stage == "bundle":
                target = Path(bundle_out) if bundle_out else (DEFAULT_FULL_BUNDLE if preset.name == "full"
                                                              else out / "bundle")
                assemble_bundle(out, preset, target, command, device)
                stages.finish(stage, {"path": str(target)})
            log.write(event="stage_done", stage=stage, seconds=round(time.perf_counter() - started, 2))
        if stage == stop_after:
            return None
    return Path(stages.result("bundle")["path"])


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
    save_bundle(target, tokenizer_bytes, models, name=f"ua-gec-{preset.name}", metadata=metadata)
    card = render_model_card({
        "name": f"ua-gec-{preset.name}",
        "vocab": vocab,
        "roles": roles_info,
        "k_max": preset.training["nar_drafter"].nar_k_max,
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
        "torch_version": torch.__version__,
        "finished": time.strftime("%Y-%m-%d", time.gmtime()),
    })
    (target / "MODEL_CARD.md").write_text(card)
    (target / "TRAINING.json").write_text(
        json.dumps({"preset": asdict(preset) | {"training": {r: asdict(c) for r, c in preset.training.items()}},
                    "results": roles_info}, indent=2, default=str) + "\n"
    )
    return target


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
