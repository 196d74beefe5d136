"""Resumable training state (model, optimizer, scheduler, counters, every RNG) and the
signal guard that turns SIGTERM / Ctrl-C into "finish this step, checkpoint, stop"."""

from __future__ import annotations

import random
import signal
import threading
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import torch


class Interrupted(RuntimeError):
    """Training stopped on a signal after writing a checkpoint; rerun with --resume."""


def rng_state(generator: torch.Generator) -> dict[str, Any]:
    state = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
        "generator": generator.get_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any], generator: torch.Generator) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    generator.set_state(state["generator"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def seed_everything(seed: int) -> torch.Generator:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    return torch.Generator().manual_seed(seed)


def save_checkpoint(path: Path, state: dict[str, Any]) -> None:
    # Write then rename: a kill during the write leaves the previous checkpoint intact.
    tmp = path.with_suffix(".tmp")
    torch.save(state, tmp)
    tmp.replace(path)


def load_checkpoint(path: Path) -> dict[str, Any]:
    # Our own files; they hold numpy RNG state and python tuples, which weights_only rejects.
    return torch.load(path, map_location="cpu", weights_only=False)


class StopFlag:
    def __init__(self) -> None:
        self.signal: int | None = None

    def __bool__(self) -> bool:
        return self.signal is not None


@contextmanager
def stop_on_signals():
    """Yield a flag that SIGTERM/SIGINT set instead of killing the process mid-step; a second
    Ctrl-C falls back to the default behaviour (immediate KeyboardInterrupt)."""
    flag = StopFlag()
    if threading.current_thread() is not threading.main_thread():
        yield flag
        return

    def handler(signum: int, _frame: Any) -> None:
        if flag.signal is not None and signum == signal.SIGINT:
            raise KeyboardInterrupt
        flag.signal = signum

    previous = {s: signal.signal(s, handler) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield flag
    finally:
        for s, h in previous.items():
            signal.signal(s, h)
