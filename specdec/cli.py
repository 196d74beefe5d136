"""The `specdec` command: one entry point, one subcommand per job."""

from __future__ import annotations

import argparse
import json
import sys
import typing
from collections.abc import Sequence
from dataclasses import Field, fields
from pathlib import Path

from core.backends import BACKENDS, DEFAULT_BACKEND, PRECISIONS
from core.config import DEVICE_HELP, DRAFTER_ADDRESS, GATEWAY_ADDRESS, HTTP_ADDRESS, VERIFIER_ADDRESS, device_arg
from core.errors import BindError, SpecdecError
from specdec import distill, import_hf
from specdec.api import ADDR_ENV, BUNDLE_ENV, default_address, resolve_bundle
from specdec.serve import add_batch_flags

DEFAULT_LOADTEST_SENTENCES = 100  # `specdec loadtest` without --inputs / --ua-gec
BACKEND_HELP = (
    f"backend of the verifier and the NAR drafter (default: {DEFAULT_BACKEND}, or the [verifier] and [drafter] "
    "backend keys of the config)"
)
PRECISION_HELP = (
    "fp32, or int8: the verifier's and the NAR drafter's ONNX graphs dynamically quantized (backend "
    "onnxruntime only; default: fp32, or the [verifier] and [drafter] precision keys of the config)"
)


def main(argv: Sequence[str] | None = None) -> int:
    parser = _build_parser()
    args = parser.parse_args(argv)
    try:
        return args.run(args)
    except SpecdecError as exc:
        print(f"specdec {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except (BindError, FileNotFoundError, KeyError, ValueError) as exc:
        print(f"specdec {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


def add_decoding_flags(parser: argparse.ArgumentParser) -> None:
    """The per-request decoding flags shared by `decode` and `generate` (unset = default): one per
    DecodingConfig field, named and explained by the field's metadata."""
    from decoding.config import Mode, cli_flag
    from decoding.modes import mode_names

    g = parser.add_argument_group("decoding (unset: the default shown, or the gateway's [defaults])")
    for f, kind in _decoding_fields():
        help_text = f.metadata["help"]
        if "default" not in help_text:
            shown = "unset" if f.default is None else f.default
            help_text += f" (default: {shown})"
        if kind is Mode:
            g.add_argument(cli_flag(f), dest=f.name, choices=mode_names(), help=help_text)
        elif kind is bool:  # --adaptive / --no-adaptive; unset stays None (the default applies)
            g.add_argument(cli_flag(f), dest=f.name, action=argparse.BooleanOptionalAction, help=help_text)
        else:
            g.add_argument(cli_flag(f), dest=f.name, type=kind, help=help_text)


def decoding_overrides(args: argparse.Namespace) -> dict:
    """The decoding flags as DecodingConfig overrides (None: not given)."""
    return {f.name: getattr(args, f.name) for f, _ in _decoding_fields()}


def _decoding_fields() -> list[tuple[Field, type]]:
    """DecodingConfig's fields with the scalar type a flag parses (`float | None` -> float)."""
    from decoding.config import DecodingConfig

    hints = typing.get_type_hints(DecodingConfig)
    out = []
    for f in fields(DecodingConfig):
        kinds = [k for k in typing.get_args(hints[f.name]) or (hints[f.name],) if k is not type(None)]
        out.append((f, kinds[0]))
    return out


# ----------------------------------------------------------------------------------------------
# Subcommands
# ----------------------------------------------------------------------------------------------


def _cmd_tiny_bundle(args: argparse.Namespace) -> int:
    from seq2seq_models.bundle import make_tiny_bundle

    out = make_tiny_bundle(args.out, args.seed)
    print(out)
    return 0


def _cmd_decode(args: argparse.Namespace) -> int:
    """`Engine.load` and `Engine.generate_each` over stdin's lines: one JSON record a line, in order;
    a bad line gets an error record and the rest go on (exit status 2 if any failed)."""
    from decoding.request import Policy
    from specdec.api import Engine

    engine = Engine.load(args.bundle, backend=args.backend, precision=args.precision, device=args.device,
                         dtype=args.dtype, policy=Policy(flags=True))
    overrides = {k: v for k, v in decoding_overrides(args).items() if v is not None}
    engine.prepare_config(overrides)  # a bad flag is one error for the run, before any line is read
    requests = (_line_request(engine, number, line.rstrip("\n"), args, overrides)
                for number, line in enumerate(sys.stdin, start=1))
    failed = 0
    for index, outcome in engine.generate_each(requests):
        if isinstance(outcome, SpecdecError):
            failed += 1
            print(f"specdec decode: error: {outcome.code.value}: line {index + 1}: {outcome.message}", file=sys.stderr)
            record = {"line": index + 1, "error": outcome.message, "code": outcome.code.value}
        else:
            record = {"output_ids": outcome.output_ids, "text": outcome.text, "stats": outcome.stats.record()}
        print(json.dumps(record, ensure_ascii=False), flush=True)
    return 2 if failed else 0


def _line_request(engine, number: int, line: str, args: argparse.Namespace, overrides: dict):
    """One stdin line as a request (text, or ids with --ids), or the SpecdecError of a malformed one."""
    try:
        ids = _parse_ids(line) if args.ids and line.strip() else None
    except SpecdecError as exc:
        return exc
    if ids is not None:
        return engine.request(ids, args.target_lang, overrides)
    return engine.request(line if line.strip() else [], args.target_lang, overrides)


def _cmd_serve(args: argparse.Namespace) -> int:
    from core.config import load_sections
    from specdec.serve import batch_overrides, serve_forever, serve_processes

    metrics = _metrics_overrides(args)
    overrides = {
        "gateway": {"address": args.gateway_addr, "verifier_address": args.verifier_addr,
                    "drafter_address": args.drafter_addr, "metrics_address": metrics["gateway"],
                    "http_address": "" if args.no_http else args.http_addr},
        "verifier": {"address": args.verifier_addr, "backend": args.backend, "device": args.device,
                     "precision": args.precision, "intra_op_threads": args.verifier_threads,
                     "metrics_address": metrics["verifier"], **batch_overrides(args)},
        "drafter": {"address": args.drafter_addr, "backend": args.backend, "device": args.device,
                    "precision": args.precision, "intra_op_threads": args.drafter_threads,
                    "metrics_address": metrics["drafter"], **batch_overrides(args)},
    }
    sections = load_sections(args.config, overrides=overrides)
    # Every role gets the default bundle (the gateway reads its tokenizer), as docs/services.md says.
    bundle = resolve_bundle(args.bundle)

    def ready(running) -> None:
        shown = running.addresses.get("gateway") or running.addresses[args.role]
        print(shown, flush=True)

    if args.role == "all" and args.processes:
        serve_processes(bundle, sections, _serve_child_args(args, bundle, sections), ready)
    else:
        serve_forever(args.role, bundle, sections, ready)
    return 0


def _metrics_overrides(args: argparse.Namespace) -> dict[str, str | None]:
    """Each role's metrics_address from --ROLE-metrics-addr, or --metrics-addr for the one role served."""
    out = {role: getattr(args, f"{role}_metrics_addr") for role in ("gateway", "verifier", "drafter")}
    if args.metrics_addr is not None:
        if args.role == "all":
            raise ValueError("--metrics-addr names one role's endpoint: with `all` give --gateway-metrics-addr, "
                             "--verifier-metrics-addr and --drafter-metrics-addr")
        if out[args.role] is not None:
            raise ValueError(f"give --metrics-addr or --{args.role}-metrics-addr, not both")
        out[args.role] = args.metrics_addr
    return out


def _serve_child_args(args: argparse.Namespace, bundle: Path, sections) -> list[str]:
    """The flags a `serve all --processes` child gets: the parent's own (the environment is inherited),
    and both services' intra-op threads as `serve all` shares the host's CPUs between them."""
    from specdec.serve import batch_overrides, serve_config, share_host_threads

    shared = share_host_threads(serve_config(sections))
    out = ["--bundle", str(bundle), "--verifier-threads", str(shared.verifier.intra_op_threads),
           "--drafter-threads", str(shared.drafter.intra_op_threads)]
    for flag, value in (("--config", args.config), ("--backend", args.backend), ("--device", args.device),
                        ("--precision", args.precision),
                        ("--verifier-addr", args.verifier_addr), ("--drafter-addr", args.drafter_addr),
                        ("--verifier-metrics-addr", args.verifier_metrics_addr),
                        ("--drafter-metrics-addr", args.drafter_metrics_addr),
                        *((f"--{key.replace('_', '-')}", value) for key, value in batch_overrides(args).items())):
        if value is not None:
            out += [flag, str(value)]
    return out


def _cmd_generate(args: argparse.Namespace) -> int:
    from specdec.client import CallError, degraded_note, format_record, generate

    tls, token = _client_security(args)
    text = _generate_text(args)
    try:
        record = generate(args.addr, text, decoding_overrides(args), timeout=args.timeout, tls=tls, token=token,
                          target_lang=args.target_lang)
    except CallError as exc:  # e.g. a missing token: one line, like specdec's own errors, not a traceback
        print(f"specdec generate: error: {exc}", file=sys.stderr)
        return 2
    print(format_record(record, args.json), flush=True)
    note = None if args.json else degraded_note(record)
    if note is not None:
        print(f"specdec generate: {note}", file=sys.stderr)
    return 0


def _generate_text(args: argparse.Namespace) -> str:
    """The text of `generate`: the argument, --file, or stdin (no argument, or "-"); one trailing
    newline of a file or stdin is not part of it."""
    if args.text is not None and args.text != "-" and args.file is not None:
        raise ValueError("give the text as an argument or with --file, not both")
    if args.file is not None:
        text = Path(args.file).read_text(encoding="utf-8")
    elif args.text is not None and args.text != "-":
        return args.text
    else:
        if sys.stdin.isatty():
            print("specdec generate: reading the text from stdin (end it with Ctrl-D)", file=sys.stderr)
        text = sys.stdin.read()
    return text.removesuffix("\n").removesuffix("\r")


def _cmd_loadtest(args: argparse.Namespace) -> int:
    """Exit 0 when at least one request of every run succeeded, 1 otherwise (e.g. every call refused)."""
    from specdec import loadtest

    if args.sweep and (args.rate is not None or args.concurrency is not None):
        raise ValueError("--sweep sets the concurrency of each run: leave out --concurrency and --rate")
    if args.waves and args.rate is not None:
        raise ValueError("--waves is a closed loop: give --concurrency (or --sweep), not --rate")
    tls, token = _client_security(args)
    if args.inputs:
        inputs = loadtest.file_texts(args.inputs)
    else:
        inputs = loadtest.ua_gec_texts(args.ua_gec or DEFAULT_LOADTEST_SENTENCES, args.data_dir)
    spec = loadtest.LoadSpec(
        address=args.addr, inputs=inputs, overrides=decoding_overrides(args), stream=args.stream,
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


def _client_security(args: argparse.Namespace):
    """(ClientTLS or None, bearer token or None) from the security flags of `_add_client_security`."""
    from serving.auth import read_token
    from serving.tls import ClientTLS

    if bool(args.tls_cert) != bool(args.tls_key):
        raise ValueError("--tls-cert and --tls-key go together")
    tls = ClientTLS(args.tls_ca, args.tls_cert, args.tls_key) if args.tls or args.tls_ca or args.tls_cert else None
    return tls, read_token(args.token, args.token_file)


def _cmd_health(args: argparse.Namespace) -> int:
    """Exit 0 only when the server at --addr reports SERVING over grpc.health.v1 (compose healthchecks)."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from serving.tls import ClientTLS, open_channel

    tls = ClientTLS(args.tls_ca) if args.tls_ca else None
    with open_channel(args.addr, tls, []) as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=args.service), timeout=args.timeout
            )
        except grpc.RpcError as exc:  # down, draining or unreachable: one line, no traceback
            print(f"specdec health: error: {args.addr}: {exc.code().name} {exc.details() or ''}".rstrip(),
                  file=sys.stderr)
            return 1
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
    if reply.status != health_pb2.HealthCheckResponse.SERVING:
        print(f"specdec health: error: {args.addr}: {status}", file=sys.stderr)
        return 1
    print(f"{args.addr}: {status}")
    return 0


def _cmd_export_onnx(args: argparse.Namespace) -> int:
    from seq2seq_models.bundle import bundle_roles, load_bundle
    from seq2seq_models.onnx_export import ROLES, default_cache_root, ensure_export

    path = resolve_bundle(args.bundle)
    bundle = load_bundle(path, roles=[r for r in ROLES if r in bundle_roles(path)])
    out = Path(args.out) if args.out else default_cache_root(bundle.path)
    exports = {}
    for role in bundle.models:
        export = ensure_export(bundle.models[role], bundle.fingerprint, out, force=args.force, role=role)
        exports[role] = {"directory": str(export.directory), "reused": export.reused}
    print(json.dumps({"fingerprint": bundle.fingerprint, "exports": exports}))
    return 0


def _cmd_export_triton(args: argparse.Namespace) -> int:
    from specdec.triton_export import TritonExportOptions, export_triton

    options = TritonExportOptions(
        model=args.model, backend=args.backend or "torch", device=args.device,
        instance_kind="KIND_GPU" if args.device.startswith("cuda") else "KIND_CPU",
        max_sessions=args.max_sessions, session_idle_s=args.session_idle_s, threads=args.threads, onnx=args.onnx,
    )
    model_dir = export_triton(resolve_bundle(args.bundle), args.out, options)
    repository = str(Path(args.out).resolve())
    print(json.dumps({"repository": repository, "model": options.model, "directory": str(model_dir)}))
    return 0


def _cmd_train(args: argparse.Namespace) -> int:
    from training.pipeline import run_from_args

    return run_from_args(args, " ".join(["specdec train", *sys.argv[2:]]))


def _cmd_evaluate(args: argparse.Namespace) -> int:
    from specdec.run_quality import run_from_args

    return run_from_args(args)


def _cmd_bench(args: argparse.Namespace) -> int:
    from specdec.benchmark import run_from_args

    return run_from_args(args, resolve_bundle(args.bundle), " ".join(["specdec bench", *sys.argv[2:]]))


def _parse_ids(line: str) -> list[int]:
    from core.errors import invalid

    try:
        return [int(tok) for tok in line.split()]
    except ValueError:
        raise invalid(f"--ids expects space-separated integers, got {line[:40]!r}") from None


# ----------------------------------------------------------------------------------------------


class _Parser(argparse.ArgumentParser):
    def __init__(self, *args, **kwargs) -> None:
        kwargs.setdefault("formatter_class", _DefaultsFormatter)
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> None:  # one line, no usage dump
        self.exit(2, f"{self.prog}: error: {message}\n")


class _DefaultsFormatter(argparse.HelpFormatter):
    """Every option that takes a value ends its help with its default ("none": unset), unless the
    help already says it; flags (off unless given) and required options are left as they are."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if "default" in text or not action.option_strings or action.nargs == 0 or action.required:
            return text
        if action.default is argparse.SUPPRESS:
            return text
        shown = "none" if action.default is None else "%(default)s"
        return f"{text} (default: {shown})".lstrip()


def address_arg(text: str) -> str:
    """HOST:PORT (or unix:PATH, or a gRPC target URI) as an argparse `type`: a port-less address
    would silently dial port 443, so it is argparse's one-line error instead."""
    if text.startswith("unix:") or "://" in text:
        return text
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise argparse.ArgumentTypeError(f"{text!r} is not HOST:PORT (e.g. {GATEWAY_ADDRESS})")
    return text


def addresses_arg(text: str) -> str:
    """`address_arg`, or a comma-separated list of such addresses (the gateway's replicas)."""
    for part in text.split(","):
        address_arg(part)
    return text


def _default_addr() -> str:
    return default_address()


ADDR_HELP = f"gateway address HOST:PORT (default: ${ADDR_ENV}, else {GATEWAY_ADDRESS})"


def _add_client_security(p: argparse.ArgumentParser) -> None:
    """The TLS and token flags of the commands that call a gateway (`generate`, `loadtest`)."""
    s = p.add_argument_group("security (README: Security)")
    s.add_argument("--tls", action="store_true", help="connect over TLS, checking the gateway against the system's CAs")
    s.add_argument("--tls-ca", help="connect over TLS, checking the gateway's certificate against this PEM CA")
    s.add_argument("--tls-cert", help="PEM client certificate to present (the gateway's mTLS); needs --tls-key")
    s.add_argument("--tls-key", help="PEM private key of --tls-cert")
    token = s.add_mutually_exclusive_group()
    token.add_argument("--token", help="bearer token the gateway requires (visible in the process list)")
    token.add_argument("--token-file", help="read the bearer token from this file")


def _build_parser() -> argparse.ArgumentParser:
    from specdec import __version__

    parser = _Parser(prog="specdec", description=__doc__)
    parser.add_argument("--version", action="version", version=f"specdec {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    import_hf.add_parser(sub)
    distill.add_parser(sub)

    p = sub.add_parser("tiny-bundle", help="write a deterministic random bundle for tests and demos")
    p.add_argument("--out", required=True, help="output directory")
    p.add_argument("--seed", type=int, default=0, help="seed of the random weights")
    p.set_defaults(run=_cmd_tiny_bundle)

    p = sub.add_parser("decode", help="decode stdin lines in-process, one JSON object per line")
    p.add_argument("--bundle", help=f"model bundle directory (default: ${BUNDLE_ENV} or bundles/ua-gec)")
    p.add_argument("--ids", action="store_true", help="lines are space-separated token ids, not text")
    p.add_argument("--dtype", choices=["float32", "float64"], default="float32", help="the models' dtype (torch)")
    p.add_argument("--backend", choices=BACKENDS, default=None, help=BACKEND_HELP)
    p.add_argument("--precision", choices=PRECISIONS, default=None, help=PRECISION_HELP)
    p.add_argument("--device", type=device_arg, default="auto", help=f"where the models run: {DEVICE_HELP}")
    p.add_argument("--target-lang", default="", metavar="CODE",
                   help="a many-to-many model's target language (NLLB fra_Latn, M2M100 fr, mBART-50 fr_XX); "
                        "empty: the model's default")
    add_decoding_flags(p)
    p.set_defaults(run=_cmd_decode)

    p = sub.add_parser("export-onnx", help="export the bundle's models to ONNX (cached by bundle fingerprint)")
    p.add_argument("--bundle", help=f"model bundle directory (default: ${BUNDLE_ENV} or bundles/ua-gec)")
    p.add_argument("--out", help="cache root (default: $SPECDEC_ONNX_CACHE or BUNDLE/onnx)")
    p.add_argument("--force", action="store_true", help="re-export even when the cache has this fingerprint")
    p.set_defaults(run=_cmd_export_onnx)

    p = sub.add_parser("export-triton", help="write a Triton Inference Server model repository for the verifier")
    p.add_argument("--bundle", help=f"model bundle directory (default: ${BUNDLE_ENV} or bundles/ua-gec)")
    p.add_argument("--out", required=True, help="model repository directory (tritonserver --model-repository)")
    p.add_argument("--model", default="specdec_verifier", help="model name (verifier_url triton://HOST:PORT/MODEL)")
    p.add_argument("--backend", choices=BACKENDS, default=None, help="the verifier backend inside the model "
                   "(default: torch)")
    p.add_argument("--device", default="cpu", help="where the model runs inside Triton: cpu, cuda or cuda:N")
    p.add_argument("--max-sessions", type=int, default=64, help="sessions (sequences) the model holds at once")
    p.add_argument("--session-idle-s", type=float, default=300.0, help="the model frees sessions idle this long")
    p.add_argument("--threads", type=int, default=1, help="torch threads in the model instance")
    p.add_argument("--onnx", action="store_true", help="also the ONNX encoder/decoder on the onnxruntime backend")
    p.set_defaults(run=_cmd_export_triton)

    p = sub.add_parser("serve", help="run the verifier, drafter or gateway service (or all three)")
    p.add_argument("role", choices=["verifier", "drafter", "gateway", "all"])
    p.add_argument("--bundle", help=f"model bundle directory (default: ${BUNDLE_ENV} or bundles/ua-gec)")
    p.add_argument("--config", help="TOML config file (see config/specdec.example.toml; default: none)")
    p.add_argument("--gateway-addr", type=address_arg,
                   help=f"gateway listen address (default: [gateway] address of the config, else {GATEWAY_ADDRESS})")
    http = p.add_mutually_exclusive_group()
    http.add_argument("--http-addr", type=address_arg, metavar="HOST:PORT",
                      help="the gateway's HTTP endpoints: KServe v2 REST, OpenAI-style /v1/completions, "
                           "LibreTranslate's /translate, the playground at / (default: [gateway] http_address of "
                           f"the config, else {HTTP_ADDRESS})")
    http.add_argument("--no-http", action="store_true", help="no HTTP endpoints (gRPC only)")
    p.add_argument("--verifier-addr", type=addresses_arg,
                   help=f"verifier address (default: [verifier] address of the config, else {VERIFIER_ADDRESS}); "
                        "for `serve gateway` its replicas: a comma-separated list, or dns:///NAME:PORT")
    p.add_argument("--drafter-addr", type=addresses_arg,
                   help=f"drafter address (default: [drafter] address of the config, else {DRAFTER_ADDRESS}); "
                        "for `serve gateway` its replicas, as --verifier-addr")
    metrics = p.add_argument_group("metrics (Prometheus text at http://ADDR/metrics; off unless set)")
    metrics.add_argument("--metrics-addr", metavar="HOST:PORT",
                         help="the metrics endpoint of the one role served (not with `all`)")
    for role in ("gateway", "verifier", "drafter"):
        metrics.add_argument(f"--{role}-metrics-addr", metavar="HOST:PORT",
                             help=f"the {role}'s metrics endpoint (default: [{role}] metrics_address of the config, "
                             "else off)")
    p.add_argument("--backend", choices=BACKENDS, default=None, help=BACKEND_HELP)
    p.add_argument("--device", help=f"where the verifier's and drafter's models run: {DEVICE_HELP} "
                   "(default: auto, or the [verifier] and [drafter] device keys of the config)")
    p.add_argument("--precision", choices=PRECISIONS, default=None, help=PRECISION_HELP)
    for role in ("verifier", "drafter"):
        p.add_argument(f"--{role}-threads", type=int, default=None, metavar="N",
                       help=f"the {role}'s intra-op threads (ONNX Runtime; torch on the torch backend); 0: chosen "
                       f"(all usable CPUs, at most 8; split with the other model under `all`) (default: [{role}] "
                       "intra_op_threads of the config, else 0)")
    add_batch_flags(p)
    p.add_argument("--processes", action="store_true",
                   help="with `all`: the verifier and the drafter in their own processes (one GIL each)")
    p.set_defaults(run=_cmd_serve)

    p = sub.add_parser("health", help="exit 0 when a server reports SERVING (grpc.health.v1), else 1")
    p.add_argument("--addr", type=address_arg, default=_default_addr(),
                   help=f"server address HOST:PORT (default: ${ADDR_ENV}, else {GATEWAY_ADDRESS})")
    p.add_argument("--service", default="", help="service name to ask about (default: the whole server)")
    p.add_argument("--timeout", type=float, default=3.0, help="deadline in seconds")
    p.add_argument("--tls-ca", help="connect over TLS, checking the server's certificate against this PEM CA")
    p.set_defaults(run=_cmd_health)

    p = sub.add_parser("generate", help="decode one text through a running gateway")
    p.add_argument("text", nargs="?", help="the text; without it (or with -), the text is read from stdin")
    p.add_argument("--file", metavar="PATH", help="read the text from this file (UTF-8)")
    p.add_argument("--addr", type=address_arg, default=_default_addr(), help=ADDR_HELP)
    p.add_argument("--json", action="store_true", help="print the same JSON object as `specdec decode`")
    p.add_argument("--target-lang", default="", metavar="CODE",
                   help="a many-to-many model's target language (NLLB fra_Latn, M2M100 fr, mBART-50 fr_XX); "
                        "empty: the model's default")
    p.add_argument("--timeout", type=float, default=120.0, help="deadline in seconds")
    _add_client_security(p)
    add_decoding_flags(p)
    p.set_defaults(run=_cmd_generate)

    p = sub.add_parser("loadtest", help="drive a running gateway with concurrent requests; throughput and latency")
    p.add_argument("--addr", "--address", dest="addr", type=address_arg, default=_default_addr(), help=ADDR_HELP)
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
    _add_client_security(p)
    add_decoding_flags(p)
    p.set_defaults(run=_cmd_loadtest)

    try:  # training/ ships with the source tree, not necessarily with an installed wheel
        from training.arguments import add_arguments as add_train_arguments
    except ModuleNotFoundError:
        add_train_arguments = None
    if add_train_arguments is not None:
        p = sub.add_parser("train", help="train the bundled UA-GEC models (all stages; resumable)")
        add_train_arguments(p)
        p.set_defaults(run=_cmd_train)

        from specdec.run_quality import add_arguments as add_evaluate_arguments

        p = sub.add_parser("evaluate", help="GLEU of a training run's verifier on the validation split, "
                                            "beside the sources'")
        add_evaluate_arguments(p)
        p.set_defaults(run=_cmd_evaluate)

    from specdec.benchmark import add_arguments as add_bench_arguments

    p = sub.add_parser("bench", help="benchmark every decoding mode on the UA-GEC test split (BENCHMARKS.md)")
    add_bench_arguments(p)
    p.set_defaults(run=_cmd_bench)
    return parser


if __name__ == "__main__":
    sys.exit(main())
