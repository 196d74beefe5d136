"""Fixtures of the Triton interop tests: a `serve all` stack on loopback ports with the tiny bundle
(the KServe v2 endpoint), and, for the `triton` marker, a real Triton server (tests/triton/server.py)."""

from __future__ import annotations

import grpc
import pytest

from protos.specdec.v1 import gateway_pb2_grpc

# The same tiny bundle and `serve all` stack as the services tests.
from tests.services.conftest import bundle, bundle_dir, stack  # noqa: F401


@pytest.fixture(scope="session")
def gateway_address(stack) -> str:  # noqa: F811
    return stack.running.addresses["gateway"]


@pytest.fixture(scope="session")
def gateway(gateway_address):
    with grpc.insecure_channel(gateway_address) as channel:
        yield gateway_pb2_grpc.GatewayServiceStub(channel)
