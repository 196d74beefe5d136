"""Which model worker a verifier session goes to, through `serve all --processes` at 32 clients.

    python bench/bench_placement.py            # print the table
    python bench/bench_placement.py --write    # also replace the "Verifier placement (CPU)" section

The stack of `bench/bench_bulk.py --services` (its config; int8, two verifier model workers of one
thread), once with `[verifier] placement = "length"` and once with `"sessions"`: each round starts
the two stacks in turn, so rounds interleave them. Per mode (AR greedy, IAD k=32): output tokens/s of
`--sentences` requests (the first UA-GEC test sentences) by 32 closed-loop clients after a warm-up of
32, and from the verifier's counters over the same run, the key positions its forwards' attention ran
over per position the rows hold (`specdec_verifier_attended_positions_total` over
`specdec_verifier_held_positions_total`): what padding costs the attention, which a noisy host's
tokens/s blur.
"""

from __future__ import annotations

import re
import statistics
import sys
import tempfile
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from anywhere

from bench.bench_bulk import CLIENTS, MAX_NEW_TOKENS, _services_toml
from bench.bench_load import _free_port
from evaluation.bench_report import bench_parser, machine_stamp, publish, start_services
from evaluation.loadtest import LoadSpec, run_load, ua_gec_texts

REPO = Path(__file__).resolve().parents[1]
SECTION = "## Verifier placement (CPU)"
PLACEMENTS = ("length", "sessions")
MODES = (("AR greedy", {"mode": "ar"}), ("IAD k=32", {"mode": "iad", "k": 32}))
COUNTERS = ("specdec_verifier_attended_positions_total", "specdec_verifier_held_positions_total")


def main(argv: list[str] | None = None) -> int:
    p = bench_parser(__doc__, REPO, data_dir=False)
    p.add_argument("--sentences", type=int, default=200, help="UA-GEC test sentences, one request each (default: 200)")
    p.add_argument("--rounds", type=int, default=3, help="interleaved rounds (default: 3)")
    args = p.parse_args(argv)
    texts = ua_gec_texts(args.sentences, None)
    runs: dict[tuple[str, str], list[tuple[float, float]]] = {}
    for _ in range(args.rounds):
        for placement in PLACEMENTS:
            for mode, rate, padding in _stack_runs(args.bundle, placement, texts):
                runs.setdefault((placement, mode), []).append((rate, padding))
                print(f"placement {placement}, {mode}: {rate:.0f} tok/s, attended / held {padding:.2f}",
                      file=sys.stderr)
    lines = ["| mode | placement | output tokens/s (median) | best | attended / held positions (median) |",
             "|---|---|---:|---:|---:|"]
    for mode, _ in MODES:
        for placement in PLACEMENTS:
            rates, paddings = zip(*runs[(placement, mode)], strict=True)
            lines.append(f"| {mode} | {placement} | {statistics.median(rates):.0f} | {max(rates):.0f} | "
                         f"{statistics.median(paddings):.2f} |")
    return publish(args, SECTION, machine_stamp("int8 (ONNX Runtime), 2 verifier model workers of one intra-op thread"),
                   f"`serve all --processes`, {CLIENTS} clients, {args.sentences} UA-GEC test sentences a run, "
                   f"{args.rounds} interleaved rounds (module docstring of `bench/bench_placement.py`).", lines)


def _stack_runs(bundle: str, placement: str, texts: list[str]) -> list[tuple[str, float, float]]:
    """One stack with `placement`: per mode, (mode, output tokens/s, attended / held positions)."""
    port = _free_port()
    config = Path(tempfile.mkdtemp()) / "placement.toml"
    config.write_text(_services_toml("int8").replace(
        "[verifier]\n", f'[verifier]\nplacement = "{placement}"\nmetrics_address = "127.0.0.1:{port}"\n'))
    proc, address = start_services(Path(bundle), "onnxruntime", extra_args=(
        "--config", str(config), "--processes", "--verifier-model-workers", "2"))
    out = []
    try:
        for mode, params in MODES:
            spec = LoadSpec(address=address, inputs=texts, overrides={**params, "max_new_tokens": MAX_NEW_TOKENS},
                            concurrency=CLIENTS, requests=len(texts), warmup=CLIENTS, timeout=600.0)
            before = _counters(port)
            report = run_load(spec)
            after = _counters(port)
            attended, held = (after[name] - before[name] for name in COUNTERS)
            out.append((mode, report.output_tokens / report.wall_s, attended / held))
    finally:
        proc.terminate()
        proc.wait(60)
    return out


def _counters(port: int) -> dict[str, float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as reply:
        text = reply.read().decode()
    values = {}
    for name in COUNTERS:
        match = re.search(rf"^{name} (\S+)$", text, re.MULTILINE)
        if match is None:
            raise RuntimeError(f"the verifier exports no {name}")
        values[name] = float(match.group(1))
    return values


if __name__ == "__main__":
    sys.exit(main())
