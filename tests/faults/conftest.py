"""The fault-injection suite (issue: reliability under cancellation, deadlines and overload).

Every test here starts its own servers on loopback, injects one kind of fault (cancellation
storms, expired deadlines, a hung or killed peer, racing opens, oversized or malformed requests,
floods), is bounded in count and time, and stops by itself. The suite is not part of the default
`python -m pytest -q` run (it is marked `faults`); `.ci/run` runs it after the default run with
`python -m pytest -q -m faults tests/faults`.
"""

from __future__ import annotations

import pytest

from seq2seq_models.bundle import make_tiny_bundle


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if "/tests/faults/" in str(item.path).replace("\\", "/"):
            item.add_marker(pytest.mark.faults)


@pytest.fixture(scope="module")
def bundle_dir(tmp_path_factory):
    """The tiny random bundle every fault test serves (one per test file)."""
    return make_tiny_bundle(tmp_path_factory.mktemp("faults-bundle"), seed=3)
