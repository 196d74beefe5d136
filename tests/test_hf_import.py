"""`specdec import-hf` against `transformers` itself: for each family a small random-weight model is
built with `transformers`, saved, imported, and its greedy output compared with `generate` on the
torch and ONNX Runtime backends; tokenizers built here round-trip text as `transformers`' do."""

from __future__ import annotations

import io
import json
import random
from pathlib import Path

import pytest

transformers = pytest.importorskip("transformers", reason="import-hf needs transformers (the hf extra)")

import sentencepiece as spm  # noqa: E402
import torch  # noqa: E402
from tokenizers import ByteLevelBPETokenizer  # noqa: E402

from bench.hf_checkpoints import scaled  # noqa: E402
from decoding.config import DecodingConfig, layered_defaults  # noqa: E402
from decoding.decode import decode  # noqa: E402
from drafter_service.session import make_drafter  # noqa: E402
from gateway.wire import overrides_to_wire  # noqa: E402
from protos.specdec.v1 import gateway_pb2, gateway_pb2_grpc  # noqa: E402
from seq2seq_models.bundle import bundle_decoding_defaults, load_bundle  # noqa: E402
from specdec.cli import main as cli_main  # noqa: E402
from specdec.serve import ServiceStack  # noqa: E402
from verifier_service.session import make_verifier  # noqa: E402

CORPUS = (Path(__file__).resolve().parents[1] / "seq2seq_models" / "data" / "tiny_corpus.txt").read_text().splitlines()
MAX_NEW = 16
SOURCES = 5
# A first-divergence gap below this in HF's own float32 logits is a near-tie, not an import error.
NEAR_TIE = 1e-4
LOOPBACK = {
    "verifier": {"address": "127.0.0.1:0", "metrics_address": "127.0.0.1:0"},
    "drafter": {"address": "127.0.0.1:0", "metrics_address": "127.0.0.1:0"},
    "gateway": {"address": "127.0.0.1:0", "metrics_address": "127.0.0.1:0", "drafter_retry_s": 0.2},
}


def _shape(**extra) -> dict:
    """A BART-style config's shape; `extra` adds keys or replaces these."""
    base = dict(
        d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4, decoder_attention_heads=4,
        encoder_ffn_dim=64, decoder_ffn_dim=64, max_position_embeddings=64, dropout=0.0, attention_dropout=0.0,
        activation_dropout=0.0, forced_eos_token_id=None,
    )
    return {**base, **extra}


def _t5_shape(**extra) -> dict:
    base = dict(d_model=32, d_kv=8, num_layers=2, num_decoder_layers=2, d_ff=64, dropout_rate=0.0,
                decoder_start_token_id=0)
    return {**base, **extra}


def _bart_tokenizer(root: Path):
    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator(CORPUS, vocab_size=300, special_tokens=["<s>", "<pad>", "</s>", "<unk>", "<mask>"])
    bpe.save_model(str(root))
    return transformers.BartTokenizer(vocab=str(root / "vocab.json"), merges=str(root / "merges.txt"))


def _spm(vocab_size: int, **ids) -> spm.SentencePieceProcessor:
    out = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(CORPUS), model_writer=out, vocab_size=vocab_size, hard_vocab_limit=False,
        minloglevel=2, num_threads=1, **ids,
    )
    return spm.SentencePieceProcessor(model_proto=out.getvalue())


def _t5_tokenizer(root: Path):
    sp = _spm(150, pad_id=0, eos_id=1, unk_id=2, bos_id=-1)
    vocab = [(sp.id_to_piece(i), sp.get_score(i)) for i in range(sp.get_piece_size())]
    return transformers.T5Tokenizer(vocab=vocab, extra_ids=4)


def _marian_tokenizer(root: Path):
    sp = _spm(150)
    for name in ("source.spm", "target.spm"):
        (root / name).write_bytes(sp.serialized_model_proto())
    vocab = {"</s>": 0, "<unk>": 1}
    for i in range(sp.get_piece_size()):
        vocab.setdefault(sp.id_to_piece(i), len(vocab))
    vocab.pop("<s>", None)
    vocab = {piece: i for i, piece in enumerate(vocab)}
    vocab["<pad>"] = len(vocab)
    (root / "vocab.json").write_text(json.dumps(vocab))
    return transformers.MarianTokenizer(
        source_spm=str(root / "source.spm"), target_spm=str(root / "target.spm"), vocab=str(root / "vocab.json")
    )


def _m2m100_tokenizer(root: Path):
    sp = _spm(150)
    (root / "sentencepiece.bpe.model").write_bytes(sp.serialized_model_proto())
    vocab = {"<s>": 0, "<pad>": 1, "</s>": 2, "<unk>": 3}
    for i in range(sp.get_piece_size()):
        vocab.setdefault(sp.id_to_piece(i), len(vocab))
    (root / "vocab.json").write_text(json.dumps(vocab))
    return transformers.M2M100Tokenizer(
        vocab_file=str(root / "vocab.json"), spm_file=str(root / "sentencepiece.bpe.model"), src_lang="en",
        tgt_lang="de", language_codes="wmt21",
    )


def _build(family: str, root: Path):
    """(model, tokenizer or None) of one family, sized to its tokenizer's vocabulary."""
    t = transformers
    if family == "marian":
        tok = _marian_tokenizer(root)
        v = len(tok)
        cfg = t.MarianConfig(vocab_size=v, pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id,
                             decoder_start_token_id=tok.pad_token_id, **_shape())
        return t.MarianMTModel(cfg), tok
    if family == "bart":
        tok = _bart_tokenizer(root)
        return t.BartForConditionalGeneration(t.BartConfig(vocab_size=len(tok), **_shape())), tok
    if family == "mbart":
        return t.MBartForConditionalGeneration(t.MBartConfig(vocab_size=120, scale_embedding=True, **_shape())), None
    if family == "m2m100":
        tok = _m2m100_tokenizer(root)
        vocab = max(tok.lang_code_to_id.values()) + 1  # the language codes follow the pieces
        model = t.M2M100ForConditionalGeneration(t.M2M100Config(vocab_size=vocab, **_shape()))
        model.generation_config.forced_bos_token_id = tok.lang_code_to_id["de"]
        return model, tok
    if family == "t5":
        tok = _t5_tokenizer(root)
        cfg = t.T5Config(vocab_size=len(tok), num_heads=6, feed_forward_proj="relu", **_t5_shape())
        return t.T5ForConditionalGeneration(cfg), tok
    if family == "t5-v1.1":
        cfg = t.T5Config(vocab_size=120, num_heads=4, feed_forward_proj="gated-gelu", tie_word_embeddings=False,
                         **_t5_shape())
        return t.T5ForConditionalGeneration(cfg), None
    raise AssertionError(family)


FAMILIES = ["marian", "bart", "mbart", "m2m100", "t5", "t5-v1.1"]


@pytest.fixture(scope="module")
def imported(tmp_path_factory):
    """family -> (HF model, HF tokenizer or None, bundle directory)."""
    out = {}
    for i, family in enumerate(FAMILIES):
        root = tmp_path_factory.mktemp(family)
        model, tok = _build(family, root)
        model = scaled(model, seed=i)
        model.save_pretrained(root / "hf")
        if tok is not None:
            tok.save_pretrained(root / "hf")
        assert cli_main(["import-hf", "--model", str(root / "hf"), "--out", str(root / "bundle")]) == 0
        # The reference is the checkpoint as loaded back (Marian's sinusoids are rebuilt on load).
        reloaded = transformers.AutoModelForSeq2SeqLM.from_pretrained(str(root / "hf")).eval()
        out[family] = (reloaded, tok, root / "bundle")
    return out


def _sources(bundle, seed: int, n: int = SOURCES) -> list[list[int]]:
    cfg = bundle.config("verifier")
    specials = {cfg.pad_id, cfg.eos_id, cfg.bos_id, cfg.unk_id}
    words = [i for i in range(cfg.source_vocab_size) if i not in specials]
    rng = random.Random(seed)
    return [[rng.choice(words) for _ in range(rng.randint(1, 14))] for _ in range(n)]


def _config(**overrides) -> DecodingConfig:
    return DecodingConfig().with_overrides({"max_new_tokens": MAX_NEW, **overrides})


def _hf_beam(model, source: list[int], eos: int, forced_bos: int, width: int = 4) -> list[int]:
    """`generate`'s beam search, without the decoder start token and the EOS."""
    with torch.no_grad():
        out = model.generate(
            torch.tensor([[*source, eos]]), do_sample=False, num_beams=width,
            max_new_tokens=MAX_NEW, forced_eos_token_id=None, forced_bos_token_id=forced_bos, min_length=0,
        )[0].tolist()[1:]
    return out[: out.index(eos)] if eos in out else out


def _hf_greedy(model, source: list[int], eos: int, forced_bos: int | None = None) -> list[int]:
    # A T5 decoder deeper than its encoder overruns transformers' KV cache, which is sized by the
    # encoder's depth: generate() recomputes the whole prefix each step instead.
    use_cache = model.config.num_decoder_layers <= model.config.num_layers if "t5" in model.config.model_type else True
    with torch.no_grad():
        out = model.generate(
            torch.tensor([[*source, eos]]), do_sample=False, num_beams=1, max_new_tokens=MAX_NEW,
            forced_eos_token_id=None, forced_bos_token_id=forced_bos, min_length=0, use_cache=use_cache,
        )[0].tolist()[1:]  # without the decoder start token
    return out[: out.index(eos)] if eos in out else out  # and without the EOS, as output_ids are


def _near_tie_gap(model, source: list[int], start: int, prefix: list[int], eos: int) -> float:
    """HF's own top-2 logit gap where it chose the token after `prefix`."""
    with torch.no_grad():
        logits = model(
            input_ids=torch.tensor([[*source, eos]]), decoder_input_ids=torch.tensor([[start, *prefix]])
        ).logits[0, -1]
    top = logits.topk(2).values
    return float(top[0] - top[1])


@pytest.mark.parametrize("backend", ["torch", "onnxruntime"])
@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_equals_transformers_generate(imported, family, backend, tmp_path):
    model, _, bundle_dir = imported[family]
    _check_greedy(model, bundle_dir, backend, tmp_path, seed=len(family), label=family)


def _check_greedy(model, bundle_dir: Path, backend: str, cache: Path, seed: int, label: str, sources: int = SOURCES):
    """Greedy on `backend` equals `generate(do_sample=False, num_beams=1)`, but at a float32 near-tie."""
    bundle = load_bundle(bundle_dir)
    cfg = bundle.config("verifier")
    verifier = make_verifier(bundle, backend, cache_root=cache)
    # The checkpoint's generation settings in force, as generate() has them (Marian's banned padding).
    config = layered_defaults(bundle_decoding_defaults(bundle_dir), {"mode": "ar", "max_new_tokens": MAX_NEW})
    for source in _sources(bundle, seed=seed, n=sources):
        want = _hf_greedy(model, source, cfg.eos_id)
        got = decode(source, config, verifier).output_ids
        if got == want:
            continue
        # Where they part (one may end first: then the other's EOS was the choice there).
        at = next((i for i, (a, b) in enumerate(zip(got, want, strict=False)) if a != b), min(len(got), len(want)))
        gap = _near_tie_gap(model, source, cfg.bos_id, want[:at], cfg.eos_id)
        assert gap < NEAR_TIE, f"{label}/{backend} source {source}: ours {got} vs HF {want} (HF top-2 gap {gap:.2e})"


def _separate_vocabularies(root: Path):
    """A Marian tokenizer with separate source (150 pieces) and target (90 pieces) vocabularies; the
    special tokens have the same ids in both."""
    vocabs = {}
    for side, size in (("source", 150), ("target", 90)):
        sp = _spm(size)
        (root / f"{side}.spm").write_bytes(sp.serialized_model_proto())
        pieces = ["</s>", "<unk>", "<pad>", *(sp.id_to_piece(i) for i in range(sp.get_piece_size()))]
        vocabs[side] = {piece: i for i, piece in enumerate(p for p in dict.fromkeys(pieces) if p != "<s>")}
    (root / "vocab.json").write_text(json.dumps(vocabs["source"]))
    (root / "target_vocab.json").write_text(json.dumps(vocabs["target"]))
    tok = transformers.MarianTokenizer(
        source_spm=str(root / "source.spm"), target_spm=str(root / "target.spm"), vocab=str(root / "vocab.json"),
        target_vocab_file=str(root / "target_vocab.json"), separate_vocabs=True,
    )
    return tok, len(vocabs["source"]), len(vocabs["target"])


def _shaped(name: str, root: Path):
    """(model, tokenizer or None) of one of SHAPES."""
    t = transformers
    if name == "marian-separate-vocabularies":
        tok, source, target = _separate_vocabularies(root)
        pad = tok.pad_token_id
        cfg = t.MarianConfig(
            vocab_size=source, decoder_vocab_size=target, share_encoder_decoder_embeddings=False,
            pad_token_id=pad, eos_token_id=tok.eos_token_id, decoder_start_token_id=pad,
            **_shape(encoder_attention_heads=2, decoder_attention_heads=8, encoder_ffn_dim=96, decoder_ffn_dim=40),
        )
        return t.MarianMTModel(cfg), tok
    if name == "bart-wide-decoder":  # deeper encoder; untied head; ReLU
        cfg = t.BartConfig(vocab_size=120, tie_word_embeddings=False, activation_function="relu", **_shape(
            encoder_layers=3, decoder_layers=1, decoder_attention_heads=8, decoder_ffn_dim=112))
        return t.BartForConditionalGeneration(cfg), None
    if name == "mbart-narrow-decoder":  # deeper decoder; unscaled embeddings; tanh-approximated GELU
        cfg = t.MBartConfig(vocab_size=120, scale_embedding=False, activation_function="gelu_new", **_shape(
            encoder_layers=1, decoder_layers=3, encoder_attention_heads=8, decoder_attention_heads=2,
            encoder_ffn_dim=128, decoder_ffn_dim=48))
        return t.MBartForConditionalGeneration(cfg), None
    if name == "m2m100-untied":  # scaled embeddings off, untied head, SiLU
        cfg = t.M2M100Config(vocab_size=120, scale_embedding=False, tie_word_embeddings=False,
                             activation_function="silu", **_shape(decoder_attention_heads=2, decoder_ffn_dim=24,
                                                                  decoder_layers=3))
        return t.M2M100ForConditionalGeneration(cfg), None
    if name == "t5-deep-encoder":  # num_decoder_layers below num_layers; gated SiLU; untied head
        cfg = t.T5Config(vocab_size=120, num_heads=4, feed_forward_proj="gated-silu", tie_word_embeddings=False,
                         **_t5_shape(num_layers=3, num_decoder_layers=1))
        return t.T5ForConditionalGeneration(cfg), None
    if name == "mt5-deep-decoder":  # num_decoder_layers above num_layers (see _hf_greedy); tied head
        cfg = t.MT5Config(vocab_size=120, num_heads=2, feed_forward_proj="gated-gelu",
                          tie_word_embeddings=True, **_t5_shape(num_layers=1, num_decoder_layers=3, d_kv=12))
        return t.MT5ForConditionalGeneration(cfg), None
    raise AssertionError(name)


SHAPES = ["marian-separate-vocabularies", "bart-wide-decoder", "mbart-narrow-decoder", "m2m100-untied",
          "t5-deep-encoder", "mt5-deep-decoder"]


@pytest.fixture(scope="module")
def shaped(tmp_path_factory):
    """name -> (HF model, HF tokenizer or None, bundle directory) of the SHAPES, built once."""
    made = {}

    def get(name: str):
        if name not in made:
            root = tmp_path_factory.mktemp(name)
            model, tok = _shaped(name, root)
            scaled(model, seed=SHAPES.index(name) + 20).save_pretrained(root / "hf")
            if tok is not None:
                tok.save_pretrained(root / "hf")
            assert cli_main(["import-hf", "--model", str(root / "hf"), "--out", str(root / "bundle")]) == 0
            reloaded = transformers.AutoModelForSeq2SeqLM.from_pretrained(str(root / "hf")).eval()
            made[name] = (reloaded, tok, root / "bundle")
        return made[name]

    return get


@pytest.mark.slow  # in .ci/run's slow step: the default run stays a few minutes
@pytest.mark.parametrize("backend", ["torch", "onnxruntime"])
@pytest.mark.parametrize("name", SHAPES)
def test_every_shape_the_configs_allow_equals_generate(shaped, name, backend, tmp_path):
    """Encoder and decoder of their own head counts, FFN widths and depths, Marian's separate
    vocabularies of different sizes, tied and untied heads, scaled embeddings on and off."""
    model, _, bundle_dir = shaped(name)
    _check_greedy(model, bundle_dir, backend, tmp_path, seed=SHAPES.index(name), label=name)


def test_separate_vocabularies_take_text_and_refuse_a_target_id_as_source(shaped, tmp_path):
    """Marian with separate vocabularies: sources are encoded in the source vocabulary and outputs
    decoded in the target's, as `transformers` does; the in-process edge takes source ids up to the
    source vocabulary's size (larger than the target's) and refuses one past it."""
    from core.errors import SpecdecError

    model, tok, bundle_dir = shaped("marian-separate-vocabularies")
    bundle = load_bundle(bundle_dir)
    cfg = bundle.config("verifier")
    assert (cfg.source_vocab_size, cfg.vocab_size) == (model.config.vocab_size, model.config.decoder_vocab_size)
    for text in TEXTS + CORPUS[:10]:
        assert bundle.tokenizer.encode(text) == tok(text)["input_ids"][:-1], text
    for ids in ([5, 6, 7, 8], list(range(3, cfg.vocab_size))):
        assert bundle.tokenizer.decode(ids) == tok.decode(ids, skip_special_tokens=True), ids
    verifier = make_verifier(bundle, "torch")
    top = cfg.source_vocab_size - 1
    want = _hf_greedy(model, [top, 5, top], cfg.eos_id)
    assert decode([top, 5, top], _config(mode="ar"), verifier).output_ids == want
    with pytest.raises(SpecdecError, match="outside the vocabulary"):
        decode([top + 1], _config(mode="ar"), verifier)


def test_separate_vocabularies_through_serve_all(shaped):
    """The verifier reports its source vocabulary's size (ModelInfo.source_vocab_size): the gateway
    takes source ids past the target vocabulary and refuses one past the source's."""
    import grpc

    model, _, bundle_dir = shaped("marian-separate-vocabularies")
    cfg = load_bundle(bundle_dir).config("verifier")
    top = cfg.source_vocab_size - 1
    config = overrides_to_wire({"mode": "ar", "max_new_tokens": MAX_NEW})
    with ServiceStack("all", bundle_dir, LOOPBACK) as stack, grpc.insecure_channel(
        stack.running.addresses["gateway"]
    ) as channel:
        gateway = gateway_pb2_grpc.GatewayServiceStub(channel)
        reply = gateway.Generate(gateway_pb2.GenerateRequest(input_ids=[top, 5, top], config=config), timeout=60)
        assert list(reply.output_ids) == _hf_greedy(model, [top, 5, top], cfg.eos_id)
        with pytest.raises(grpc.RpcError) as err:
            gateway.Generate(gateway_pb2.GenerateRequest(input_ids=[top + 1], config=config), timeout=60)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "outside the vocabulary" in err.value.details()


# transformers' activations but the two with learnt parameters (refused by name).
ACTIVATION_NAMES = sorted(set(transformers.activations.ACT2FN) - {"prelu", "xielu"})


def test_every_parameter_free_activation_is_transformers_own():
    """Each activation transformers names (ACT2FN) maps to one of ours that computes it."""
    from seq2seq_models.hf_import.common import activation
    from seq2seq_models.layers import ACTIVATIONS

    x = torch.linspace(-12, 12, 2001)
    for name in ACTIVATION_NAMES:
        want = transformers.activations.ACT2FN[name](x)
        got = ACTIVATIONS[activation(name)](x)
        assert torch.allclose(got, want, atol=1e-6, rtol=1e-5), name
    assert set(ACTIVATIONS) == {activation(name) for name in ACTIVATION_NAMES}


@pytest.mark.slow  # in .ci/run's slow step: the default run stays a few minutes
@pytest.mark.parametrize("name", ACTIVATION_NAMES)
def test_a_checkpoint_of_each_activation_equals_generate(name, tmp_path):
    """A one-layer BART of each activation, on both backends (the ONNX export has each op)."""
    t = transformers
    cfg = t.BartConfig(vocab_size=60, activation_function=name, **_shape(encoder_layers=1, decoder_layers=1))
    model = scaled(t.BartForConditionalGeneration(cfg), seed=ACTIVATION_NAMES.index(name) + 40)
    model.save_pretrained(tmp_path / "hf")
    assert cli_main(["import-hf", "--model", str(tmp_path / "hf"), "--out", str(tmp_path / "bundle")]) == 0
    reloaded = t.AutoModelForSeq2SeqLM.from_pretrained(str(tmp_path / "hf")).eval()
    for backend in ("torch", "onnxruntime"):
        _check_greedy(reloaded, tmp_path / "bundle", backend, tmp_path / "onnx", seed=1, label=name, sources=3)


@pytest.mark.parametrize("family", ["bart", "t5"])
def test_lossless_modes_equal_greedy(imported, family, tmp_path):
    """IAD needs no drafter: on an imported bundle it equals greedy, fp32 and int8."""
    _, _, bundle_dir = imported[family]
    bundle = load_bundle(bundle_dir)
    for precision in ("fp32", "int8"):
        verifier = make_verifier(bundle, "onnxruntime", cache_root=tmp_path, precision=precision)
        for source in _sources(bundle, seed=3):
            greedy = decode(source, _config(mode="ar"), verifier)
            iad = decode(source, _config(mode="iad", k=4), verifier)
            assert iad.output_ids == greedy.output_ids, (family, precision, source)


TEXTS = [
    "The quick brown fox jumps over the lazy dog.",
    "Hello world, it's me again!",
    "  spaces   and\ttabs ",
    "Я хочу подякувати вам.",
    "numbers 12345 and symbols #@%",
]


def test_a_target_language_is_the_forced_first_token(imported):
    """M2M100: the checkpoint's forced_bos_token_id by default, or the code a request names; greedy
    (and IAD) with it equal `generate` with the same forced token; sources framed `__en__ ... </s>`."""
    model, tok, bundle_dir = imported["m2m100"]
    bundle = load_bundle(bundle_dir)
    ours = bundle.tokenizer
    assert ours.first_tokens() == [tok.lang_code_to_id["de"]]
    assert ours.first_tokens("ru") == [tok.lang_code_to_id["ru"]]
    with pytest.raises(ValueError, match="unknown target language 'xx'"):
        ours.first_tokens("xx")
    verifier = make_verifier(bundle, "torch")
    cfg = bundle.config("verifier")
    for text in TEXTS[:3]:
        source = ours.encode(text)
        assert source == tok(text)["input_ids"][:-1] and source[0] == tok.lang_code_to_id["en"]
        for lang in ("", "ru"):
            first = ours.first_tokens(lang)
            want = _hf_greedy(model, source, cfg.eos_id, forced_bos=first[0])
            for mode in ("ar", "iad"):
                got = decode(source, _config(mode=mode, k=4), verifier, prefix=first).output_ids
                assert got == want, (text, lang, mode)
            beam = decode(source, _config(mode="beam", num_beams=4), verifier, prefix=first).output_ids
            assert beam == _hf_beam(model, source, cfg.eos_id, forced_bos=first[0]), (text, lang)


@pytest.mark.parametrize("family", ["bart", "t5", "marian", "m2m100"])
def test_text_round_trips_as_transformers(imported, family):
    _, tok, bundle_dir = imported[family]
    ours = load_bundle(bundle_dir).tokenizer
    eos = tok.eos_token_id
    for text in TEXTS + CORPUS[:20]:
        want = tok(text)["input_ids"]
        assert want[-1] == eos
        assert ours.encode(text) == want[:-1], (family, text)
        assert ours.decode(want) == tok.decode(want, skip_special_tokens=True), (family, text)
    rng = random.Random(0)
    for _ in range(20):
        ids = [rng.randrange(len(tok)) for _ in range(rng.randint(1, 12))]
        assert ours.decode(ids) == tok.decode(ids, skip_special_tokens=True), (family, ids)


@pytest.fixture(scope="module")
def pair(imported, tmp_path_factory) -> Path:
    """The BART verifier with a one-layer BART of its vocabulary as AR drafter."""
    root = tmp_path_factory.mktemp("pair")
    model, tok, _ = imported["bart"]
    small = scaled(transformers.BartForConditionalGeneration(transformers.BartConfig(
        vocab_size=len(tok), **{**_shape(), "encoder_layers": 1, "decoder_layers": 1})), seed=11)
    model.save_pretrained(root / "verifier")
    tok.save_pretrained(root / "verifier")
    small.save_pretrained(root / "small")
    assert cli_main(["import-hf", "--model", str(root / "verifier"), "--ar-drafter", str(root / "small"),
                     "--out", str(root / "bundle")]) == 0
    return root / "bundle"


def test_an_ar_drafter_of_the_same_vocabulary_runs_mjsd_sampling_and_gad(pair):
    bundle = load_bundle(pair)
    verifier = make_verifier(bundle, "torch")
    drafter = make_drafter(bundle, "torch")
    for source in _sources(bundle, seed=5):
        greedy = decode(source, _config(mode="ar"), verifier)
        # At threshold 1 no drafted token passes, so every token is the verifier's own argmax.
        strict = decode(source, _config(mode="mjsd", gamma=3, num_beams=2, threshold=1.0), verifier, drafter)
        assert strict.output_ids == greedy.output_ids
        mjsd = decode(source, _config(mode="mjsd", gamma=3, num_beams=2, threshold=0.2), verifier, drafter)
        assert mjsd.stats.drafted_tokens > 0 and 0 < len(mjsd.output_ids) <= MAX_NEW
        sampled = decode(source, _config(mode="spec", gamma=3, temperature=0.8, seed=1), verifier, drafter)
        assert 0 < len(sampled.output_ids) <= MAX_NEW
        # Without a NAR drafter, GAD's blocks are the AR drafter's greedy tokens: still greedy's output.
        gad = decode(source, _config(mode="gad", k=4), verifier, drafter)
        assert gad.output_ids == greedy.output_ids
        assert gad.stats.drafted_tokens > 0


def test_int8_gad_with_the_ar_drafter_equals_int8_greedy(pair, tmp_path):
    """On ONNX Runtime, int8 verifier (and the AR drafter's own export): GAD equals int8 greedy."""
    bundle = load_bundle(pair)
    verifier = make_verifier(bundle, "onnxruntime", cache_root=tmp_path, precision="int8")
    drafter = make_drafter(bundle, "onnxruntime", cache_root=tmp_path, precision="int8")
    for source in _sources(bundle, seed=7):
        greedy = decode(source, _config(mode="ar"), verifier)
        gad = decode(source, _config(mode="gad", k=5), verifier, drafter)
        assert gad.output_ids == greedy.output_ids and gad.stats.drafted_tokens > 0


def test_gad_with_the_verifier_as_its_own_ar_drafter_accepts_whole_blocks(imported, tmp_path):
    """The classic draft-model check: a drafter equal to the verifier has every drafted token accepted."""
    model, tok, _ = imported["t5"]
    model.save_pretrained(tmp_path / "t5")
    tok.save_pretrained(tmp_path / "t5")
    out = tmp_path / "self"
    assert cli_main(["import-hf", "--model", str(tmp_path / "t5"), "--ar-drafter", str(tmp_path / "t5"),
                     "--out", str(out)]) == 0
    bundle = load_bundle(out)
    verifier, drafter = make_verifier(bundle, "torch"), make_drafter(bundle, "torch")
    for source in _sources(bundle, seed=9):
        greedy = decode(source, _config(mode="ar"), verifier)
        gad = decode(source, _config(mode="gad", k=4), verifier, drafter)
        assert gad.output_ids == greedy.output_ids
        assert gad.stats.accepted_tokens == gad.stats.drafted_tokens > 0


def test_a_drafter_of_another_vocabulary_is_one_line(imported, tmp_path, capsys):
    t = transformers
    other = t.BartForConditionalGeneration(t.BartConfig(vocab_size=77, **_shape()))
    other.save_pretrained(tmp_path / "other")
    model = imported["bart"][0]
    model.save_pretrained(tmp_path / "verifier")
    capsys.readouterr()
    code = cli_main(["import-hf", "--model", str(tmp_path / "verifier"), "--ar-drafter", str(tmp_path / "other"),
                     "--out", str(tmp_path / "out")])
    err = capsys.readouterr().err.strip()
    assert code == 2
    assert len(err.splitlines()) == 1 and "another vocabulary" in err and "vocab_size 77" in err, err


def test_an_unsupported_model_type_is_one_line(tmp_path, capsys):
    (tmp_path / "gpt").mkdir()
    (tmp_path / "gpt" / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    code = cli_main(["import-hf", "--model", str(tmp_path / "gpt"), "--out", str(tmp_path / "out")])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1 and "'gpt2'" in err, err


@pytest.mark.parametrize("which", ["verifier alone", "with an AR drafter"])
def test_lossless_modes_through_serve_all(imported, pair, which):
    """`serve all` on an imported bundle: every lossless mode it can run equals in-process greedy,
    by text and by ids; without a drafter, a drafter mode runs as plain AR and says it is degraded."""
    import grpc

    _, tok, bundle_dir = imported["bart"]
    bundle_dir = bundle_dir if which == "verifier alone" else pair
    bundle = load_bundle(bundle_dir)
    verifier = make_verifier(bundle, "torch")
    modes = {"ar": {}, "iad": {"k": 4}} if which == "verifier alone" else {"ar": {}, "iad": {"k": 4}, "gad": {"k": 4}}
    with ServiceStack("all", bundle_dir, LOOPBACK) as stack, grpc.insecure_channel(
        stack.running.addresses["gateway"]
    ) as channel:
        gateway = gateway_pb2_grpc.GatewayServiceStub(channel)
        for text in TEXTS[:3]:
            ids = bundle.tokenizer.encode(text)
            want = decode(ids, _config(mode="ar"), verifier).output_ids
            for mode, extra in modes.items():
                config = overrides_to_wire({"mode": mode, "max_new_tokens": MAX_NEW, **extra})
                reply = gateway.Generate(gateway_pb2.GenerateRequest(text=text, config=config), timeout=60)
                assert list(reply.output_ids) == want, (mode, text)
                assert reply.text == tok.decode(want, skip_special_tokens=True)
                by_ids = gateway.Generate(gateway_pb2.GenerateRequest(input_ids=ids, config=config), timeout=60)
                assert list(by_ids.output_ids) == want, (mode, text)
        if which == "verifier alone":
            config = overrides_to_wire({"mode": "gad", "k": 4, "max_new_tokens": MAX_NEW})
            reply = gateway.Generate(gateway_pb2.GenerateRequest(text=TEXTS[0], config=config), timeout=60)
            assert reply.stats.degraded
            greedy = decode(bundle.tokenizer.encode(TEXTS[0]), _config(mode="ar"), verifier)
            assert list(reply.output_ids) == greedy.output_ids


def test_a_target_language_through_serve_all_and_decode(imported, tmp_path, capsys, monkeypatch):
    """The request field (and `--target-lang`) picks the forced first token; an unknown code is
    INVALID_ARGUMENT with the codes the model has; a model without codes refuses any."""
    import grpc

    model, tok, bundle_dir = imported["m2m100"]
    cfg = load_bundle(bundle_dir).config("verifier")
    with ServiceStack("all", bundle_dir, LOOPBACK) as stack, grpc.insecure_channel(
        stack.running.addresses["gateway"]
    ) as channel:
        gateway = gateway_pb2_grpc.GatewayServiceStub(channel)
        for lang in ("", "ru"):
            forced = tok.lang_code_to_id[lang or "de"]
            for text in TEXTS[:2]:
                want = _hf_greedy(model, tok(text)["input_ids"][:-1], cfg.eos_id, forced_bos=forced)
                config = overrides_to_wire({"mode": "iad", "k": 4, "max_new_tokens": MAX_NEW})
                request = gateway_pb2.GenerateRequest(text=text, target_lang=lang, config=config)
                assert list(gateway.Generate(request, timeout=60).output_ids) == want, (lang, text)
                streamed = [i for chunk in gateway.GenerateStream(request, timeout=60) for i in chunk.output_ids]
                assert streamed == want, (lang, text)
        # Beam search starts from the forced token too, and streams it first.
        want = _hf_beam(model, tok(TEXTS[1])["input_ids"][:-1], cfg.eos_id, forced_bos=tok.lang_code_to_id["ru"])
        config = overrides_to_wire({"mode": "beam", "num_beams": 4, "max_new_tokens": MAX_NEW})
        request = gateway_pb2.GenerateRequest(text=TEXTS[1], target_lang="ru", config=config)
        assert list(gateway.Generate(request, timeout=60).output_ids) == want
        assert [i for chunk in gateway.GenerateStream(request, timeout=60) for i in chunk.output_ids] == want
        # KServe: the same choice as a request parameter, through the real tritonclient.
        import numpy as np
        import tritonclient.grpc as triton_grpc

        text_in = triton_grpc.InferInput("TEXT", [1], "BYTES")
        text_in.set_data_from_numpy(np.array([TEXTS[0].encode()], dtype=np.object_))
        with triton_grpc.InferenceServerClient(stack.running.addresses["gateway"]) as client:
            reply = client.infer("specdec", [text_in], parameters={"target_lang": "ru", "mode": "ar",
                                                                    "max_new_tokens": MAX_NEW})
        forced = tok.lang_code_to_id["ru"]
        want = _hf_greedy(model, tok(TEXTS[0])["input_ids"][:-1], cfg.eos_id, forced_bos=forced)
        assert reply.as_numpy("OUTPUT_IDS").tolist() == want
        with pytest.raises(grpc.RpcError) as err:
            gateway.Generate(gateway_pb2.GenerateRequest(text=TEXTS[0], target_lang="xx"), timeout=60)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "'xx'" in err.value.details()
        assert "ru" in err.value.details() or "de" in err.value.details()
    monkeypatch.setattr("sys.stdin", io.StringIO(TEXTS[0] + "\n"))
    capsys.readouterr()
    assert cli_main(["decode", "--bundle", str(bundle_dir), "--backend", "torch", "--mode", "iad",
                     "--target-lang", "ru", "--max-new-tokens", str(MAX_NEW)]) == 0
    record = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    forced = tok.lang_code_to_id["ru"]
    assert record["output_ids"] == _hf_greedy(model, tok(TEXTS[0])["input_ids"][:-1], cfg.eos_id, forced_bos=forced)
    t5_dir = imported["t5"][2]
    monkeypatch.setattr("sys.stdin", io.StringIO(TEXTS[0] + "\n"))
    args = ["decode", "--bundle", str(t5_dir), "--backend", "torch", "--mode", "ar", "--target-lang", "ru"]
    assert cli_main(args) == 2
    assert "no target languages" in capsys.readouterr().err
