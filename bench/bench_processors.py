"""What generate()'s logits processors cost per greedy step.

    python bench/bench_processors.py            # prints the table
    python bench/bench_processors.py --write    # also replaces its section of BENCHMARKS.md

The bundle's greedy (mode ar, one sentence at a time, in-process) over the first `--sentences`
UA-GEC test sentences, without processors and with every processor on (repetition_penalty,
no_repeat_ngram_size, encoder_no_repeat_ngram_size, multi-token bad_words_ids, min_new_tokens,
suppress_tokens, begin_suppress_tokens, forced_eos_token_id), per backend and precision. The
figure is time per step (each sentence run without and with, back to back, in `--rounds` rounds;
each sentence's fastest round each way, summed, over its verifier steps), taken over the sentences
whose output the processors leave unchanged: a step costs more the longer the prefix it attends
to, so two runs that take different steps would compare different work, not the processors' cost.
The settings are active on every step (every plan is computed, the penalty scales every seen
token) but chosen to change few greedy outputs; how many sentences were kept is printed with the
table.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from anywhere

from evaluation.bench_report import bench_parser, machine_stamp, write_section
from evaluation.loadtest import ua_gec_texts
from seq2seq_models.bundle import load_bundle

ROOT = Path(__file__).resolve().parents[1]
SECTION = "## Logits processors (CPU)"
SETUPS = [("onnxruntime", "int8"), ("onnxruntime", "fp32"), ("torch", "fp32")]


def main(argv: list[str] | None = None) -> int:
    import specdec

    p = bench_parser(__doc__, ROOT)
    p.add_argument("--sentences", type=int, default=40)
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--max-new-tokens", type=int, default=200)
    args = p.parse_args(argv)
    corpus = ua_gec_texts(args.sentences, args.data_dir)
    processors = _every_processor(load_bundle(args.bundle, roles=["verifier"]).verifier.config)
    rows = []
    for backend, precision in SETUPS:
        with specdec.Engine.load(args.bundle, backend=backend, precision=precision, threads=1) as engine:
            texts = _unchanged(engine, corpus, args.max_new_tokens, processors)  # warms both ways too
            steps = sum(engine.generate(t, mode="ar", max_new_tokens=args.max_new_tokens).stats.iterations
                        for t in texts)  # the same with the processors: the outputs are
            rounds = []
            for r in range(args.rounds):
                rounds.append(_paired_round(engine, texts, args.max_new_tokens, processors, r))
                without, with_, _ = _fastest(rounds[-1:], steps)
                print(f"round {r + 1}/{args.rounds} {backend} {precision}: {without:.3f} / {with_:.3f} ms/step",
                      file=sys.stderr)
            rows.append((backend, precision, len(texts), *_fastest(rounds, steps)))
    table = _table(rows)
    print(table)
    if args.write:
        note = (f"Bundle: {Path(args.bundle).name}; greedy (mode ar), one sentence at a time in-process, one "
                f"intra-op thread; of the first {len(corpus)} UA-GEC test sentences, those whose output the "
                f"processors leave unchanged (so both runs take the same steps); ms per verifier step (a "
                f"sentence's time over its steps); each sentence runs without and with the processors back to back, "
                f"in alternating order, {args.rounds} rounds, and its fastest round each way counts (the "
                f"machine's other load only adds time). "
                f"With: {_shown(processors)}.")
        write_section(args.output, SECTION, f"{machine_stamp()}\n\n{note}\n\n{table}")
    return 0


def _every_processor(config) -> dict:
    """Every processor on, with settings that leave most greedy outputs as they are (a sentence
    corrector copies its source, so a small encoder n-gram size would ban most of its output)."""
    unk = config.unk_id
    return {
        "repetition_penalty": 1.01, "no_repeat_ngram_size": 4, "encoder_no_repeat_ngram_size": 64,
        "bad_words_ids": [[unk, unk], [unk, unk, unk]], "min_new_tokens": 2, "suppress_tokens": [unk],
        "begin_suppress_tokens": [unk], "forced_eos_token_id": config.eos_id,
    }


def _unchanged(engine, texts: list[str], max_new_tokens: int, params: dict) -> list[str]:
    """The texts whose greedy output is the same with `params` as without."""
    kept = [t for t in texts if engine.generate(t, mode="ar", max_new_tokens=max_new_tokens).output_ids
            == engine.generate(t, mode="ar", max_new_tokens=max_new_tokens, **params).output_ids]
    print(f"{len(kept)} of {len(texts)} outputs unchanged by the processors", file=sys.stderr)
    return kept


def _paired_round(engine, texts: list[str], max_new_tokens: int, params: dict, r: int) -> list[tuple[float, float]]:
    """Each text's ms without and with `params`, run back to back (which goes first alternates),
    so that a slower moment of the machine falls on both."""
    out = []
    for i, text in enumerate(texts):
        ms = [0.0, 0.0]
        for which in ((0, 1) if (i + r) % 2 == 0 else (1, 0)):
            t0 = time.perf_counter()
            engine.generate(text, mode="ar", max_new_tokens=max_new_tokens, **(params if which else {}))
            ms[which] = (time.perf_counter() - t0) * 1000
        out.append((ms[0], ms[1]))
    return out


def _fastest(rounds: list[list[tuple[float, float]]], steps: int) -> tuple[float, float, float]:
    """ms per step without and with, each sentence's fastest round summed (the machine's other
    load only ever adds time), and their ratio."""
    without = sum(min(r[i][0] for r in rounds) for i in range(len(rounds[0])))
    with_ = sum(min(r[i][1] for r in rounds) for i in range(len(rounds[0])))
    return without / steps, with_ / steps, with_ / without


def _table(rows: list[tuple[str, str, int, float, float, float]]) -> str:
    lines = ["| backend | precision | sentences timed | without processors, ms / step | with every processor | cost |",
             "|---|---|---:|---:|---:|---:|"]
    for backend, precision, kept, without, with_, ratio in rows:
        lines.append(f"| {backend} | {precision} | {kept} | {without:.3f} | {with_:.3f} | {(ratio - 1) * 100:+.1f}% |")
    return "\n".join(lines)


def _shown(params: dict) -> str:
    return ", ".join(f"`{k}={v}`" for k, v in params.items())


if __name__ == "__main__":
    sys.exit(main())
