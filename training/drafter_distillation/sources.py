"""The user's unlabelled sources as token ids, and their split into training and validation pairs."""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

VALID_EVERY = 20  # every 20th labelled pair is held out for validation ...
VALID_MAX = 500  # ... up to this many


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


def _parse_ids(line: str, number: int, vocab_size: int) -> list[int]:
    try:
        ids = [int(token) for token in line.split()]
    except ValueError:
        raise ValueError(f"--sources line {number}: not space-separated token ids: {line[:40]!r}") from None
    bad = [i for i in ids if not 0 <= i < vocab_size]
    if bad:
        raise ValueError(f"--sources line {number}: id {bad[0]} is outside the vocabulary (0 to {vocab_size - 1})")
    return ids
