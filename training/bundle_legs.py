"""What training a shipped bundle further has in common, whichever models a leg trains.

A *leg* starts from a bundle (not from a run's checkpoints, which never enter the repository and
go with the machine that made them), trains some of its models on, and writes a new bundle: the
models it did not train copied unchanged (their float16 weights round-trip byte for byte), the card
with the trained models' rows re-scored and a paragraph saying what the leg did, and the leg
recorded in the metadata under its kind (a list, so legs chain). `training/continuation.py` (the
verifier) and `training/redistill.py` (the drafters) are the two kinds.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from pathlib import Path

import torch

from seq2seq_models.bundle import ModelBundle, load_bundle, save_bundle
from seq2seq_models.transformer import Seq2SeqTransformer
from training.checkpoint import Interrupted
from training.model_card import role_row
from training.pipeline import configure_threads, run_pipeline
from training.presets import ROLES, Preset, get_preset
from training.tokenizer import TOKENIZER_FILE
from training.train import TrainConfig, count_parameters, uses_bfloat16


def leg_parser(module: str, doc: str | None, source_help: str) -> argparse.ArgumentParser:
    """The command line every kind of leg shares; each adds its own steps and rates."""
    parser = argparse.ArgumentParser(prog=f"python -m {module}", description=doc,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--from", dest="source", required=True, help=source_help)
    parser.add_argument("--out", required=True, help="run directory (data, checkpoints, logs)")
    parser.add_argument("--bundle-out", required=True, help="where the new bundle goes")
    parser.add_argument("--warmup-steps", type=int, default=40, help="warm-up of the fresh optimisers' moments")
    parser.add_argument("--checkpoint-every", type=int, default=25,
                        help="steps between checkpoints (the last four are averaged); evaluations at twice this")
    parser.add_argument("--resume", action="store_true", help="continue an interrupted leg")
    parser.add_argument("--device", help="torch device (default: cuda when present, else cpu)")
    parser.add_argument("--threads", type=int, help="CPU threads for torch (default: the CPUs this process may use)")
    return parser


def run_leg(module: str, parser: argparse.ArgumentParser, argv: Sequence[str] | None,
            leg: Callable[[argparse.Namespace, str], Path]) -> int:
    """Parse, set torch's threads, run `leg(args, command)` and print the bundle it wrote; 143 when
    a signal interrupted it (it checkpointed: rerun with --resume)."""
    args = parser.parse_args(argv)
    configure_threads(args.threads)
    command = " ".join([f"python -m {module}", *(sys.argv[1:] if argv is None else argv)])
    try:
        bundle = leg(args, command)
    except Interrupted as exc:
        print(f"training interrupted: {exc}", file=sys.stderr)
        return 143
    print(bundle)
    return 0


def open_leg(source: Path, bundle_out: Path, copied: str, device: str | None) -> tuple[ModelBundle, Preset, str]:
    """The source bundle, the preset that made it, and the device (cuda when present); `bundle_out`
    must be another directory, since the models the leg does not train (`copied`) are read from `source`."""
    if bundle_out.resolve() == source.resolve():
        raise ValueError(f"--bundle-out must differ from --from: the source's {copied} copied from it")
    bundle = load_bundle(source)
    preset = get_preset(bundle.metadata["preset"], bundle.metadata.get("seed", 1))
    return bundle, preset, device or ("cuda" if torch.cuda.is_available() else "cpu")


def precision_name(config: TrainConfig, device: str) -> str:
    """How the leg's training forward ran, for its card."""
    return "bfloat16 autocast" if uses_bfloat16(config.mixed_precision, torch.device(device)) else "float32"


def leg_config(role: TrainConfig, steps: int, peak_lr: float, warmup_steps: int,
               checkpoint_every: int) -> TrainConfig:
    """The preset's settings for a role (batches, smoothing, evaluation set) on a leg's schedule; the
    weights of its last four checkpoints are averaged when that validates better."""
    if steps <= 0 or checkpoint_every <= 0 or steps % checkpoint_every:
        # Snapshots are taken at multiples of checkpoint_every: the average must end on the last step.
        raise ValueError(f"steps ({steps}) must be a positive multiple of --checkpoint-every ({checkpoint_every})")
    return replace(role, max_steps=steps, peak_lr=peak_lr, warmup_steps=warmup_steps,
                   checkpoint_every=checkpoint_every, eval_every=2 * checkpoint_every, average_last=4)


def prepare_bundle_data(out: Path, source: Path, bundle: ModelBundle, preset: Preset) -> Path:
    """The pipeline's data, encode and concat stages, with the bundle's tokenizer in place of a new
    one (so token ids match every model of the bundle); returns the data directory."""
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


def save_init(model: Seq2SeqTransformer, path: Path) -> Path:
    """A bundle model's weights as the float32 state dict `train_role(init_from=...)` starts from."""
    if not path.is_file():
        path.parent.mkdir(parents=True, exist_ok=True)
        torch.save({k: v.float() for k, v in model.state_dict().items()}, path)
    return path


def earlier_legs(metadata: Mapping, kind: str) -> list[dict]:
    """The legs of one kind a bundle already went through (a bundle of the first leg's format kept one)."""
    previous = metadata.get(kind)
    return [previous] if isinstance(previous, dict) else list(previous or [])


def write_leg_bundle(bundle: ModelBundle, source: Path, target: Path, trained: dict[str, Seq2SeqTransformer],
                     scores: dict[str, dict], steps: dict[str, int], kind: str, leg: dict, heading: str,
                     paragraph: Callable[[dict, int], str], card_lines: dict[str, str] | None = None) -> Path:
    """Write `target`: `source`'s bundle with the `trained` models (validation `scores`, `steps` more
    steps each) in place of its own. `paragraph(leg, number)` renders the card's text for the
    leg, the `number`-th of its kind; it opens a `## heading` section unless that is the card's last. The card's
    lines that start with a key of `card_lines` become its value (the trained models' rows always do)."""
    models = {role: trained.get(role, bundle.models[role]) for role in ROLES if role in bundle.configs}
    validation = dict(bundle.metadata["validation"])
    for role, role_scores in scores.items():
        validation[role] = {k: role_scores[k] for k in ("valid_loss", "valid_ppl", "valid_acc")} | {
            "steps": validation[role]["steps"] + steps[role]}
    legs = [*earlier_legs(bundle.metadata, kind), leg]
    config = json.loads((source / "config.json").read_text())
    dtypes = {config["models"][role]["dtype"] for role in models}
    if len(dtypes) != 1:
        raise ValueError(f"{source}: its models are stored in different dtypes {sorted(dtypes)}")
    save_bundle(target, (source / TOKENIZER_FILE).read_bytes(), models, name=bundle.name,
                metadata=bundle.metadata | {"validation": validation, kind: legs}, weights_dtype=dtypes.pop())
    lines = {f"| {role} |": role_row(role, {**validation[role], "params": count_parameters(trained[role]),
                                            "architecture": bundle.configs[role].to_dict()}) for role in trained}
    lines |= card_lines or {}
    card = "\n".join(next((new for start, new in lines.items() if line.startswith(start)), line)
                     for line in (source / "MODEL_CARD.md").read_text().split("\n"))
    section = paragraph(leg, len(legs))
    # A leg extends its kind's section while that section is the card's last; after a leg of another
    # kind (a continuation after a re-distillation) it opens a section of its own, numbered, so the
    # card reads in the order things were done.
    if _last_heading(card) != f"## {heading}":
        section = f"\n## {heading}{'' if len(legs) == 1 else f', leg {len(legs)}'}\n" + section
    (target / "MODEL_CARD.md").write_text(card.replace("\n## Licence", section + "\n## Licence", 1))
    training = json.loads((source / "TRAINING.json").read_text()) if (source / "TRAINING.json").is_file() else {}
    training[kind] = legs
    (target / "TRAINING.json").write_text(json.dumps(training, indent=2, default=str) + "\n")
    return target


def _last_heading(card: str) -> str | None:
    """The card's last `## ` heading before its licence section."""
    body = card.split("\n## Licence", 1)[0]
    return next((line for line in reversed(body.split("\n")) if line.startswith("## ")), None)
