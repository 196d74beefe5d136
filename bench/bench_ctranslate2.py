"""specdec against CTranslate2 on the bundle's own verifier: UA-GEC test sentences, batch 1, CPU.

    python bench/bench_ctranslate2.py                    # 300 sentences, print the table
    python bench/bench_ctranslate2.py --sample 50        # a quicker run
    python bench/bench_ctranslate2.py --write            # also the "## CTranslate2 reference" section

CTranslate2 (`pip install -e '.[bench]'`) runs the verifier converted by bench/ct2_convert.py (fp32
weights; int8 is its `compute_type="int8"`), greedy, beam 1, one sentence per call. specdec runs
in-process (`decoding.decode.decode`) on ONNX Runtime at `precision` fp32 and int8 (verifier and NAR
drafter): AR greedy, IAD, GAD k=10 (fixed, and adaptive: k <= 10 per step) and GAD++. Both
engines get the same intra-op threads (`--threads`: CTranslate2's `intra_threads`, ONNX Runtime's
`intra_op_num_threads` of every session). Timing: after a warm-up of a few sentences per row,
ROUNDS interleaved rounds (each round every ROUNDS-th sentence, every row in turn), so drift of a
shared machine skews all rows alike; a row's ms/sentence is its summed wall time over the sample.

Checked and reported: CTranslate2 fp32 greedy equals specdec fp32 greedy (the conversion is exact;
a difference is printed), every lossless specdec row equals greedy on its own precision, the share
of sentences whose int8 greedy equals fp32 greedy (each engine), GLEU of every row, and the two
targets of issue 12: specdec int8 GAD k=10 faster than CTranslate2 int8 greedy, int8 IAD at least
2x faster.
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from anywhere

from bench.ct2_convert import convert, default_dir, greedy, open_translator, vocabulary

REPO = Path(__file__).resolve().parents[1]
SECTION = "## CTranslate2 reference"
MAX_NEW_TOKENS = 200  # evaluation.benchmark.DEFAULT_MAX_NEW_TOKENS
ROUNDS = 5
WARMUP = 3
IAD_K = 32  # the UA-GEC benchmark's IAD row
GAD_K = 10
GAD_PP = {"k": 25, "beta": 3, "tau": 1.0}  # the UA-GEC benchmark's quick GAD++ row
CT2, SPECDEC = "CTranslate2", "specdec"


@dataclass
class Row:
    engine: str
    mode: str
    precision: str
    decode: Callable[[list[int]], tuple[list[int], int]]  # source ids -> (output ids, iterations)
    lossless: bool = True
    outputs: list[list[int]] | None = None
    iterations: int = 0
    seconds: float = 0.0

    @property
    def name(self) -> str:
        return f"{self.engine} {self.mode} {self.precision}"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--bundle", default=str(REPO / "bundles" / "ua-gec"))
    p.add_argument("--sample", type=int, default=300, help="first N UA-GEC test sentences (default 300)")
    p.add_argument("--threads", type=int, default=default_threads(),
                   help="intra-op threads of both engines (default: the CPUs this process may use, at most 8)")
    p.add_argument("--no-gad-plus-plus", action="store_true", help="leave the GAD++ rows out")
    p.add_argument("--write", action="store_true", help=f"replace the '{SECTION}' section of BENCHMARKS.md")
    p.add_argument("--output", type=Path, default=REPO / "BENCHMARKS.md")
    args = p.parse_args()

    from evaluation.benchmark import select_sentences
    from seq2seq_models.bundle import load_bundle
    from training.data import load_test_set

    bundle = load_bundle(args.bundle, roles=("verifier", "nar_drafter"))
    model_dir = convert(bundle, default_dir(bundle))
    rows = make_rows(bundle, model_dir, args.threads, gad_plus_plus=not args.no_gad_plus_plus)
    sentences = select_sentences(load_test_set(), bundle.tokenizer, bundle.verifier.config.max_len - 1, args.sample)
    run_interleaved(rows, [s.source_ids for s in sentences], progress=lambda m: print(m, file=sys.stderr, flush=True))
    table, verdicts, problems = report(rows, sentences, bundle.tokenizer)
    header = (f"Machine: {_cpu()}, {args.threads} intra-op thread(s) for both engines; "
              f"ctranslate2 {_version('ctranslate2')}, onnxruntime {_version('onnxruntime')}; "
              f"date {dt.date.today()}; command "
              f"`python bench/bench_ctranslate2.py --sample {args.sample} --threads {args.threads}"
              f"{' --no-gad-plus-plus' if args.no_gad_plus_plus else ''} --write`\n\n"
              f"Bundle: {Path(args.bundle).name} (fingerprint {bundle.fingerprint[:12]}); "
              f"{len(sentences)} UA-GEC test sentences (corpus order), batch 1, max_new_tokens {MAX_NEW_TOKENS}, "
              f"{ROUNDS} interleaved rounds after {WARMUP} warm-up sentences per row. CTranslate2 runs the bundle's "
              "verifier converted by `bench/ct2_convert.py` (greedy, beam 1); specdec runs in-process on ONNX Runtime "
              "(`decoding.decode.decode`, verifier and NAR drafter at the row's precision). `vs CT2 int8` = "
              "CTranslate2 int8 greedy's ms / the row's ms; a step is one decoder call (CTranslate2: one per output "
              "token and the EOS), ms / step = ms / sentence over steps, the encoder included.")
    body = "\n\n".join([header, table, "\n".join(verdicts)])
    print(body)
    for line in problems:
        print(line, file=sys.stderr)
    if args.write:
        from evaluation.bench_report import write_section

        write_section(args.output, SECTION, body)
    return 1 if problems else 0


def default_threads() -> int:
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:
        cpus = os.cpu_count() or 1
    return max(1, min(cpus, 8))


def make_rows(bundle, model_dir: Path, threads: int, gad_plus_plus: bool = True) -> list[Row]:
    from decoding.config import DecodingConfig, Mode
    from decoding.decode import decode
    from drafter_service.session import make_drafter
    from verifier_service.session import make_verifier

    vocab = vocabulary(bundle)
    eos = bundle.verifier.config.eos_id
    rows: list[Row] = []
    for compute_type, precision in (("float32", "fp32"), ("int8", "int8")):
        translator = open_translator(model_dir, compute_type, threads)

        def ct2(ids: list[int], t=translator) -> tuple[list[int], int]:
            out = greedy(t, vocab, ids, MAX_NEW_TOKENS, eos)
            return out, len(out) + 1  # one decoder step per token, the EOS's included

        rows.append(Row(CT2, "greedy", precision, ct2))
    modes = [("greedy", DecodingConfig(mode=Mode.AR), True),
             (f"IAD k={IAD_K}", DecodingConfig(mode=Mode.IAD, k=IAD_K), True),
             (f"GAD k={GAD_K}", DecodingConfig(mode=Mode.GAD, k=GAD_K), True),
             (f"GAD k={GAD_K} adaptive", DecodingConfig(mode=Mode.GAD, k=GAD_K, adaptive=True), True)]
    if gad_plus_plus:
        label = f"GAD++ k={GAD_PP['k']} beta={GAD_PP['beta']} tau={GAD_PP['tau']}"
        modes.append((label, DecodingConfig(mode=Mode.GAD_PLUS_PLUS, **GAD_PP), False))
    for precision in ("fp32", "int8"):
        verifier = make_verifier(bundle, "onnxruntime", device="cpu", precision=precision, intra_op_threads=threads)
        drafter = make_drafter(bundle, "onnxruntime", device="cpu", precision=precision, intra_op_threads=threads)
        for mode, config, lossless in modes:
            config = config.with_overrides({"max_new_tokens": MAX_NEW_TOKENS, "seed": 0})

            def ours(ids: list[int], c=config, v=verifier, d=drafter) -> tuple[list[int], int]:
                result = decode(ids, c, v, d)
                return result.output_ids, result.stats.iterations

            rows.append(Row(SPECDEC, mode, precision, ours, lossless))
    return rows


def run_interleaved(rows: list[Row], sources: list[list[int]], progress: Callable[[str], None] = print) -> None:
    """Every row decodes every source once: ROUNDS rounds, each every ROUNDS-th source with every row
    in turn; a row's time is the sum of its decode calls."""
    for row in rows:
        for ids in sources[:WARMUP]:
            row.decode(ids)
        row.outputs = [[] for _ in sources]
    for r in range(ROUNDS):
        for row in rows:
            for i in range(r, len(sources), ROUNDS):
                started = time.perf_counter()
                out, iterations = row.decode(sources[i])
                row.seconds += time.perf_counter() - started
                row.outputs[i] = out
                row.iterations += iterations
        progress(f"round {r + 1}/{ROUNDS} done")


def report(rows: list[Row], sentences, tokenizer) -> tuple[str, list[str], list[str]]:
    """The markdown table, the verdict lines, and the problems (a lossless row that differs from
    greedy, a conversion that is not exact): each a reason to exit 1."""
    from evaluation.gec_metrics import gleu

    n = len(sentences)
    sources = [s.source for s in sentences]
    refs = [s.references for s in sentences]
    by = {(row.engine, row.mode, row.precision): row for row in rows}
    ct2_int8 = by[CT2, "greedy", "int8"]

    def ms(row: Row) -> float:
        return 1000 * row.seconds / n

    lines = ["| engine | mode | precision | ms / sentence | vs CT2 int8 | steps / sentence | ms / step | "
             "= greedy (same engine, precision) | = fp32 greedy | GLEU |",
             "|---|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    problems: list[str] = []
    for row in rows:
        own_greedy = by[row.engine, "greedy", row.precision]
        fp32_greedy = by[row.engine, "greedy", "fp32"]
        same = _share(row.outputs, own_greedy.outputs)
        if row.lossless and same < 100.0:
            problems.append(f"LOSSLESS VIOLATED: {row.name} equals greedy on {same:.1f}% of sentences")
        texts = [tokenizer.decode(o) for o in row.outputs]
        vs_greedy = "-" if row.mode == "greedy" else f"{same:.1f}%"
        lines.append(f"| {row.engine} | {row.mode} | {row.precision} | {ms(row):.1f} | {ms(ct2_int8) / ms(row):.2f}x | "
                     f"{row.iterations / n:.1f} | {1000 * row.seconds / row.iterations:.2f} | {vs_greedy} | "
                     f"{_share(row.outputs, fp32_greedy.outputs):.1f}% | {gleu(sources, texts, refs):.2f} |")
    exact = _share(by[CT2, "greedy", "fp32"].outputs, by[SPECDEC, "greedy", "fp32"].outputs)
    if exact < 100.0:
        problems.append(f"CONVERSION NOT EXACT: CTranslate2 fp32 greedy equals specdec's on {exact:.1f}% of sentences")
    gad = by[SPECDEC, f"GAD k={GAD_K}", "int8"]
    iad = by[SPECDEC, f"IAD k={IAD_K}", "int8"]
    adaptive = by[SPECDEC, f"GAD k={GAD_K} adaptive", "int8"]
    gad_speedup, iad_speedup = ms(ct2_int8) / ms(gad), ms(ct2_int8) / ms(iad)
    adaptive_speedup = ms(ct2_int8) / ms(adaptive)
    ct2_agree = _share(ct2_int8.outputs, by[CT2, "greedy", "fp32"].outputs)
    ours_agree = _share(by[SPECDEC, "greedy", "int8"].outputs, by[SPECDEC, "greedy", "fp32"].outputs)
    verdicts = [
        f"- Conversion: CTranslate2 fp32 greedy identical to specdec fp32 greedy on {exact:.1f}% of sentences.",
        f"- int8 greedy identical to fp32 greedy: CTranslate2 {ct2_agree:.1f}%, specdec {ours_agree:.1f}%.",
        f"- specdec int8 GAD k={GAD_K} vs CTranslate2 int8 greedy: {gad_speedup:.2f}x "
        f"({'faster: target met' if gad_speedup > 1 else 'slower: target NOT met'}).",
        f"- specdec int8 GAD k<={GAD_K} adaptive vs CTranslate2 int8 greedy: {adaptive_speedup:.2f}x "
        f"({'faster: target met' if adaptive_speedup > 1 else 'slower: target NOT met'}).",
        f"- specdec int8 IAD k={IAD_K} vs CTranslate2 int8 greedy: {iad_speedup:.2f}x "
        f"({'target (>= 2x) met' if iad_speedup >= 2 else 'target (>= 2x) NOT met'}).",
    ]
    return "\n".join(lines), verdicts, problems


def _share(a: list[list[int]] | None, b: list[list[int]] | None) -> float:
    assert a is not None and b is not None
    return 100.0 * sum(x == y for x, y in zip(a, b, strict=True)) / len(a)


def _cpu() -> str:
    from evaluation.bench_report import cpu_name

    return cpu_name()


def _version(package: str) -> str:
    from importlib.metadata import version

    return version(package)


if __name__ == "__main__":
    sys.exit(main())
