"""One trainer for every role: the AR verifier and the small AR drafter (teacher forcing) and the
NAR block drafter (random prefix + k masks, glancing). Seeded, JSON-line logged, resumable.

Layout of a role's directory:
    checkpoint.pt   model + optimizer + scheduler + counters + RNG state (every N steps, on signals)
    best.pt         weights with the lowest validation loss so far (or the average below, if lower)
    snapshots/      with average_last > 0: the weights at the last checkpoint steps, averaged at the end
    log.jsonl       one JSON object per logged step / evaluation
    result.json     final validation scores (written when the role is finished)
"""

from __future__ import annotations

import json
import math
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, TextIO

import torch

from seq2seq_models.config import ModelConfig
from seq2seq_models.transformer import Seq2SeqTransformer
from training.batching import ar_tensors, nar_tensors, source_tensors, token_batches
from training.checkpoint import (
    Interrupted,
    load_checkpoint,
    rng_state,
    save_checkpoint,
    seed_everything,
    set_rng_state,
    stop_on_signals,
)
from training.data import IdPair
from training.objectives import glancing_inputs, token_loss
from training.transfer import load_initial_weights


@dataclass(frozen=True)
class TrainConfig:
    objective: str = "ar"  # "ar" (teacher forcing) or "nar" (block drafter)
    max_steps: int = 1000
    max_tokens: int = 4096  # padded tokens (rows x longest side) per batch
    peak_lr: float = 7e-4
    warmup_steps: int = 1000
    weight_decay: float = 0.01
    label_smoothing: float = 0.1
    clip_norm: float = 1.0
    seed: int = 1
    log_every: int = 50
    eval_every: int = 1000
    checkpoint_every: int = 500
    eval_max_pairs: int = 2000  # validation subset size (fixed, first pairs) to keep evals short
    nar_k_max: int = 25
    glat_ratio: float = 0.5  # 0 disables glancing
    # Checkpoint averaging: at the end, the mean of the weights at the last `average_last` checkpoint
    # steps (checkpoint_every apart) becomes best.pt when its validation loss is lower. It smooths the
    # noise of small batches at no training cost (Vaswani et al. 2017 average their last checkpoints).
    average_last: int = 0
    # Mixed precision for the training forward: "auto" is bfloat16 autocast where the hardware has
    # bfloat16 arithmetic (CUDA; a CPU with AVX-512 BF16 or AMX, which oneDNN uses; BENCHMARKS.md,
    # "Training (CPU)") and float32 elsewhere, where
    # bfloat16 would be emulated and slower; "bf16" and "off" force it. No loss scaling is needed
    # for bfloat16. Weights, optimizer state and evaluation stay float32.
    mixed_precision: str = "auto"

    def __post_init__(self) -> None:
        if self.mixed_precision not in ("auto", "bf16", "off"):
            raise ValueError(f"mixed_precision must be 'auto', 'bf16' or 'off', not {self.mixed_precision!r}")
        if self.objective not in ("ar", "nar"):
            raise ValueError(f"objective must be 'ar' or 'nar', not {self.objective!r}")


def train_role(
    name: str,
    model_config: ModelConfig,
    config: TrainConfig,
    train_pairs: Sequence[IdPair],
    valid_pairs: Sequence[IdPair],
    out_dir: str | Path,
    resume: bool = False,
    device: str | torch.device = "cpu",
    echo: TextIO | None = sys.stdout,
    init_from: str | Path | None = None,
    on_step: Callable[[int, float], None] | None = None,
) -> dict[str, Any]:
    """Train one model to `config.max_steps`; returns the final validation scores.

    With `resume`, continues from `out_dir/checkpoint.pt` and reproduces the uninterrupted run
    exactly (same batches, dropout masks and NAR prefixes), given the same thread count.
    `init_from` (a state dict file, e.g. a pre-training run's best.pt) gives the starting weights of
    a fresh run, from a model of the same width and at most as many layers (`load_initial_weights`);
    a resumed run has them in its checkpoint. `on_step(step, loss)` is called after every optimizer
    step (a progress display).
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    ckpt_path = out / "checkpoint.pt"
    if ckpt_path.exists() and not resume:
        raise FileExistsError(f"{ckpt_path} exists: pass --resume to continue it, or delete {out}")
    if not train_pairs:
        raise ValueError(f"{name}: no training pairs")
    device = torch.device(device)
    generator = seed_everything(config.seed)
    model = Seq2SeqTransformer(model_config).to(device)
    layer_map = None
    if init_from is not None and not ckpt_path.exists():
        layer_map = load_initial_weights(model, torch.load(init_from, map_location=device, weights_only=True))
    optimizer = torch.optim.AdamW(
        model.parameters(), lr=config.peak_lr, betas=(0.9, 0.98), eps=1e-9, weight_decay=config.weight_decay
    )
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, inverse_sqrt(config.warmup_steps))
    step, epoch, batch_index, best_loss = 0, 0, 0, math.inf
    if ckpt_path.exists():
        state = load_checkpoint(ckpt_path)
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        scheduler.load_state_dict(state["scheduler"])
        step, epoch, batch_index, best_loss = state["step"], state["epoch"], state["batch_index"], state["best_loss"]
        set_rng_state(state["rng"], generator)
    log = JsonLog(out / "log.jsonl", echo, role=name)
    bf16 = uses_bfloat16(config.mixed_precision, device)
    log.write(event="start", step=step, params=count_parameters(model), device=str(device), config=asdict(config),
              precision="bfloat16 autocast" if bf16 else "float32", init_from=str(init_from) if init_from else None,
              init_layers=layer_map)

    def checkpoint() -> None:
        save_checkpoint(
            ckpt_path,
            {
                "model": model.state_dict(),
                "optimizer": optimizer.state_dict(),
                "scheduler": scheduler.state_dict(),
                "step": step,
                "epoch": epoch,
                "batch_index": batch_index,
                "best_loss": best_loss,
                "rng": rng_state(generator),
                "model_config": model_config.to_dict(),
                "train_config": asdict(config),
            },
        )

    snapshots = out / "snapshots"

    def snapshot() -> None:
        """Keep the weights of the last `average_last` checkpoint steps, to be averaged at the end."""
        if config.average_last <= 0 or step <= _average_from(config):
            return
        snapshots.mkdir(exist_ok=True)
        save_checkpoint(snapshots / f"step-{step:07d}.pt", model.state_dict())
        for old in sorted(snapshots.glob("step-*.pt"))[: -config.average_last]:
            old.unlink()

    def evaluate_and_keep_best() -> dict[str, float]:
        nonlocal best_loss
        scores = evaluate(model, valid_pairs[: config.eval_max_pairs], config, device)
        if scores["valid_loss"] < best_loss:
            best_loss = scores["valid_loss"]
            torch.save(model.state_dict(), out / "best.pt")
        log.write(event="eval", step=step, **scores, best_loss=best_loss)
        return scores

    extra = config.nar_k_max if config.objective == "nar" else 0
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16)
    window = _Throughput()
    batches: list[list[int]] = []
    scores: dict[str, float] | None = None
    with stop_on_signals() as stop:
        while step < config.max_steps:
            batches = token_batches(train_pairs, config.max_tokens, config.seed, epoch, extra=extra)
            while batch_index < len(batches) and step < config.max_steps:
                batch = [train_pairs[i] for i in batches[batch_index]]
                model.train()
                with autocast:
                    loss, n_tokens = batch_loss(model, batch, config, generator, device)
                optimizer.zero_grad(set_to_none=True)
                loss.backward()
                grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), config.clip_norm)
                optimizer.step()
                scheduler.step()
                step += 1
                batch_index += 1
                window.add(n_tokens, float(loss.detach()))
                if on_step is not None:
                    on_step(step, window.losses[-1])
                if step % config.log_every == 0:
                    log.write(
                        event="train", step=step, epoch=epoch, loss=window.mean_loss(), lr=scheduler.get_last_lr()[0],
                        grad_norm=float(grad_norm), tokens_per_s=window.rate(),
                    )
                    window = _Throughput()
                scores = None
                if step % config.eval_every == 0:
                    scores = evaluate_and_keep_best()
                if step % config.checkpoint_every == 0 or stop:
                    checkpoint()
                if step % config.checkpoint_every == 0:
                    snapshot()
                if stop:
                    log.write(event="interrupted", step=step, signal=stop.signal)
                    raise Interrupted(f"{name}: stopped at step {step} on signal {stop.signal}; rerun with --resume")
            if batch_index >= len(batches):
                epoch, batch_index = epoch + 1, 0
        if scores is None:  # the last step was not an evaluation step (or nothing ran on resume)
            scores = evaluate_and_keep_best()
        checkpoint()
    average = average_snapshots(model_config, snapshots, config, valid_pairs, out, best_loss, log, device)
    if average is not None and average["kept"]:
        best_loss = average["valid_loss"]
    if not batches:  # resumed at max_steps: no epoch was batched, but the fraction of this one is still known
        batches = token_batches(train_pairs, config.max_tokens, config.seed, epoch, extra=extra)
    result = {"role": name, "steps": step, "epochs": epoch + batch_index / max(1, len(batches)), **scores,
              "best_valid_loss": best_loss, "average": average, "params": count_parameters(model)}
    (out / "result.json").write_text(json.dumps(result, indent=2) + "\n")
    log.write(event="done", **result)
    return result


@torch.no_grad()
def average_snapshots(
    model_config: ModelConfig,
    snapshots: Path,
    config: TrainConfig,
    valid_pairs: Sequence[IdPair],
    out: Path,
    best_loss: float,
    log: JsonLog,
    device: torch.device,
) -> dict[str, Any] | None:
    """Average the kept snapshots, evaluate, and make the average best.pt when its validation loss
    beats `best_loss`. Returns the averaged steps, their scores and whether best.pt is now the average
    (None when there was nothing to average)."""
    if config.average_last <= 0:
        return None
    # Only the window before max_steps: a run whose max_steps was raised has older snapshots too.
    files = [f for f in sorted(snapshots.glob("step-*.pt")) if _snapshot_step(f) > _average_from(config)]
    if len(files) < 2:
        return None
    mean = {k: v.double() for k, v in torch.load(files[0], map_location="cpu", weights_only=True).items()}
    for f in files[1:]:
        for k, v in torch.load(f, map_location="cpu", weights_only=True).items():
            mean[k] += v.double()
    average = Seq2SeqTransformer(model_config).to(device)
    average.load_state_dict({k: v / len(files) for k, v in mean.items()})  # copied in at the weights' dtype
    scores = evaluate(average, valid_pairs[: config.eval_max_pairs], config, device)
    kept = scores["valid_loss"] < best_loss
    if kept:
        torch.save(average.state_dict(), out / "best.pt")
    result = {"steps": [_snapshot_step(f) for f in files], **scores, "kept": kept}
    log.write(event="average", **result, best_loss=min(best_loss, scores["valid_loss"]))
    return result


def _average_from(config: TrainConfig) -> int:
    """Snapshots of steps after this one are averaged (the last `average_last` checkpoint steps)."""
    return config.max_steps - config.average_last * config.checkpoint_every


def _snapshot_step(path: Path) -> int:
    return int(path.stem.split("-")[1])


@torch.no_grad()
def evaluate(
    model: Seq2SeqTransformer, pairs: Sequence[IdPair], config: TrainConfig, device: torch.device
) -> dict[str, float]:
    """Validation loss (no label smoothing) and token accuracy; for the NAR drafter on blocks of
    k_max with fixed prefixes (own generator) and no glancing, i.e. as it drafts at inference."""
    model.eval()
    generator = torch.Generator().manual_seed(12345)
    total_loss, total_tokens, total_correct = 0.0, 0, 0
    for batch_ids in token_batches(pairs, config.max_tokens, seed=0, epoch=0, extra=config.nar_k_max):
        batch = [pairs[i] for i in batch_ids]
        src, src_mask = (t.to(device) for t in source_tensors(batch, model.config))
        if config.objective == "nar":
            dec_in, labels, self_mask = (t.to(device) for t in nar_tensors(batch, model.config, config.nar_k_max,
                                                                          generator))
        else:
            dec_in, labels = (t.to(device) for t in ar_tensors(batch, model.config))
            self_mask = None
        loss, n, correct = token_loss(model(src, src_mask, dec_in, self_mask), labels)
        total_loss += float(loss) * n
        total_tokens += n
        total_correct += correct
    mean = total_loss / max(1, total_tokens)
    accuracy = total_correct / max(1, total_tokens)
    return {"valid_loss": mean, "valid_ppl": math.exp(min(mean, 50.0)), "valid_acc": accuracy}


def inverse_sqrt(warmup: int):
    """lr factor: linear warm-up to 1 at `warmup`, then 1/sqrt(step/warmup)."""
    warmup = max(1, warmup)

    def factor(step: int) -> float:
        step = max(1, step)
        return min(step / warmup, math.sqrt(warmup / step))

    return factor


def training_seconds(log_path: str | Path) -> float:
    """Wall time a role trained, summed over its runs (each from its "start" to its last record), so
    a stage resumed across sessions reports its whole cost."""
    total, first, last = 0.0, None, None
    for line in Path(log_path).read_text().splitlines():
        record = json.loads(line)
        if record.get("event") == "start":
            total += (last - first) if first is not None else 0.0
            first = record["time"]
        last = record["time"]
    return total + ((last - first) if first is not None and last is not None else 0.0)


def count_parameters(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def load_best(model_config: ModelConfig, role_dir: str | Path) -> Seq2SeqTransformer:
    model = Seq2SeqTransformer(model_config)
    model.load_state_dict(torch.load(Path(role_dir) / "best.pt", map_location="cpu"))
    return model.eval()


class JsonLog:
    """Plain JSON lines (one object per event) to a file and, optionally, a stream."""

    def __init__(self, path: Path, echo: TextIO | None, **fields: Any) -> None:
        self.path = path
        self.echo = echo
        self.fields = fields

    def write(self, **record: Any) -> None:
        line = json.dumps({"time": round(time.time(), 3), **self.fields, **record}, default=str)
        with self.path.open("a", encoding="utf-8") as f:
            f.write(line + "\n")
        if self.echo is not None:
            print(line, file=self.echo, flush=True)


def uses_bfloat16(mixed_precision: str, device: torch.device) -> bool:
    """Whether a training forward runs under bfloat16 autocast (see TrainConfig.mixed_precision)."""
    if mixed_precision != "auto":
        return mixed_precision == "bf16"
    if device.type == "cuda":
        return True
    return device.type == "cpu" and _cpu_has_bfloat16()


def _cpu_has_bfloat16() -> bool:
    # oneDNN's own check (AVX-512 BF16 or AMX); a private op, so an older or newer torch without it
    # falls back to float32 rather than failing.
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return False


def batch_loss(
    model: Seq2SeqTransformer,
    batch: Sequence[IdPair],
    config: TrainConfig,
    generator: torch.Generator,
    device: torch.device,
) -> tuple[torch.Tensor, int]:
    cfg = model.config
    src, src_mask = (t.to(device) for t in source_tensors(batch, cfg))
    if config.objective == "nar":
        k = int(torch.randint(1, config.nar_k_max + 1, (1,), generator=generator))
        dec_in, labels, self_mask = (t.to(device) for t in nar_tensors(batch, cfg, k, generator))
        if config.glat_ratio > 0:
            dec_in, labels = glancing_inputs(model, src, src_mask, dec_in, labels, self_mask, config.glat_ratio,
                                             generator)
    else:
        dec_in, labels = (t.to(device) for t in ar_tensors(batch, cfg))
        self_mask = None
    loss, _, _ = token_loss(model(src, src_mask, dec_in, self_mask), labels, config.label_smoothing)
    # Real (unpadded) tokens, source + EOS and BOS + target, so rates compare across batch shapes.
    n_tokens = sum(len(p.source) + len(p.target) + 2 for p in batch)
    return loss, n_tokens


class _Throughput:
    def __init__(self) -> None:
        self.start = time.perf_counter()
        self.tokens = 0
        self.losses: list[float] = []

    def add(self, tokens: int, loss: float) -> None:
        self.tokens += tokens
        self.losses.append(loss)

    def rate(self) -> float:
        return self.tokens / max(1e-9, time.perf_counter() - self.start)

    def mean_loss(self) -> float:
        return sum(self.losses) / max(1, len(self.losses))
