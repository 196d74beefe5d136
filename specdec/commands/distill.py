"""`specdec distill`: drafters for a bundle's verifier, learnt from its own greedy outputs.

The verifier decodes the unlabelled sources greedily, and an NAR block drafter (and, with
--ar-drafter, a small AR drafter) learns those outputs: greedy output is what GAD's drafts are
checked against. Everything resumable lives in a work directory (--work): the labelled pairs, each
drafter's checkpoints and logs. Rerunning the same command continues where it stopped; a finished
drafter is not trained again. The new bundle (--out) is a copy of the old one with the drafters
added and a section appended to its MODEL_CARD.md. The drafters are sized from the verifier (a share
of its parameters) unless given a shape; each one's shape and steps, with a time estimate, are
printed before anything runs.

This module reads the command line into one `DistillOptions` and prints what the run reports; the
work is `training.drafter_distillation`'s.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from core.config import DEVICE_HELP, device_arg
from training.drafter_distillation.options import (
    AR_SHARE,
    DEFAULT_AR_STEPS,
    DEFAULT_BATCH_TOKENS,
    DEFAULT_K_MAX,
    DEFAULT_LR,
    DEFAULT_STEPS,
    DEFAULT_WARMUP,
    NAR_SHARE,
    DistillOptions,
)


def register(sub) -> None:
    p = sub.add_parser(
        "distill",
        help="train an NAR drafter (and optionally a small AR drafter) on a bundle's own greedy outputs",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--bundle", required=True, help="the bundle whose verifier the drafters are for")
    p.add_argument("--sources", required=True, help="unlabelled source texts, one a line (with --ids: token ids)")
    p.add_argument("--out", required=True, help="the new bundle: a copy of --bundle with the drafters added")
    p.add_argument("--ids", action="store_true", help="source lines are space-separated token ids (needed for a "
                   "bundle without a tokenizer)")
    p.add_argument("--target-lang", default="", metavar="CODE", help="a many-to-many model's target language: "
                   "the drafters learn the verifier's outputs into it (default: the model's default)")
    p.add_argument("--work", help="checkpoint directory; rerunning with it continues (default: OUT.work)")
    p.add_argument("--device", type=device_arg, default="auto",
                   help=f"where training runs: {DEVICE_HELP} (default: auto)")
    p.add_argument("--steps", type=int, default=DEFAULT_STEPS, help=f"NAR drafter training steps "
                   f"(default {DEFAULT_STEPS}); raising it on a rerun continues the training")
    p.add_argument("--ar-drafter", action="store_true", help="also train a small AR drafter (replaces the "
                   "bundle's own, if it has one)")
    p.add_argument("--ar-steps", type=int, default=DEFAULT_AR_STEPS, help=f"AR drafter steps "
                   f"(default {DEFAULT_AR_STEPS})")
    p.add_argument("--k-max", type=int, default=DEFAULT_K_MAX, help=f"longest block the NAR drafter is trained "
                   f"to draft (default {DEFAULT_K_MAX}); serve with k up to it")
    p.add_argument("--batch-tokens", type=int, default=DEFAULT_BATCH_TOKENS, help="padded tokens per training "
                   f"batch, and source tokens per labelling batch (default {DEFAULT_BATCH_TOKENS})")
    p.add_argument("--lr", type=float, default=DEFAULT_LR, help=f"peak learning rate (default {DEFAULT_LR}; "
                   "a small drafter learns faster with more)")
    p.add_argument("--warmup", type=int, default=DEFAULT_WARMUP, help=f"warm-up steps (default {DEFAULT_WARMUP})")
    p.add_argument("--nar-layers", type=_layers, help="NAR drafter layers ENC,DEC (default: the verifier's "
                   "encoder depth, and 1 or 2 decoder layers)")
    p.add_argument("--nar-width", type=int, help="NAR drafter width (default: the widest, up to the verifier's "
                   f"and 512, that keeps the drafter within {NAR_SHARE * 100:.0f}%% of the verifier's parameters)")
    p.add_argument("--ar-layers", type=_layers, help="AR drafter layers ENC,DEC (default: up to 3,1)")
    p.add_argument("--ar-width", type=int, help="AR drafter width (default: the widest, up to half the verifier's "
                   f"and 256, that keeps the drafter within {AR_SHARE * 100:.0f}%% of the verifier's parameters)")
    p.add_argument("--seed", type=int, default=1, help="the drafters' initialisation and batch order (default: 1)")
    p.add_argument("--name", help="the new bundle's name (default: the old one's)")
    p.add_argument("--progress", action="store_true", help="show the progress line even when stderr is not "
                   "a terminal")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from training.checkpoint import Interrupted
    from training.drafter_distillation.run import distill

    options = options_from(args)
    stream = sys.stderr if args.progress or sys.stderr.isatty() else None
    try:
        written = distill(options, progress=stream)
    except Interrupted as exc:
        where = str(exc).split(";")[0]  # "<stage>: stopped at ..."; distill has no --resume: it always continues
        print(f"specdec distill: {where}; rerun the same command to continue from {options.work}", file=sys.stderr)
        return 143
    print(f"wrote {written}", file=sys.stderr)
    return 0


def options_from(args: argparse.Namespace) -> DistillOptions:
    """The run's options, made once from the command line."""
    out = Path(args.out)
    return DistillOptions(
        bundle=Path(args.bundle), sources=Path(args.sources), out=out,
        work=Path(args.work) if args.work else out.with_name(out.name + ".work"), ids=args.ids, device=args.device,
        steps=args.steps, ar_drafter=args.ar_drafter, ar_steps=args.ar_steps, k_max=args.k_max,
        batch_tokens=args.batch_tokens, lr=args.lr, warmup=args.warmup, nar_layers=args.nar_layers,
        nar_width=args.nar_width, ar_layers=args.ar_layers, ar_width=args.ar_width, seed=args.seed, name=args.name,
        target_lang=args.target_lang,
    )


def _layers(text: str) -> tuple[int, int]:
    try:
        enc, dec = (int(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected ENC,DEC (two layer counts), got {text!r}") from None
    return enc, dec
