"""The checks of the session protocol (`core.interfaces`), written once so every edge refuses the
same requests with the same status code and message.

What a client controls is checked once, where it enters (ARCHITECTURE.md, "Validation once, at the
edge"): the servers' RPC boundaries, the gateway, and `decoding.decode.decode()` for in-process
callers. The sessions below trust their input and keep only `check_session_step`, the one check
that needs a session's state. `config` is anything with `vocab_size` and `max_len` (a model config:
the longest source including its EOS, and the longest target including BOS).
"""

from __future__ import annotations

from collections.abc import Sized
from typing import Protocol

from core.errors import invalid, out_of_range, out_of_step
from core.wire import TOP1_ONLY


class ModelLimits(Protocol):
    vocab_size: int
    max_len: int


def check_source_ids(
    source_ids: list[int], vocab_size: int, max_source_len: int, what: str = "source", ids_name: str = "source"
) -> None:
    """A non-empty source of known ids, at most `max_source_len` long (not counting its EOS).
    `what` / `ids_name` name it in messages (the gateway says "input" / "input_ids").
    The length comes first: it costs nothing, while checking every id of a huge list does."""
    check_length(source_ids, max_source_len, what)
    check_ids(source_ids, vocab_size, ids_name)
    if not source_ids:
        raise invalid(f"{what} is empty")


def check_length(ids: list[int] | Sized, max_len: int, what: str) -> None:
    """OUT_OF_RANGE for more than `max_len` tokens; run before any per-token work."""
    if len(ids) > max_len:
        raise out_of_range(f"{what} has {len(ids)} tokens; the limit is {max_len}")


def check_bounded(name: str, value: int, low: int, high: int) -> None:
    """A count a client controls: INVALID_ARGUMENT below `low`, OUT_OF_RANGE over the ceiling `high`."""
    if value < low:
        raise invalid(f"{name} must be >= {low}, got {value}")
    if value > high:
        raise out_of_range(f"{name} must be <= {high}, got {value}")


def check_session_step(committed_len: int, held: int, appended: int, lookahead: int, config: ModelLimits) -> None:
    """A step may keep at most the `held` tokens the session has seen, and the output it leads to
    (`appended` final tokens, then `lookahead` drafted ones) must fit the model's max_len."""
    if not 0 <= committed_len <= held:
        raise out_of_step(f"committed_len {committed_len} but the session holds {held} output tokens")
    total = committed_len + appended + lookahead
    if total > config.max_len - 1:
        raise out_of_range(f"output would reach {total} tokens; the limit is {config.max_len - 1}")


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
