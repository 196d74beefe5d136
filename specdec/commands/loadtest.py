"""`specdec loadtest`: a running gateway driven with concurrent requests; throughput and latency
(`evaluation.loadtest` does the driving)."""

from __future__ import annotations

import argparse

from specdec.commands import flags

DEFAULT_LOADTEST_SENTENCES = 100  # `specdec loadtest` without --inputs / --ua-gec


def register(sub) -> None:
    p = sub.add_parser("loadtest", help="drive a running gateway with concurrent requests; throughput and latency")
    p.add_argument("--addr", "--address", dest="addr", type=flags.address_arg, default=flags.default_addr(),
                   help=flags.ADDR_HELP)
    src = p.add_mutually_exclusive_group()
    src.add_argument("--inputs", metavar="FILE", help="input texts, one per line")
    src.add_argument("--ua-gec", type=int, metavar="N", help="the first N sentences of the UA-GEC test split "
                     f"(the default input, N={DEFAULT_LOADTEST_SENTENCES})")
    p.add_argument("--data-dir", help="prepared training data dir whose test.text.jsonl to use (default: ua-gec)")
    load = p.add_mutually_exclusive_group()
    load.add_argument("--concurrency", type=int, help="closed loop: this many clients, each sends its next "
                      "request when its previous one answered (default 1)")
    load.add_argument("--rate", type=float, help="open loop: a request every 1/RATE seconds, answered or not "
                      "(default: closed loop)")
    p.add_argument("--sweep", metavar="N,N,...", help="a closed-loop run at each client count in turn; prints a table "
                   "(default: one run)")
    p.add_argument("--waves", action="store_true", help="closed loop in waves: the next N requests start "
                   "together once all of the previous N answered (a static batch)")
    p.add_argument("--stream", action="store_true", help="call GenerateStream (measures time to first token)")
    p.add_argument("--requests", type=int, help="requests per run (default: one pass over the inputs, "
                   "unless --duration bounds the run)")
    p.add_argument("--duration", type=float, help="seconds after which no request starts (in-flight ones finish; "
                   "default: no limit)")
    p.add_argument("--warmup", type=int, default=0, help="requests sent, unmeasured, before each run")
    p.add_argument("--timeout", type=float, default=120.0, help="per-request deadline in seconds")
    p.add_argument("--channels", type=int, default=1, help="gRPC channels (connections) the requests share")
    p.add_argument("--client-id", help="send this x-client-id on every request (one client for the gateway's "
                   "fairness limit); default: one id per virtual client")
    p.add_argument("--metrics-url", action="append", help="a Prometheus endpoint (e.g. the verifier's "
                   "http://HOST:PORT/metrics) whose *batch_rows and *forward_seconds histograms give the mean rows per "
                   "forward and the model worker's busy share; repeatable (default: none)")
    p.add_argument("--json", action="store_true", help="print one JSON object (a sweep's runs under \"sweep\")")
    p.add_argument("--progress", action="store_true", help="show the progress line on stderr even when it is "
                   "not a terminal")
    flags.add_client_security(p)
    flags.add_decoding_flags(p)
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    """Exit 0 when at least one request of every run succeeded, 1 otherwise (e.g. every call refused)."""
    from evaluation import loadtest

    if args.sweep and (args.rate is not None or args.concurrency is not None):
        raise ValueError("--sweep sets the concurrency of each run: leave out --concurrency and --rate")
    if args.waves and args.rate is not None:
        raise ValueError("--waves is a closed loop: give --concurrency (or --sweep), not --rate")
    tls, token = flags.client_security(args)
    if args.inputs:
        inputs = loadtest.file_texts(args.inputs)
    else:
        inputs = loadtest.ua_gec_texts(args.ua_gec or DEFAULT_LOADTEST_SENTENCES, args.data_dir)
    spec = loadtest.LoadSpec(
        address=args.addr, inputs=inputs, overrides=flags.decoding_overrides(args), stream=args.stream,
        concurrency=args.concurrency or 1, rate=args.rate, waves=args.waves, requests=args.requests,
        duration=args.duration, timeout=args.timeout, warmup=args.warmup, channels=args.channels,
        client_id=args.client_id, tls=tls, token=token, metrics_urls=args.metrics_url or (),
    )
    progress = loadtest.progress_stream(args.progress)
    if args.sweep:
        reports = loadtest.run_sweep(spec, _parse_counts(args.sweep), progress)
    else:
        reports = [loadtest.run_load(spec, progress)]
    if args.json:
        print(loadtest.reports_json(reports, sweep=bool(args.sweep)), flush=True)
    elif args.sweep:
        print(loadtest.format_sweep(reports), flush=True)
    else:
        print(loadtest.format_report(reports[0]), flush=True)
    return 0 if all(r.ok for r in reports) else 1


def _parse_counts(text: str) -> list[int]:
    try:
        counts = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise ValueError(f"--sweep expects comma-separated client counts, e.g. 1,4,16,32; got {text!r}") from None
    if not counts or min(counts) < 1:
        raise ValueError(f"--sweep expects client counts of at least 1; got {text!r}")
    return counts
