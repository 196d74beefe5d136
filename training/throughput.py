"""Timed short run of a preset's training step, to plan the long run:

    python -m training.throughput --out runs/ua-gec [--role verifier] [--steps 30]

Needs the run's data stages (`python -m training.pipeline --out OUT --stop-after encode`).
Prints one JSON object: real tokens/s (source + target, no padding), seconds per step, batches
and tokens per epoch, the estimated wall time of one epoch and of the preset's max_steps, and
the latency of one incremental verify step (5 tokens against a cached 30-token prefix).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import torch

from seq2seq_models.transformer import Seq2SeqTransformer
from training.batching import token_batches
from training.checkpoint import seed_everything
from training.data import IdPair, load_id_pairs
from training.pipeline import configure_threads
from training.presets import get_preset
from training.train import TrainConfig, batch_loss, count_parameters


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m training.throughput", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="run directory with finished data stages")
    parser.add_argument("--preset", choices=["full", "smoke"], default="full")
    parser.add_argument("--role", choices=["verifier", "nar_drafter", "ar_drafter"], default="verifier")
    parser.add_argument("--steps", type=int, default=30, help="timed steps (after 3 warm-up steps)")
    parser.add_argument("--threads", type=int)
    parser.add_argument("--device")
    args = parser.parse_args(argv)
    threads = configure_threads(args.threads)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    report = measure(Path(args.out), args.preset, args.role, args.steps, device)
    print(json.dumps({"threads": threads, **report}, indent=2))
    return 0


def measure(out: Path, preset_name: str, role: str, steps: int, device: torch.device) -> dict:
    preset = get_preset(preset_name)
    vocab = json.loads((out / "stages" / "tokenizer.json").read_text())["vocab_size"]
    train_file = "train.ids.jsonl" if role == "verifier" else "train.distill.jsonl"
    if not (out / "data" / train_file).is_file():
        train_file = "train.ids.jsonl"  # drafters before distillation: same lengths, close enough
    pairs = load_id_pairs(out / "data" / train_file)
    config = preset.training[role]
    model = Seq2SeqTransformer(preset.model_config(role, vocab))
    extra = config.nar_k_max if config.objective == "nar" else 0
    batches = token_batches(pairs, config.max_tokens, config.seed, epoch=0, extra=extra)
    tokens_per_epoch = sum(len(p.source) + len(p.target) + 2 for p in pairs)
    elapsed, tokens = timed_steps(model, pairs, config, device, steps)
    rate = tokens / elapsed
    epoch_s = tokens_per_epoch / rate
    return {
        "preset": preset_name,
        "role": role,
        "device": str(device),
        "params": count_parameters(model),
        "timed_steps": steps,
        "tokens_per_s": round(rate, 1),
        "seconds_per_step": round(elapsed / steps, 3),
        "batches_per_epoch": len(batches),
        "tokens_per_epoch": tokens_per_epoch,
        "epoch_minutes": round(epoch_s / 60, 1),
        "max_steps": config.max_steps,
        "max_steps_hours": round(config.max_steps * elapsed / steps / 3600, 1),
        "max_steps_epochs": round(config.max_steps / len(batches), 1),
        "verify_step_ms": round(_verify_step_ms(model.eval(), device), 2),
    }


def timed_steps(
    model: Seq2SeqTransformer, pairs: Sequence[IdPair], config: TrainConfig, device: torch.device | str, steps: int,
    warmup: int = 3,
) -> tuple[float, int]:
    """Seconds and real tokens of `steps` training steps of `model` (forward, backward, clipped AdamW
    update) on batches of `pairs` as training makes them, after `warmup` untimed steps (the first
    pay for the allocator's warm-up). The model's weights are changed."""
    device = torch.device(device)
    generator = seed_everything(config.seed)
    model.to(device).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    extra = config.nar_k_max if config.objective == "nar" else 0
    batches = token_batches(pairs, config.max_tokens, config.seed, epoch=0, extra=extra)
    tokens, elapsed = 0, 0.0
    for i in range(steps + warmup):
        batch = [pairs[j] for j in batches[i % len(batches)]]
        started = time.perf_counter()
        loss, n = batch_loss(model, batch, config, generator, device)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), config.clip_norm)
        optimizer.step()
        if device.type == "cuda":
            torch.cuda.synchronize()
        if i >= warmup:
            tokens += n
            elapsed += time.perf_counter() - started
    return elapsed, tokens


@torch.no_grad()
def _verify_step_ms(model: Seq2SeqTransformer, device: torch.device, prefix: int = 30, block: int = 5) -> float:
    """One verifier iteration as served: score `block` tokens against a cached prefix, roll back."""
    src = torch.randint(5, model.config.vocab_size, (1, 40), device=device)
    cache = model.start(src, capacity=prefix + block)
    model.extend(cache, torch.randint(5, model.config.vocab_size, (1, prefix), device=device))
    draft = torch.randint(5, model.config.vocab_size, (1, block), device=device)
    times = []
    for _ in range(30):
        started = time.perf_counter()
        model.score(cache, draft)
        model.truncate(cache, prefix)
        times.append(time.perf_counter() - started)
    times.sort()
    return 1000 * times[len(times) // 2]


if __name__ == "__main__":
    sys.exit(main())
