"""fp32 against int8 models on UA-GEC, in-process, one sentence at a time (ONNX Runtime, CPU).

    python bench/bench_int8.py                 # first 100 test sentences, print the table
    python bench/bench_int8.py --write         # also the "## int8 models (CPU)" section of BENCHMARKS.md

Rows: greedy (AR), GAD k=10 and IAD, each on the fp32 and on the int8 verifier + NAR drafter
(`precision = "int8"`, seq2seq_models/onnx_quantize.py). ms/sentence is the mean wall time of
`decoding.decode.decode`; modes are timed in turn, each after a warm-up of 3 sentences. Checked: each
lossless mode equals greedy on the same precision; reported: the share of sentences whose int8
greedy output equals the fp32 one, and the GLEU of every row.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from anywhere

from decoding.config import DecodingConfig, Mode
from decoding.decode import decode
from drafter_service.session import make_drafter
from evaluation.bench_report import machine_stamp, write_section
from evaluation.benchmark import select_sentences
from evaluation.gec_metrics import gleu
from seq2seq_models.bundle import load_bundle
from training.data import load_test_set
from verifier_service.session import make_verifier

REPO = Path(__file__).resolve().parents[1]
SECTION = "## int8 models (CPU)"
MODES = (("greedy", DecodingConfig(mode=Mode.AR, max_new_tokens=200)),
         ("GAD k=10", DecodingConfig(mode=Mode.GAD, k=10, max_new_tokens=200)),
         ("IAD", DecodingConfig(mode=Mode.IAD, k=10, max_new_tokens=200)))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--bundle", default=str(REPO / "bundles" / "ua-gec"))
    p.add_argument("--sample", type=int, default=100)
    p.add_argument("--write", action="store_true", help="update the section in BENCHMARKS.md")
    args = p.parse_args()
    bundle = load_bundle(args.bundle)
    tok = bundle.tokenizer
    stacks = {prec: (make_verifier(bundle, "onnxruntime", device="cpu", precision=prec),
                     make_drafter(bundle, "onnxruntime", device="cpu", precision=prec)) for prec in ("fp32", "int8")}
    verifier = stacks["fp32"][0]
    sentences = select_sentences(load_test_set(), tok, verifier.max_source_len, args.sample)
    sources = [s.source for s in sentences]
    refs = [s.references for s in sentences]
    outputs: dict[tuple[str, str], list[list[int]]] = {}
    rows = []
    for name, config in MODES:
        for prec, (v, d) in stacks.items():
            for s in sentences[:3]:
                decode(s.source_ids, config, v, d)
            outs, started = [], time.perf_counter()
            for s in sentences:
                outs.append(decode(s.source_ids, config, v, d).output_ids)
            ms = (time.perf_counter() - started) * 1000 / len(sentences)
            outputs[name, prec] = outs
            texts = [tok.decode(o) for o in outs]
            same = "" if name == "greedy" else f"{_share(outs, outputs['greedy', prec]):.0f}%"
            rows.append((name, prec, ms, gleu(sources, texts, refs), same))
            print(f"{name} {prec}: {ms:.1f} ms/sentence", file=sys.stderr, flush=True)
    agree = _share(outputs["greedy", "int8"], outputs["greedy", "fp32"])
    table = _table(rows, agree, len(sentences))
    print(table)
    if args.write:
        stamp = machine_stamp(f"bundle {Path(args.bundle).name}")
        write_section(REPO / "BENCHMARKS.md", SECTION, f"{stamp}\n\n{table}")
    return 0


def _share(a: list[list[int]], b: list[list[int]]) -> float:
    return 100.0 * sum(x == y for x, y in zip(a, b, strict=True)) / len(a)


def _table(rows, agree: float, n: int) -> str:
    fp32 = {name: ms for name, prec, ms, _, _ in rows if prec == "fp32"}
    lines = [
        f"{n} UA-GEC test sentences, in-process, one at a time, ONNX Runtime CPU.\n",
        "| mode | precision | ms/sentence | vs fp32 | GLEU | = greedy (same precision) |",
        "|---|---|---:|---:|---:|---:|",
    ]
    for name, prec, ms, score, same in rows:
        lines.append(f"| {name} | {prec} | {ms:.1f} | {fp32[name] / ms:.2f}x | {score:.2f} | {same or '-'} |")
    lines.append(f"\nint8 greedy output identical to fp32 greedy on {agree:.1f}% of sentences.")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
