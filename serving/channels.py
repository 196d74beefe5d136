"""gRPC server and channel options every specdec process uses (message sizes, keepalive, reconnect
backoff)."""

from __future__ import annotations

# Sessions move a few hundred bytes per step; 16 MiB leaves room for full-vocabulary rows.
DEFAULT_MAX_MESSAGE_BYTES = 16 * 1024 * 1024

# Keepalive: a peer that vanished without closing its connection (a killed client, a dropped
# network) would otherwise hold its sessions until the idle timeout or for ever. Every process
# pings its peers every KEEPALIVE_TIME_MS and drops the connection, ending its streams and so
# freeing their sessions, when no answer comes within KEEPALIVE_TIMEOUT_MS.
KEEPALIVE_TIME_MS = 30_000
KEEPALIVE_TIMEOUT_MS = 10_000
# Servers accept pings this often (clients ping every KEEPALIVE_TIME_MS, well above it); a peer
# pinging faster is sent GOAWAY (too_many_pings) instead of costing the server work.
MIN_PING_INTERVAL_MS = 10_000


def _keepalive() -> list[tuple[str, int]]:
    return [
        ("grpc.keepalive_time_ms", KEEPALIVE_TIME_MS),
        ("grpc.keepalive_timeout_ms", KEEPALIVE_TIMEOUT_MS),
        # Ping also while no call is open: a drafter connection can sit idle between requests.
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.max_pings_without_data", 0),
    ]


def grpc_options(max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES) -> list[tuple[str, int]]:
    return [
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.max_receive_message_length", max_message_bytes),
    ]


def server_options(max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES) -> list[tuple[str, int]]:
    return [
        *grpc_options(max_message_bytes),
        *_keepalive(),
        ("grpc.http2.min_recv_ping_interval_without_data_ms", MIN_PING_INTERVAL_MS),
        ("grpc.http2.min_ping_interval_without_data_ms", MIN_PING_INTERVAL_MS),
    ]


def channel_options(max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES) -> list[tuple[str, int]]:
    # Short reconnect backoff: a restarted drafter should be used again within about a second,
    # not after gRPC's default of up to two minutes.
    return [
        *grpc_options(max_message_bytes),
        *_keepalive(),
        ("grpc.initial_reconnect_backoff_ms", 200),
        ("grpc.min_reconnect_backoff_ms", 200),
        ("grpc.max_reconnect_backoff_ms", 1000),
    ]
