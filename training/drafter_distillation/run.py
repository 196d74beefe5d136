"""`specdec distill`'s run, top-down: check the options, read the verifier and the sources, label,
train each drafter, write the new bundle (the package docstring tells the method)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import TextIO

import torch

from seq2seq_models.bundle import load_bundle
from seq2seq_models.ort_runner import resolve_device
from training.data import IdPair
from training.drafter_distillation.bundle import write_distilled_bundle
from training.drafter_distillation.drafters import TIMED_PAIRS, describe, drafter_plans, train_drafter
from training.drafter_distillation.labels import Labelling, label
from training.drafter_distillation.options import DistillOptions
from training.drafter_distillation.sources import VALID_EVERY, read_sources, split_pairs
from training.pipeline import hardware
from training.train import count_parameters


def distill(options: DistillOptions, progress: TextIO | None = None, report: TextIO | None = None) -> Path:
    """Label, train and write the new bundle; returns its path. `progress`: the stream for the live
    progress line (None: none); `report`: one line per stage (None: stderr)."""
    o = options
    report = report or sys.stderr
    o.check()
    bundle = load_bundle(o.bundle, roles=["verifier"])
    verifier_cfg = bundle.config("verifier")
    sources, reading = read_sources(o.sources, bundle.tokenizer, o.ids, verifier_cfg.source_vocab_size,
                                    verifier_cfg.max_len)
    if o.k_max > verifier_cfg.max_len // 2:
        raise ValueError(f"--k-max {o.k_max} leaves too little of the verifier's {verifier_cfg.max_len} positions "
                         f"for the output (at most {verifier_cfg.max_len // 2})")
    device = resolve_device(o.device)
    verifier_params = count_parameters(bundle.verifier)
    plans = drafter_plans(o, verifier_cfg, verifier_params)
    o.work.mkdir(parents=True, exist_ok=True)
    labelling = Labelling(
        work=o.work,
        # The verifier's outputs start as served ones do: the target language's code, or the default.
        first=bundle.tokenizer.first_tokens(o.target_lang),
        # The longest target leaves room for the BOS and a whole block of masks (NAR training rows).
        longest=verifier_cfg.max_len - o.k_max - 1,
        batch_tokens=o.batch_tokens,
        key={"bundle": bundle.fingerprint, "sources_sha256": reading["sha256"], "ids": o.ids},
    )
    if reading["dropped_too_long"]:
        print(f"specdec distill: {reading['dropped_too_long']} of {reading['lines']} sources are longer than the "
              f"verifier's {verifier_cfg.max_len - 1} tokens: left out", file=report)
    # What will be trained, and for how long, before anything is: timed on the sources as their own
    # labels, cut as labels are.
    proxies = [IdPair(source, source[: labelling.longest]) for source in sources[:TIMED_PAIRS]]
    for plan in plans:
        print(f"specdec distill: {describe(plan, verifier_params, proxies, o.work, device)}", file=report)

    pairs, seconds = label(bundle.verifier, sources, labelling, device, progress)
    if not pairs:
        raise ValueError("the verifier's greedy output was empty for every source: nothing to learn")
    print(f"specdec distill: {len(pairs)} sources labelled with the verifier's greedy output ({seconds:.0f} s)",
          file=report)
    train, valid = split_pairs(pairs)

    results, drafters = {}, {}
    for plan in plans:
        results[plan.role], drafters[plan.role] = train_drafter(plan, bundle.verifier, train, valid, o.work,
                                                                device, progress)
        r = results[plan.role]
        print(f"specdec distill: {plan.role}: {r['steps']} steps, valid loss {r['valid_loss']:.3f}, "
              f"token accuracy {r['valid_acc']:.3f} ({r['seconds']:.0f} s)", file=report)
    info = {
        "sources": {**reading, "file": o.sources.name, "labelled": len(pairs), "train_pairs": len(train),
                    "valid_pairs": len(valid), "valid_every": VALID_EVERY, "labelling_seconds": seconds,
                    "first_tokens": labelling.first},
        "device": device,
        "hardware": hardware(device),
        "torch_version": torch.__version__,
        "command": o.command(),
        "roles": results,
    }
    return write_distilled_bundle(o.bundle, o.out, drafters, info, o.name)
