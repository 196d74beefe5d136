"""The id and length checks of the session protocol (`core.interfaces`), written once so every
backend and every edge refuses the same requests with the same status code and message.

`limits` is anything with `vocab_size` and `max_len` (a model config: the longest source including
its EOS, and the longest target including BOS).
"""

from __future__ import annotations

from typing import Protocol

from core.errors import invalid, out_of_range, out_of_step
from core.wire import TOP1_ONLY


class ModelLimits(Protocol):
    vocab_size: int
    max_len: int


def check_source(source_ids: list[int], config: ModelLimits) -> None:
    check_source_ids(source_ids, config.vocab_size, config.max_len - 1)


def check_source_ids(source_ids: list[int], vocab_size: int, max_source_len: int) -> None:
    """A non-empty source of known ids, at most `max_source_len` long (not counting its EOS)."""
    check_ids(source_ids, vocab_size, "source")
    if not source_ids:
        raise invalid("source is empty")
    if len(source_ids) > max_source_len:
        raise out_of_range(f"source has {len(source_ids)} tokens; the limit is {max_source_len}")


def check_sync(committed_len: int, held: int, append_ids: list[int], lookahead: int, config: ModelLimits) -> None:
    """A step may keep at most the `held` tokens the session has seen, and must fit max_len."""
    if not 0 <= committed_len <= held:
        raise out_of_step(f"committed_len {committed_len} but the session holds {held} output tokens")
    check_ids(append_ids, config.vocab_size, "append_ids")
    total = committed_len + len(append_ids) + lookahead
    if total > config.max_len - 1:
        raise out_of_range(f"output would reach {total} tokens; the limit is {config.max_len - 1}")


def check_draft(draft_ids: list[int], top_k: int, config: ModelLimits) -> None:
    if not 1 <= top_k <= config.vocab_size:
        raise invalid(f"top_k must be in [1, {config.vocab_size}], got {top_k}")
    check_ids(draft_ids, config.vocab_size, "draft_ids")


def check_wire_top_k(top_k: int, vocab_size: int) -> None:
    """A VerifyStep.top_k: TOP1_ONLY (no candidate lists, see core.wire) up to the vocabulary."""
    if not TOP1_ONLY <= top_k <= vocab_size:
        raise invalid(f"top_k must be in [{TOP1_ONLY}, {vocab_size}], got {top_k}")


def check_draft_len(draft_len: int, max_draft_len: int) -> None:
    """A draft asked for or sent in one step, against a server's configured limit."""
    if draft_len > max_draft_len:
        raise out_of_range(f"draft has {draft_len} tokens; the limit is {max_draft_len}")


def check_positive(value: int, name: str) -> None:
    if value < 1:
        raise invalid(f"{name} must be >= 1, got {value}")


def check_ids(ids: list[int], vocab_size: int, what: str) -> None:
    bad = [i for i in ids if not 0 <= i < vocab_size]
    if bad:
        raise invalid(f"{what} has ids outside the vocabulary [0, {vocab_size}): {bad[:5]}")
