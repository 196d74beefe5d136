"""The UA-GEC benchmark as a script: the same as `specdec bench` (see `evaluation/benchmark.py`).

    python bench/bench_ua_gec.py                         # 500 test sentences, in-process, print the table
    python bench/bench_ua_gec.py --through both --write  # also through the services; update BENCHMARKS.md
    python bench/bench_ua_gec.py --quick --bundle DIR    # one configuration per mode, 20 sentences
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from anywhere

from specdec.cli import main

if __name__ == "__main__":
    sys.exit(main(["bench", *sys.argv[1:]]))
