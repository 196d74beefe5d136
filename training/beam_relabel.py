"""Sources re-labelled with the verifier's own beam search (sequence-level knowledge distillation's
data), so the drafters learn what the verifier would output (high acceptance) rather than the
references. Resumable chunk by chunk; `search` may replace the beam search (`specdec distill`
labels with greedy)."""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from seq2seq_models.batched_beam import beam_search_texts
from seq2seq_models.transformer import Seq2SeqTransformer
from training.checkpoint import Interrupted, stop_on_signals
from training.data import IdPair, load_id_pairs, write_id_pairs


def relabel_pairs(
    model: Seq2SeqTransformer,
    pairs: Sequence[IdPair],
    out_path: str | Path,
    num_beams: int = 5,
    max_tokens: int = 128,
    chunk_size: int = 512,
    batch_tokens: int = 8192,
    log: Callable[..., None] | None = None,
    search: Callable[[list[list[int]]], list[list[int]]] | None = None,
) -> list[IdPair]:
    """Write `out_path` (id pairs: original source, verifier output) and return its pairs.
    `search` gives the outputs of a chunk of sources (default: the beam search of `num_beams`).

    Progress is appended to `out_path.partial` chunk by chunk, so an interrupted run resumes
    where it stopped: SIGTERM / Ctrl-C finish the chunk in hand and raise `Interrupted`; a process
    killed mid-write leaves at most a truncated last line, which the next run drops. Outputs that
    are empty or longer than `max_tokens` (with BOS) are dropped.
    """
    out_path = Path(out_path)
    if out_path.is_file():
        return load_id_pairs(out_path)
    partial = out_path.with_suffix(out_path.suffix + ".partial")
    done = _read_partial(partial)
    todo = [i for i in range(len(pairs)) if i not in done]
    model.eval()
    started = time.perf_counter()
    with partial.open("a", encoding="utf-8") as f, stop_on_signals() as stop:
        for start in range(0, len(todo), chunk_size):
            if stop:
                raise Interrupted(f"relabel: stopped at {len(done)} of {len(pairs)} pairs on signal {stop.signal}; "
                                  f"rerun with --resume")
            chunk = todo[start : start + chunk_size]
            with torch.no_grad():
                sources = [pairs[i].source for i in chunk]
                if search is not None:
                    outputs = search(sources)
                else:
                    results = beam_search_texts(model, sources, batch_tokens=batch_tokens, num_beams=num_beams)
                    outputs = [r.tokens for r in results]
            for i, tokens in zip(chunk, outputs, strict=True):
                done[i] = tokens
                f.write(json.dumps({"i": i, "target": tokens}) + "\n")
            f.flush()
            if log is not None:
                elapsed = time.perf_counter() - started
                log(event="relabel", done=len(done), total=len(pairs), sentences_per_s=(start + len(chunk)) / elapsed)
    kept = [IdPair(pairs[i].source, done[i]) for i in range(len(pairs)) if 0 < len(done[i]) < max_tokens]
    write_id_pairs(out_path, kept)
    partial.unlink()
    return kept


def _read_partial(partial: Path) -> dict[int, list[int]]:
    """The rows of an earlier run's `.partial` file, by pair index. A last line cut short (the
    process killed while writing it) is dropped, and cut from the file so that appends follow whole
    lines."""
    done: dict[int, list[int]] = {}
    if not partial.is_file():
        return done
    text = partial.read_text(encoding="utf-8")
    lines = text.split("\n")
    whole = lines[:-1]  # the text after the last newline is a line cut short (or nothing)
    for line in whole:
        if line.strip():
            row = json.loads(line)
            done[row["i"]] = row["target"]
    if lines[-1]:
        partial.write_text("".join(line + "\n" for line in whole), encoding="utf-8")
    return done
