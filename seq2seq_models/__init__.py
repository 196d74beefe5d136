"""Encoder-decoder Transformers (AR verifier, NAR block drafter, small AR drafter),
their rollback KV cache, model bundles and the SentencePiece tokenizer wrapper."""

from seq2seq_models.bundle import ModelBundle, load_bundle, save_bundle
from seq2seq_models.config import ModelConfig
from seq2seq_models.tokenizer import Tokenizer
from seq2seq_models.transformer import DecoderCache, Seq2SeqTransformer

__all__ = [
    "DecoderCache",
    "ModelBundle",
    "ModelConfig",
    "Seq2SeqTransformer",
    "Tokenizer",
    "load_bundle",
    "save_bundle",
]
