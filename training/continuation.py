"""Continue fine-tuning a shipped bundle's verifier when the run that made it is gone.

    python -m training.continuation --from bundles/ua-gec-base --out runs/ua-gec-cont --steps 250 \\
        --bundle-out bundles/ua-gec [--resume]

Checkpoints stay out of the repository, so a machine that is not kept takes a run's optimiser state
with it (it happened to the base verifier's 1200-step run). What survives is the bundle: this starts a
fresh AdamW from its verifier's weights, on the data the pipeline prepares with the bundle's own
tokenizer (so token ids match the drafters), warms up briefly to `--peak-lr` and decays as the
pipeline's schedule does. The drafters are copied unchanged (byte for byte: their float16 weights
round-trip exactly). The new bundle's card is the old one with the verifier's row re-scored and a
section that says what this leg did.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

import torch

from seq2seq_models.bundle import load_bundle, save_bundle
from training.checkpoint import Interrupted
from training.data import load_id_pairs
from training.model_card import role_row
from training.pipeline import configure_threads, hardware, run_pipeline
from training.presets import ROLES, get_preset
from training.tokenizer import TOKENIZER_FILE
from training.train import (
    TrainConfig,
    count_parameters,
    evaluate,
    load_best,
    train_role,
    training_seconds,
    uses_bfloat16,
)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m training.continuation", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--from", dest="source", required=True, help="the bundle whose verifier continues")
    parser.add_argument("--out", required=True, help="run directory (data, checkpoints, logs)")
    parser.add_argument("--bundle-out", required=True, help="where the new bundle goes")
    parser.add_argument("--steps", type=int, required=True, help="optimiser steps of this leg")
    parser.add_argument("--peak-lr", type=float, default=8e-5,
                        help="lr after the warm-up (default: the base schedule's lr at step 700, 3e-4*sqrt(50/700))")
    parser.add_argument("--warmup-steps", type=int, default=40, help="warm-up of the fresh optimiser's moments")
    parser.add_argument("--checkpoint-every", type=int, default=25,
                        help="steps between checkpoints (the last four are averaged); evaluations at twice this")
    parser.add_argument("--resume", action="store_true", help="continue an interrupted leg")
    parser.add_argument("--device", help="torch device (default: cuda when present, else cpu)")
    parser.add_argument("--threads", type=int, help="CPU threads for torch (default: the CPUs this process may use)")
    args = parser.parse_args(argv)
    configure_threads(args.threads)
    command = " ".join(["python -m training.continuation", *(sys.argv[1:] if argv is None else argv)])
    try:
        bundle = continue_verifier(
            Path(args.source), Path(args.out), Path(args.bundle_out), steps=args.steps, peak_lr=args.peak_lr,
            warmup_steps=args.warmup_steps, checkpoint_every=args.checkpoint_every, resume=args.resume,
            device=args.device, command=command,
        )
    except Interrupted as exc:
        print(f"training interrupted: {exc}", file=sys.stderr)
        return 143
    print(bundle)
    return 0


def continue_verifier(
    source: Path,
    out: Path,
    bundle_out: Path,
    steps: int,
    peak_lr: float = 8e-5,
    warmup_steps: int = 40,
    checkpoint_every: int = 25,
    resume: bool = False,
    device: str | None = None,
    command: str = "",
) -> Path:
    """Train the source bundle's verifier `steps` more steps; write source's drafters beside it."""
    if bundle_out.resolve() == source.resolve():
        raise ValueError("--bundle-out must differ from --from: the source's drafters are copied from it")
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    bundle = load_bundle(source)
    preset = get_preset(bundle.metadata["preset"], bundle.metadata.get("seed", 1))
    config = leg_config(preset.training["verifier"], steps, peak_lr, warmup_steps, checkpoint_every)
    data_dir = _prepare_data(out, source, bundle, preset)
    init = out / "init" / "verifier.pt"
    if not init.is_file():
        init.parent.mkdir(parents=True, exist_ok=True)
        torch.save({k: v.float() for k, v in bundle.verifier.state_dict().items()}, init)
    train_files = ["train.ids.jsonl"] + (["train.concat.ids.jsonl"] if preset.concat_max_tokens else [])
    valid_pairs = load_id_pairs(data_dir / "valid.ids.jsonl")
    result = train_role(
        "verifier", bundle.configs["verifier"], config,
        [pair for name in train_files for pair in load_id_pairs(data_dir / name)],
        valid_pairs, out / "verifier", resume=resume, device=device, echo=sys.stdout, init_from=init,
    )
    verifier = load_best(bundle.configs["verifier"], out / "verifier").to(device)
    # The run's result holds its last step's scores; the card compares the weights shipped before
    # and after this leg, on the same validation pairs.
    valid = valid_pairs[: config.eval_max_pairs]
    before = evaluate(bundle.verifier.to(device), valid, config, torch.device(device))
    after = evaluate(verifier, valid, config, torch.device(device))
    leg = {
        "from": bundle.name, "steps": steps, "peak_lr": peak_lr, "warmup_steps": warmup_steps,
        "valid_before": before | {"steps": bundle.metadata["validation"]["verifier"]["steps"]}, "command": command,
        "hardware": hardware(device), "seconds": round(training_seconds(out / "verifier" / "log.jsonl")),
        "precision": "bfloat16 autocast" if uses_bfloat16(config.mixed_precision, torch.device(device)) else "float32",
        "average": result.get("average"),
    }
    return _write_bundle(bundle, source, bundle_out, verifier.cpu(), after, leg)


def leg_config(verifier: TrainConfig, steps: int, peak_lr: float, warmup_steps: int,
               checkpoint_every: int) -> TrainConfig:
    """The preset's verifier settings (batches, smoothing, evaluation set) on this leg's schedule; the
    weights of its last four checkpoints are averaged when that validates better."""
    if steps <= 0 or checkpoint_every <= 0 or steps % checkpoint_every:
        # Snapshots are taken at multiples of checkpoint_every: the average must end on the last step.
        raise ValueError(f"--steps ({steps}) must be a positive multiple of --checkpoint-every ({checkpoint_every})")
    return replace(verifier, max_steps=steps, peak_lr=peak_lr, warmup_steps=warmup_steps,
                   checkpoint_every=checkpoint_every, eval_every=2 * checkpoint_every, average_last=4)


def _prepare_data(out: Path, source: Path, bundle, preset) -> Path:
    """The pipeline's data, encode and concat stages, with the bundle's tokenizer in place of a new one."""
    data_dir = out / "data"
    run_pipeline(out, preset, resume=True, stop_after="data", echo=None)
    tokenizer_file = data_dir / TOKENIZER_FILE
    tokenizer_bytes = (source / TOKENIZER_FILE).read_bytes()
    if not tokenizer_file.is_file():
        tokenizer_file.write_bytes(tokenizer_bytes)
    elif tokenizer_file.read_bytes() != tokenizer_bytes:
        raise ValueError(f"{tokenizer_file} is not {source}'s tokenizer: use a fresh --out")
    marker = out / "stages" / "tokenizer.json"
    if not marker.is_file():
        marker.write_text(json.dumps({"vocab_size": bundle.tokenizer.vocab_size,
                                      "fingerprint": bundle.tokenizer.fingerprint}) + "\n")
    run_pipeline(out, preset, resume=True, stop_after="concat", echo=None)
    return data_dir


def _write_bundle(bundle, source: Path, target: Path, verifier, scores: dict, leg: dict) -> Path:
    models = {role: bundle.models[role] for role in ROLES if role in bundle.configs and role != "verifier"}
    models["verifier"] = verifier
    validation = dict(bundle.metadata["validation"])
    validation["verifier"] = {k: scores[k] for k in ("valid_loss", "valid_ppl", "valid_acc")} | {
        "steps": validation["verifier"]["steps"] + leg["steps"]}
    metadata = bundle.metadata | {"validation": validation, "continued": leg}
    config = json.loads((source / "config.json").read_text())
    dtype = config["models"]["verifier"]["dtype"]
    save_bundle(target, (source / TOKENIZER_FILE).read_bytes(), models, name=bundle.name, metadata=metadata,
                weights_dtype=dtype)
    row = role_row("verifier", {**validation["verifier"], "params": count_parameters(verifier),
                                "architecture": bundle.configs["verifier"].to_dict()})
    card = "\n".join(row if line.startswith("| verifier |") else line
                     for line in (source / "MODEL_CARD.md").read_text().split("\n"))
    card = card.replace("\n## Licence", _leg_section(leg, validation["verifier"]) + "\n## Licence", 1)
    (target / "MODEL_CARD.md").write_text(card)
    training = json.loads((source / "TRAINING.json").read_text()) if (source / "TRAINING.json").is_file() else {}
    training["continued"] = leg
    (target / "TRAINING.json").write_text(json.dumps(training, indent=2, default=str) + "\n")
    return target


def _leg_section(leg: dict, after: dict) -> str:
    before = leg["valid_before"]
    average = leg.get("average") or {}
    averaged = (f" The weights kept are the average of steps {', '.join(map(str, average['steps']))} of this leg."
                if average.get("kept") else "")
    return (
        f"\n## Verifier continued\n\n"
        f"The verifier above is {leg['from']}'s ({before['steps']} fine-tuning steps) trained "
        f"{leg['steps']} steps more by `training/continuation.py`: a fresh AdamW from its weights, warm-up "
        f"{leg['warmup_steps']} steps to lr {leg['peak_lr']:g}, then inverse-square-root decay, on the same "
        f"fine-tuning pairs.{averaged} Validation loss {before['valid_loss']:.4f} -> {after['valid_loss']:.4f}, "
        f"token accuracy {before['valid_acc']:.3f} -> {after['valid_acc']:.3f}. The drafters are "
        f"{leg['from']}'s, unchanged (distilled from the verifier before this leg).\n\n"
        f"```\n{leg['command']}\n```\n\n"
        f"Hardware: {leg['hardware']}; training forward in {leg['precision']}; "
        f"{leg['seconds'] / 3600:.1f} h.\n"
    )


if __name__ == "__main__":
    raise SystemExit(main())
