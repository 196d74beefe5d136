"""`specdec serve verifier|drafter|gateway|all`: the flags, merged into the config's sections, and the
services run until SIGTERM / Ctrl-C (`specdec.serve`)."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from core.backends import BACKENDS, PRECISIONS
from core.config import DEVICE_HELP, DRAFTER_ADDRESS, GATEWAY_ADDRESS, HTTP_ADDRESS, VERIFIER_ADDRESS
from specdec.api import resolve_bundle
from specdec.commands.flags import BACKEND_HELP, BUNDLE_HELP, PRECISION_HELP, address_arg, addresses_arg

# `specdec serve` flags for the batching keys of [verifier] and [drafter] (serving.model_service.SessionLimits).
BATCH_FLAGS = (
    ("max_batch_rows", int, "rows one forward may hold; 1 turns batching off"),
    ("max_batch_tokens", int, "tokens (append + draft) one forward may hold"),
    ("batch_wait_ms", float, "how long a step may wait for company when the forward is not full; 0: never"),
)


def register(sub) -> None:
    p = sub.add_parser("serve", help="run the verifier, drafter or gateway service (or all three)")
    p.add_argument("role", choices=["verifier", "drafter", "gateway", "all"])
    p.add_argument("--bundle", help=BUNDLE_HELP)
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
    p.add_argument("--verifier-model-workers", type=int, default=None, metavar="N",
                   help="copies of the verifier's model, each on its own worker thread with its share of "
                        "--verifier-threads; a session stays on one. On a CPU under load N one-thread workers "
                        "outrun one N-thread worker (docs/performance.md) (default: [verifier] model_workers of "
                        "the config, else 1)")
    add_batch_flags(p)
    p.add_argument("--processes", action="store_true",
                   help="with `all`: the verifier and the drafter in their own processes (one GIL each)")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from core.config import load_sections
    from specdec.serve import serve_forever, serve_processes

    metrics = _metrics_overrides(args)
    overrides = {
        "gateway": {"address": args.gateway_addr, "verifier_address": args.verifier_addr,
                    "drafter_address": args.drafter_addr, "metrics_address": metrics["gateway"],
                    "http_address": "" if args.no_http else args.http_addr},
        "verifier": {"address": args.verifier_addr, "backend": args.backend, "device": args.device,
                     "precision": args.precision, "intra_op_threads": args.verifier_threads,
                     "metrics_address": metrics["verifier"], "model_workers": args.verifier_model_workers,
                     **batch_overrides(args)},
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
        serve_processes(bundle, sections, serve_child_args(args, bundle, sections), ready)
    else:
        serve_forever(args.role, bundle, sections, ready)
    return 0


def add_batch_flags(parser: argparse.ArgumentParser) -> None:
    """--max-batch-rows, --max-batch-tokens, --batch-wait-ms: the batching keys of both model services."""
    group = parser.add_argument_group("batching (the [verifier] and [drafter] keys of the same names)")
    from serving.model_service import SessionLimits

    for key, kind, help_text in BATCH_FLAGS:
        default = getattr(SessionLimits, key)
        group.add_argument("--" + key.replace("_", "-"), dest=key, type=kind,
                           help=f"{help_text} (default: the config's key, else {default})")


def batch_overrides(args: argparse.Namespace) -> dict[str, Any]:
    """The batching flags as section overrides (None: not given, the config's value stands)."""
    return {key: getattr(args, key, None) for key, _, _ in BATCH_FLAGS}


def serve_child_args(args: argparse.Namespace, bundle: Path, sections) -> list[str]:
    """The flags a `serve all --processes` child gets: the parent's own (the environment is inherited),
    and both services' intra-op threads as `serve all` shares the host's CPUs between them."""
    from specdec.serve import serve_config, share_host_threads

    shared = share_host_threads(serve_config(sections))
    out = ["--bundle", str(bundle), "--verifier-threads", str(shared.verifier.intra_op_threads),
           "--drafter-threads", str(shared.drafter.intra_op_threads)]
    for flag, value in (("--config", args.config), ("--backend", args.backend), ("--device", args.device),
                        ("--precision", args.precision), ("--verifier-model-workers", args.verifier_model_workers),
                        ("--verifier-addr", args.verifier_addr), ("--drafter-addr", args.drafter_addr),
                        ("--verifier-metrics-addr", args.verifier_metrics_addr),
                        ("--drafter-metrics-addr", args.drafter_metrics_addr),
                        *((f"--{key.replace('_', '-')}", value) for key, value in batch_overrides(args).items())):
        if value is not None:
            out += [flag, str(value)]
    return out


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
