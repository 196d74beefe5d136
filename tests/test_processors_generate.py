"""Greedy, the lossless modes and beam search with `generate()`'s logits processors on, against
`transformers`' `generate()` with the same settings, on BART and T5 checkpoints built here (the BART
one made to end its outputs early, so that the EOS rules bite), on the torch and ONNX Runtime
backends (fp32; int8 against int8 greedy), in process and through `serve all`. Each setting is
chosen from the unprocessed greedy output so that it changes it (a suppressed token it emitted, a
bad word it contains), and the test checks that it does."""

from __future__ import annotations

import io
import json

import pytest

transformers = pytest.importorskip("transformers", reason="import-hf needs transformers (the hf extra)")

import torch  # noqa: E402

from bench.hf_checkpoints import build_and_import, random_sources  # noqa: E402
from core.errors import SpecdecError, StatusCode  # noqa: E402
from decoding.config import DecodingConfig  # noqa: E402
from decoding.decode import decode  # noqa: E402
from gateway.wire import overrides_to_wire  # noqa: E402
from protos.specdec.v1 import gateway_pb2, gateway_pb2_grpc  # noqa: E402
from seq2seq_models.bundle import load_bundle  # noqa: E402
from specdec.cli import main as cli_main  # noqa: E402
from specdec.serve import ServiceStack  # noqa: E402
from verifier_service.session import make_verifier  # noqa: E402

MAX_NEW = 16
SOURCES = 6
FAMILIES = ("bart", "t5")
LOOPBACK = {
    "verifier": {"address": "127.0.0.1:0", "metrics_address": "127.0.0.1:0", "backend": "torch"},
    "drafter": {"address": "127.0.0.1:0", "metrics_address": "127.0.0.1:0"},
    "gateway": {"address": "127.0.0.1:0", "metrics_address": "127.0.0.1:0"},
}
# BART's EOS bias: outputs that end within the length limit, so min_length and min_new_tokens matter.
EOS_BIAS = 5.5


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, tuple]:
    """family -> (the HF model, the imported bundle's directory, its model config)."""
    def early_eos(model) -> None:
        with torch.no_grad():
            model.final_logits_bias[0, model.config.eos_token_id] += EOS_BIAS

    out = {}
    for seed, family in enumerate(FAMILIES):
        edit = early_eos if family == "bart" else None
        model, bundle_dir = build_and_import(family, tmp_path_factory.mktemp(family), seed + 7, edit)
        out[family] = (model, bundle_dir, load_bundle(bundle_dir).config("verifier"))
    return out


def _settings(greedy: list[int], longer: list[int], source: list[int], eos: int) -> list[dict]:
    """Processor settings that each change the unprocessed greedy output `greedy`, one processor at a
    time, then all at once; `longer`: the greedy output of at least 4 tokens (min_new_tokens 4)."""
    head = longer[:4]
    one_at_a_time = [
        {"no_repeat_ngram_size": 2},
        {"repetition_penalty": 1.6},
        {"encoder_no_repeat_ngram_size": 1} if set(greedy) & set(source) else {"suppress_tokens": [head[1]]},
        {"bad_words_ids": [[head[0], head[1]], [head[2]]]},
        {"min_length": len(greedy) + 3},
        {"min_new_tokens": len(greedy) + 2},
        {"forced_eos_token_id": eos},
        {"suppress_tokens": [head[1], head[3]]},
        {"begin_suppress_tokens": [head[0]]},
    ]
    together = {"no_repeat_ngram_size": 3, "repetition_penalty": 1.2, "bad_words_ids": [[head[1], head[2]]],
                "min_new_tokens": 3, "forced_eos_token_id": eos, "suppress_tokens": [head[3]]}
    return [*one_at_a_time, together]


def _generate(model, source: list[int], eos: int, settings: dict, beams: int = 1) -> list[tuple[list[int], float]]:
    """generate()'s outputs (EOS cut) and scores (greedy: 0) with these processors and nothing else."""
    off = {"forced_eos_token_id": None, "forced_bos_token_id": None, "min_length": 0}
    with torch.no_grad():
        out = model.generate(
            torch.tensor([[*source, eos]]), do_sample=False, num_beams=beams, num_return_sequences=beams,
            max_new_tokens=MAX_NEW, return_dict_in_generate=True, output_scores=True, **{**off, **settings},
        )
    scores = out.sequences_scores.tolist() if beams > 1 else [0.0]
    cut = [(ids[1:][: ids[1:].index(eos)] if eos in ids[1:] else ids[1:]) for ids in out.sequences.tolist()]
    return list(zip(cut, scores, strict=True))


def _cases(model, cfg, seed: int) -> list[tuple[list[int], dict, list[int]]]:
    """(source, settings, generate()'s greedy output with them) for each source and setting."""
    out = []
    for source in random_sources(cfg, seed, SOURCES, longest=10):
        greedy = _generate(model, source, cfg.eos_id, {})[0][0]
        longer = _generate(model, source, cfg.eos_id, {"min_new_tokens": 4})[0][0]
        out += [(source, s, _generate(model, source, cfg.eos_id, s)[0][0])
                for s in _settings(greedy, longer, source, cfg.eos_id)]
    return out


def _config(**overrides) -> DecodingConfig:
    return DecodingConfig().with_overrides({"max_new_tokens": MAX_NEW, **overrides})


@pytest.mark.slow  # in .ci/run's slow step: the default run stays a few minutes
@pytest.mark.parametrize("backend", ["torch", "onnxruntime"])
@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_and_the_lossless_modes_equal_generate_with_processors(checkpoints, family, backend, tmp_path):
    model, bundle_dir, cfg = checkpoints[family]
    verifier = make_verifier(load_bundle(bundle_dir), backend, cache_root=tmp_path)
    changed: dict[str, int] = {}
    for source, settings, want in _cases(model, cfg, seed=1):
        for mode in ("ar", "iad"):
            got = decode(source, _config(mode=mode, k=4, **settings), verifier).output_ids
            assert got == want, (family, mode, settings, source, got, want)
        plain = decode(source, _config(mode="ar"), verifier).output_ids
        for name in settings:
            changed[name] = changed.get(name, 0) + (plain != want)
    if family != "bart":  # only BART's outputs end early: the EOS rules change T5's nowhere
        changed = {name: n for name, n in changed.items() if name not in ("min_length", "min_new_tokens")}
    assert all(changed.values()), f"settings that changed no output: {changed}"


@pytest.mark.slow  # in .ci/run's slow step: the default run stays a few minutes
@pytest.mark.parametrize("backend", ["torch", "onnxruntime"])
@pytest.mark.parametrize("family", FAMILIES)
def test_beam_with_processors_equals_generate(checkpoints, family, backend, tmp_path):
    """generate()'s beam search processes log-softmax scores, unnormalised: its n-best lists and scores."""
    model, bundle_dir, cfg = checkpoints[family]
    verifier = make_verifier(load_bundle(bundle_dir), backend, cache_root=tmp_path)
    for source, settings, _ in _cases(model, cfg, seed=2)[::3]:
        want = _generate(model, source, cfg.eos_id, settings, beams=4)
        result = decode(source, _config(mode="beam", num_beams=4, num_return_sequences=4, **settings), verifier)
        assert [h.output_ids for h in result.hypotheses] == [ids for ids, _ in want], (settings, source)
        assert [h.score for h in result.hypotheses] == pytest.approx([s for _, s in want], abs=1e-4)


def test_processors_through_serve_all_kserve_and_the_cli(checkpoints, capsys, monkeypatch):
    """The request's processors reach the verifier service (VerifyOpen.processors): Generate (AR's
    greedy runs, IAD, beam) equals generate(); KServe and the CLI take token lists as strings."""
    import grpc
    import numpy as np
    import tritonclient.grpc as triton_grpc

    model, bundle_dir, cfg = checkpoints["bart"]
    cases = _cases(model, cfg, seed=3)[-3:]
    with ServiceStack("all", bundle_dir, LOOPBACK) as stack:
        address = stack.running.addresses["gateway"]
        with grpc.insecure_channel(address) as channel:
            gateway = gateway_pb2_grpc.GatewayServiceStub(channel)
            for source, settings, want in cases:
                for mode in ("ar", "iad"):
                    config = overrides_to_wire({"mode": mode, "max_new_tokens": MAX_NEW, **settings})
                    reply = gateway.Generate(gateway_pb2.GenerateRequest(input_ids=source, config=config), timeout=60)
                    assert list(reply.output_ids) == want, (mode, settings)
                beam = overrides_to_wire({"mode": "beam", "num_beams": 4, "max_new_tokens": MAX_NEW, **settings})
                reply = gateway.Generate(gateway_pb2.GenerateRequest(input_ids=source, config=beam), timeout=60)
                assert list(reply.output_ids) == _generate(model, source, cfg.eos_id, settings, beams=4)[0][0]
        source, settings, want = cases[-1]
        as_text = {k: ";".join(" ".join(map(str, w)) for w in v) if k == "bad_words_ids" else
                   " ".join(map(str, v)) if isinstance(v, list) else v for k, v in settings.items()}
        ids_in = triton_grpc.InferInput("INPUT_IDS", [len(source)], "INT64")
        ids_in.set_data_from_numpy(np.array(source, dtype=np.int64))
        with triton_grpc.InferenceServerClient(address) as client:
            reply = client.infer("specdec", [ids_in], parameters={"mode": "ar", "max_new_tokens": MAX_NEW, **as_text})
        assert reply.as_numpy("OUTPUT_IDS").tolist() == want
    monkeypatch.setattr("sys.stdin", io.StringIO(" ".join(map(str, source)) + "\n"))
    flags = [f"--{k.replace('_', '-')}={v}" for k, v in as_text.items()]
    capsys.readouterr()
    assert cli_main(["decode", "--bundle", str(bundle_dir), "--backend", "torch", "--ids", "--mode", "ar",
                     "--max-new-tokens", str(MAX_NEW), *flags]) == 0
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["output_ids"] == want


def test_int8_lossless_modes_equal_int8_greedy_with_processors(checkpoints, tmp_path):
    """The int8 graphs apply the same processors: IAD equals int8 greedy with them on."""
    model, bundle_dir, cfg = checkpoints["bart"]
    verifier = make_verifier(load_bundle(bundle_dir), "onnxruntime", cache_root=tmp_path, precision="int8")
    for source, settings, _ in _cases(model, cfg, seed=5)[::2]:
        greedy = decode(source, _config(mode="ar", **settings), verifier)
        assert decode(source, _config(mode="iad", k=4, **settings), verifier).output_ids == greedy.output_ids


def test_bad_processor_settings_and_a_verifier_without_processors_are_refused(checkpoints):
    """A token id outside the vocabulary is INVALID_ARGUMENT; the Triton-hosted verifier, whose model
    applies no processors, refuses a session that asks for any, in one line naming the way out."""
    from gateway.peers.remote import CallOptions
    from gateway.peers.triton import TritonVerifier
    from protos.specdec.v1 import common_pb2

    _, bundle_dir, cfg = checkpoints["t5"]
    source = random_sources(cfg, 4, 1)[0]
    with pytest.raises(SpecdecError) as err:
        decode(source, _config(mode="ar", suppress_tokens=[cfg.vocab_size]), make_verifier(load_bundle(bundle_dir),
                                                                                             "torch"))
    assert err.value.code == StatusCode.INVALID_ARGUMENT and "outside the vocabulary" in err.value.message
    info = common_pb2.ModelInfo(vocab_size=cfg.vocab_size, eos_id=cfg.eos_id, max_source_len=64, max_target_len=64)
    triton = TritonVerifier(None, "verifier", info, CallOptions())
    with pytest.raises(SpecdecError) as err:
        triton.open(source, _config(mode="ar", no_repeat_ngram_size=3).processors())
    assert err.value.code == StatusCode.INVALID_ARGUMENT and "specdec's own service" in err.value.message
