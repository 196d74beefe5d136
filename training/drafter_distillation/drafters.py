"""Each drafter's plan (shape and training settings, from the options and the verifier), told before
anything runs with a time estimate measured on a few training steps, and its training in its own
directory of the work directory: continued on a rerun, only loaded once done."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, TextIO

import torch

from seq2seq_models.config import ModelConfig
from seq2seq_models.transformer import Seq2SeqTransformer
from training.data import IdPair
from training.drafter_distillation.drafter_models import (
    default_ar_shape,
    default_nar_shape,
    drafter_config,
    initial_weights,
    parameter_count,
)
from training.drafter_distillation.options import DistillOptions
from training.drafter_distillation.progress import ProgressLine
from training.drafter_distillation.sources import VALID_MAX
from training.drafter_distillation.work import check_work, duration
from training.throughput import timed_steps
from training.train import TrainConfig, load_best, train_role, training_seconds

TIMED_STEPS = 2  # training steps timed for the estimate (after one untimed)
TIMED_PAIRS = 2000  # pairs the timed batches are drawn from


@dataclass(frozen=True)
class DrafterPlan:
    role: str  # "nar_drafter" or "ar_drafter"
    model_config: ModelConfig
    train_config: TrainConfig
    seed: int


def drafter_plans(o: DistillOptions, verifier_cfg: ModelConfig, verifier_params: int) -> list[DrafterPlan]:
    """The drafters to train: the NAR drafter, and the AR drafter when asked for; a shape the options
    leave open is sized from the verifier (`drafter_models`)."""
    def shape(layers: tuple[int, int] | None, width: int | None, default: tuple[int, int, int]) -> tuple[int, ...]:
        enc, dec = layers or default[:2]
        return enc, dec, width or default[2]

    def schedule(steps: int) -> dict[str, Any]:
        # Nothing here depends on the step count, so a rerun with more steps continues the same run.
        return {"max_steps": steps, "max_tokens": o.batch_tokens, "seed": o.seed, "warmup_steps": o.warmup,
                "log_every": 10, "eval_every": 250, "checkpoint_every": 50, "eval_max_pairs": VALID_MAX}

    plans = [DrafterPlan(
        "nar_drafter",
        drafter_config(verifier_cfg, *shape(o.nar_layers, o.nar_width, default_nar_shape(verifier_cfg,
                                                                                         verifier_params))),
        TrainConfig(objective="nar", peak_lr=o.lr, nar_k_max=o.k_max, glat_ratio=0.5, **schedule(o.steps)),
        o.seed,
    )]
    if o.ar_drafter:
        plans.append(DrafterPlan(
            "ar_drafter",
            drafter_config(verifier_cfg, *shape(o.ar_layers, o.ar_width, default_ar_shape(verifier_cfg,
                                                                                          verifier_params))),
            TrainConfig(objective="ar", peak_lr=o.lr, **schedule(o.ar_steps)),
            o.seed,
        ))
    return plans


def describe(plan: DrafterPlan, verifier_params: int, pairs: list[IdPair], work: Path, device: str) -> str:
    """One line: the drafter's shape, its parameters against the verifier's, and its steps with the
    time they should take (TIMED_STEPS of them timed on batches of `pairs`, shaped as the training
    pairs will be), or that the work directory has it trained already."""
    cfg, steps = plan.model_config, plan.train_config.max_steps
    params = parameter_count(cfg)
    shape = (f"{plan.role}: {cfg.encoder_layers}+{cfg.decoder_layers} layers of width {cfg.d_model}, "
             f"{params / 1e6:.2f}M parameters ({params / verifier_params:.0%} of the verifier's "
             f"{verifier_params / 1e6:.2f}M)")
    done = _steps_done(work / plan.role)
    if done >= steps:
        return f"{shape}; {steps} steps, trained already in {work / plan.role}"
    seconds, _ = timed_steps(Seq2SeqTransformer(cfg), pairs, plan.train_config, device, TIMED_STEPS, warmup=1)
    left = (steps - done) * seconds / TIMED_STEPS
    return f"{shape}; {steps - done} steps{f' (of {steps})' if done else ''}, about {duration(left)}"


def train_drafter(
    plan: DrafterPlan, verifier: Any, train: list[Any], valid: list[Any], work: Path, device: str,
    progress: TextIO | None,
) -> tuple[dict[str, Any], Any]:
    """Train (or continue, or just load) one drafter in `work / plan.role`; its result and best model."""
    role_dir = work / plan.role
    role_dir.mkdir(parents=True, exist_ok=True)
    # What shapes the training run; the step count and the cadences may change on a rerun.
    cadence = ("max_steps", "log_every", "eval_every", "checkpoint_every", "eval_max_pairs")
    train_key = {k: v for k, v in asdict(plan.train_config).items() if k not in cadence}
    check_work(role_dir / "key.json", {"model": plan.model_config.to_dict(), "training": train_key})
    finished = role_dir / "result.json"
    result = json.loads(finished.read_text()) if finished.is_file() else None
    init_path = role_dir / "init.pt"
    if not init_path.is_file():
        state, how = initial_weights(plan.model_config, verifier, plan.seed)
        torch.save(state, init_path)
        (role_dir / "init.json").write_text(json.dumps({"embeddings": how}) + "\n")
    if result is None or result["steps"] != plan.train_config.max_steps:
        line = ProgressLine(progress, plan.role, plan.train_config.max_steps, "steps")
        try:
            result = train_role(plan.role, plan.model_config, plan.train_config, train, valid, role_dir, resume=True,
                                device=device, echo=None, init_from=init_path,
                                on_step=lambda step, loss: line.show(step, f"loss {loss:.3f}"))
        finally:
            line.close()
    init = json.loads((role_dir / "init.json").read_text())
    summary = {
        "steps": result["steps"], "epochs": result["epochs"], "valid_loss": result["valid_loss"],
        "valid_acc": result["valid_acc"], "best_valid_loss": result["best_valid_loss"], "params": result["params"],
        "seconds": training_seconds(role_dir / "log.jsonl"), "embeddings": init["embeddings"],
        "architecture": plan.model_config.to_dict(),
        "k_max": plan.train_config.nar_k_max if plan.train_config.objective == "nar" else None,
        "glat": plan.train_config.glat_ratio if plan.train_config.objective == "nar" else None,
    }
    model = load_best(plan.model_config, role_dir)
    return summary, model


def _steps_done(role_dir: Path) -> int:
    """The steps a drafter's directory holds: its result's, else the last logged (a resumed run
    continues from its last checkpoint, at most a checkpoint's steps before)."""
    if (role_dir / "result.json").is_file():
        return int(json.loads((role_dir / "result.json").read_text())["steps"])
    log = role_dir / "log.jsonl"
    lines = log.read_text().splitlines() if log.is_file() else []
    return max((int(json.loads(line).get("step", 0)) for line in lines if line.strip()), default=0)
