"""Continue fine-tuning a shipped bundle's verifier when the run that made it is gone.

    python -m training.continuation --from bundles/ua-gec --out runs/ua-gec-cont --steps 250 \\
        --bundle-out runs/ua-gec-continued [--resume]

Checkpoints stay out of the repository, so a machine that is not kept takes a run's optimiser state
with it (it happened to the base verifier's 1200-step run). What survives is the bundle: this starts a
fresh AdamW from its verifier's weights, on the data the pipeline prepares with the bundle's own
tokenizer (so token ids match the drafters), warms up briefly to `--peak-lr` and decays as the
pipeline's schedule does. The drafters are copied unchanged (byte for byte: their float16 weights
round-trip exactly). The new bundle's card is the old one with the verifier's row re-scored and a
paragraph that says what this leg did. Legs chain: a continued bundle can be continued again, and its
metadata keeps every leg in order (`continued`, a list).
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from pathlib import Path

import torch

from training.bundle_legs import (
    earlier_legs,
    leg_config,
    leg_parser,
    open_leg,
    precision_name,
    prepare_bundle_data,
    run_leg,
    save_init,
    write_leg_bundle,
)
from training.data import load_id_pairs
from training.pipeline import hardware
from training.train import evaluate, load_best, train_role, training_seconds


def main(argv: Sequence[str] | None = None) -> int:
    parser = leg_parser("training.continuation", __doc__, "the bundle whose verifier continues")
    parser.add_argument("--steps", type=int, required=True, help="optimiser steps of this leg")
    parser.add_argument("--peak-lr", type=float, default=8e-5,
                        help="lr after the warm-up (default: the base schedule's lr at step 700, 3e-4*sqrt(50/700))")
    return run_leg("training.continuation", parser, argv, lambda args, command: continue_verifier(
        Path(args.source), Path(args.out), Path(args.bundle_out), steps=args.steps, peak_lr=args.peak_lr,
        warmup_steps=args.warmup_steps, checkpoint_every=args.checkpoint_every, resume=args.resume,
        device=args.device, command=command,
    ))


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
    bundle, preset, device = open_leg(source, bundle_out, "drafters are", device)
    config = leg_config(preset.training["verifier"], steps, peak_lr, warmup_steps, checkpoint_every)
    data_dir = prepare_bundle_data(out, source, bundle, preset)
    init = save_init(bundle.verifier, out / "init" / "verifier.pt")
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
        "from": str(source), "steps": steps, "peak_lr": peak_lr, "warmup_steps": warmup_steps,
        "valid_before": before | {"steps": bundle.metadata["validation"]["verifier"]["steps"]},
        "valid_after": after, "command": command,
        "hardware": hardware(device), "seconds": round(training_seconds(out / "verifier" / "log.jsonl")),
        "precision": precision_name(config, device),
        "average": result.get("average"),
        # Whether the drafters this leg copies were re-distilled (from some earlier verifier of the bundle):
        # the card's paragraph says which drafters ship, and only the source's metadata knows.
        "drafters_redistilled": bool(earlier_legs(bundle.metadata, "redistilled")),
    }
    return write_leg_bundle(bundle, source, bundle_out, {"verifier": verifier.cpu()}, {"verifier": after},
                            {"verifier": steps}, "continued", leg, "Verifier continued", _leg_paragraph)


def _leg_paragraph(leg: dict, number: int) -> str:
    before, after = leg["valid_before"], leg["valid_after"]
    average = leg.get("average") or {}
    averaged = (f" The weights kept are the average of steps {', '.join(map(str, average['steps']))} of this leg."
                if average.get("kept") else "")
    # The first leg reads as it did before legs chained; a later one says which it is.
    if number == 1:
        opening = f"The verifier above is {leg['from']}'s ({before['steps']} fine-tuning steps)"
        drafters = f"{leg['from']}'s, unchanged (distilled from the verifier before this leg)"
    else:
        opening = (f"Leg {number}: the verifier of leg {number - 1}, as shipped in {leg['from']} "
                   f"({before['steps']} steps),")
        drafters = ("the ones re-distilled from an earlier verifier of this bundle (\"Drafters re-distilled\"), "
                    "unchanged" if leg.get("drafters_redistilled") else "still the ones distilled before the first leg")
    return (
        f"\n{opening} trained {leg['steps']} steps more by `training/continuation.py`: a fresh AdamW from its "
        f"weights, warm-up {leg['warmup_steps']} steps to lr {leg['peak_lr']:g}, then inverse-square-root decay, on "
        f"the same fine-tuning pairs.{averaged} Validation loss {before['valid_loss']:.4f} -> "
        f"{after['valid_loss']:.4f}, token accuracy {before['valid_acc']:.3f} -> {after['valid_acc']:.3f}. "
        f"The drafters are {drafters}.\n\n"
        f"```\n{leg['command']}\n```\n\n"
        f"Hardware: {leg['hardware']}; training forward in {leg['precision']}; "
        f"{leg['seconds'] / 3600:.1f} h.\n"
    )


if __name__ == "__main__":
    raise SystemExit(main())
