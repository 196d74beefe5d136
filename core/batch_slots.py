"""One outcome per item of a batched model call, written once for the verifier's `step_batch` and
the NAR drafter's `draft_rows`: each item is planned on its own (its exception goes in its slot and
it stays out of the forward), a session may appear once per batch, and a failing forward fails
exactly the items that were in it."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from core.errors import out_of_step


def answer_in_slots(
    items: Sequence[tuple[Any, Any]],
    plan: Callable[[int, Any, Any], Any],
    run: Callable[[list[Any], list[Any]], None],
    what: str = "step",
) -> list[Any]:
    """`plan(slot, session, request)` validates one item and returns its plan; `run(plans, outcomes)`
    runs one forward over the plans and fills their slots of `outcomes`."""
    outcomes: list[Any] = [None] * len(items)
    planned: list[tuple[int, Any]] = []
    seen: set[int] = set()
    for slot, (session, request) in enumerate(items):
        try:
            if id(session) in seen:
                raise out_of_step(f"the session already has a {what} in this batch")
            planned.append((slot, plan(slot, session, request)))
            seen.add(id(session))
        except Exception as e:  # the item's own failure goes in its slot
            outcomes[slot] = e
    if planned:
        try:
            run([p for _, p in planned], outcomes)
        except Exception as e:  # a failed forward fails the items in it
            for slot, _ in planned:
                outcomes[slot] = e
    return outcomes
