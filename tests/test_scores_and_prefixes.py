"""Per-token log-probabilities and target prefixes, against `transformers` on checkpoints built here.

- `output_logprobs`: greedy's token log-probs are `generate(output_scores=True)`'s scores, normalised
  (`log_softmax`), at the tokens it chose, the EOS's last; the lossless modes give greedy's; a beam
  hypothesis' are `generate`'s transition scores and sum to its score times its length ** penalty.
- A target prefix (text or ids): every mode continues from it as `generate` continues from
  `decoder_input_ids` = [start, *prefix] (beam search with length_penalty 0: the prefix counts in
  the length here, as a forced token does, and not in `generate`'s prompt).
- Both through every door: in process, gRPC (Generate and GenerateStream), KServe, the CLI.
"""

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
from specdec.api import Engine  # noqa: E402
from specdec.cli import main as cli_main  # noqa: E402
from specdec.serve import ServiceStack  # noqa: E402
from verifier_service.session import make_verifier  # noqa: E402

MAX_NEW = 16
FAMILIES = ("bart", "t5")
TOLERANCE = 1e-4
LOOPBACK = {
    "verifier": {"address": "127.0.0.1:0", "metrics_address": "127.0.0.1:0", "backend": "torch"},
    "drafter": {"address": "127.0.0.1:0", "metrics_address": "127.0.0.1:0"},
    "gateway": {"address": "127.0.0.1:0", "metrics_address": "127.0.0.1:0"},
}
TEXT, PREFIX_TEXT = "The quick brown fox jumps over the lazy dog.", "Hello world"


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, tuple]:
    """family -> (the HF model as loaded back, its tokenizer, the imported bundle's directory)."""
    out = {}
    for seed, family in enumerate(FAMILIES):
        root = tmp_path_factory.mktemp(family)
        model, bundle_dir = build_and_import(family, root, seed + 3)
        out[family] = (model, transformers.AutoTokenizer.from_pretrained(str(root / "hf")), bundle_dir)
    return out


def _opened(bundle_dir, backend: str, seed: int, cache_root=None) -> tuple:
    """(the bundle's verifier on `backend`, its model config, four random sources)."""
    bundle = load_bundle(bundle_dir)
    cfg = bundle.config("verifier")
    return make_verifier(bundle, backend, cache_root=cache_root), cfg, random_sources(cfg, seed, count=4)


def _config(**overrides) -> DecodingConfig:
    return DecodingConfig().with_overrides({"max_new_tokens": MAX_NEW, "output_logprobs": True, **overrides})


def _hf_greedy(model, source: list[int], eos: int, start: int, prefix: list[int] = ()) -> tuple[list[int], list[float]]:
    """generate()'s greedy continuation of [start, *prefix] (EOS cut) and its tokens' normalised
    scores (the EOS's included), the prefix's counted in the length limit."""
    with torch.no_grad():
        out = model.generate(
            torch.tensor([[*source, eos]]), decoder_input_ids=torch.tensor([[start, *prefix]]), do_sample=False,
            num_beams=1, max_new_tokens=MAX_NEW - len(prefix), output_scores=True, return_dict_in_generate=True,
            forced_eos_token_id=None, forced_bos_token_id=None, min_length=0,
        )
    new = out.sequences[0, 1 + len(prefix):].tolist()
    scores = [float(torch.log_softmax(s[0].float(), -1)[t]) for s, t in zip(out.scores, new, strict=False)]
    ids = new[: new.index(eos)] if eos in new else new
    return [*prefix, *ids], [0.0] * len(prefix) + scores


def _close(got: list[float], want: list[float]) -> bool:
    return len(got) == len(want) and all(abs(a - b) <= TOLERANCE for a, b in zip(got, want, strict=True))


@pytest.mark.parametrize("backend", ["torch", "onnxruntime"])
@pytest.mark.parametrize("family", FAMILIES)
def test_token_logprobs_are_generates_scores(checkpoints, family, backend, tmp_path):
    model, _, bundle_dir = checkpoints[family]
    verifier, cfg, sources = _opened(bundle_dir, backend, 1, tmp_path)
    for source in sources:
        ids, scores = _hf_greedy(model, source, cfg.eos_id, cfg.bos_id)
        for mode in ("ar", "iad"):
            got = decode(source, _config(mode=mode, k=4), verifier)
            assert got.output_ids == ids, (mode, source)
            assert _close(got.token_logprobs, scores), (mode, source, got.token_logprobs, scores)
        unasked = decode(source, _config(mode="ar", output_logprobs=False), verifier)
        assert unasked.output_ids == ids and unasked.token_logprobs == []


@pytest.mark.parametrize("family", FAMILIES)
def test_beam_token_logprobs_are_generates_transition_scores(checkpoints, family):
    model, _, bundle_dir = checkpoints[family]
    verifier, cfg, sources = _opened(bundle_dir, "torch", 2)
    for source in sources:
        config = _config(mode="beam", num_beams=4, num_return_sequences=4, length_penalty=1.5)
        result = decode(source, config, verifier)
        with torch.no_grad():
            out = model.generate(
                torch.tensor([[*source, cfg.eos_id]]), do_sample=False, num_beams=4, num_return_sequences=4,
                length_penalty=1.5, max_new_tokens=MAX_NEW, output_scores=True, return_dict_in_generate=True,
                forced_eos_token_id=None, forced_bos_token_id=None, min_length=0,
            )
        transitions = model.compute_transition_scores(out.sequences, out.scores, out.beam_indices)
        for h, seq, steps in zip(result.hypotheses, out.sequences.tolist(), transitions.tolist(), strict=True):
            n = len(h.token_logprobs)
            assert n == len(h.output_ids) + (h.finish_reason == "eos")
            assert seq[1 : 1 + len(h.output_ids)] == h.output_ids
            assert _close(h.token_logprobs, steps[:n])
            assert abs(sum(h.token_logprobs) / n**1.5 - h.score) <= TOLERANCE
        assert result.token_logprobs == result.hypotheses[0].token_logprobs


@pytest.mark.parametrize("family", FAMILIES)
def test_every_mode_continues_a_target_prefix(checkpoints, family):
    """Greedy, IAD and beam (length penalty 0) from a prefix equal generate() from decoder_input_ids
    [start, *prefix]; the prefix is the output's first tokens, log-prob 0 each."""
    model, _, bundle_dir = checkpoints[family]
    verifier, cfg, sources = _opened(bundle_dir, "torch", 3)
    for source in sources:
        prefix = source[:3]
        ids, scores = _hf_greedy(model, source, cfg.eos_id, cfg.bos_id, prefix)
        for mode in ("ar", "iad"):
            got = decode(source, _config(mode=mode, k=4), verifier, prefix=prefix)
            assert got.output_ids == ids and _close(got.token_logprobs, scores), (mode, source)
        with torch.no_grad():
            want = model.generate(
                torch.tensor([[*source, cfg.eos_id]]), decoder_input_ids=torch.tensor([[cfg.bos_id, *prefix]]),
                do_sample=False, num_beams=4, num_return_sequences=4, length_penalty=0.0,
                max_new_tokens=MAX_NEW - len(prefix), output_scores=True, return_dict_in_generate=True,
                forced_eos_token_id=None, forced_bos_token_id=None, min_length=0,
            )
        beam = decode(source, _config(mode="beam", num_beams=4, num_return_sequences=4, length_penalty=0.0), verifier,
                      prefix=prefix)
        for h, seq, score in zip(beam.hypotheses, want.sequences.tolist(), want.sequences_scores.tolist(),
                                 strict=True):
            seq = seq[1:]
            assert h.output_ids == (seq[: seq.index(cfg.eos_id)] if cfg.eos_id in seq else seq)
            assert abs(h.score - score) <= TOLERANCE


def test_a_text_prefix_is_the_outputs_first_tokens_on_every_door(checkpoints, capsys, monkeypatch):
    """A text prefix is encoded as a target (transformers' tokenizer, no special tokens) and the
    output starts with it in process, over gRPC (Generate, GenerateStream), KServe and the CLI; ids
    work the same; with token log-probs on every door; both at once, or one too long, are refused."""
    import grpc
    import numpy as np
    import tritonclient.grpc as triton_grpc

    model, tok, bundle_dir = checkpoints["bart"]
    cfg = load_bundle(bundle_dir).config("verifier")
    text, prefix_text = TEXT, PREFIX_TEXT
    prefix = tok(text_target=prefix_text, add_special_tokens=False)["input_ids"]
    source = tok(text)["input_ids"][:-1]
    want_ids, want_scores = _hf_greedy(model, source, cfg.eos_id, cfg.bos_id, prefix)
    params = {"mode": "iad", "k": 4, "max_new_tokens": MAX_NEW, "output_logprobs": True}
    with Engine.load(bundle_dir, backend="torch") as engine:
        out = engine.generate(text, target_prefix=prefix_text, **params)
        assert out.output_ids == want_ids and _close(out.token_logprobs, want_scores)
        assert engine.generate(text, target_prefix=prefix, **params).output_ids == want_ids
        with pytest.raises(SpecdecError) as err:
            engine.generate(text, target_prefix=prefix, mode="ar", max_new_tokens=len(prefix))
        assert err.value.code == StatusCode.OUT_OF_RANGE and "forced first tokens" in err.value.message
    with ServiceStack("all", bundle_dir, LOOPBACK) as stack:
        address = stack.running.addresses["gateway"]
        with grpc.insecure_channel(address) as channel:
            gateway = gateway_pb2_grpc.GatewayServiceStub(channel)
            request = gateway_pb2.GenerateRequest(text=text, target_prefix=prefix_text,
                                                  config=overrides_to_wire(params))
            reply = gateway.Generate(request, timeout=60)
            assert list(reply.output_ids) == want_ids and _close(list(reply.token_logprobs), want_scores)
            chunks = list(gateway.GenerateStream(request, timeout=60))
            assert [i for c in chunks for i in c.output_ids] == want_ids
            assert list(chunks[0].output_ids) == prefix  # the prefix goes out first
            assert _close(list(chunks[-1].token_logprobs), want_scores)
            by_ids = gateway_pb2.GenerateRequest(text=text, target_prefix_ids=prefix, config=overrides_to_wire(params))
            assert list(gateway.Generate(by_ids, timeout=60).output_ids) == want_ids
            both = gateway_pb2.GenerateRequest(text=text, target_prefix=prefix_text, target_prefix_ids=prefix)
            with pytest.raises(grpc.RpcError) as failed:
                gateway.Generate(both, timeout=60)
            assert failed.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        text_in = triton_grpc.InferInput("TEXT", [1], "BYTES")
        text_in.set_data_from_numpy(np.array([text.encode()], dtype=np.object_))
        with triton_grpc.InferenceServerClient(address) as client:
            kserve = client.infer("specdec", [text_in], parameters={
                **params, "target_prefix_ids": ",".join(map(str, prefix))})
        assert kserve.as_numpy("OUTPUT_IDS").tolist() == want_ids
        assert _close(kserve.as_numpy("TOKEN_LOGPROBS").tolist(), want_scores)
    monkeypatch.setattr("sys.stdin", io.StringIO(text + "\n"))
    capsys.readouterr()
    assert cli_main(["decode", "--bundle", str(bundle_dir), "--backend", "torch", "--mode", "ar", "--max-new-tokens",
                     str(MAX_NEW), "--target-prefix", prefix_text, "--output-logprobs"]) == 0
    record = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert record["output_ids"] == want_ids and _close(record["token_logprobs"], want_scores)
