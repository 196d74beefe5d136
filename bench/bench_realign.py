"""GAD with realigned block drafts against GAD with every block drafted after the whole output.

    python bench/bench_realign.py                  # prints the table
    python bench/bench_realign.py --write          # also replaces its section of BENCHMARKS.md

In process, the shipped bundle's verifier and NAR drafter on the default backend (the library's
`decode`, as `specdec bench` runs it), GAD k=10 on the first `--sentences` UA-GEC test sentences,
one sentence at a time; the variants interleaved per round, best of `--rounds`. "Unshifted" is
GAD's mode spec with `realign` and `lookahead` off; "realigned" turns `realign` on
(decoding.policies.drafter_sync: after a block cut at its first token, the next blocks are drafted
after the output less its last token; after a block whose verifier token is the draft's next one,
they skip one drafted position more; a block call repeated is answered from memory); "realigned,
lookahead" is GAD as it runs (each block drafted one position longer than it is verified). All
give the verifier's greedy output (asserted).
"""

from __future__ import annotations

import dataclasses
import sys
import time
from pathlib import Path
from unittest.mock import patch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from anywhere

from core.backends import DEFAULT_BACKEND
from decoding.config import DecodingConfig, Mode
from decoding.decode import decode
from decoding.modes import MODES
from drafter_service.session import make_drafter
from evaluation.bench_report import bench_parser, machine_stamp, write_section
from evaluation.loadtest import ua_gec_texts
from seq2seq_models.bundle import load_bundle
from verifier_service.session import make_verifier

ROOT = Path(__file__).resolve().parents[1]
SECTION = "## Realigned drafts (GAD)"


def main(argv: list[str] | None = None) -> int:
    p = bench_parser(__doc__, ROOT)
    p.add_argument("--sentences", type=int, default=300)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--k", type=int, default=10)
    p.add_argument("--max-new-tokens", type=int, default=200)
    args = p.parse_args(argv)
    bundle = load_bundle(args.bundle)
    verifier = make_verifier(bundle, DEFAULT_BACKEND)
    drafter = make_drafter(bundle, DEFAULT_BACKEND)
    sources = [bundle.tokenizer.encode(t) for t in ua_gec_texts(args.sentences, args.data_dir)]
    ar = DecodingConfig(mode=Mode.AR, max_new_tokens=args.max_new_tokens)
    greedy = [decode(s, ar, verifier, None).output_ids for s in sources]
    gad = DecodingConfig(mode=Mode.GAD, k=args.k, max_new_tokens=args.max_new_tokens, overlap=False, preverify=False)
    variants = {  # GAD's mode spec as each variant runs it
        "unshifted": dataclasses.replace(MODES[Mode.GAD], realign=False, lookahead=False),
        "realigned": dataclasses.replace(MODES[Mode.GAD], lookahead=False),
        "realigned, lookahead": MODES[Mode.GAD],
    }
    best: dict[str, float] = {}
    iterations: dict[str, int] = {}
    for _ in range(args.rounds):
        for name, spec in variants.items():
            with patch.dict(MODES, {Mode.GAD: spec}):
                t0 = time.perf_counter()
                results = [decode(s, gad, verifier, drafter) for s in sources]
                best[name] = min(best.get(name, float("inf")), time.perf_counter() - t0)
            if [r.output_ids for r in results] != greedy:
                raise AssertionError(f"{name} GAD differs from greedy")
            iterations[name] = sum(r.stats.iterations for r in results)
    n = len(sources)
    lines = ["| GAD k=10 drafts | iterations / sentence | ms / sentence | speed-up | identical to greedy |",
             "|---|---:|---:|---:|---:|"]
    for name in variants:
        lines.append(f"| {name} | {iterations[name] / n:.2f} | {1000 * best[name] / n:.1f} | "
                     f"{best['unshifted'] / best[name]:.2f}x | 100% |")
    table = "\n".join(lines)
    print(table)
    if args.write:
        note = (f"Bundle: {Path(args.bundle).name}; the first {n} UA-GEC test sentences, GAD k={args.k}, "
                f"max_new_tokens {args.max_new_tokens}, in process (backend {DEFAULT_BACKEND}), one "
                f"sentence at a time; best of {args.rounds} interleaved rounds. Unshifted: "
                "every block drafted after the whole output; realigned: after a block cut at its first token, "
                "the next blocks drafted after the output less its last token, until the next such cut; after "
                "a block whose verifier token is the draft's next one (the correction dropped a drafted token), "
                "one drafted position further on; a block call repeated after a guessed insertion answered from "
                "memory. Lookahead: each block drafted one position longer than it is verified (the token "
                "overlapped drafting guesses from; off here).")
        write_section(args.output, SECTION, f"{machine_stamp()}\n\n{note}\n\n{table}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
