"""Sequence-level distillation: re-label sources with the verifier's own beam search, so the
drafters learn what the verifier would output (high acceptance) rather than the references."""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from seq2seq_models.batched_beam import beam_search_texts
from seq2seq_models.transformer import Seq2SeqTransformer
from training.data import IdPair, load_id_pairs, write_id_pairs


def distill_pairs(
    model: Seq2SeqTransformer,
    pairs: Sequence[IdPair],
    out_path: str | Path,
    num_beams: int = 5,
    max_tokens: int = 128,
    chunk_size: int = 512,
    batch_tokens: int = 8192,
    log: Callable[..., None] | None = None,
) -> list[IdPair]:
    """Write `out_path` (id pairs: original source, verifier output) and return its pairs.

    Progress is appended to `out_path.partial` chunk by chunk, so an interrupted run resumes
    where it stopped. Outputs that are empty or longer than `max_tokens` (with BOS) are dropped.
    """
    out_path = Path(out_path)
    if out_path.is_file():
        return load_id_pairs(out_path)
    partial = out_path.with_suffix(out_path.suffix + ".partial")
    done: dict[int, list[int]] = {}
    if partial.is_file():
        for line in partial.read_text(encoding="utf-8").splitlines():
            if line.strip():
                row = json.loads(line)
                done[row["i"]] = row["target"]
    todo = [i for i in range(len(pairs)) if i not in done]
    model.eval()
    started = time.perf_counter()
    with partial.open("a", encoding="utf-8") as f:
        for start in range(0, len(todo), chunk_size):
            chunk = todo[start : start + chunk_size]
            with torch.no_grad():
                results = beam_search_texts(
                    model, [pairs[i].source for i in chunk], batch_tokens=batch_tokens, num_beams=num_beams
                )
            for i, r in zip(chunk, results, strict=True):
                done[i] = r.tokens
                f.write(json.dumps({"i": i, "target": r.tokens}) + "\n")
            f.flush()
            if log is not None:
                elapsed = time.perf_counter() - started
                log(event="distill", done=len(done), total=len(pairs), sentences_per_s=(start + len(chunk)) / elapsed)
    kept = [IdPair(pairs[i].source, done[i]) for i in range(len(pairs)) if 0 < len(done[i]) < max_tokens]
    write_id_pairs(out_path, kept)
    partial.unlink()
    return kept
