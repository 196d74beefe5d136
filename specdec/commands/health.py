"""`specdec health`: exit 0 only when a server reports SERVING over grpc.health.v1 (compose healthchecks)."""

from __future__ import annotations

import argparse
import sys

from core.config import GATEWAY_ADDRESS
from specdec.api import ADDR_ENV
from specdec.commands.flags import address_arg, default_addr


def register(sub) -> None:
    p = sub.add_parser("health", help="exit 0 when a server reports SERVING (grpc.health.v1), else 1")
    p.add_argument("--addr", type=address_arg, default=default_addr(),
                   help=f"server address HOST:PORT (default: ${ADDR_ENV}, else {GATEWAY_ADDRESS})")
    p.add_argument("--service", default="", help="service name to ask about (default: the whole server)")
    p.add_argument("--timeout", type=float, default=3.0, help="deadline in seconds")
    p.add_argument("--tls-ca", help="connect over TLS, checking the server's certificate against this PEM CA")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
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
