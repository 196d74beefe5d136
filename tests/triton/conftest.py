"""Fixtures of the Triton interop tests: a `serve all` stack on loopback ports with the tiny bundle
(the KServe v2 endpoint), and, for the `triton` marker, a real Triton server (tests/triton/server.py)."""

from __future__ import annotations

from pathlib import Path

import grpc
import pytest

from protos.specdec.v1 import gateway_pb2_grpc
from seq2seq_models.bundle import load_bundle, make_tiny_bundle
from specdec.serve import ServiceStack
from tests.services.conftest import LOOPBACK


@pytest.fixture(scope="session")
def bundle_dir(tmp_path_factory) -> Path:
    return make_tiny_bundle(tmp_path_factory.mktemp("triton-bundle"), seed=3)


@pytest.fixture(scope="session")
def bundle(bundle_dir):
    return load_bundle(bundle_dir)


@pytest.fixture(scope="session")
def stack(bundle_dir):
    with ServiceStack("all", bundle_dir, LOOPBACK) as running:
        yield running


@pytest.fixture(scope="session")
def gateway_address(stack) -> str:
    return stack.running.addresses["gateway"]


@pytest.fixture(scope="session")
def gateway(gateway_address):
    with grpc.insecure_channel(gateway_address) as channel:
        yield gateway_pb2_grpc.GatewayServiceStub(channel)
