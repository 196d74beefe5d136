"""Serving under load: `specdec serve all` driven by `specdec loadtest` on UA-GEC test sentences.

    python bench/bench_load.py                      # the full sweep (about 8 minutes on 2 cores)
    python bench/bench_load.py --write              # also replace "## Load (serve all)" in BENCHMARKS.md
    python bench/bench_load.py --modes ar,gad --clients 1,4 --sentences 16     # a quick check
    python bench/bench_load.py --extra-mode "gad-adaptive:mode=gad,k=10,adaptive=true"
    python bench/bench_load.py --set verifier.batch_wait_ms=2       # any other config key, every run

For each batching setting the three services run as `specdec serve all --processes` (one process per
service; `--one-process` for all three in one) on loopback ports, all settings' stacks up at once
and every cell measured on each stack in turn, configured by a TOML file this script writes: the
gateway's `workers`, `max_queued` and `max_per_client` and the model services' `max_sessions` are
raised so the largest client count runs at once instead of queueing at the gateway. Batching "off"
sets `max_batch_rows = 1` in `[verifier]` and `[drafter]`; "on" leaves the services' defaults, or
takes `--max-batch-rows`, `--max-batch-tokens`, `--batch-wait-ms`. A service whose config does not
know these keys yet (checked in-process with the same parser `serve` uses, or forced with `--no-
batching-keys`) runs once, unbatched, and the table says so.

Every cell is a closed-loop `specdec loadtest` run (in-process calls to `evaluation.loadtest`): the
first `--sentences` UA-GEC test sentences, one request each, at 1, 4, 16 and 32 clients, for AR
greedy, GAD k=10, IAD (k=32, as `specdec bench`) and beam 5, plus a `--waves` row at the largest
client count with batching on (a static batch: the next wave starts when its slowest sentence is
done) and any `--extra-mode`. The first cell of each mode on each server is preceded by a few unmeasured
requests (ONNX Runtime and the channels warm up). Mean batch rows come from the verifier's
Prometheus endpoint (`*batch_rows` histograms) when it has one, and "verifier busy" (the share of
the cell's wall time its model worker spent in forwards) from its `*forward_seconds` histogram; the
progress lines give the drafter's too.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import os
import shlex
import socket
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from anywhere

from core.backends import BACKENDS
from evaluation.bench_report import accelerator_note, cpu_name, start_services, write_section
from evaluation.benchmark import BenchConfig
from evaluation.loadtest import LoadReport, LoadSpec, run_load, ua_gec_texts

SECTION = "## Load (serve all)"
ROOT = Path(__file__).resolve().parents[1]
MODES: dict[str, tuple[str, dict[str, Any]]] = {
    "ar": ("AR greedy", {"mode": "ar"}),
    "gad": ("GAD k=10", {"mode": "gad", "k": 10}),
    "iad": ("IAD k=32", {"mode": "iad", "k": 32}),
    "beam": ("beam 5", {"mode": "beam", "num_beams": 5}),
}
MODEL_SECTIONS = ("verifier", "drafter")
WARMUP_REQUESTS = 4


@dataclass(frozen=True)
class Batching:
    name: str  # "on", "off" or "unbatched" (the services know no batching keys)
    keys: dict[str, dict[str, Any]] = field(default_factory=dict)  # section -> batching keys


@dataclass
class Cell:
    mode: str
    batching: str
    clients: int
    waves: bool
    report: LoadReport


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    clients = _counts(args.clients)
    modes = [BenchConfig(*MODES[m]) for m in args.modes.split(",")] + [_extra_mode(text) for text in args.extra_mode]
    modes = [m for m in modes if m is not None]
    texts = ua_gec_texts(args.sentences, args.data_dir)
    settings, note = _batching_settings(args)
    print(note, file=sys.stderr)
    cells = _run_interleaved(args, settings, modes, clients, texts)
    table = format_table(cells)
    ratios = format_ratios(cells, max(clients))
    print(table)
    if ratios:
        print()
        print(ratios)
    if args.write:
        write_section(args.output, SECTION, _section_body(args, note, texts, table, ratios))
    return 0 if all(c.report.ok == c.report.requests for c in cells) else 1


def format_table(cells: list[Cell]) -> str:
    rows_col = any(c.report.mean_batch_rows for c in cells)
    busy_col = any(_verifier_busy(c.report) is not None for c in cells)
    head = "| mode | batching | clients | requests/s | output tokens/s | p50 ms | p95 ms |"
    rule = "|---|---|---:|---:|---:|---:|---:|"
    if rows_col:
        head += " mean batch rows |"
        rule += "---:|"
    if busy_col:
        head += " verifier busy |"
        rule += "---:|"
    head += " errors |"
    rule += "---:|"
    lines = [head, rule]
    for c in cells:
        r = c.report
        lat = r.latency_ms or {}
        clients = f"{c.clients} (waves)" if c.waves else str(c.clients)
        line = (f"| {c.mode} | {c.batching} | {clients} | {r.requests_per_s:.2f} | {r.output_tokens_per_s:.1f} | "
                f"{_ms(lat.get('p50'))} | {_ms(lat.get('p95'))} |")
        if rows_col:
            rows = _verifier_rows(r)
            line += f" {rows:.2f} |" if rows is not None else " - |"
        if busy_col:
            busy = _verifier_busy(r)
            line += f" {100 * busy:.0f}% |" if busy is not None else " - |"
        errors = sum(r.errors.values())
        line += f" {errors} |" if not errors else f" {errors} ({', '.join(sorted(r.errors))}) |"
        lines.append(line)
    return "\n".join(lines)


def format_ratios(cells: list[Cell], clients: int) -> str:
    """Per mode at `clients`: batching on over off (output tokens/s; p50 latency), and streaming
    refill (batching on, closed loop) over the static batch (waves)."""
    def find(mode: str, batching: str, waves: bool) -> LoadReport | None:
        key = (mode, batching, clients, waves)
        return next((c.report for c in cells if (c.mode, c.batching, c.clients, c.waves) == key), None)

    lines = []
    for mode in dict.fromkeys(c.mode for c in cells):
        on, off, static = find(mode, "on", False), find(mode, "off", False), find(mode, "on", True)
        on_off = refill = "-"
        if on and off and off.output_tokens_per_s > 0 and off.latency_ms and on.latency_ms:
            on_off = (f"{on.output_tokens_per_s / off.output_tokens_per_s:.2f}x tokens/s, "
                      f"{on.latency_ms['p50'] / off.latency_ms['p50']:.2f}x p50 latency")
        closed = on
        if static is None:  # services without batching keys: the unbatched run has the waves row
            closed, static = find(mode, "unbatched", False), find(mode, "unbatched", True)
        if closed and static and static.output_tokens_per_s > 0:
            refill = f"{closed.output_tokens_per_s / static.output_tokens_per_s:.2f}x tokens/s"
        if (on_off, refill) != ("-", "-"):
            lines.append(f"| {mode} | {on_off} | {refill} |")
    if not lines:
        return ""
    return "\n".join([f"At {clients} clients:", "", "| mode | batching on / off | streaming refill / static batch |",
                      "|---|---|---|", *lines])


# ----------------------------------------------------------------------------------------------


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--bundle", default=str(ROOT / "bundles" / "ua-gec"), help="default: bundles/ua-gec")
    p.add_argument("--backend", default="onnxruntime", choices=BACKENDS)
    p.add_argument("--sentences", type=int, default=64, help="UA-GEC test sentences per cell (one request each)")
    p.add_argument("--data-dir", help="prepared training data dir whose test.text.jsonl to use (default: ua-gec)")
    p.add_argument("--clients", default="1,4,16,32", help="closed-loop client counts")
    p.add_argument("--modes", default="ar,gad,iad,beam", help=f"a comma-separated subset of {','.join(MODES)}")
    p.add_argument("--extra-mode", action="append", default=[], metavar="NAME:FIELD=VALUE,...",
                   help="another row set, e.g. 'gad-adaptive:mode=gad,k=10,adaptive=true' (DecodingConfig fields; "
                   "skipped with a note when the gateway has no such field); repeatable")
    p.add_argument("--batching", default="on,off", help="which settings to run: on, off or both (default)")
    p.add_argument("--no-batching-keys", action="store_true",
                   help="the services know no batching keys: run once, unbatched")
    p.add_argument("--max-batch-rows", type=int, help="batching on: [verifier]/[drafter] max_batch_rows")
    p.add_argument("--max-batch-tokens", type=int, help="batching on: [verifier]/[drafter] max_batch_tokens")
    p.add_argument("--batch-wait-ms", type=float, help="batching on: [verifier]/[drafter] batch_wait_ms")
    p.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                   help="one more key of the services' TOML config for every run (a TOML value, e.g. "
                   "'gateway.fallback=\"fail\"'); repeatable")
    p.add_argument("--one-process", action="store_true",
                   help="serve all in one process (default: --processes, one process per service)")
    p.add_argument("--no-waves", action="store_true", help="leave out the static-batch (--waves) rows")
    p.add_argument("--stream", action="store_true", help="GenerateStream instead of Generate")
    p.add_argument("--max-new-tokens", type=int, default=200, help="as `specdec bench` (default 200)")
    p.add_argument("--threads", type=int, help="OMP_NUM_THREADS of the services (default: unset)")
    p.add_argument("--write", action="store_true", help=f"replace the '{SECTION}' section of --output")
    p.add_argument("--output", type=Path, default=ROOT / "BENCHMARKS.md")
    return p


def _counts(text: str) -> list[int]:
    counts = [int(x) for x in text.split(",") if x.strip()]
    if not counts or min(counts) < 1:
        raise SystemExit(f"--clients: expected positive counts, got {text!r}")
    return counts


def _extra_mode(text: str) -> BenchConfig | None:
    """'NAME:field=value,...' as a BenchConfig; None (with a note) when DecodingConfig has no such field."""
    import tomllib

    from decoding.config import DecodingConfig

    name, sep, spec = text.partition(":")
    if not sep or not name:
        raise SystemExit(f"--extra-mode: expected NAME:FIELD=VALUE,..., got {text!r}")
    overrides: dict[str, Any] = {}
    for item in filter(None, spec.split(",")):
        key, eq, value = item.partition("=")
        if not eq:
            raise SystemExit(f"--extra-mode {name}: expected FIELD=VALUE, got {item!r}")
        try:  # TOML scalars, as the config's environment variables: 10, 0.5, true; else a string
            overrides[key.strip()] = tomllib.loads(f"v = {value.strip()}")["v"]
        except tomllib.TOMLDecodeError:
            overrides[key.strip()] = value.strip()
    try:
        DecodingConfig().with_overrides(overrides)
    except Exception as exc:  # an unknown field: the helper that adds it has not been merged yet
        print(f"bench_load: skipping --extra-mode {name}: {exc}", file=sys.stderr)
        return None
    return BenchConfig(name, overrides)


def _batching_settings(args) -> tuple[list[Batching], str]:
    """The settings to run and a note on how batching was configured."""
    wanted = [w.strip() for w in args.batching.split(",") if w.strip()]
    if set(wanted) - {"on", "off"} or not wanted:
        raise SystemExit(f"--batching: expected on, off or on,off; got {args.batching!r}")
    on_keys = {k: v for k, v in (("max_batch_rows", args.max_batch_rows), ("max_batch_tokens", args.max_batch_tokens),
                                 ("batch_wait_ms", args.batch_wait_ms)) if v is not None}
    sections = [] if args.no_batching_keys else [s for s in MODEL_SECTIONS if _accepts_batching_keys(s)]
    if not sections:
        why = "--no-batching-keys" if args.no_batching_keys else "the services' config knows no batching keys yet"
        return [Batching("unbatched")], f"Batching: not configurable ({why}); one unbatched run."
    settings = {
        "on": Batching("on", {s: dict(on_keys) for s in sections}),
        "off": Batching("off", {s: {"max_batch_rows": 1} for s in sections}),
    }
    on_text = ", ".join(f"{k} = {v}" for k, v in on_keys.items()) or "the services' defaults"
    note = (f"Batching on: {on_text}; off: max_batch_rows = 1; in [{'], ['.join(sections)}]"
            + ("" if len(sections) == len(MODEL_SECTIONS) else
               f" ([{', '.join(s for s in MODEL_SECTIONS if s not in sections)}] knows no batching keys yet)") + ".")
    return [settings[w] for w in wanted], note


def _accepts_batching_keys(section: str) -> bool:
    """Whether `serve` knows `max_batch_rows` in `section` (the same parser it runs; a value it
    refuses still means the key is known)."""
    from specdec.serve import serve_config

    try:
        serve_config({section: {"max_batch_rows": 1}})
    except ValueError as exc:
        return "unknown key" not in str(exc)
    return True


def _run_interleaved(args, settings: list[Batching], modes: list[BenchConfig], clients: list[int],
                     texts: list[str]) -> list[Cell]:
    """Every batching setting's `serve all` runs at once (an idle stack costs nothing), and each
    (mode, clients) cell is measured on every stack in turn, so a drift of the machine's speed over
    the run hits batching on and off alike (a run of one stack after the other showed 1-client
    cells, where batching cannot matter, differing by 1.7x)."""
    most = max(clients)
    with tempfile.TemporaryDirectory() as tmp, contextlib.ExitStack() as stack:
        stacks = []
        for batching in settings:
            metrics = {s: f"127.0.0.1:{_free_port()}" for s in MODEL_SECTIONS}
            config = Path(tmp) / f"load-{batching.name}.toml"
            config.write_text(_config_toml(batching, most, metrics, _extra_keys(args.set)))
            server, address = _start(args, config, Path(tmp) / f"serve-{batching.name}.log")
            stack.callback(_stop, server)
            stacks.append((batching, address, [f"http://{metrics[s]}/metrics" for s in ("verifier", "drafter")]))
        cells = []
        for mode in modes:
            overrides = {**mode.overrides, "max_new_tokens": args.max_new_tokens}
            runs = [(c, False) for c in clients] + ([(most, True)] if not args.no_waves else [])
            for n, (c, waves) in enumerate(runs):
                for batching, address, urls in stacks:
                    # The static batch is the comparison point of the batching scheduler's streaming refill.
                    if waves and batching.name == "off":
                        continue
                    spec = LoadSpec(address, texts, overrides, stream=args.stream, concurrency=c, waves=waves,
                                    requests=len(texts), timeout=600, warmup=WARMUP_REQUESTS if n == 0 else 0,
                                    metrics_urls=urls)
                    report = run_load(spec)
                    cells.append(Cell(mode.name, batching.name, c, waves, report))
                    rows = _verifier_rows(report)
                    print(f"{mode.name:>12} batching {batching.name:<9} {c:>3} clients{' waves' if waves else '':6} "
                          f"{report.requests_per_s:7.2f} requests/s {report.output_tokens_per_s:8.1f} tokens/s "
                          f"p50 {_ms((report.latency_ms or {}).get('p50')):>8} ms"
                          + (f" batch rows {rows:.2f}" if rows is not None else "")
                          + _busy_text(report)
                          + (f" errors {report.errors}" if report.errors else ""), file=sys.stderr, flush=True)
    order = {b.name: i for i, b in enumerate(settings)}
    return sorted(cells, key=lambda c: order[c.batching])  # the table lists one setting after the other


def _stop(server: subprocess.Popen) -> None:
    server.terminate()
    server.wait(timeout=60)


def _config_toml(batching: Batching, clients: int, metrics: dict[str, str],
                 extra: dict[str, dict[str, str]] | None = None) -> str:
    """Room for `clients` requests at once (beam 5 without batched beams: 5 verifier sessions each);
    `extra`: section -> key -> TOML value text, last (it wins)."""
    sessions = max(64, clients * 8)
    tables: dict[str, dict[str, str]] = {
        "gateway": {"workers": str(clients), "max_queued": str(max(64, clients * 4)),
                    "max_per_client": str(max(16, clients * 2)), "request_timeout_s": "600.0"},
    }
    for section in MODEL_SECTIONS:
        tables[section] = {"max_sessions": str(sessions), "metrics_address": f'"{metrics[section]}"'}
        tables[section].update({k: str(v) for k, v in batching.keys.get(section, {}).items()})
    for section, keys in (extra or {}).items():
        tables.setdefault(section, {}).update(keys)
    lines = []
    for section, keys in tables.items():
        lines += [f"[{section}]", *(f"{k} = {v}" for k, v in keys.items()), ""]
    return "\n".join(lines)


def _extra_keys(items: list[str]) -> dict[str, dict[str, str]]:
    out: dict[str, dict[str, str]] = {}
    for item in items:
        key, eq, value = item.partition("=")
        section, dot, name = key.strip().partition(".")
        if not (eq and dot and section and name):
            raise SystemExit(f"--set: expected SECTION.KEY=VALUE, got {item!r}")
        out.setdefault(section, {})[name] = value.strip()
    return out


def _start(args, config: Path, log: Path) -> tuple[subprocess.Popen, str]:
    processes = () if args.one_process else ("--processes",)
    return start_services(Path(args.bundle), args.backend, args.threads,
                          extra_args=("--config", str(config), *processes), log=log)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _verifier_rows(report: LoadReport) -> float | None:
    rows = [v for name, v in report.mean_batch_rows.items() if "verifier" in name]
    return rows[0] if rows else next(iter(report.mean_batch_rows.values()), None)


def _busy_text(report: LoadReport) -> str:
    """Each model worker's busy share and mean forward, for the progress line."""
    return "".join(f" {name.split('_')[-3]}{' encoder' if name.endswith('encode_seconds') else ''} busy "
                   f"{100 * busy:.0f}% ({report.mean_forward_ms[name]:.1f} ms)"
                   for name, busy in report.worker_busy.items())


def _verifier_busy(report: LoadReport) -> float | None:
    """The share of the cell's wall time the verifier's model worker spent in forwards."""
    forwards = (v for name, v in report.worker_busy.items() if "verifier" in name and name.endswith("forward_seconds"))
    return next(forwards, None)


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def _section_body(args, note: str, texts: list[str], table: str, ratios: str) -> str:
    stamp = (f"Machine: {cpu_name()}, {os.cpu_count()} cores{accelerator_note()}; "
             f"verifier and NAR drafter backend {args.backend}; "
             f"date {dt.date.today().isoformat()}; command `{shlex.join(['python', *sys.argv])}`")
    what = (f"Bundle: {Path(args.bundle).name}; the first {len(texts)} UA-GEC test sentences per cell, one "
            f"{'GenerateStream' if args.stream else 'Generate'} request each, max_new_tokens {args.max_new_tokens}. "
            f"Services: `specdec serve all{' --processes' if not args.one_process else ''}` (one stack per batching "
            "setting, up at once; each cell measured on every stack in turn); the client "
            "(`evaluation.loadtest`, closed loop) in "
            f"another, over loopback; gateway workers = {max(_counts(args.clients))}, model services' max_sessions = "
            f"{max(64, max(_counts(args.clients)) * 8)}"
            + (f", and {', '.join(args.set)}" if args.set else "") + ". "
            "Clients N: N requests in flight at all times; N (waves): N requests sent "
            "together, the next N once all answered (a static batch). Throughput over the cell's wall time; "
            f"latency over its requests. {note}")
    return "\n\n".join(filter(None, [stamp, what, table, ratios]))


if __name__ == "__main__":
    sys.exit(main())
