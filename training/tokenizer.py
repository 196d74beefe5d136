"""The bundle's shared SentencePiece tokenizer, trained on the train split's sources and targets."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from seq2seq_models.tokenizer import Tokenizer, train_tokenizer
from training.data import TextPair

TOKENIZER_FILE = "tokenizer.model"


def train_shared_tokenizer(
    pairs: Sequence[TextPair], out_dir: str | Path, vocab_size: int = 8000, model_type: str = "unigram"
) -> Tokenizer:
    """Train on sources and targets together (one vocabulary for both sides); skipped when the
    model file exists. Targets repeat most of their source, which is fine: both are real text."""
    path = Path(out_dir) / TOKENIZER_FILE
    if not path.is_file():
        lines = [p.source for p in pairs] + [p.target for p in pairs]
        model = train_tokenizer(lines, vocab_size=vocab_size, model_type=model_type)
        tmp = path.with_suffix(".tmp")
        tmp.write_bytes(model)
        tmp.replace(path)
    return Tokenizer.load(path)
