"""Overlapped drafting through the services: each mode with overlap off and on, in one run.

    python bench/bench_overlap.py                   # prints the table
    python bench/bench_overlap.py --write           # also replaces "## Overlapped drafting" in BENCHMARKS.md
    python bench/bench_overlap.py --sentences 60    # a short check

One `specdec serve all --processes` stack on the bundled models (ONNX Runtime, TCP loopback). For
GAD k=10, GAD++ and MJSD the same UA-GEC test sentences go through the gateway one request in
flight, overlap off then on (the per-request `overlap` field, so the same servers serve both), over
several interleaved rounds; the table gives ms per sentence (best round of each), the speed-up,
the pre-draft hit rate (pre-drafted blocks used / started: a hit needs the block accepted in full
and the drafter's guess of the verifier's token right) and whether the outputs are identical.

It also gives the most overlap could save at the hit rate it had: a used pre-draft takes one
drafter call off the critical path, nothing more, so the ceiling is
off / (off - used pre-drafts x drafter ms per iteration), with the drafter's and the verifier's
ms per iteration from the gateway's stats of the overlap-off run (its `drafter_time_ms` and
`verifier_time_ms`, round trips included). Overlap that runs drafter and verifier on the same
cores stays below it, as each slows the other.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import grpc

from core.backends import BACKENDS
from gateway.wire import overrides_to_wire
from protos.specdec.v1 import gateway_pb2, gateway_pb2_grpc
from specdec.bench_report import machine_stamp, start_services, write_section
from specdec.loadtest import ua_gec_texts

ROOT = Path(__file__).resolve().parents[1]
SECTION = "## Overlapped drafting"
MODES = {"GAD k=10": {"mode": "gad", "k": 10}, "GAD++ k=10": {"mode": "gad++", "k": 10}, "MJSD": {"mode": "mjsd"}}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--bundle", default=str(ROOT / "bundles" / "ua-gec"))
    p.add_argument("--backend", default="onnxruntime", choices=BACKENDS)
    p.add_argument("--data-dir", help="prepared data dir whose test.text.jsonl to use (default: ua-gec)")
    p.add_argument("--sentences", type=int, default=300)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--max-new-tokens", type=int, default=200)
    p.add_argument("--write", action="store_true")
    p.add_argument("--output", type=Path, default=ROOT / "BENCHMARKS.md")
    args = p.parse_args(argv)
    texts = ua_gec_texts(args.sentences, args.data_dir)
    proc, address = start_services(Path(args.bundle), args.backend, extra_args=("--processes",))
    try:
        rows = _measure(address, texts, args)
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    table = _table(rows)
    print(table)
    if args.write:
        stamp = machine_stamp(f"backend {args.backend}")
        note = (f"Bundle: {Path(args.bundle).name}; the first {len(texts)} UA-GEC test sentences through "
                f"`specdec serve all --processes` (TCP loopback), one Generate in flight, max_new_tokens "
                f"{args.max_new_tokens}; best of {args.rounds} interleaved rounds, overlap off and on in each. Hit "
                "rate: pre-drafted blocks used / started. GAD's outputs are identical by construction (asserted). "
                "Drafter and verifier ms / iteration: the gateway's stats of the overlap-off run, round trips "
                "included. "
                "Ceiling: what overlap would give at its hit rate if it cost nothing, each used pre-draft taking "
                "one drafter call off the critical path: off / (off - used pre-drafts x drafter ms / iteration).")
        write_section(args.output, SECTION, f"{stamp}\n\n{note}\n\n{table}")
    return 0


def _measure(address: str, texts: list[str], args) -> list[dict]:
    rows = []
    with grpc.insecure_channel(address) as channel:
        stub = gateway_pb2_grpc.GatewayServiceStub(channel)
        for name, overrides in MODES.items():
            best: dict[bool, float] = {}
            replies: dict[bool, list] = {}
            for _ in range(args.rounds):
                for overlap in (False, True):
                    wire = overrides_to_wire({**overrides, "max_new_tokens": args.max_new_tokens, "overlap": overlap})
                    stub.Generate(gateway_pb2.GenerateRequest(text=texts[0], config=wire), timeout=120)  # warm
                    t0 = time.perf_counter()
                    replies[overlap] = [stub.Generate(gateway_pb2.GenerateRequest(text=t, config=wire), timeout=120)
                                        for t in texts]
                    best[overlap] = min(best.get(overlap, float("inf")), time.perf_counter() - t0)
            same = sum(list(a.output_ids) == list(b.output_ids) for a, b in zip(replies[False], replies[True],
                                                                                strict=True))
            if overrides["mode"] == "gad" and same != len(texts):
                raise AssertionError(f"{name}: overlap changed {len(texts) - same} outputs")
            started = sum(r.stats.predrafts for r in replies[True])
            used = sum(r.stats.predrafts_used for r in replies[True])
            plain = replies[False]
            iterations_off = max(1, sum(r.stats.iterations for r in plain))
            drafter_ms = sum(r.stats.drafter_time_ms for r in plain) / iterations_off
            off_ms = 1000 * best[False] / len(texts)
            rows.append({
                "mode": name, "off_ms": off_ms, "on_ms": 1000 * best[True] / len(texts),
                "drafter_ms": drafter_ms, "verifier_ms": sum(r.stats.verifier_time_ms for r in plain) / iterations_off,
                "ceiling": off_ms / max(off_ms - used / len(texts) * drafter_ms, 1e-9),
                "iterations": sum(r.stats.iterations for r in replies[True]) / len(texts),
                "hit_rate": used / started if started else 0.0, "identical": same / len(texts),
                "degraded": sum(r.stats.degraded for rs in replies.values() for r in rs),
            })
    return rows


def _table(rows: list[dict]) -> str:
    lines = ["| mode | iterations / sentence | overlap off ms / sentence | overlap on ms / sentence | speed-up | "
             "pre-draft hit rate | identical outputs | drafter ms / iteration | verifier ms / iteration | "
             "ceiling at this hit rate |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['mode']} | {r['iterations']:.1f} | {r['off_ms']:.1f} | {r['on_ms']:.1f} | "
                     f"{r['off_ms'] / r['on_ms']:.2f}x | {100 * r['hit_rate']:.0f}% | {100 * r['identical']:.1f}% | "
                     f"{r['drafter_ms']:.1f} | {r['verifier_ms']:.1f} | {r['ceiling']:.2f}x |")
    if any(r["degraded"] for r in rows):
        lines.append(f"\n{sum(r['degraded'] for r in rows)} requests fell back to AR (drafter failures).")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
