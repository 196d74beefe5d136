"""An imported checkpoint's generation config is in force by default, as it is for `generate()`:
`specdec import-hf` records the settings specdec honours as the bundle's decoding defaults (and says
which it took and which it left, with why), every door applies them under its own defaults, and a
request overrides each one."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

transformers = pytest.importorskip("transformers", reason="import-hf needs transformers (the hf extra)")

import grpc  # noqa: E402
import torch  # noqa: E402

import specdec  # noqa: E402
from bench.hf_checkpoints import Shape, build, random_sources  # noqa: E402
from gateway.wire import overrides_to_wire  # noqa: E402
from protos.specdec.v1 import gateway_pb2, gateway_pb2_grpc  # noqa: E402
from seq2seq_models.bundle import bundle_decoding_defaults, load_bundle  # noqa: E402
from specdec.serve import ServiceStack  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
MAX_NEW = 16
# The checkpoint's generation config: what specdec honours, and sampling settings it leaves.
GENERATION = {"no_repeat_ngram_size": 2, "min_new_tokens": 3, "repetition_penalty": 1.3, "num_beams": 3,
              "length_penalty": 0.8, "do_sample": True, "temperature": 0.7}
TAKEN = {"no_repeat_ngram_size": 2, "min_new_tokens": 3, "repetition_penalty": 1.3, "num_beams": 3,
         "length_penalty": 0.8}
LOOPBACK = {role: {"address": "127.0.0.1:0"} for role in ("gateway", "verifier", "drafter")}


@pytest.fixture(scope="module")
def imported(tmp_path_factory) -> tuple:
    """(the checkpoint as transformers loads it, the bundle directory, import-hf's stderr)."""
    root = tmp_path_factory.mktemp("generation")
    build("bart", root / "hf", Shape(), seed=11)
    model = transformers.AutoModelForSeq2SeqLM.from_pretrained(str(root / "hf")).eval()
    for name, value in GENERATION.items():
        setattr(model.generation_config, name, value)
    model.save_pretrained(root / "hf")
    proc = subprocess.run([sys.executable, "-m", "specdec", "import-hf", "--model", str(root / "hf"), "--out",
                           str(root / "bundle")], capture_output=True, text=True, timeout=600, cwd=REPO,
                          env={**os.environ, "PYTHONWARNINGS": "ignore"})
    assert proc.returncode == 0, proc.stderr
    return model, root / "bundle", proc.stderr


def _generate(model, source: list[int], **settings) -> list[int]:
    """generate()'s greedy (or beam) output with the checkpoint's generation config in force, EOS cut."""
    with torch.no_grad():
        out = model.generate(torch.tensor([[*source, model.config.eos_token_id]]), max_new_tokens=MAX_NEW,
                             do_sample=False, **settings)
    ids = out[0, 1:].tolist()
    eos = model.config.eos_token_id
    return ids[: ids.index(eos)] if eos in ids else ids


def test_the_import_records_what_it_takes_and_says_what_it_leaves(imported):
    _, bundle_dir, stderr = imported
    assert bundle_decoding_defaults(bundle_dir) == TAKEN
    lines = stderr.strip().splitlines()
    assert any(line.startswith("decoding defaults from the checkpoint's generation config:") and
               all(f"{k}={v}" in line for k, v in TAKEN.items()) for line in lines), stderr
    assert any("temperature not taken: sampling" in line for line in lines), stderr
    assert any("do_sample not taken: sampling" in line for line in lines), stderr
    assert "Traceback" not in stderr


def test_greedy_and_beam_follow_the_generation_config_and_a_request_overrides_it(imported):
    model, bundle_dir, _ = imported
    config = load_bundle(bundle_dir).config("verifier")
    sources = random_sources(config, seed=3, count=5)
    with specdec.Engine.load(bundle_dir, backend="torch") as engine:
        for source in sources:
            greedy = engine.generate(source, mode="ar", max_new_tokens=MAX_NEW).output_ids
            assert greedy == _generate(model, source, num_beams=1), source
            assert engine.generate(source, mode="iad", max_new_tokens=MAX_NEW).output_ids == greedy
            plain = engine.generate(source, mode="ar", max_new_tokens=MAX_NEW, no_repeat_ngram_size=0,
                                    repetition_penalty=1.0, min_new_tokens=0).output_ids
            assert plain == _generate(model, source, num_beams=1, no_repeat_ngram_size=0, repetition_penalty=1.0,
                                      min_new_tokens=0), source
            beam = engine.generate(source, mode="beam", max_new_tokens=MAX_NEW).output_ids  # the config's 3 beams
            assert beam == _generate(model, source), source
    # At least one source where the generation config's processors change the greedy output.
    with specdec.Engine.load(bundle_dir, backend="torch") as engine:
        assert any(engine.generate(s, mode="ar", max_new_tokens=MAX_NEW).output_ids
                   != engine.generate(s, mode="ar", max_new_tokens=MAX_NEW, no_repeat_ngram_size=0,
                                      repetition_penalty=1.0, min_new_tokens=0).output_ids for s in sources)


def test_a_policys_defaults_stay_over_the_bundles(imported):
    """What a caller's `Policy` changes (here the mode and min_new_tokens) stays; the bundle's other
    settings stay in force under it."""
    from decoding.config import DecodingConfig, Mode
    from decoding.request import Policy

    model, bundle_dir, _ = imported
    source = random_sources(load_bundle(bundle_dir).config("verifier"), seed=5, count=1)[0]
    policy = Policy(defaults=DecodingConfig(mode=Mode.IAD, min_new_tokens=1))
    with specdec.Engine.load(bundle_dir, backend="torch", policy=policy) as engine:
        out = engine.generate(source, max_new_tokens=MAX_NEW)
    assert out.stats.mode == "iad"
    assert out.output_ids == _generate(model, source, num_beams=1, min_new_tokens=1)


def test_the_gateway_applies_the_bundles_defaults_under_its_own(imported):
    model, bundle_dir, _ = imported
    config = load_bundle(bundle_dir).config("verifier")
    sources = random_sources(config, seed=4, count=3)
    sections = {**LOOPBACK, "verifier": {"address": "127.0.0.1:0", "backend": "torch"},
                "defaults": {"mode": "ar", "max_new_tokens": MAX_NEW, "no_repeat_ngram_size": 3}}
    with ServiceStack("all", bundle_dir, sections) as stack, \
            grpc.insecure_channel(stack.running.addresses["gateway"]) as channel:
        gateway = gateway_pb2_grpc.GatewayServiceStub(channel)
        for source in sources:
            reply = gateway.Generate(gateway_pb2.GenerateRequest(input_ids=source), timeout=60)
            # [defaults]' no_repeat_ngram_size over the bundle's; the bundle's other settings stay.
            assert list(reply.output_ids) == _generate(model, source, num_beams=1, no_repeat_ngram_size=3)
            override = gateway_pb2.GenerateRequest(input_ids=source, config=overrides_to_wire(
                {"repetition_penalty": 1.0, "min_new_tokens": 0, "no_repeat_ngram_size": 0}))
            assert list(gateway.Generate(override, timeout=60).output_ids) == _generate(
                model, source, num_beams=1, repetition_penalty=1.0, min_new_tokens=0, no_repeat_ngram_size=0)
