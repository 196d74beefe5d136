"""Re-distil a bundle's drafters from its verifier, each drafter starting from the one it replaces.

    python -m training.redistill --from runs/ua-gec-cont2/bundle --out runs/ua-gec-redistill \\
        --bundle-out bundles/ua-gec [--ar-steps 250] [--nar-steps 500] [--resume]

Sequence-level distillation trains the drafters on their verifier's own outputs. A verifier trained
on by `training/continuation.py` writes somewhat different text, and drafters distilled from the old
one draft for the old one (fewer tokens accepted). The pipeline's drafter stages would train new
ones from scratch (~3 h on 2 CPU cores in float32); most of what the old drafters learnt still holds,
so this re-labels the training and validation sources with the bundle's verifier (the pipeline's
distill stage, with its search width; resumable) and trains each drafter on from its own weights: a
fresh AdamW, a short warm-up to the lr its pipeline schedule had reached at its last step, then
inverse-square-root decay, the last four checkpoints averaged when that validates better. The
verifier is copied byte for byte.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import torch

from training import bundle_legs
from training.beam_relabel import relabel_pairs
from training.data import load_id_pairs
from training.pipeline import hardware
from training.presets import Preset
from training.train import evaluate, inverse_sqrt, load_best, train_role, training_seconds

DRAFTERS = ("ar_drafter", "nar_drafter")


def main(argv: Sequence[str] | None = None) -> int:
    parser = bundle_legs.leg_parser("training.redistill", __doc__, "the bundle whose verifier teaches")
    parser.add_argument("--ar-steps", type=int, default=250, help="optimiser steps of the AR drafter")
    parser.add_argument("--nar-steps", type=int, default=500, help="optimiser steps of the NAR drafter")
    return bundle_legs.run_leg("training.redistill", parser, argv, lambda args, command: redistill_drafters(
        Path(args.source), Path(args.out), Path(args.bundle_out),
        steps={"ar_drafter": args.ar_steps, "nar_drafter": args.nar_steps}, warmup_steps=args.warmup_steps,
        checkpoint_every=args.checkpoint_every, resume=args.resume, device=args.device, command=command,
    ))


def redistill_drafters(
    source: Path, out: Path, bundle_out: Path, steps: dict[str, int], warmup_steps: int = 40,
    checkpoint_every: int = 25, resume: bool = False, device: str | None = None, command: str = "",
) -> Path:
    """Distil `source`'s verifier into new targets, train each drafter `steps[role]` more steps on
    them from its own weights, and write the bundle (the verifier unchanged) to `bundle_out`."""
    bundle, preset, device = bundle_legs.open_leg(source, bundle_out, "verifier is", device)
    configs = {
        role: bundle_legs.leg_config(preset.training[role], steps[role], final_lr(preset, role), warmup_steps,
                                     checkpoint_every)
        for role in DRAFTERS
    }
    data_dir = bundle_legs.prepare_bundle_data(out, source, bundle, preset)
    started = time.perf_counter()
    distilled = _distill(bundle.verifier.to(device), data_dir, preset)
    distill_seconds = time.perf_counter() - started
    valid = distilled["valid"]
    trained, scores, roles = {}, {}, {}
    for role in DRAFTERS:
        config = configs[role]
        init = bundle_legs.save_init(bundle.models[role], out / "init" / f"{role}.pt")
        result = train_role(
            role, bundle.configs[role], config, distilled["train"], valid, out / role, resume=resume,
            device=device, echo=sys.stdout, init_from=init,
        )
        model = load_best(bundle.configs[role], out / role).to(device)
        # Both scored on the new targets: how much closer to the new verifier the drafter got.
        pairs = valid[: config.eval_max_pairs]
        before = evaluate(bundle.models[role].to(device), pairs, config, torch.device(device))
        scores[role] = evaluate(model, pairs, config, torch.device(device))
        trained[role] = model.cpu()
        roles[role] = {
            "steps": steps[role], "peak_lr": config.peak_lr, "valid_before": before, "valid_after": scores[role],
            "seconds": round(training_seconds(out / role / "log.jsonl")), "average": result.get("average"),
        }
    leg = {
        "from": str(source), "warmup_steps": warmup_steps, "search_beams": preset.distill_beams,
        "pairs": {split: len(pairs) for split, pairs in distilled.items()}, "distill_seconds": round(distill_seconds),
        "roles": roles, "command": command, "hardware": hardware(device),
        "precision": bundle_legs.precision_name(configs["ar_drafter"], device),
    }
    card_lines = {"Distilled training targets:": f"Distilled training targets: {leg['pairs']['train']} pairs "
                                                 f"(re-distilled from the verifier above, see below)."}
    return bundle_legs.write_leg_bundle(bundle, source, bundle_out, trained, scores, steps, "redistilled", leg,
                            "Drafters re-distilled", _leg_paragraph, card_lines)


def final_lr(preset: Preset, role: str) -> float:
    """The lr the preset's inverse-sqrt schedule reaches at the role's last step: where training it
    from scratch left off, so a leg neither shakes its weights loose nor crawls."""
    config = preset.training[role]
    return config.peak_lr * inverse_sqrt(config.warmup_steps)(config.max_steps)


def _distill(verifier, data_dir: Path, preset: Preset) -> dict[str, list]:
    """The verifier's outputs on the training and validation sources (the pipeline's distill stage,
    which resumes from a partial file), as (source, output) pairs; progress as JSON lines on stdout."""
    return {split: relabel_pairs(verifier, load_id_pairs(data_dir / f"{split}.ids.jsonl"),
                                 data_dir / f"{split}.distill.jsonl", num_beams=preset.distill_beams,
                                 max_tokens=preset.max_tokens, chunk_size=preset.distill_chunk,
                                 log=lambda split=split, **r: print(json.dumps({"split": split, **r}), flush=True))
            for split in ("train", "valid")}


def _leg_paragraph(leg: dict, number: int) -> str:
    search = "greedy" if leg["search_beams"] == 1 else f"beam-{leg['search_beams']}"
    per_role = []
    for role, r in leg["roles"].items():
        before, after = r["valid_before"], r["valid_after"]
        averaged = (f", the average of steps {', '.join(map(str, r['average']['steps']))} kept"
                    if (r.get("average") or {}).get("kept") else "")
        per_role.append(f"{role} {r['steps']} steps at lr {r['peak_lr']:.2g}{averaged}: validation loss "
                        f"{before['valid_loss']:.4f} -> {after['valid_loss']:.4f}, token accuracy "
                        f"{before['valid_acc']:.3f} -> {after['valid_acc']:.3f}, in {r['seconds'] / 3600:.1f} h")
    opening = "The drafters above were" if number == 1 else f"Leg {number}: the drafters were again"
    return (
        f"\n{opening} re-distilled from {leg['from']}'s verifier by `training/redistill.py`: its {search} "
        f"outputs on the {leg['pairs']['train']} training and {leg['pairs']['valid']} validation sources are the "
        f"new targets ({leg['distill_seconds'] / 60:.0f} min), and each drafter trained on from its own weights "
        f"(a fresh AdamW, warm-up {leg['warmup_steps']} steps, then inverse-square-root decay; scores on the "
        f"new validation targets, before -> after): {'; '.join(per_role)}. The verifier is unchanged.\n\n"
        f"```\n{leg['command']}\n```\n\n"
        f"Hardware: {leg['hardware']}; training forward in {leg['precision']}.\n"
    )


if __name__ == "__main__":
    raise SystemExit(main())
