"""`specdec bench`: the GLEU scorer on hand-computed examples, the perplexity helper, and the
benchmark end to end on the tiny random bundle (a few UA-GEC test sentences, or synthetic ones)."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from evaluation import benchmark
from evaluation.bench_report import accelerator_note, vector_units
from evaluation.gec_metrics import exact_match, gleu, sentence_stats, tokenize
from evaluation.perplexity import output_nll, perplexity
from seq2seq_models.bundle import load_bundle, make_tiny_bundle
from specdec.cli import main
from verifier_service.session import LocalVerifier

# Hand-computed (see each test): one error, in the last word.
SRC = "we went to the shop yesterdy"
REF = "we went to the shop yesterday"
OTHER_REF = "we went to the shop yesterday evening"


@dataclass(frozen=True)
class _Item:
    source: str
    references: list[str]


@pytest.fixture(scope="module")
def bundle_dir(tmp_path_factory) -> Path:
    return make_tiny_bundle(tmp_path_factory.mktemp("bundle"), seed=0)


@pytest.fixture
def one_thread():
    # The bench sets torch's thread count; keep it from leaking into other tests.
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def _items(n: int) -> list:
    try:
        from training.data import load_test_set

        return load_test_set()[:n]
    except ModuleNotFoundError:  # ua-gec not installed: synthetic sentences with two references
        return [_Item(f"{SRC} {i}", [f"{REF} {i}", f"{OTHER_REF} {i}"]) for i in range(n)]


# ---------------------------------------------------------------------------------------------- GLEU


def test_gleu_identical_to_reference_is_100():
    assert gleu([SRC], [REF], [[REF]]) == pytest.approx(100.0)


def test_gleu_copying_the_source_is_penalised():
    # n = 1..4 matches minus hypothesis n-grams that are in the source but not the reference:
    # 1-grams (5 - 1)/6, 2-grams (4 - 1)/5, 3-grams (3 - 1)/4, 4-grams (2 - 1)/3; equal lengths (BP = 1).
    assert sentence_stats(tokenize(SRC), tokenize(SRC), tokenize(REF)).tolist() == [6, 6, 4, 6, 3, 5, 2, 4, 1, 3]
    expected = 100 * (4 / 6 * 3 / 5 * 2 / 4 * 1 / 3) ** 0.25
    assert gleu([SRC], [SRC], [[REF]]) == pytest.approx(expected)
    plain_bleu = 100 * (5 / 6 * 4 / 5 * 3 / 4 * 2 / 3) ** 0.25  # the same without the source penalty
    assert expected < plain_bleu


def test_gleu_brevity_penalty():
    # Every n-gram of the short hypothesis matches; BP = exp(1 - r/c) = exp(1 - 6/5).
    assert gleu([SRC], ["we went to the shop"], [[REF]]) == pytest.approx(100 * math.exp(-0.2))


def test_gleu_sums_statistics_over_the_corpus():
    # (6+4)/(6+6), (5+3)/(5+5), (4+2)/(4+4), (3+1)/(3+3): the product is 1/3.
    assert gleu([SRC, SRC], [REF, SRC], [[REF], [REF]]) == pytest.approx(100 * (1 / 3) ** 0.25)


def test_gleu_multi_reference_averages_over_reference_draws():
    to_other = gleu([SRC], [REF], [[OTHER_REF]])
    assert to_other == pytest.approx(100 * math.exp(1 - 7 / 6))  # all n-grams match; only BP (c=6, r=7)
    both = gleu([SRC], [REF], [[REF, OTHER_REF]], draws=2000, seed=1)
    assert both == pytest.approx((100 + to_other) / 2, abs=2.0)
    assert gleu([SRC], [REF], [[REF, OTHER_REF]], seed=1) == gleu([SRC], [REF], [[REF, OTHER_REF]], seed=1)
    assert gleu([SRC], [SRC], [[REF, REF]]) == pytest.approx(gleu([SRC], [SRC], [[REF]]))


def test_exact_match_against_any_reference():
    assert exact_match([REF, OTHER_REF, SRC], [[REF], [REF, f" {OTHER_REF} "], [REF]]) == pytest.approx(200 / 3)


def test_gleu_rejects_bad_input():
    with pytest.raises(ValueError):
        gleu([SRC], [SRC, SRC], [[REF]])
    with pytest.raises(ValueError):
        gleu([SRC], [SRC], [[]])


# ---------------------------------------------------------------------------------------------- perplexity


def test_perplexity_matches_the_verifier_sessions_log_probs(bundle_dir):
    bundle = load_bundle(bundle_dir, roles=["verifier"])
    model = bundle.verifier
    sources = [bundle.tokenizer.encode("Я хочу подякувати вам."), bundle.tokenizer.encode("We have been here.")]
    outputs = [[5, 17, 33, 8], [40, 41]]
    total, tokens = 0.0, 0
    for src, out in zip(sources, outputs, strict=True):
        # Direct: the verifier session scores the whole output plus EOS as one draft block.
        session = LocalVerifier(model).open(src)
        res = session.step(0, [], [*out, model.config.eos_id], 1)
        nll = -sum(res.draft_logprobs)
        assert output_nll(model, src, out) == pytest.approx(nll, rel=1e-5)
        total += nll
        tokens += len(out) + 1
    assert perplexity(model, sources, outputs) == pytest.approx(math.exp(total / tokens), rel=1e-5)
    # Without EOS (an output cut at max_new_tokens) one token fewer is scored.
    no_eos = output_nll(model, sources[0], outputs[0], with_eos=False)
    assert no_eos < output_nll(model, sources[0], outputs[0])


# ---------------------------------------------------------------------------------------------- the bench


def test_bench_in_process_quick_produces_every_column(bundle_dir, one_thread):
    configs = benchmark.quick_configs()
    modes = {c.overrides["mode"] for c in configs}
    assert modes == {"beam", "ar", "iad", "gad", "gad++", "mjsd", "spec"}
    result = benchmark.run_benchmark(
        bundle_dir, _items(8), configs, backend="torch", max_new_tokens=8, limit=4, threads=1, warmup=1
    )
    assert result.sentences == 4
    assert [r.name for r in result.rows] == [c.name for c in configs]
    rows = {r.name: r for r in result.rows}
    for r in result.rows:
        for value in (r.iterations, r.tokens_per_iteration, r.gleu, r.exact, r.identical, r.perplexity, r.wall_s):
            assert math.isfinite(value) and value >= 0
        assert r.speedup_greedy is not None and r.speedup_beam is not None
        # The time split covers the wall time: drafter + verifier calls + the rest.
        assert r.draft_ms >= 0 and r.verify_ms > 0 and r.other_ms >= 0
        assert r.draft_ms + r.verify_ms + r.other_ms == pytest.approx(r.ms_per_sentence, rel=1e-6, abs=1e-6)
    assert rows["GAD k=10"].draft_ms > rows[benchmark.GREEDY].draft_ms  # a model drafts vs no draft
    assert rows[benchmark.GREEDY].speedup_greedy == pytest.approx(1.0)
    assert rows[benchmark.BEAM5].speedup_beam == pytest.approx(1.0)
    assert rows[benchmark.GREEDY].tokens_per_iteration == pytest.approx(1.0)
    # Lossless modes: identical to greedy on every sentence.
    for name in (f"IAD k={benchmark.IAD_CAP}", "GAD k=10"):
        assert rows[name].identical == 100.0
        assert rows[name].perplexity == pytest.approx(rows[benchmark.GREEDY].perplexity)
    assert result.lossless_ok and not result.notes
    table = benchmark.format_table(result)
    for column in ("iterations / sentence", "tokens / iteration", "GLEU", "exact match %", "% identical to greedy",
                   "verifier ppl", "wall s", "draft / verify / other ms", "speed-up vs greedy", "speed-up vs beam 5"):
        assert column in table
    assert len(table.splitlines()) == 2 + len(configs)


def test_interleaved_rounds_keep_every_output_with_its_sentence(bundle_dir):
    # 7 sentences over 5 rounds: rounds of 2 and of 1 sentence; each config decodes each sentence once.
    from decoding.decode import decode

    bundle = load_bundle(bundle_dir)
    verifier = LocalVerifier(bundle.verifier)
    sentences = [benchmark.Sentence(f"s{i}", [], [5 + i, 6 + 2 * i, 7]) for i in range(7)]
    configs = [c for c in benchmark.quick_configs() if c.overrides["mode"] in ("ar", "iad")]
    calls: list[tuple[str, int]] = []

    def decoder(config):
        cfg = benchmark._decoding_config(config, 6)

        def one(s):
            calls.append((config.name, sentences.index(s)))
            res = decode(s.source_ids, cfg, verifier)
            return res.output_ids, res.stats

        return one

    runs = benchmark._timed("in-process", [(c, decoder(c)) for c in configs], sentences, None, warmup=1)
    for config, run in zip(configs, runs, strict=True):
        cfg = benchmark._decoding_config(config, 6)
        assert run.outputs == [decode(s.source_ids, cfg, verifier).output_ids for s in sentences]
        assert sorted(i for name, i in calls[2:] if name == config.name) == list(range(7))
    # Round 0 starts with the first config, round 1 with the second.
    timed = calls[len(configs):]
    assert timed[0][0] == configs[0].name and timed[2 * 2][0] == configs[1].name


def test_full_config_list_covers_the_issue():
    names = [c.name for c in benchmark.full_configs()]
    assert names[:3] == [benchmark.BEAM5, benchmark.GREEDY, f"IAD k={benchmark.IAD_CAP}"]
    assert [n for n in names if n.startswith("GAD k=")] == [f"GAD k={k}" for k in (5, 10, 15, 20, 25)]
    assert "GAD++ k=25 beta=3 tau=1.0" in names and "GAD++ k=25 beta=5 tau=3.0" in names
    assert {"MJSD gamma=4 beams=4 thr=0.1", "MJSD gamma=4 beams=8 thr=0.1", "Spec. sampling gamma=4 T=1"} <= set(names)


def test_cli_bench_write_replaces_only_its_section(bundle_dir, tmp_path, one_thread, capsys):
    out = tmp_path / "BENCHMARKS.md"
    out.write_text("# Benchmarks\n\n## Before\n\nkeep me\n\n## UA-GEC benchmark\n\nstale table\n\n## After\n\nme too\n")
    rc = main(["bench", "--bundle", str(bundle_dir), "--quick", "--sample", "2", "--max-new-tokens", "4",
               "--backend", "torch", "--device", "cpu", "--threads", "1", "--write", "--output", str(out)])
    assert rc == 0
    printed = capsys.readouterr().out
    assert "| in-process | AR greedy |" in printed
    text = out.read_text()
    assert "stale table" not in text
    assert text.index("## Before") < text.index("## UA-GEC benchmark") < text.index("## After")
    assert "keep me" in text and "me too" in text
    section = text[text.index("## UA-GEC benchmark") : text.index("## After")]
    for needle in ("Machine:", "cores", "backend torch on cpu", "date", "command `specdec bench", "tiny-random-seed0",
                   "fingerprint",
                   "first 2 sentences", "GLEU (Napoles", "| in-process | IAD k=32 |"):
        assert needle in section


def test_bench_through_the_services_matches_in_process(bundle_dir, one_thread):
    configs = benchmark.quick_configs()
    result = benchmark.run_benchmark(
        bundle_dir, _items(4), configs, stacks=("in-process", "services"), backend="torch", max_new_tokens=4,
        limit=2, threads=1, warmup=1,
    )
    services = [r for r in result.rows if r.stack == "services"]
    assert [r.name for r in services] == [c.name for c in configs]
    assert next(r for r in services if r.name == benchmark.GREEDY).speedup_greedy == pytest.approx(1.0)
    assert result.lossless_ok
    (note,) = result.notes
    assert note.startswith("Outputs through the services identical to in-process:")
    assert note.count("100%") == len(configs)


def test_machine_stamp_names_the_vector_units_that_set_int8_and_bfloat16_speed():
    # two hosts both called "AMD EPYC" ran CTranslate2's int8 at 6.9 and 11.4 ms a step: VNNI or not
    assert vector_units({"avx2", "avx512f", "avx512_vnni", "avx512_bf16"}) == "AVX-512 VNNI BF16"
    assert vector_units({"avx2", "avx512f"}) == "AVX-512"
    assert vector_units({"avx2", "fma"}) == "AVX2, no AVX-512"
    assert vector_units({"sse4_2"}) == "no AVX2"


def test_every_benchmark_owns_a_level_two_heading_in_benchmarks_md():
    # write_section replaces up to the next "## ": a section named without one ran into its neighbour
    bench_dir = Path(__file__).resolve().parents[1] / "bench"
    sections = [m.group(1) for path in sorted(bench_dir.glob("*.py"))
                for m in re.finditer(r'^\w*SECTION = "(.*)"', path.read_text(), re.MULTILINE)]
    assert len(sections) >= 10
    assert [s for s in sections if not s.startswith("## ")] == []


def test_the_bench_index_names_every_script_and_benchmarks_md_no_missing_one():
    """bench/README.md indexes exactly the scripts bench/ holds, and names only retired ones among
    those it no longer has; BENCHMARKS.md cites a script that is gone only where it says it retired."""
    root = Path(__file__).resolve().parents[1]
    scripts = {p.name for p in (root / "bench").iterdir() if p.suffix in (".py", ".sh")}
    index, _, retired = (root / "bench" / "README.md").read_text().partition("## Retired scripts")
    assert set(re.findall(r"`(\w+\.(?:py|sh))`", index)) == scripts
    gone = set(re.findall(r"^\| `(\w+\.py)` \|", retired, re.MULTILINE))
    assert gone and not gone & scripts
    benchmarks = (root / "BENCHMARKS.md").read_text()
    said = set(re.findall(r"^Script retired: `bench/(\w+\.py)`", benchmarks, re.MULTILINE))
    cited = set(re.findall(r"bench/(\w+\.(?:py|sh))", benchmarks))
    assert cited - scripts == said and said <= gone


def _bench_script(name: str):
    """A script of bench/ as a module (bench/ is no package: its scripts run as `python bench/x.py`)."""
    import importlib.util

    path = Path(__file__).resolve().parents[1] / "bench" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"bench_{name}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_services_overhead_splits_into_a_fixed_and_a_per_iteration_cost():
    split = _bench_script("bench_services")._fixed_and_per_iteration
    iterations = [3, 10, 21, 40, 7]
    fixed, per_iteration = split(iterations, [4.0 + 0.25 * n for n in iterations])
    assert fixed == pytest.approx(4.0) and per_iteration == pytest.approx(0.25)
    assert split([21, 21, 21], [5.0, 5.2, 4.9]) is None  # one length: nothing to split by


def test_a_stamp_says_when_the_services_ran_their_models_on_a_gpu(monkeypatch):
    monkeypatch.delenv("SPECDEC__VERIFIER__DEVICE", raising=False)
    monkeypatch.delenv("SPECDEC__DRAFTER__DEVICE", raising=False)
    assert accelerator_note() == ""  # the CPU: nothing to add to the CPU's name
    monkeypatch.setenv("SPECDEC__VERIFIER__DEVICE", "cuda")
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU seen"
    assert accelerator_note() == f"; models on {gpu} (verifier cuda, drafter cpu)"
