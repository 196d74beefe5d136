"""The Docker suite (issue #14): builds the image and runs the compose stack for real.

Not part of the default `python -m pytest -q` run (every test here is marked `docker`, which addopts
deselects); `.ci/run` starts a docker daemon when it can and runs `python -m pytest -q -n 0 -m docker
tests/docker`. It skips, saying why, only where Docker cannot run at all.
"""

from __future__ import annotations

import pytest


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if "/tests/docker/" in str(item.path).replace("\\", "/"):
            item.add_marker(pytest.mark.docker)
