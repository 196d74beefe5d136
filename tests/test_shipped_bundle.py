"""The trained UA-GEC bundle that ships in `bundles/ua-gec`: its budget, its card, and that the CLI
and the services use it when no bundle is named."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import grpc
import pytest

from core.backends import DEFAULT_BACKEND
from decoding.config import DecodingConfig, Mode
from decoding.decode import decode
from drafter_service.session import LocalDrafter
from protos.specdec.v1 import gateway_pb2, gateway_pb2_grpc
from seq2seq_models.bundle import load_bundle
from specdec.api import DEFAULT_BUNDLE_DIR
from tests.services.conftest import wait_ready_line
from training.arguments import SHIPPED_PRESET
from training.data import load_test_set
from verifier_service.session import make_verifier

REPO = Path(__file__).resolve().parents[1]
BUDGET_BYTES = 150 * 1024 * 1024  # issue 16: the bundle stays under 150 MB (float16 weights if need be)
MODES = [DecodingConfig(mode=Mode.AR), DecodingConfig(mode=Mode.IAD, k=10), DecodingConfig(mode=Mode.GAD, k=10)]


@pytest.fixture(scope="module")
def bundle():
    return load_bundle(DEFAULT_BUNDLE_DIR)  # also checks every file against its fingerprint


@pytest.fixture(scope="module")
def greedy_in_process(bundle):
    """Greedy through the library, with the backend `specdec decode` and `specdec serve` default to."""
    verifier = make_verifier(bundle, DEFAULT_BACKEND)
    drafter = LocalDrafter({"nar_drafter": bundle.nar_drafter, "ar_drafter": bundle.ar_drafter})
    return lambda text: decode(bundle.tokenizer.encode(text), MODES[0], verifier, drafter).output_ids


@pytest.fixture(scope="module")
def sentences(bundle) -> list[str]:
    """The first UA-GEC test sentences of at most 64 tokens (one per stdin line)."""
    fits = (i.source for i in load_test_set() if "\n" not in i.source and len(bundle.tokenizer.encode(i.source)) <= 64)
    return [next(fits) for _ in range(6)]


def _env_without_bundle() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "SPECDEC_BUNDLE"}
    return {**env, "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1"}


def test_bundle_fits_the_repository_budget_and_its_card_tells_how_it_was_made(bundle):
    tracked = [p for p in DEFAULT_BUNDLE_DIR.iterdir() if p.is_file()]
    assert sum(p.stat().st_size for p in tracked) <= BUDGET_BYTES
    assert bundle.metadata["kind"] == "trained" and bundle.metadata["preset"] == SHIPPED_PRESET
    card = (DEFAULT_BUNDLE_DIR / "MODEL_CARD.md").read_text()
    for needed in ("CC-BY-4.0", "python -m training.pipeline", f"--preset {SHIPPED_PRESET}",
                   "Synthetic pre-training pairs", "Wall time per stage", "Hardware:"):
        assert needed in card, needed
    if "continued" in bundle.metadata:  # a verifier trained on from an earlier bundle says so, and how
        assert "## Verifier continued" in card and "python -m training.continuation" in card
    if "redistilled" in bundle.metadata:  # drafters re-distilled from the verifier say so, and how
        assert "## Drafters re-distilled" in card and "python -m training.redistill" in card
    for role, scores in bundle.metadata["validation"].items():
        row = next(line for line in card.splitlines() if line.startswith(f"| {role} |"))
        assert row.endswith(f"| {scores['valid_acc']:.3f} |")  # the card quotes the recorded scores


def test_each_drafter_is_at_most_a_fifth_of_the_verifier(bundle):
    def params(model) -> int:
        return sum(p.numel() for p in model.parameters())

    verifier = params(bundle.verifier)
    assert verifier > 40_000_000  # issue 16: at least Transformer-base, 6+6 layers of width 512
    for drafter in (bundle.nar_drafter, bundle.ar_drafter):
        assert params(drafter) <= verifier / 5


def test_decode_uses_the_shipped_bundle_and_lossless_modes_agree(sentences, greedy_in_process):
    """`specdec decode` with no --bundle: GAD and IAD give greedy's output, and greedy is the library's."""
    stdin = "".join(s + "\n" for s in sentences)
    outputs = {}
    for config in MODES:
        flags = ["--mode", config.mode.value, *(["--k", str(config.k)] if config.mode != Mode.AR else [])]
        proc = subprocess.run(
            [sys.executable, "-m", "specdec", "decode", *flags], input=stdin, capture_output=True, text=True,
            env=_env_without_bundle(), cwd=REPO, timeout=600,
        )
        assert proc.returncode == 0, proc.stderr
        outputs[config.mode] = [json.loads(line) for line in proc.stdout.splitlines()]
    greedy = [r["output_ids"] for r in outputs[Mode.AR]]
    assert len(greedy) == len(sentences)
    assert [r["output_ids"] for r in outputs[Mode.IAD]] == greedy
    assert [r["output_ids"] for r in outputs[Mode.GAD]] == greedy
    # The NAR drafter is a real drafter: GAD needs far fewer verifier iterations than greedy's tokens.
    assert sum(r["stats"]["iterations"] for r in outputs[Mode.GAD]) < 0.5 * sum(map(len, greedy))

    assert greedy == [greedy_in_process(s) for s in sentences]


def test_serve_all_uses_the_shipped_bundle(sentences, greedy_in_process, tmp_path):
    """`specdec serve all` with no --bundle serves the shipped models: GAD through the gateway
    equals greedy in-process, and the drafter is used (not degraded)."""
    config = tmp_path / "loopback.toml"
    config.write_text("".join(
        f'[{section}]\nmetrics_address = "127.0.0.1:0"\n' for section in ("gateway", "verifier", "drafter")
    ))
    addresses = ["--gateway-addr", "127.0.0.1:0", "--verifier-addr", "127.0.0.1:0", "--drafter-addr", "127.0.0.1:0"]
    proc = subprocess.Popen(
        [sys.executable, "-m", "specdec", "serve", "all", "--config", str(config), *addresses],
        cwd=REPO, env=_env_without_bundle(), stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
    )
    try:
        address = wait_ready_line(proc, timeout=300)
        with grpc.insecure_channel(address) as channel:
            stub = gateway_pb2_grpc.GatewayServiceStub(channel)
            gad = gateway_pb2.DecodingConfig(mode=gateway_pb2.MODE_GAD)
            request = gateway_pb2.GenerateRequest(text=sentences[0], config=gad)
            reply = stub.Generate(request, timeout=120)
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    assert list(reply.output_ids) == greedy_in_process(sentences[0])
    assert not reply.stats.degraded
