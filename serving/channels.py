"""gRPC server and channel options every specdec process uses (message sizes, reconnect backoff)."""

from __future__ import annotations

# Sessions move a few hundred bytes per step; 16 MiB leaves room for full-vocabulary rows.
DEFAULT_MAX_MESSAGE_BYTES = 16 * 1024 * 1024


def grpc_options(max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES) -> list[tuple[str, int]]:
    return [
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.max_receive_message_length", max_message_bytes),
    ]


def channel_options(max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES) -> list[tuple[str, int]]:
    # Short reconnect backoff: a restarted drafter should be used again within about a second,
    # not after gRPC's default of up to two minutes.
    return [
        *grpc_options(max_message_bytes),
        ("grpc.initial_reconnect_backoff_ms", 200),
        ("grpc.min_reconnect_backoff_ms", 200),
        ("grpc.max_reconnect_backoff_ms", 1000),
    ]
