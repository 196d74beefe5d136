"""How many examples the heaviest property tests draw. The default run draws a share of them
(SPECDEC_PROPERTY_SCALE, default 0.35) so that it stays a few minutes on two cores; `.ci/run` runs
those files again at the full count (SPECDEC_PROPERTY_SCALE=1)."""

from __future__ import annotations

import os

SCALE = float(os.environ.get("SPECDEC_PROPERTY_SCALE", "0.35"))


def examples(full: int) -> int:
    """`full` examples scaled to this run, never fewer than 10."""
    return max(10, round(full * SCALE))
