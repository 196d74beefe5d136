"""specdec's import of Hugging Face checkpoints against CTranslate2's own conversion of them: equal
greedy ids, and batch-1 speed on a Marian-base-sized model.

    python bench/bench_hf_ctranslate2.py                  # build the checkpoints, check, time, print
    python bench/bench_hf_ctranslate2.py --write          # also the section of BENCHMARKS.md
    python bench/bench_hf_ctranslate2.py --model DIR      # a save_pretrained Marian/BART/T5/... directory
    python bench/bench_hf_ctranslate2.py --no-speed       # the equality check only

Equality. Every checkpoint (the Marian-base one, or --model, and small ones of the --families built
by bench/hf_checkpoints.py) is imported with `specdec import-hf` and converted with CTranslate2's
`TransformersConverter` (its own reading of the checkpoint, not bench/ct2_convert.py). On varied
random source ids, CTranslate2's greedy (beam 1, float32, `min_decoding_length=0` so that an EOS
first is allowed as in `generate`) must equal specdec's greedy (`decoding.decode.decode`, mode ar, ONNX
Runtime fp32). A difference is a failure (exit 1) unless HF's own top-2 logit gap where the two part
is below NEAR_TIE: a float32 near-tie, printed as such. The converter runs beside specdec, with
transformers 5: it takes the vocabulary from the checkpoint's tokenizer files and BART's / mBART's
pre- or post-norm from `normalize_before` in config.json, which hub checkpoints have and
bench/hf_checkpoints.py writes. mBART-25's conversion has no decoder start token: it is passed as
the target prefix.

Speed, on the Marian-base-sized checkpoint only, batch 1, every output exactly STEPS tokens long:
transformers `generate` (fp32, `min_new_tokens = max_new_tokens = STEPS`), CTranslate2 fp32 and int8
(`min_decoding_length = max_decoding_length = STEPS`), specdec fp32 and int8 (AR greedy on ONNX
Runtime, `max_new_tokens = STEPS`, on sources whose greedy emits no EOS within STEPS tokens, so every
row decodes the same number of steps). ms / sentence is the wall time of one call, encoder
included; ms / step is that over the decoder steps (one per output token). Each engine runs at 1 and
2 intra-op threads (torch's `set_num_threads`, CTranslate2's `intra_threads`, ONNX Runtime's
`intra_op_num_threads`); the faster of the two is marked. Rows are timed interleaved (one round
per source, every row in turn) so drift of a shared machine hits all rows alike.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from anywhere

from bench.hf_checkpoints import MARIAN_BASE, Shape, build

REPO = Path(__file__).resolve().parents[1]
SECTION = "## Hugging Face checkpoints against CTranslate2"
NEAR_TIE = 1e-3  # HF's top-2 logit gap (float32) below which a difference is a near-tie
SMALL_FAMILIES = ("marian", "bart", "mbart", "m2m100", "t5", "t5-v1.1")
STEPS = 64
WARMUP = 1
THREADS = (1, 2)


@dataclass
class Agreement:
    name: str
    same: int = 0
    near_ties: list[str] = field(default_factory=list)
    mismatches: list[str] = field(default_factory=list)

    @property
    def total(self) -> int:
        return self.same + len(self.near_ties) + len(self.mismatches)

    def line(self) -> str:
        text = f"{self.name}: CTranslate2 fp32 greedy = specdec fp32 greedy on {self.same}/{self.total} sources"
        if self.near_ties:
            text += f", {len(self.near_ties)} float32 near-tie(s)"
        if self.mismatches:
            text += f", {len(self.mismatches)} MISMATCH(ES)"
        return text


@dataclass
class Row:
    engine: str
    precision: str
    threads: int
    decode: Callable[[list[int]], list[int]]
    seconds: float = 0.0
    sentences: int = 0
    steps: int = 0
    outputs: list[list[int]] = field(default_factory=list)

    def ms_sentence(self) -> float:
        return 1000 * self.seconds / self.sentences

    def ms_step(self) -> float:
        return 1000 * self.seconds / self.steps


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", type=Path, help="a save_pretrained checkpoint (default: build a Marian-base-sized one)")
    p.add_argument("--work", type=Path, default=REPO / "runs" / "hf-ct2",
                   help="where checkpoints, bundles and conversions are kept (default: runs/hf-ct2)")
    p.add_argument("--families", default=",".join(SMALL_FAMILIES),
                   help="small checkpoints to check for equality too ('' for none)")
    p.add_argument("--sources", type=int, default=16, help="random sources per checkpoint for equality")
    p.add_argument("--sentences", type=int, default=16, help="sources timed per speed row")
    p.add_argument("--no-speed", action="store_true", help="the equality check only")
    p.add_argument("--write", action="store_true", help=f"replace the '{SECTION}' section of BENCHMARKS.md")
    p.add_argument("--output", type=Path, default=REPO / "BENCHMARKS.md")
    args = p.parse_args()
    load_at_start = os.getloadavg()

    base = args.model or build_once("marian", args.work / "marian-base" / "hf", MARIAN_BASE)
    checkpoints = {base.name if args.model else "marian-base": base}
    for i, family in enumerate(f for f in args.families.split(",") if f):
        checkpoints[family] = build_once(family, args.work / family / "hf", Shape(), seed=i + 1)
    agreements = check_all(checkpoints, base, args)
    problems = [f"{a.name}: {m}" for a in agreements for m in a.mismatches]
    if not args.no_speed:
        rows, sources = speed_rows(base, *prepare(base, args.work / next(iter(checkpoints))), args.sentences,
                                   args.work)
        run_interleaved(rows, sources, _progress)
        body = section_body(args, base, agreements, speed_table(rows), load_at_start, os.getloadavg(), len(sources))
        print(body)
        problems += [f"{row.engine} {row.precision} {row.threads} thread(s): an output is not {STEPS} tokens long"
                     for row in rows if any(len(out) != STEPS for out in row.outputs)]
        if args.write:
            from evaluation.bench_report import write_section

            write_section(args.output, SECTION, body)
    for line in problems:
        print(f"PROBLEM {line}", file=sys.stderr)
    return 1 if problems else 0


def check_all(checkpoints: dict[str, Path], base: Path, args: argparse.Namespace) -> list[Agreement]:
    """Import, convert and compare every checkpoint; prints each result as it comes."""
    agreements = []
    for name, hf_dir in checkpoints.items():
        _progress(f"{name}: import, convert, compare")
        bundle_dir, ct2_dir = prepare(hf_dir, args.work / name)
        max_new = STEPS if hf_dir == base else 24
        agreement = check_agreement(name, hf_dir, bundle_dir, ct2_dir, args.sources, max_new, args.work)
        print(agreement.line(), flush=True)
        for tie in agreement.near_ties:
            print(f"  near-tie: {tie}")
        agreements.append(agreement)
    return agreements


def build_once(family: str, out: Path, shape: Shape, seed: int = 0) -> Path:
    """`hf_checkpoints.build`, kept on disk: the build is deterministic in (family, shape, seed) and
    the builder's source."""
    import hashlib

    from bench import hf_checkpoints

    stamp = out / "specdec_build"
    source = hashlib.sha256(Path(hf_checkpoints.__file__).read_bytes()).hexdigest()[:12]
    key = f"{family} {shape} {seed} {source}"
    if stamp.exists() and stamp.read_text() == key:
        return out
    build(family, out, shape, seed)
    stamp.write_text(key)
    return out


def prepare(hf_dir: Path, work: Path) -> tuple[Path, Path]:
    """(specdec bundle, CTranslate2 model directory) of `hf_dir`, remade when the checkpoint changed."""
    bundle_dir, ct2_dir = work / "bundle", work / "ct2"
    stamp, key = work / "specdec_source", _checkpoint_key(hf_dir)
    if not stamp.exists() or stamp.read_text() != key:
        import shutil

        for path in (bundle_dir, ct2_dir):
            shutil.rmtree(path, ignore_errors=True)
        import_bundle(hf_dir, bundle_dir)
        convert(hf_dir, ct2_dir)
        stamp.write_text(key)
    return bundle_dir, ct2_dir


def _checkpoint_key(hf_dir: Path) -> str:
    """The checkpoint's files by name, size and modification time."""
    files = sorted(p for p in Path(hf_dir).iterdir() if p.is_file())
    return "\n".join(f"{p.name} {p.stat().st_size} {p.stat().st_mtime_ns}" for p in files)


def import_bundle(hf_dir: Path, bundle_dir: Path) -> None:
    from specdec.cli import main as specdec_main

    code = specdec_main(["import-hf", "--model", str(hf_dir), "--out", str(bundle_dir)])
    if code != 0:
        raise SystemExit(f"specdec import-hf {hf_dir} failed ({code})")


def convert(hf_dir: Path, ct2_dir: Path) -> None:
    """CTranslate2's own Transformers converter: float32 weights (int8 is a load-time compute type)."""
    import ctranslate2

    ctranslate2.converters.TransformersConverter(str(hf_dir)).convert(str(ct2_dir), force=True)


class Ct2Model:
    """A converted model's CTranslate2 translator and vocabulary, decoding ids as specdec does."""

    def __init__(self, ct2_dir: Path, compute_type: str = "float32", threads: int = 1) -> None:
        import ctranslate2

        self.translator = ctranslate2.Translator(str(ct2_dir), device="cpu", compute_type=compute_type,
                                                 inter_threads=1, intra_threads=threads)
        self.source_vocab, self.target_vocab = ct2_vocabularies(ct2_dir)
        self.index = {token: i for i, token in enumerate(self.target_vocab)}
        # mBART-25's conversion has no start token of its own: the first token of the target prefix is
        # it (the language code in translation), and the hypothesis starts after it.
        self.needs_start = json.loads((ct2_dir / "config.json").read_text()).get("decoder_start_token") is None

    def greedy(self, source_ids: list[int], eos_id: int, start_id: int, max_new: int, min_new: int = 0
               ) -> list[int]:
        """Greedy ids without the EOS, the source framed as specdec frames it (`ids + [EOS]`)."""
        tokens = [self.source_vocab[i] for i in [*source_ids, eos_id]]
        prefix = [[self.target_vocab[start_id]]] if self.needs_start else None
        [result] = self.translator.translate_batch(
            [tokens], target_prefix=prefix, beam_size=1, max_decoding_length=max_new,
            min_decoding_length=min_new, return_end_token=False, disable_unk=False, use_vmap=False)
        return [self.index[t] for t in result.hypotheses[0]]


def ct2_vocabularies(ct2_dir: Path) -> tuple[list[str], list[str]]:
    """(source, target) vocabularies of a converted model, in id order."""
    shared = ct2_dir / "shared_vocabulary.json"
    if shared.exists():
        vocab = json.loads(shared.read_text())
        return vocab, vocab
    return (json.loads((ct2_dir / "source_vocabulary.json").read_text()),
            json.loads((ct2_dir / "target_vocabulary.json").read_text()))


def random_sources(bundle: Any, usable: int, n: int, seed: int = 0, max_len: int = 40) -> list[list[int]]:
    """Varied sources: random non-special ids below `usable` (the ids both engines know), 1..max_len long."""
    cfg = bundle.config("verifier")
    specials = {cfg.pad_id, cfg.eos_id, cfg.bos_id, cfg.unk_id}
    rng = random.Random(seed)
    words = [i for i in range(min(usable, cfg.source_vocab_size)) if i not in specials]
    return [[rng.choice(words) for _ in range(rng.randint(1, max_len))] for _ in range(n)]


def check_agreement(name: str, hf_dir: Path, bundle_dir: Path, ct2_dir: Path, n: int, max_new: int,
                    cache: Path) -> Agreement:
    from decoding.config import DecodingConfig, Mode
    from decoding.decode import decode
    from seq2seq_models.bundle import load_bundle
    from verifier_service.session import make_verifier

    bundle = load_bundle(bundle_dir, roles=("verifier",))
    eos = bundle.config("verifier").eos_id
    ct2 = Ct2Model(ct2_dir)
    verifier = make_verifier(bundle, "onnxruntime", device="cpu", cache_root=cache / "onnx")
    config = DecodingConfig(mode=Mode.AR, max_new_tokens=max_new)
    result = Agreement(name)
    hf = None
    for source in random_sources(bundle, len(ct2.source_vocab), n, seed=len(name)):
        ours = decode(source, config, verifier).output_ids
        theirs = ct2.greedy(source, eos, bundle.config("verifier").bos_id, max_new)
        if ours == theirs:
            result.same += 1
            continue
        at = next((i for i, (a, b) in enumerate(zip(ours, theirs, strict=False)) if a != b),
                  min(len(ours), len(theirs)))
        hf = hf or _hf_model(hf_dir)
        gap = hf_top2_gap(hf, source, ours[:at], bundle.config("verifier"))
        text = f"source {source}: specdec {ours} vs CTranslate2 {theirs} (HF top-2 gap at {at}: {gap:.2e})"
        (result.near_ties if gap < NEAR_TIE else result.mismatches).append(text)
    return result


def hf_top2_gap(model: Any, source: list[int], prefix: list[int], cfg: Any) -> float:
    """HF's own top-2 logit gap at the token after `prefix`."""
    import torch

    with torch.inference_mode():
        logits = model(input_ids=torch.tensor([[*source, cfg.eos_id]]),
                       decoder_input_ids=torch.tensor([[cfg.bos_id, *prefix]])).logits[0, -1]
    top = logits.topk(2).values
    return float(top[0] - top[1])


def _hf_model(hf_dir: Path) -> Any:
    import torch
    from transformers import AutoModelForSeq2SeqLM
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    return AutoModelForSeq2SeqLM.from_pretrained(str(hf_dir), dtype=torch.float32).eval()


def speed_rows(hf_dir: Path, bundle_dir: Path, ct2_dir: Path, n: int, cache: Path
               ) -> tuple[list[Row], list[list[int]]]:
    """The rows, and `n` sources whose specdec fp32 greedy runs STEPS tokens without an EOS."""
    import torch

    from decoding.config import DecodingConfig, Mode
    from decoding.decode import decode
    from seq2seq_models.bundle import load_bundle
    from verifier_service.session import make_verifier

    bundle = load_bundle(bundle_dir, roles=("verifier",))
    cfg = bundle.config("verifier")
    config = DecodingConfig(mode=Mode.AR, max_new_tokens=STEPS)
    hf = _hf_model(hf_dir)
    rows: list[Row] = []
    for threads in THREADS:
        def generate(ids: list[int], t: int = threads) -> list[int]:
            torch.set_num_threads(t)
            with torch.inference_mode():
                out = hf.generate(torch.tensor([[*ids, cfg.eos_id]]), do_sample=False, num_beams=1,
                                  min_new_tokens=STEPS, max_new_tokens=STEPS, forced_eos_token_id=None,
                                  forced_bos_token_id=None)
            return out[0, 1:].tolist()

        rows.append(Row("transformers generate", "fp32", threads, generate))
    for compute_type, precision in (("float32", "fp32"), ("int8", "int8")):
        for threads in THREADS:
            ct2 = Ct2Model(ct2_dir, compute_type, threads)
            rows.append(Row("CTranslate2", precision, threads,
                            lambda ids, m=ct2: m.greedy(ids, cfg.eos_id, cfg.bos_id, STEPS, min_new=STEPS)))
    for precision in ("fp32", "int8"):
        for threads in THREADS:
            verifier = make_verifier(bundle, "onnxruntime", device="cpu", precision=precision,
                                     intra_op_threads=threads, cache_root=cache / "onnx")
            rows.append(Row("specdec (ONNX Runtime)", precision, threads,
                            lambda ids, v=verifier: decode(ids, config, v).output_ids))
    fp32 = next(r for r in rows if r.engine.startswith("specdec") and r.precision == "fp32")
    usable = len(ct2_vocabularies(ct2_dir)[0])
    sources: list[list[int]] = []
    for source in random_sources(bundle, usable, 4 * n, seed=7, max_len=30):
        if len(sources) < n and len(fp32.decode(source)) == STEPS:
            sources.append(source)
    return rows, sources


def run_interleaved(rows: list[Row], sources: list[list[int]], progress: Callable[[str], None]) -> None:
    """One round per source: every row decodes it in turn (the order reversed every other round), timed
    per call, so a burst of other work on the machine lands on neighbouring rows alike."""
    for row in rows:
        for ids in sources[:WARMUP]:
            row.decode(ids)
        row.outputs = [[] for _ in sources]
    for i, source in enumerate(sources):
        for row in rows if i % 2 == 0 else rows[::-1]:
            started = time.perf_counter()
            out = row.decode(source)
            row.seconds += time.perf_counter() - started
            row.outputs[i] = out
            row.sentences += 1
            row.steps += len(out)
        progress(f"source {i + 1}/{len(sources)} done")


def speed_table(rows: list[Row]) -> str:
    best: dict[tuple[str, str], Row] = {}
    for row in rows:
        key = (row.engine, row.precision)
        if key not in best or row.ms_step() < best[key].ms_step():
            best[key] = row
    reference = best["specdec (ONNX Runtime)", "fp32"].outputs
    lines = ["| engine | precision | intra-op threads | ms / sentence | ms / step | steps / sentence | "
             "= specdec fp32 greedy |", "|---|---|---:|---:|---:|---:|---:|"]
    for row in rows:
        mark = " (best)" if best[row.engine, row.precision] is row else ""
        same = sum(a == b for a, b in zip(row.outputs, reference, strict=True))
        lines.append(f"| {row.engine} | {row.precision} | {row.threads}{mark} | {row.ms_sentence():.1f} | "
                     f"{row.ms_step():.2f} | {row.steps / row.sentences:.1f} | {same}/{len(reference)} |")
    verdicts = []
    for precision in ("fp32", "int8"):
        ours, theirs = best["specdec (ONNX Runtime)", precision], best["CTranslate2", precision]
        ratio = theirs.ms_step() / ours.ms_step()
        verdict = "at most CTranslate2's" if ours.ms_step() <= theirs.ms_step() else "ABOVE CTranslate2's"
        verdicts.append(f"- {precision}, best thread count each: specdec {ours.ms_step():.2f} ms / step "
                        f"({ours.threads} thread(s)), CTranslate2 {theirs.ms_step():.2f} ms / step "
                        f"({theirs.threads} thread(s)): specdec's step is {verdict} (CTranslate2 / specdec "
                        f"{ratio:.2f}x).")
    return "\n".join(lines) + "\n\n" + "\n".join(verdicts)


def section_body(args: argparse.Namespace, base: Path, agreements: list[Agreement], table: str,
                 load_before: tuple[float, ...], load_after: tuple[float, ...], timed: int) -> str:
    import datetime as dt
    import shlex

    from evaluation.bench_report import cpu_name

    versions = ", ".join(f"{p} {_version(p)}" for p in ("ctranslate2", "transformers", "torch", "onnxruntime"))
    checkpoint = (f"`{base}`" if args.model else
                  f"a random-weight MarianMTModel of Marian-base size built by `bench/hf_checkpoints.py` "
                  f"(d_model {MARIAN_BASE.d_model}, {MARIAN_BASE.layers}+{MARIAN_BASE.layers} layers, "
                  f"{MARIAN_BASE.heads} heads, ffn {MARIAN_BASE.ffn}, vocabulary {MARIAN_BASE.vocab}, "
                  "SentencePiece tokenizer files)")
    command = shlex.join(["python", "bench/bench_hf_ctranslate2.py", *sys.argv[1:]])
    stamp = (f"Machine: {cpu_name()}, {os.cpu_count()} cores, 1-minute load average {load_before[0]:.2f} at the "
             f"start and {load_after[0]:.2f} after the timing (other work shares the machine); {versions}; "
             f"date {dt.date.today().isoformat()}; command `{command}`")
    method = (f"Checkpoint: {checkpoint}, imported with `specdec import-hf` and converted with CTranslate2's "
              "own `TransformersConverter`. Batch 1, every output exactly "
              f"{STEPS} tokens: transformers `generate` with `min_new_tokens = max_new_tokens = {STEPS}`, "
              f"CTranslate2 with `min_decoding_length = max_decoding_length = {STEPS}` (greedy, beam 1), "
              f"specdec AR greedy in-process (`decoding.decode.decode`, ONNX Runtime, `precision` fp32 / int8) "
              f"with `max_new_tokens = {STEPS}` on {timed} random sources (1-30 ids) whose fp32 greedy emits no "
              f"EOS within {STEPS} tokens; all rows decode the same sources. ms / sentence is one call's wall "
              "time, encoder included; ms / step is that over the output tokens (one decoder step each); "
              "`= specdec fp32 greedy`: sources whose output equals specdec fp32's. "
              f"One round per source, every row in turn (order reversed every other round), after {WARMUP} "
              "warm-up source(s) per row; each engine at 1 and 2 intra-op threads, the faster marked (best).")
    agreement = "Greedy agreement (fp32, random sources; a difference only where HF's own top-2 gap is a near-tie):\n\n"
    agreement += "\n".join(f"- {a.line()}" for a in agreements)
    return "\n\n".join([stamp, method, table, agreement])


def _version(package: str) -> str:
    from importlib.metadata import version

    return version(package)


def _progress(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


if __name__ == "__main__":
    sys.exit(main())
