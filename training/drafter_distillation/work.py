"""The work directory's records: what its files were made from, and the stages' times."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def check_work(path: Path, key: dict[str, Any]) -> None:
    """Record what a work directory's files were made from; refuse to continue them for other inputs."""
    if path.is_file():
        if json.loads(path.read_text()) != json.loads(json.dumps(key)):
            raise ValueError(f"{path.parent} holds a run for other inputs or settings ({path.name} differs): "
                             f"delete it or pass another --work")
    else:
        path.write_text(json.dumps(key, indent=2) + "\n")


def duration(seconds: float) -> str:
    """A time as the model card and the plan lines tell it: seconds, minutes or hours."""
    if seconds >= 3600:
        return f"{seconds / 3600:.1f} h"
    return f"{seconds / 60:.1f} min" if seconds >= 60 else f"{seconds:.0f} s"


def stage_seconds(path: Path, seconds: float, pairs: int) -> dict[str, Any]:
    """A stage's wall time, kept from the run that finished it (a rerun finds it done)."""
    if path.is_file():
        return json.loads(path.read_text())
    record = {"seconds": round(seconds, 2), "pairs": pairs}
    path.write_text(json.dumps(record) + "\n")
    return record
