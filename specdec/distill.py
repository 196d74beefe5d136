"""`specdec distill`: drafters for a bundle's verifier, learnt from its own greedy outputs.

Sequence-level knowledge distillation (Kim and Rush 2016): the verifier decodes the user's
unlabelled sources greedily (batched: `training.greedy_labels`, chunk by chunk through
`training.distill.distill_pairs`, which makes the labelling resumable), and the NAR
block drafter (and, with `--ar-drafter`, a small AR drafter) learns those outputs with the
project's own objectives and batching (`training.train.train_role`: k [MASK]s after a causal prefix
with glancing for the NAR drafter, teacher forcing for the AR one). Greedy output is what GAD's
drafts are checked against, so it is the target. The drafters are `training.kd_drafters`'s shapes.

Everything resumable lives in a work directory: the labelled pairs (written chunk by chunk), each
drafter's checkpoints and logs. Rerunning the same command continues where it stopped; a finished
drafter is not trained again. The new bundle is a copy of the old one with the drafters added and
a section appended to its MODEL_CARD.md (`specdec.distill_bundle`).
"""

from __future__ import annotations

import hashlib
import json
import sys
import time
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any, TextIO

DEFAULT_STEPS = 2000
DEFAULT_AR_STEPS = 1000
DEFAULT_K_MAX = 25
DEFAULT_LR = 1e-3  # the presets' drafters' peak learning rate (training/presets.py)
DEFAULT_WARMUP = 150
VALID_EVERY = 20  # every 20th labelled pair is held out for validation ...
VALID_MAX = 500  # ... up to this many


@dataclass(frozen=True)
class DistillOptions:
    bundle: Path
    sources: Path
    out: Path
    work: Path
    ids: bool = False
    device: str = "auto"
    steps: int = DEFAULT_STEPS
    ar_drafter: bool = False
    ar_steps: int = DEFAULT_AR_STEPS
    k_max: int = DEFAULT_K_MAX
    batch_tokens: int = 4096
    lr: float = DEFAULT_LR
    warmup: int = DEFAULT_WARMUP
    nar_layers: tuple[int, int] | None = None
    nar_width: int | None = None
    ar_layers: tuple[int, int] | None = None
    ar_width: int | None = None
    seed: int = 1
    name: str | None = None
    target_lang: str = ""

    def command(self) -> str:
        """The command line that makes this run (the flags that differ from their defaults)."""
        words = ["specdec", "distill", "--bundle", str(self.bundle), "--sources", str(self.sources), "--out",
                 str(self.out)]
        defaults = DistillOptions(self.bundle, self.sources, self.out, self.work)
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name in ("bundle", "sources", "out") or value == getattr(defaults, f.name):
                continue
            flag = "--" + f.name.replace("_", "-")
            if isinstance(value, bool):
                words.append(flag)
            else:
                words += [flag, ",".join(map(str, value)) if isinstance(value, tuple) else str(value)]
        return " ".join(words)


def distill(options: DistillOptions, progress: TextIO | None = None, report: TextIO = sys.stderr) -> Path:
    """Label, train and write the new bundle (see the module docstring); returns its path.
    `progress`: the stream for the live progress line (None: none); `report`: one line per stage."""
    o = options
    _check_options(o)
    import torch

    from seq2seq_models.bundle import load_bundle
    from seq2seq_models.ort_runner import resolve_device
    from specdec.distill_bundle import write_distilled_bundle

    bundle = load_bundle(o.bundle, roles=["verifier"])
    verifier_cfg = bundle.config("verifier")
    sources, reading = read_sources(o.sources, bundle.tokenizer, o.ids, verifier_cfg.vocab_size,
                                    verifier_cfg.max_len)
    if o.k_max > verifier_cfg.max_len // 2:
        raise ValueError(f"--k-max {o.k_max} leaves too little of the verifier's {verifier_cfg.max_len} positions "
                         f"for the output (at most {verifier_cfg.max_len // 2})")
    device = resolve_device(o.device)
    plans = _plans(o, verifier_cfg)
    o.work.mkdir(parents=True, exist_ok=True)
    # The verifier's outputs start as served ones do: the target language's code, or the default.
    first = bundle.tokenizer.first_tokens(o.target_lang)
    _check_work(o.work / "labels.key.json", {"bundle": bundle.fingerprint, "sources_sha256": reading["sha256"],
                                             "ids": o.ids, "first": first})

    pairs, labelling = _label(bundle, sources, first, o, device, progress)
    if not pairs:
        raise ValueError("the verifier's greedy output was empty for every source: nothing to learn")
    print(f"specdec distill: {len(pairs)} sources labelled with the verifier's greedy output "
          f"({labelling['seconds']:.0f} s)", file=report)
    train, valid = split_pairs(pairs)

    results, drafters = {}, {}
    for role, plan in plans.items():
        results[role], drafters[role] = _train_drafter(role, plan, bundle.verifier, train, valid, o, device,
                                                       progress)
        r = results[role]
        print(f"specdec distill: {role}: {r['steps']} steps, valid loss {r['valid_loss']:.3f}, "
              f"token accuracy {r['valid_acc']:.3f} ({r['seconds']:.0f} s)", file=report)
    info = {
        "sources": {**reading, "file": o.sources.name, "labelled": len(pairs), "train_pairs": len(train),
                    "valid_pairs": len(valid), "valid_every": VALID_EVERY, "labelling_seconds": labelling["seconds"],
                    "first_tokens": first},
        "device": device,
        "hardware": _hardware(device),
        "torch_version": torch.__version__,
        "command": o.command(),
        "roles": results,
    }
    return write_distilled_bundle(o.bundle, o.out, drafters, info, o.name)


def read_sources(
    path: Path, tokenizer: Any, ids: bool, vocab_size: int, max_len: int
) -> tuple[list[list[int]], dict[str, Any]]:
    """The source lines as token ids, and what was read: lines, kept, dropped (longer than the
    verifier takes), the file's sha256. Blank lines are skipped; a bad line is a ValueError naming it."""
    if not path.is_file():
        raise FileNotFoundError(f"--sources {path}: no such file")
    data = path.read_bytes()
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ValueError(f"--sources {path}: not UTF-8 text ({exc.reason} at byte {exc.start})") from None
    if not ids and getattr(tokenizer, "kind", "") == "none":
        raise ValueError("the bundle has no tokenizer: pass --ids and give each source as space-separated token ids")
    sources: list[list[int]] = []
    lines = dropped = 0
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        lines += 1
        source = _parse_ids(line, number, vocab_size) if ids else list(tokenizer.encode(line))
        if len(source) + 1 > max_len:  # with its EOS, longer than the verifier takes
            dropped += 1
        elif source:
            sources.append(source)
    if not sources:
        detail = f"all {lines} lines are longer than the verifier's {max_len} tokens" if lines else "no source lines"
        raise ValueError(f"--sources {path}: {detail}")
    return sources, {"lines": lines, "kept": len(sources), "dropped_too_long": dropped,
                     "sha256": hashlib.sha256(data).hexdigest()}


def split_pairs(pairs: list[Any]) -> tuple[list[Any], list[Any]]:
    """(train, valid): every VALID_EVERY-th pair held out, up to VALID_MAX; a handful of pairs
    are all trained on and validated on (too few to spare any)."""
    if len(pairs) < VALID_EVERY:
        return list(pairs), list(pairs)
    held = set(range(0, len(pairs), VALID_EVERY)[:VALID_MAX])
    return [p for i, p in enumerate(pairs) if i not in held], [pairs[i] for i in sorted(held)]


class ProgressLine:
    """A live one-line progress display ("label done/total unit, rate, eta") on a terminal stream,
    redrawn at most every 0.2 s; nothing when `stream` is None. The rate counts from the first
    update, so a resumed run's rate is its own."""

    def __init__(self, stream: TextIO | None, label: str, total: int, unit: str) -> None:
        self.stream = stream
        self.label = label
        self.total = total
        self.unit = unit
        self.first: tuple[int, float] | None = None
        self.drawn = 0.0

    def show(self, done: int, note: str = "") -> None:
        now = time.perf_counter()
        if self.first is None:
            self.first = (done, now)
        if self.stream is None or (now - self.drawn < 0.2 and done < self.total):
            return
        self.drawn = now
        rate = (done - self.first[0]) / max(now - self.first[1], 1e-9)
        eta = (self.total - done) / rate if rate > 0 else 0.0
        text = f"\r{self.label}: {done}/{self.total} {self.unit} {rate:.1f}/s eta {eta:.0f} s {note}"
        self.stream.write(text.ljust(78))
        self.stream.flush()

    def close(self) -> None:
        if self.stream is not None and self.drawn:
            self.stream.write("\n")
            self.stream.flush()


# ----------------------------------------------------------------------------------------------
# Helpers
# ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Plan:
    model_config: Any  # ModelConfig
    train_config: Any  # TrainConfig


def _plans(o: DistillOptions, verifier_cfg: Any) -> dict[str, _Plan]:
    """Each drafter's shape and training settings."""
    from training.kd_drafters import default_ar_shape, default_nar_shape, drafter_config
    from training.train import TrainConfig

    def shape(layers: tuple[int, int] | None, width: int | None, default: tuple[int, int, int]) -> tuple[int, ...]:
        enc, dec = layers or default[:2]
        return enc, dec, width or default[2]

    def schedule(steps: int) -> dict[str, Any]:
        # Nothing here depends on the step count, so a rerun with more steps continues the same run.
        return {"max_steps": steps, "max_tokens": o.batch_tokens, "seed": o.seed, "warmup_steps": o.warmup,
                "log_every": 10, "eval_every": 250, "checkpoint_every": 50, "eval_max_pairs": VALID_MAX}

    plans = {"nar_drafter": _Plan(
        drafter_config(verifier_cfg, *shape(o.nar_layers, o.nar_width, default_nar_shape(verifier_cfg))),
        TrainConfig(objective="nar", peak_lr=o.lr, nar_k_max=o.k_max, glat_ratio=0.5, **schedule(o.steps)),
    )}
    if o.ar_drafter:
        plans["ar_drafter"] = _Plan(
            drafter_config(verifier_cfg, *shape(o.ar_layers, o.ar_width, default_ar_shape(verifier_cfg))),
            TrainConfig(objective="ar", peak_lr=o.lr, **schedule(o.ar_steps)),
        )
    return plans


def _label(
    bundle: Any, sources: list[list[int]], first: list[int], o: DistillOptions, device: str,
    progress: TextIO | None,
) -> tuple[list[Any], dict[str, Any]]:
    """The verifier's greedy output for every source, as training pairs (resumable: the work
    directory's targets.jsonl), and the labelling's wall time."""
    from training.data import IdPair
    from training.distill import distill_pairs
    from training.greedy_labels import greedy_outputs

    # The longest target leaves room for the BOS and a whole block of masks (NAR training rows).
    longest = bundle.config("verifier").max_len - o.k_max - 1
    line = ProgressLine(progress, "labelling", len(sources), "sources")
    started = time.perf_counter()
    verifier = bundle.verifier.to(device)
    try:
        pairs = distill_pairs(
            verifier, [IdPair(s, []) for s in sources], o.work / "targets.jsonl", max_tokens=longest + 1,
            chunk_size=256, log=lambda **r: line.show(r["done"]),
            search=lambda chunk: greedy_outputs(verifier, chunk, longest, first, o.batch_tokens),
        )
    finally:
        line.close()
        verifier.to("cpu")  # the device's memory is the drafters' now; the CPU copy gives their embeddings
    return pairs, _stage_seconds(o.work / "labels.json", time.perf_counter() - started, len(pairs))


def _train_drafter(
    role: str, plan: _Plan, verifier: Any, train: list[Any], valid: list[Any], o: DistillOptions, device: str,
    progress: TextIO | None,
) -> tuple[dict[str, Any], Any]:
    """Train (or continue, or just load) one drafter in `o.work / role`; its result and best model."""
    import torch

    from training.kd_drafters import initial_weights
    from training.train import load_best, train_role, training_seconds

    role_dir = o.work / role
    role_dir.mkdir(parents=True, exist_ok=True)
    # What shapes the training run; the step count and the cadences may change on a rerun.
    cadence = ("max_steps", "log_every", "eval_every", "checkpoint_every", "eval_max_pairs")
    train_key = {k: v for k, v in asdict(plan.train_config).items() if k not in cadence}
    _check_work(role_dir / "key.json", {"model": plan.model_config.to_dict(), "training": train_key})
    finished = role_dir / "result.json"
    result = json.loads(finished.read_text()) if finished.is_file() else None
    init_path = role_dir / "init.pt"
    if not init_path.is_file():
        state, how = initial_weights(plan.model_config, verifier, o.seed)
        torch.save(state, init_path)
        (role_dir / "init.json").write_text(json.dumps({"embeddings": how}) + "\n")
    if result is None or result["steps"] != plan.train_config.max_steps:
        line = ProgressLine(progress, role, plan.train_config.max_steps, "steps")
        try:
            result = train_role(role, plan.model_config, plan.train_config, train, valid, role_dir, resume=True,
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


def _check_options(o: DistillOptions) -> None:
    if o.out.exists() and not (o.out.is_dir() and not any(o.out.iterdir())):
        raise ValueError(f"--out {o.out} exists: give a new directory (the old bundle is never overwritten)")
    if o.out.resolve() == o.bundle.resolve():
        raise ValueError("--out must differ from --bundle")
    if o.lr <= 0 or o.warmup < 0:
        raise ValueError(f"--lr must be positive and --warmup at least 0, not {o.lr} and {o.warmup}")
    for name in ("steps", "ar_steps", "k_max", "batch_tokens"):
        if getattr(o, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be at least 1, not {getattr(o, name)}")


def _check_work(path: Path, key: dict[str, Any]) -> None:
    """Record what a work directory's files were made from; refuse to continue them for other inputs."""
    if path.is_file():
        if json.loads(path.read_text()) != json.loads(json.dumps(key)):
            raise ValueError(f"{path.parent} holds a run for other inputs or settings ({path.name} differs): "
                             f"delete it or pass another --work")
    else:
        path.write_text(json.dumps(key, indent=2) + "\n")


def _stage_seconds(path: Path, seconds: float, pairs: int) -> dict[str, Any]:
    """The labelling's wall time, kept from the run that finished it (a rerun finds it done)."""
    if path.is_file():
        return json.loads(path.read_text())
    record = {"seconds": round(seconds, 2), "pairs": pairs}
    path.write_text(json.dumps(record) + "\n")
    return record


def _parse_ids(line: str, number: int, vocab_size: int) -> list[int]:
    try:
        ids = [int(token) for token in line.split()]
    except ValueError:
        raise ValueError(f"--sources line {number}: not space-separated token ids: {line[:40]!r}") from None
    bad = [i for i in ids if not 0 <= i < vocab_size]
    if bad:
        raise ValueError(f"--sources line {number}: id {bad[0]} is outside the vocabulary (0 to {vocab_size - 1})")
    return ids


def _hardware(device: str) -> str:
    from training.pipeline import hardware

    return hardware(device)
