"""Command-line flags of the training pipeline, shared by `python -m training.pipeline` and
`specdec train`; kept free of heavy imports so building the `specdec` parser stays fast."""

from __future__ import annotations

import argparse

# `concat` (long pairs of consecutive sentences for the verifier's fine-tuning), `synthetic` and
# `pretrain` (synthetic-error pre-training of the verifier) do work only where the preset asks for
# them; elsewhere they finish at once as skipped.
# The AR drafter comes before the NAR drafter, which may start from its weights (`nar_from_ar_drafter`).
STAGES = ("data", "tokenizer", "encode", "concat", "synthetic", "pretrain", "verifier", "distill", "ar_drafter",
          "nar_drafter", "bundle")


PRESET_NAMES = ("base", "full", "cpu", "smoke", "smoke-synthetic")  # training.presets.PRESETS, without its imports
# The preset whose bundle ships in bundles/ua-gec: the default, and the one the pipeline writes there.
SHIPPED_PRESET = "base"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", required=True, help="run directory (data, checkpoints, logs)")
    parser.add_argument("--preset", choices=PRESET_NAMES, default=SHIPPED_PRESET)
    parser.add_argument("--resume", action="store_true", help="continue interrupted training stages")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--device", help="torch device (default: cuda when present, else cpu)")
    parser.add_argument("--threads", type=int, help="CPU threads for torch (default: the CPUs this process may use)")
    parser.add_argument("--bundle-out",
                        help=f"bundle directory (default: bundles/ua-gec for {SHIPPED_PRESET}, else OUT/bundle)")
    parser.add_argument("--stop-after", choices=STAGES, help="stop once this stage is finished")
