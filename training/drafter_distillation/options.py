"""What `specdec distill` is asked to do: one frozen record, made once from the command line and
passed down (`run.distill`)."""

from __future__ import annotations

from dataclasses import dataclass, fields
from pathlib import Path

DEFAULT_STEPS = 2000
DEFAULT_AR_STEPS = 1000
DEFAULT_K_MAX = 25
DEFAULT_LR = 1e-3  # the presets' drafters' peak learning rate (training/presets.py)
DEFAULT_WARMUP = 150
DEFAULT_BATCH_TOKENS = 4096
# The default drafters' share of the verifier's parameters (`drafter_models`): the NAR drafter runs
# one forward an iteration beside the verifier's; the AR drafter one a drafted token, so it gets less.
NAR_SHARE = 0.25
AR_SHARE = 0.1


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
    batch_tokens: int = DEFAULT_BATCH_TOKENS
    lr: float = DEFAULT_LR
    warmup: int = DEFAULT_WARMUP
    nar_layers: tuple[int, int] | None = None
    nar_width: int | None = None
    ar_layers: tuple[int, int] | None = None
    ar_width: int | None = None
    seed: int = 1
    name: str | None = None
    target_lang: str = ""

    def check(self) -> None:
        """Refuse what no run can do, before anything is read or written (one-line ValueErrors)."""
        if self.out.exists() and not (self.out.is_dir() and not any(self.out.iterdir())):
            raise ValueError(f"--out {self.out} exists: give a new directory (the old bundle is never overwritten)")
        if self.out.resolve() == self.bundle.resolve():
            raise ValueError("--out must differ from --bundle")
        if self.lr <= 0 or self.warmup < 0:
            raise ValueError(f"--lr must be positive and --warmup at least 0, not {self.lr} and {self.warmup}")
        for name in ("steps", "ar_steps", "k_max", "batch_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be at least 1, not {getattr(self, name)}")

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
