"""The verifier's greedy output for every source, as training pairs: resumable (the work
directory's targets.jsonl, written chunk by chunk), with the labelling's wall time kept."""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

from training.beam_relabel import relabel_pairs
from training.data import IdPair
from training.drafter_distillation.greedy_labels import greedy_outputs
from training.drafter_distillation.progress import ProgressLine
from training.drafter_distillation.work import check_work, stage_seconds


@dataclass(frozen=True)
class Labelling:
    work: Path  # the work directory
    first: list[int]  # the forced first tokens every output starts with
    longest: int  # the longest output kept (without BOS)
    batch_tokens: int  # source tokens per labelling batch
    key: dict[str, Any]  # what the labels are made from: a rerun for other inputs is refused


def label(verifier: Any, sources: list[list[int]], labelling: Labelling, device: str,
          progress: TextIO | None) -> tuple[list[Any], float]:
    """The pairs (source, the verifier's greedy output) and the labelling's seconds."""
    s = labelling
    check_work(s.work / "labels.key.json", {**s.key, "first": s.first})
    line = ProgressLine(progress, "labelling", len(sources), "sources")
    started = time.perf_counter()
    model = verifier.to(device)
    try:
        pairs = relabel_pairs(
            model, [IdPair(source, []) for source in sources], s.work / "targets.jsonl", max_tokens=s.longest + 1,
            chunk_size=256, log=lambda **r: line.show(r["done"]),
            search=lambda chunk: greedy_outputs(model, chunk, s.longest, s.first, s.batch_tokens),
        )
    finally:
        line.close()
        model.to("cpu")  # the device's memory is the drafters' now; the CPU copy gives their embeddings
    record = stage_seconds(s.work / "labels.json", time.perf_counter() - started, len(pairs))
    return pairs, record["seconds"]
