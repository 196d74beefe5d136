"""A checkpoint read as specdec's config and weights: its files checked (`files`), loaded by
transformers and checked to fit its config, converted by its family's converter from the registry,
with the checkpoint's decoding settings; and the model built from them."""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForSeq2SeqLM
from transformers.utils import logging as hf_logging

from seq2seq_models.config import ModelConfig
from seq2seq_models.hf_import.common import BadCheckpoint, UnsupportedModel, first, first_line
from seq2seq_models.hf_import.files import CONFIG, check_files
from seq2seq_models.hf_import.generation import GenerationDefaults, generation_defaults
from seq2seq_models.hf_import.registry import converter, read_model_type

# How many names of missing or misfitting weights an error shows.
SHOWN = 3


@dataclass
class ImportedModel:
    config: ModelConfig
    state: dict[str, torch.Tensor]
    model_type: str
    # Decoding settings from config.json / generation_config.json (forced first token, ...).
    generation: dict[str, Any]
    # The generation config's settings as decoding defaults, and those not taken (`generation`).
    defaults: GenerationDefaults


def import_checkpoint(model_dir: str | Path, mask_id: int | None = None) -> ImportedModel:
    """Read `model_dir` with transformers and return specdec's config and float32 state dict."""
    model_dir = Path(model_dir)
    model_type = read_model_type(model_dir)
    weights = check_files(model_dir)
    hf = _load(model_dir, weights)
    state = {k: v.detach().float() for k, v in hf.state_dict().items()}
    config, ours = converter(model_type)(hf.config, hf.generation_config, state, mask_id)
    return ImportedModel(config=config, state=ours, model_type=model_type, generation=_generation(hf),
                         defaults=generation_defaults(hf.generation_config))


def build_model(imported: ImportedModel):  # -> Seq2SeqTransformer
    from seq2seq_models.transformer import Seq2SeqTransformer

    model = Seq2SeqTransformer(imported.config)
    missing, unexpected = model.load_state_dict(imported.state, strict=False)
    if missing or unexpected:
        raise RuntimeError(f"weight mapping incomplete: missing {missing}, unexpected {unexpected}")
    return model.eval()


def check_same_vocabulary(verifier: ImportedModel, drafter: ImportedModel, drafter_dir: str | Path) -> None:
    """An AR drafter must speak the verifier's token ids: same vocabulary size and special ids."""
    v, d = verifier.config, drafter.config
    keys = ("vocab_size", "source_vocab_size", "pad_id", "bos_id", "eos_id")
    differ = [k for k in keys if getattr(v, k) != getattr(d, k)]
    if differ:
        detail = ", ".join(f"{k} {getattr(d, k)} vs {getattr(v, k)}" for k in differ)
        raise UnsupportedModel(f"{drafter_dir} has another vocabulary than the verifier ({detail})")


def _load(model_dir: Path, weights: Path) -> Any:
    """transformers' model of the checkpoint, refused unless every weight fits the config: a weight
    missing, of another shape, or without a place would otherwise be randomly initialised, cut off or
    ignored."""
    # The command's own output is one line; transformers' progress bars, notices and warnings are not.
    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            hf, info = AutoModelForSeq2SeqLM.from_pretrained(
                str(model_dir), dtype=torch.float32, output_loading_info=True, ignore_mismatched_sizes=True,
            )
    except Exception as exc:  # whatever transformers raises, the user gets one line
        raise BadCheckpoint(f"{model_dir}: transformers cannot load the checkpoint ({first_line(exc)})") from None
    problems = [f"{name} is {list(found)}, the config makes {list(made)}"
                for name, found, made in sorted(info.get("mismatched_keys", []))]
    problems += [_count(names, kind) for kind, names in (("missing", info.get("missing_keys")),
                 ("without a place in the model", info.get("unexpected_keys"))) if names]
    if problems:
        more = f"; and {len(problems) - 1} more problems" if len(problems) > 1 else ""
        raise BadCheckpoint(f"{weights}: the weights do not fit {CONFIG}: {problems[0]}{more}")
    return hf.eval()


def _count(names: Any, kind: str) -> str:
    shown = ", ".join(sorted(names)[:SHOWN]) + (", ..." if len(names) > SHOWN else "")
    return f"{len(names)} weights {kind} ({shown})"


def _generation(hf: Any) -> dict[str, Any]:
    """The decoding settings greedy must honour (a forced first token)."""
    return {"forced_bos_token_id": first(hf.generation_config, hf.config, "forced_bos_token_id")}
