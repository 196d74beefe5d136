"""`verifier_service.lanes.pick_lane`: a verifier service's new sessions go to the model worker
where their source adds the least padding, the workers kept about even."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from verifier_service.lanes import pick_lane


def _place(arrivals: list[int], workers: int = 2) -> list[list[int]]:
    lanes: list[list[int]] = [[] for _ in range(workers)]
    for length in arrivals:
        lanes[pick_lane(lanes, length)].append(length)
    return lanes


def test_short_and_long_sources_gather_on_different_workers():
    for order in ([3, 40, 3, 40, 3, 40], [40, 3, 3, 40, 40, 3], [3, 3, 40, 40, 3, 40], [40, 40, 3, 3, 40, 3]):
        assert sorted(sorted(lane) for lane in _place(order)) == [[3, 3, 3], [40, 40, 40]], order


def test_sources_of_one_kind_in_a_row_still_spread_over_the_workers():
    # Balance first: the third short source cannot join two others while the other worker is empty.
    assert _place([3, 3, 3, 40, 40, 40]) == [[3, 3], [3, 40, 40, 40]]


def test_a_source_between_goes_where_it_adds_least():
    lanes = [[10, 12], [60, 64]]
    assert pick_lane(lanes, 11) == 0  # padded to 12 there, to 64 beside the long ones
    assert pick_lane(lanes, 50) == 1  # padded to 64 there; beside the short ones it pads them both to 50
    assert pick_lane(lanes, 70) == 1  # pads two rows by 6 there, two by 58 on the other


def test_one_worker_takes_everything():
    assert _place([5, 50, 7], workers=1) == [[5, 50, 7]]


def test_a_busier_worker_gives_way_to_the_emptiest():
    # Worker 0 holds its like, but 12 sessions against 2 is past the slack (14 // 8 = 1).
    assert pick_lane([[20] * 12, [90, 90]], 20) == 1


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 4), st.lists(st.tuples(st.booleans(), st.integers(1, 200)), max_size=120))
def test_no_worker_takes_a_session_while_it_holds_more_than_the_slack_over_the_emptiest(workers, events):
    """Random opens and closes: the chosen worker never holds more than `max(1, sessions // (4 *
    workers))` sessions above the emptiest, so the workers stay about even."""
    lanes: list[list[int]] = [[] for _ in range(workers)]
    for opens, length in events:
        held = [i for i, lane in enumerate(lanes) if lane]
        if not opens and held:
            lanes[held[length % len(held)]].pop(length % len(lanes[held[length % len(held)]]))
            continue
        counts = [len(lane) for lane in lanes]
        chosen = pick_lane(lanes, length)
        assert counts[chosen] <= min(counts) + max(1, sum(counts) // (4 * workers))
        lanes[chosen].append(length)
