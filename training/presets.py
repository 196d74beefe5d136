"""Named run sizes: `base` (a Transformer-base verifier pre-trained on synthetic errors, then fine-tuned:
the bundled models), `full` (6+6 layers of width 256), `cpu` (what the 2-core CPU machine trains in
about 1.9 h: the previous bundle), `smoke` and `smoke-synthetic` (the whole pipeline in seconds, without
and with the synthetic stages)."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from seq2seq_models.config import ModelConfig
from training.train import TrainConfig

ROLES = ("verifier", "nar_drafter", "ar_drafter")


@dataclass(frozen=True)
class Preset:
    name: str
    vocab_size: int
    max_tokens: int  # longest source (+EOS) / target (+BOS) kept, in tokens
    max_pairs: int | None  # None: every pair
    shapes: dict[str, dict[str, Any]]  # role -> ModelConfig fields (vocab_size added later)
    training: dict[str, TrainConfig]
    distill_beams: int = 5
    distill_chunk: int = 512
    seed: int = 1
    # Synthetic-error pre-training (training/synthetic.py): each clean sentence corrupted this many
    # times, at `synthetic_scale` times UA-GEC's error rates; 0 skips the synthetic and pretrain stages.
    # The pretrain role (training["pretrain"]) trains the verifier's shape on the synthetic pairs and
    # the real ones; the verifier role then starts from its best weights and sees the real pairs only
    # (and the long pairs of `concat_max_tokens`).
    synthetic_copies: int = 0
    synthetic_scale: float = 1.0
    # Long pairs of consecutive sentences of a document, up to this many tokens, added to the
    # verifier's fine-tuning pairs (`training.data.concatenate_pairs`); 0: none.
    concat_max_tokens: int = 0
    # The NAR drafter starts from the AR drafter's best weights (same width; layers repeated to fill
    # its deeper stacks: training/transfer.py), rather than from scratch.
    nar_from_ar_drafter: bool = False
    weights_dtype: str = "float32"  # the bundle's weights on disk (float16 halves them; loaded as float32)
    notes: dict[str, str] = field(default_factory=dict)

    def model_config(self, role: str, vocab_size: int) -> ModelConfig:
        return ModelConfig(vocab_size=vocab_size, **self.shapes["verifier" if role == "pretrain" else role])


def get_preset(name: str, seed: int = 1) -> Preset:
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; choose from {sorted(PRESETS)}")
    preset = PRESETS[name]
    if seed == preset.seed:
        return preset
    return replace(preset, seed=seed, training={r: replace(c, seed=seed) for r, c in preset.training.items()})


def _shapes(verifier_layers: tuple[int, int], nar_decoder_layers: int) -> dict[str, dict[str, Any]]:
    """The `full` and `cpu` model shapes: the same widths, only the depths differ.
    `verifier_layers` is (encoder, decoder)."""
    common = {"n_heads": 4, "max_len": 256, "dropout": 0.1}
    encoder, decoder = verifier_layers
    return {
        "verifier": {"d_model": 256, "encoder_layers": encoder, "decoder_layers": decoder, "ffn_dim": 1024, **common},
        "nar_drafter": {"d_model": 192, "encoder_layers": 2, "decoder_layers": nar_decoder_layers, "ffn_dim": 768,
                        **common},
        "ar_drafter": {"d_model": 128, "encoder_layers": 2, "decoder_layers": 1, "ffn_dim": 512, **common},
    }


def _train(objective: str, **fields: Any) -> TrainConfig:
    """A TrainConfig with the logging and checkpoint cadence every full-size preset shares."""
    return TrainConfig(objective=objective, log_every=10, checkpoint_every=50, **fields)


def _full_size(name: str, shapes: dict[str, dict[str, Any]], **fields: Any) -> Preset:
    """A preset on the whole UA-GEC corpus: an 8000-piece vocabulary, pairs of up to 128 tokens."""
    return Preset(name=name, vocab_size=8000, max_tokens=128, max_pairs=None, shapes=shapes, **fields)


def _full_train(objective: str, **fields: Any) -> TrainConfig:
    """`_train` with the `full` preset's batches (6000 tokens) and evaluations (every 250 steps)."""
    return _train(objective, max_tokens=6000, eval_every=250, **fields)


# The verifier: 6+6 layers of width 256, so one incremental verify step (a few tokens against the
# cached prefix) costs a few ms on a laptop-class CPU; the drafters are much cheaper. Weights in
# float32: verifier 13.2M params, NAR 4.3M, AR 1.8M: 77 MB in all (the repository budget is 150 MB).
_FULL_SHAPES = _shapes(verifier_layers=(6, 6), nar_decoder_layers=3)

_FULL = _full_size(
    "full",
    _FULL_SHAPES,
    # 5000 steps are ~40 epochs of the ~31k train pairs: hours on a 2-core CPU, minutes on a GPU
    # (BENCHMARKS.md, "Training (CPU)").
    training={
        "verifier": _full_train("ar", max_steps=5000, peak_lr=7e-4, warmup_steps=800),
        "nar_drafter": _full_train("nar", max_steps=5000, peak_lr=7e-4, warmup_steps=800, nar_k_max=25, glat_ratio=0.5),
        "ar_drafter": _full_train("ar", max_steps=3000, peak_lr=1e-3, warmup_steps=500),
    },
    distill_beams=5,
)

# `cpu`: what the 2-core CPU machine can train without a GPU, resumable across sessions. A shallower
# verifier (4+3 layers of width 256, 8.5M params; steps of 4k target tokens, ~7.5k tokens with the
# sources); distillation with the batched search at width 1 (the verifier's greedy output,
# which is exactly what GAD's drafts are compared with); drafters for a few epochs. Weights: ~50 MB.
# 1600 verifier steps suffice because positions start as a sinusoid table, which makes the verifier
# learn to copy early (BENCHMARKS.md, "Training (CPU)", also for the preset's wall times).
_CPU_SHAPES = _shapes(verifier_layers=(4, 3), nar_decoder_layers=2)


def _quick_eval(objective: str, **fields: Any) -> TrainConfig:
    """`_train` with evaluations on the first 500 validation pairs, short enough for the CPU presets."""
    return _train(objective, eval_max_pairs=500, **fields)


# The drafters' training in `cpu` and `base`: a few epochs of the distilled pairs.
_DRAFTERS = {
    "nar_drafter": _quick_eval("nar", max_steps=2000, max_tokens=6000, peak_lr=1e-3, warmup_steps=150, eval_every=250,
                               nar_k_max=25, glat_ratio=0.5),
    "ar_drafter": _quick_eval("ar", max_steps=1000, max_tokens=6000, peak_lr=1.5e-3, warmup_steps=100, eval_every=250),
}

_CPU = _full_size(
    "cpu",
    _CPU_SHAPES,
    training={
        "verifier": _quick_eval("ar", max_steps=1600, max_tokens=4000, peak_lr=1e-3, warmup_steps=150, eval_every=200),
        # The shipped bundle's NAR drafter was evaluated (and its best weights chosen) every 350 steps.
        **_DRAFTERS, "nar_drafter": replace(_DRAFTERS["nar_drafter"], eval_every=350),
    },
    distill_beams=1,
)

# `base`: the Transformer-base verifier (6+6 layers of width 512, 8 heads: 48.5M params), drafters a
# fifth of its size or less: the NAR drafter shaped as in the GAD paper (6 encoder layers, 2 decoder
# layers of width 256: 9.0M), the AR drafter 3+1 layers of width 256 (5.6M); its step times on a
# CPU are in BENCHMARKS.md, "Training (CPU)". Pre-training sees
# each clean UA-GEC training target twice corrupted plus the real pairs (~470 steps an epoch), the
# fine-tuning the real pairs (126 steps an epoch). On a GPU the same steps take minutes.
_BASE_SHAPES = {
    "verifier": {"d_model": 512, "n_heads": 8, "encoder_layers": 6, "decoder_layers": 6, "ffn_dim": 2048,
                 "max_len": 256, "dropout": 0.1},
    "nar_drafter": {"d_model": 256, "n_heads": 4, "encoder_layers": 6, "decoder_layers": 2, "ffn_dim": 1024,
                    "max_len": 256, "dropout": 0.1},
    "ar_drafter": {"d_model": 256, "n_heads": 4, "encoder_layers": 3, "decoder_layers": 1, "ffn_dim": 1024,
                   "max_len": 256, "dropout": 0.1},
}

_BASE = _full_size(
    "base",
    _BASE_SHAPES,
    training={
        "pretrain": _quick_eval("ar", max_steps=700, max_tokens=6000, peak_lr=7e-4, warmup_steps=200, eval_every=100),
        # The verifier: the average of its last five checkpoints when better. Long pairs
        # (`concat_max_tokens`) because, trained on sentence pairs alone, it fell into repetition on
        # long outputs; 1200 steps, not 700, because at 700 it still garbled long copies while the
        # validation loss was still falling (bundles/ua-gec/MODEL_CARD.md, "Training history").
        "verifier": _quick_eval("ar", max_steps=1200, max_tokens=6000, peak_lr=3e-4, warmup_steps=50, eval_every=100,
                                average_last=5),
        # The NAR drafter starts from the AR drafter's weights (`nar_from_ar_drafter`), so it needs
        # fewer steps than one trained from scratch (the model card's "Training history").
        **_DRAFTERS, "nar_drafter": replace(_DRAFTERS["nar_drafter"], max_steps=1500),
    },
    distill_beams=1,
    synthetic_copies=2,
    concat_max_tokens=256,  # the verifier's max_len: sentences up to its limit are ones it has seen
    # Trained from scratch, this NAR drafter was still predicting the unigram distribution (valid
    # token accuracy 0.08) at step 1000 of 2000; the AR drafter left it between steps 250 and 450.
    nar_from_ar_drafter=True,
    weights_dtype="float16",  # 63M params: 126 MB in float16, within the repository's 150 MB
)

_SMOKE_SHAPE = {"d_model": 32, "n_heads": 2, "encoder_layers": 1, "decoder_layers": 1, "ffn_dim": 64,
                "max_len": 96, "dropout": 0.1}
_SMOKE_TRAIN = TrainConfig(max_steps=6, max_tokens=1500, peak_lr=3e-3, warmup_steps=2, log_every=2, eval_every=3,
                           checkpoint_every=3, eval_max_pairs=40)

_SMOKE = Preset(
    name="smoke",
    vocab_size=300,
    max_tokens=48,
    max_pairs=120,
    shapes={role: dict(_SMOKE_SHAPE) for role in ROLES},
    training={
        "verifier": _SMOKE_TRAIN,
        "nar_drafter": replace(_SMOKE_TRAIN, objective="nar", nar_k_max=5),
        "ar_drafter": _SMOKE_TRAIN,
    },
    distill_beams=2,
    distill_chunk=64,
)

# The base recipe in miniature: synthetic pre-training, fine-tuning, the verifier's checkpoints averaged,
# the NAR drafter (deeper than the AR drafter, as in `base`) started from the AR drafter's weights.
_SMOKE_SYNTHETIC = replace(
    _SMOKE, name="smoke-synthetic", synthetic_copies=2, concat_max_tokens=96,
    shapes={**_SMOKE.shapes, "nar_drafter": {**_SMOKE_SHAPE, "encoder_layers": 2, "decoder_layers": 2}},
    training={**_SMOKE.training, "pretrain": _SMOKE_TRAIN, "verifier": replace(_SMOKE_TRAIN, average_last=2)},
    nar_from_ar_drafter=True,
)

PRESETS = {"base": _BASE, "full": _FULL, "cpu": _CPU, "smoke": _SMOKE, "smoke-synthetic": _SMOKE_SYNTHETIC}
