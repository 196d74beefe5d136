"""Beam search equals `transformers`' `generate(num_beams=4, num_return_sequences=4)`: for a random
checkpoint of every family built here, imported with `specdec import-hf`, the n-best list (its
sequences, finish reasons aside, and its scores) equals `generate`'s for every `early_stopping`
value and a few length penalties, on the torch and ONNX Runtime backends, in process and through
`serve all` (requests in flight together, so their rows share forwards).

The checkpoints are `bench.hf_checkpoints`' (the shapes the hub's have), without Marian's
`bad_words_ids`: the search runs here with the settings each case names, not with a bundle's
decoding defaults (tests/test_generation_defaults.py checks that beam follows those)."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import pytest

transformers = pytest.importorskip("transformers", reason="import-hf needs transformers (the hf extra)")

import torch  # noqa: E402

from bench.hf_checkpoints import FAMILIES, build_and_import, random_sources  # noqa: E402
from decoding.config import DecodingConfig, EarlyStopping  # noqa: E402
from decoding.decode import decode  # noqa: E402
from gateway.wire import overrides_to_wire  # noqa: E402
from protos.specdec.v1 import gateway_pb2, gateway_pb2_grpc  # noqa: E402
from seq2seq_models.bundle import load_bundle  # noqa: E402
from specdec.cli import main as cli_main  # noqa: E402
from specdec.serve import ServiceStack  # noqa: E402
from verifier_service.session import make_verifier  # noqa: E402

BEAMS = 4
MAX_NEW = 16
SOURCES = 4
# (early_stopping, length_penalty) settings; generate()'s default is (False, 1.0).
SETTINGS = [(EarlyStopping.TRUE, 1.0), (EarlyStopping.FALSE, 1.0), (EarlyStopping.NEVER, 1.0),
            (EarlyStopping.NEVER, 2.0), (EarlyStopping.FALSE, -0.5)]
# A score's float32 arithmetic in generate() against ours: relative to the score's size (a negative
# length penalty multiplies the sum by the length).
TOLERANCE = 1e-4
LOOPBACK = {
    "verifier": {"address": "127.0.0.1:0", "metrics_address": "127.0.0.1:0", "backend": "torch"},
    "drafter": {"address": "127.0.0.1:0", "metrics_address": "127.0.0.1:0"},
    "gateway": {"address": "127.0.0.1:0", "metrics_address": "127.0.0.1:0"},
}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, tuple]:
    """family -> (the HF model as loaded back, the imported bundle's directory)."""
    def no_bad_words(model) -> None:
        model.generation_config.bad_words_ids = None

    return {family: build_and_import(family, tmp_path_factory.mktemp(family.replace(".", "_")), seed, no_bad_words)
            for seed, family in enumerate(FAMILIES)}


@pytest.fixture(scope="module")
def cases(checkpoints) -> dict[str, list[tuple]]:
    """family -> [(source, early_stopping, length_penalty, generate()'s n-best as (ids, score))]."""
    out = {}
    for family, (model, bundle_dir) in checkpoints.items():
        cfg = load_bundle(bundle_dir).config("verifier")
        sources = iter(random_sources(cfg, len(family), SOURCES * len(SETTINGS)))
        out[family] = [(source, early, penalty, _generate(model, source, cfg.eos_id, early, penalty))
                       for early, penalty in SETTINGS for source in [next(sources) for _ in range(SOURCES)]]
    return out


def _generate(model, source: list[int], eos: int, early: EarlyStopping, penalty: float) -> list[tuple]:
    """generate()'s n-best list as (ids without the decoder start and the EOS, score)."""
    hf_early = {EarlyStopping.TRUE: True, EarlyStopping.FALSE: False, EarlyStopping.NEVER: "never"}[early]
    with torch.no_grad():
        out = model.generate(
            torch.tensor([[*source, eos]]), do_sample=False, num_beams=BEAMS, num_return_sequences=BEAMS,
            early_stopping=hf_early, length_penalty=penalty, max_new_tokens=MAX_NEW, return_dict_in_generate=True,
            output_scores=True, forced_eos_token_id=None, forced_bos_token_id=None, min_length=0,
        )
    nbest = []
    for ids, score in zip(out.sequences.tolist(), out.sequences_scores.tolist(), strict=True):
        ids = ids[1:]
        nbest.append((ids[: ids.index(eos)] if eos in ids else ids, score))
    return nbest


def _overrides(early: EarlyStopping, penalty: float) -> dict:
    return {"mode": "beam", "num_beams": BEAMS, "num_return_sequences": BEAMS, "early_stopping": early.value,
            "length_penalty": penalty, "max_new_tokens": MAX_NEW}


def _agrees(got: list[tuple], want: list[tuple]) -> bool:
    return [ids for ids, _ in got] == [ids for ids, _ in want] and all(
        abs(a - b) <= TOLERANCE * max(1.0, abs(b)) for (_, a), (_, b) in zip(got, want, strict=True)
    )


def _report(family: str, where: str, results: list[tuple]) -> None:
    """Every disagreement with its case, or nothing."""
    bad = [f"{source} early_stopping={early.value} length_penalty={penalty}:\n  generate {want}\n  ours     {got}"
           for source, early, penalty, want, got in results if not _agrees(got, want)]
    assert not bad, f"{family} ({where}): {len(bad)}/{len(results)} differ from generate():\n" + "\n".join(bad)


@pytest.mark.parametrize("backend", ["torch", "onnxruntime"])
@pytest.mark.parametrize("family", FAMILIES)
def test_beam_equals_generate_in_process(checkpoints, cases, family, backend, tmp_path):
    _, bundle_dir = checkpoints[family]
    verifier = make_verifier(load_bundle(bundle_dir), backend, cache_root=tmp_path)
    results = []
    for source, early, penalty, want in cases[family]:
        result = decode(source, DecodingConfig().with_overrides(_overrides(early, penalty)), verifier)
        got = [(h.output_ids, h.score) for h in result.hypotheses]
        assert result.output_ids == got[0][0]
        results.append((source, early, penalty, want, got))
    _report(family, backend, results)


@pytest.mark.slow  # in .ci/run's slow step: the default run stays a few minutes
@pytest.mark.parametrize("family", ["bart", "t5-v1.1"])
def test_beam_equals_generate_through_the_services(checkpoints, cases, family):
    """Every case at once through `serve all` (their rows batched together), by Generate and by the
    last message of GenerateStream."""
    import grpc

    _, bundle_dir = checkpoints[family]
    with ServiceStack("all", bundle_dir, LOOPBACK) as stack, grpc.insecure_channel(
        stack.running.addresses["gateway"]
    ) as channel:
        gateway = gateway_pb2_grpc.GatewayServiceStub(channel)

        def call(case: tuple) -> tuple:
            source, early, penalty, _ = case
            config = overrides_to_wire(_overrides(early, penalty))
            request = gateway_pb2.GenerateRequest(input_ids=source, config=config)
            reply = gateway.Generate(request, timeout=120)
            last = list(gateway.GenerateStream(request, timeout=120))[-1]
            assert [list(h.output_ids) for h in last.hypotheses] == [list(h.output_ids) for h in reply.hypotheses]
            assert list(reply.output_ids) == list(reply.hypotheses[0].output_ids)
            return [(list(h.output_ids), h.score) for h in reply.hypotheses]

        with ThreadPoolExecutor(max_workers=8) as pool:
            got = list(pool.map(call, cases[family]))
    _report(family, "serve all", [(*case, nbest) for case, nbest in zip(cases[family], got, strict=True)])


def test_n_best_through_the_cli_and_kserve(checkpoints, cases, capsys, monkeypatch):
    """`specdec decode --n-best` lists each hypothesis with its score; KServe (gRPC and REST) returns
    the list as NBEST_* outputs; num_return_sequences over num_beams is refused with its name."""
    import io

    import grpc
    import numpy as np
    import tritonclient.grpc as triton_grpc
    import tritonclient.http as triton_http

    _, bundle_dir = checkpoints["bart"]
    source, early, penalty, want = cases["bart"][0]
    monkeypatch.setattr("sys.stdin", io.StringIO(" ".join(map(str, source)) + "\n"))
    capsys.readouterr()
    args = ["decode", "--bundle", str(bundle_dir), "--backend", "torch", "--ids", "--mode", "beam", "--beams",
            str(BEAMS), "--n-best", str(BEAMS), "--early-stopping", early.value, "--length-penalty", str(penalty),
            "--max-new-tokens", str(MAX_NEW)]
    assert cli_main(args) == 0
    record = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert _agrees([(h["output_ids"], h["score"]) for h in record["hypotheses"]], want)
    assert cli_main([*args[:-2], "--n-best", str(BEAMS + 1)]) == 2
    assert "num_return_sequences" in capsys.readouterr().err
    assert early == EarlyStopping.TRUE  # KServe takes it as generate() does, a boolean
    params = {**_overrides(early, penalty), "early_stopping": True}
    with ServiceStack("all", bundle_dir, LOOPBACK) as stack:
        ids_in = triton_grpc.InferInput("INPUT_IDS", [len(source)], "INT64")
        ids_in.set_data_from_numpy(np.array(source, dtype=np.int64))
        with triton_grpc.InferenceServerClient(stack.running.addresses["gateway"]) as client:
            reply = client.infer("specdec", [ids_in], parameters=params)
            with pytest.raises(triton_grpc.InferenceServerException) as err:
                client.infer("specdec", [ids_in], parameters={**params, "num_return_sequences": BEAMS + 1})
        rest_in = triton_http.InferInput("INPUT_IDS", [len(source)], "INT64")
        rest_in.set_data_from_numpy(np.array(source, dtype=np.int64), binary_data=False)
        with triton_http.InferenceServerClient(stack.running.http_address, network_timeout=60) as client:
            rest = client.infer("specdec", [rest_in], parameters=params)
    assert rest.as_numpy("NBEST_SCORES").tolist() == reply.as_numpy("NBEST_SCORES").tolist()
    assert err.value.status() == str(grpc.StatusCode.INVALID_ARGUMENT) and "num_return_sequences" in str(err.value)
    rows, scores = reply.as_numpy("NBEST_OUTPUT_IDS").tolist(), reply.as_numpy("NBEST_SCORES").tolist()
    got = [([i for i in row if i >= 0], score) for row, score in zip(rows, scores, strict=True)]
    assert _agrees(got, want)
    assert reply.as_numpy("OUTPUT_IDS").tolist() == got[0][0]
    assert len(reply.as_numpy("NBEST_TEXT")) == BEAMS
