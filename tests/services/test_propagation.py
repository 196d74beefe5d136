"""What crosses service boundaries: request ids into every log, deadlines end to end, and the
start-up check that drafter and verifier speak the same vocabulary."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid

import grpc
import pytest
import torch

from gateway.wire import overrides_to_wire
from protos.specdec.v1 import gateway_pb2, gateway_pb2_grpc
from seq2seq_models.bundle import save_bundle
from seq2seq_models.config import ModelConfig
from seq2seq_models.tokenizer import Tokenizer, train_tokenizer
from seq2seq_models.transformer import Seq2SeqTransformer
from serving.status import REQUEST_ID_KEY
from specdec.serve import ServiceStack
from tests.services.conftest import REPO

TEXT = "We have been living in this city."


def test_request_id_reaches_every_service_log(bundle_dir, tmp_path):
    log_path = tmp_path / "serve.log"
    env = {**os.environ, "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "specdec", "serve", "all", "--bundle", str(bundle_dir), "--gateway-addr",
           "127.0.0.1:0", "--verifier-addr", "127.0.0.1:0", "--drafter-addr", "127.0.0.1:0"]
    with log_path.open("w") as log:
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=log, text=True)
        try:
            assert proc.stdout is not None
            address = proc.stdout.readline().strip()
            assert address, f"serve all exited with {proc.poll()}"
            request_id = f"req-{uuid.uuid4().hex[:12]}"
            with grpc.insecure_channel(address) as channel:
                stub = gateway_pb2_grpc.GatewayServiceStub(channel)
                config = overrides_to_wire({"mode": "gad", "k": 4, "max_new_tokens": 12})
                stub.Generate(
                    gateway_pb2.GenerateRequest(text=TEXT, config=config),
                    timeout=60,
                    metadata=((REQUEST_ID_KEY, request_id),),
                )
        finally:
            proc.send_signal(signal.SIGTERM)
            proc.wait(timeout=60)
    lines = [json.loads(line) for line in log_path.read_text().splitlines() if line.startswith("{")]
    services = {line.get("service") for line in lines if line.get("request_id") == request_id}
    assert services == {"gateway", "verifier", "drafter"}
    events = {(line["service"], line["event"]) for line in lines if line.get("request_id") == request_id}
    assert ("gateway", "request_done") in events
    assert ("verifier", "session_opened") in events and ("verifier", "session_closed") in events


def test_deadline_is_honoured_end_to_end_and_frees_sessions(stack, gateway):
    slow = overrides_to_wire({"mode": "beam", "num_beams": 8, "max_new_tokens": 200})
    with pytest.raises(grpc.RpcError) as info:
        gateway.Generate(gateway_pb2.GenerateRequest(text=TEXT * 4, config=slow), timeout=0.05)
    assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if stack.running.verifier.active_sessions == 0 and stack.running.drafter.active_sessions == 0:
            break
        time.sleep(0.05)
    assert stack.running.verifier.active_sessions == 0
    # The services are still fine for the next request.
    quick = overrides_to_wire({"mode": "ar", "max_new_tokens": 4})
    assert gateway.Generate(gateway_pb2.GenerateRequest(text=TEXT, config=quick), timeout=60).final


def test_gateway_refuses_a_drafter_with_another_vocabulary(bundle_dir, tmp_path):
    corpus = (REPO / "seq2seq_models" / "data" / "tiny_corpus.txt").read_text().splitlines()
    other_tokenizer = train_tokenizer(corpus, vocab_size=100)
    vocab = Tokenizer(other_tokenizer).vocab_size
    torch.manual_seed(0)
    small = {"d_model": 16, "n_heads": 2, "encoder_layers": 1, "decoder_layers": 1, "ffn_dim": 32}
    other = save_bundle(
        tmp_path / "other",
        other_tokenizer,
        {r: Seq2SeqTransformer(ModelConfig(vocab_size=vocab, **small)) for r in ("nar_drafter", "ar_drafter")},
        name="other-vocabulary",
    )
    loopback = {"address": "127.0.0.1:0"}
    with (
        ServiceStack("verifier", bundle_dir, {"verifier": loopback}) as verifier,
        ServiceStack("drafter", other, {"drafter": loopback}) as drafter,
    ):
        sections = {
            "gateway": {
                "address": "127.0.0.1:0",
                "verifier_address": verifier.running.addresses["verifier"],
                "drafter_address": drafter.running.addresses["drafter"],
            }
        }
        gateway = ServiceStack("gateway", bundle_dir, sections)
        with pytest.raises(ValueError, match="drafter and verifier disagree on vocab_size, tokenizer_fingerprint"):
            gateway.start()
        gateway.loop.call_soon_threadsafe(gateway.loop.stop)
