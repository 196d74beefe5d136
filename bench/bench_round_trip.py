"""Where a verify step's round trip goes: one step at a time from a worker thread, per client design,
against a real verifier and against a bare echo server (the gRPC floor: no model, no worker hop).

    python bench/bench_round_trip.py              # tiny random bundle
    python bench/bench_round_trip.py --bundle bundles/ua-gec
    python bench/bench_round_trip.py --write  # also update "## Round trip split (CPU)" in BENCHMARKS.md

Client designs (gateway.peers.remote; the gateway runs the aio one):
- sync: a synchronous bidi stream fed by a request queue (a consumer thread per stream);
- aio: a grpc.aio stream on an event loop thread, the worker waiting on
  `asyncio.run_coroutine_threadsafe` (gateway/peers/streams.py).

Servers: `specdec serve verifier` on the bundle (the step's forward is reported by the verifier, so
"rtt - forward" is what transport, hops and the service's own Python cost), and an echo
VerifierService on grpc.aio answering every step at once from its loop. Every pass runs each
pair in turn (interleaved), so all are measured under the same load; medians of all steps.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import grpc

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from anywhere

from evaluation.bench_report import machine_stamp, write_section
from gateway.peers.remote import RemoteVerifier, fetch_verifier_info
from gateway.peers.streams import PeerChannel
from protos.specdec.v1 import common_pb2, verifier_pb2, verifier_pb2_grpc
from seq2seq_models.bundle import make_tiny_bundle
from serving.channels import channel_options
from tests.services.conftest import free_port, spawn_specdec, wait_ready_line

SECTION = "## Round trip split (CPU)"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--bundle", help="bundle directory (default: a tiny random bundle, seed 0)")
    parser.add_argument("--steps", type=int, default=40, help="steps per session")
    parser.add_argument("--sessions", type=int, default=10, help="sessions per design and pass")
    parser.add_argument("--passes", type=int, default=3)
    parser.add_argument("--write", action="store_true")
    parser.add_argument("--output", type=Path, default=Path(__file__).resolve().parents[1] / "BENCHMARKS.md")
    parser.add_argument("--echo", help=argparse.SUPPRESS)  # internal: serve the echo server at this address
    args = parser.parse_args(argv)
    if args.echo:
        asyncio.run(_serve_echo(args.echo))
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        bundle_dir = Path(args.bundle) if args.bundle else make_tiny_bundle(Path(tmp) / "bundle", seed=0)
        verifier = spawn_specdec("serve", "verifier", "--bundle", str(bundle_dir), "--verifier-addr", "127.0.0.1:0")
        echo_address = f"127.0.0.1:{free_port()}"
        echo = subprocess.Popen([sys.executable, __file__, "--echo", echo_address])
        try:
            servers = {"verifier": wait_ready_line(verifier, 120), "echo": echo_address}
            table = _table(_measure(servers, args))
        finally:
            for proc in (verifier, echo):
                proc.terminate()
                proc.wait(30)
    print(table)
    if args.write:
        stamp = machine_stamp()
        note = (
            f"Bundle: {args.bundle or 'a tiny random bundle (seed 0)'}; `specdec serve verifier` (default backend) "
            f"and a bare grpc.aio echo VerifierService, each in its own process; {args.sessions} sessions of "
            f"{args.steps} one-token steps per design and pass, {args.passes} interleaved passes, medians. "
            "Forward: the verifier's own `forward_ms`; the rest is transport, thread hops and the service's Python."
        )
        write_section(args.output, SECTION, f"{stamp}\n\n{note}\n\n{table}")
    return 0


def _measure(servers: dict[str, str], args) -> dict[tuple[str, str], tuple[list[float], list[float]]]:
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, name="bench-loop", daemon=True)
    thread.start()

    async def aio_channel(address: str) -> PeerChannel:
        return PeerChannel(address, None, channel_options())

    channels, infos = {}, {}
    for server, address in servers.items():
        sync = grpc.insecure_channel(address, options=channel_options())
        grpc.channel_ready_future(sync).result(timeout=60)
        infos[server] = fetch_verifier_info(sync)
        channels[(server, "sync")] = sync
        channels[(server, "aio")] = asyncio.run_coroutine_threadsafe(aio_channel(address), loop).result(30)
    samples: dict[tuple[str, str], tuple[list[float], list[float]]] = {key: ([], []) for key in channels}
    try:
        for _ in range(args.passes):
            for (server, design), channel in channels.items():
                rtts, forwards = samples[(server, design)]
                remote = RemoteVerifier(channel, infos[server])
                for _ in range(args.sessions):
                    session = remote.open([5, 6, 7, 8, infos[server].eos_id])
                    session.step(0, [], [], 1)  # the `opened` answer and a first step, untimed
                    for i in range(args.steps):
                        started = time.perf_counter()
                        result = session.step(i, [9], [], 1)
                        rtts.append(time.perf_counter() - started)
                        forwards.append(result.forward_s)
                    session.close()
    finally:
        for (_, design), channel in channels.items():
            if design == "aio":
                asyncio.run_coroutine_threadsafe(channel.close(), loop).result(30)
            else:
                channel.close()
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
    return samples


def _table(samples) -> str:
    lines = [
        "| server | client design | round trip ms | forward ms | round trip - forward ms |",
        "|---|---|---:|---:|---:|",
    ]
    for (server, design), (rtts, forwards) in samples.items():
        rtt, forward = statistics.median(rtts) * 1e3, statistics.median(forwards) * 1e3
        rest = statistics.median([r - f for r, f in zip(rtts, forwards, strict=True)]) * 1e3
        lines.append(f"| {server} | {design} | {rtt:.3f} | {forward:.3f} | {rest:.3f} |")
    return "\n".join(lines)


class _Echo(verifier_pb2_grpc.VerifierServiceServicer):
    """A VerifierService that answers at once from its loop: the gRPC round trip alone."""

    async def GetModelInfo(self, request, context):
        info = common_pb2.ModelInfo(vocab_size=64, eos_id=2, max_source_len=64, max_target_len=64)
        return verifier_pb2.VerifierServiceGetModelInfoResponse(model_info=info)

    async def Verify(self, request_iterator, context):
        async for request in request_iterator:
            if request.WhichOneof("kind") == "open":
                yield verifier_pb2.VerifyResponse(opened=verifier_pb2.VerifyOpened(source_len=5))
            else:
                position = verifier_pb2.Position(top1=3)
                yield verifier_pb2.VerifyResponse(step=verifier_pb2.VerifyStepResult(positions=[position]))


async def _serve_echo(address: str) -> None:
    server = grpc.aio.server()
    verifier_pb2_grpc.add_VerifierServiceServicer_to_server(_Echo(), server)
    server.add_insecure_port(address)
    await server.start()
    await server.wait_for_termination()


if __name__ == "__main__":
    sys.exit(main())
