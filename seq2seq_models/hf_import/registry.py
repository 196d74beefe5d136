"""One converter per family, keyed by the `model_type` of the checkpoint's config.json (as
CTranslate2 keeps one loader per family): a converter takes the transformers config, its generation
config, the float32 state dict and the NAR drafter's mask id, and returns specdec's `ModelConfig`
and state dict. A new family is a module with `MODEL_TYPES` and `convert`, listed here."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from seq2seq_models.config import ModelConfig
from seq2seq_models.hf_import import bart, m2m100, marian, t5
from seq2seq_models.hf_import.common import UnsupportedModel
from seq2seq_models.hf_import.files import read_config

Converter = Callable[[Any, Any, dict, "int | None"], tuple[ModelConfig, dict]]

CONVERTERS: dict[str, Converter] = {
    model_type: family.convert for family in (marian, bart, m2m100, t5) for model_type in family.MODEL_TYPES
}
SUPPORTED = tuple(CONVERTERS)


def converter(model_type: str) -> Converter:
    if model_type not in CONVERTERS:
        raise UnsupportedModel(
            f"model_type {model_type!r} is not supported; import-hf reads {', '.join(SUPPORTED)}"
        )
    return CONVERTERS[model_type]


def read_model_type(model_dir: str | Path) -> str:
    """The checkpoint's `model_type`, refused unless a converter takes it."""
    model_type = read_config(Path(model_dir)).get("model_type", "")
    converter(model_type)
    return str(model_type)
