"""A checkpoint directory's files, checked before transformers reads them, so that a broken one is
one line naming the file and what is wrong with it (`BadCheckpoint`), never a traceback: every
JSON file parses, the weights exist, a safetensors file's header is whole and covers the file, and
a pickle checkpoint (pytorch_model.bin) is read with `weights_only=True` only: one that holds
anything but tensors is refused, and nothing in it runs."""

from __future__ import annotations

import json
import pickle
import re
import warnings
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open

from seq2seq_models.hf_import.common import BadCheckpoint, first_line

CONFIG = "config.json"
SAFETENSORS, SAFETENSORS_INDEX = "model.safetensors", "model.safetensors.index.json"
PICKLE, PICKLE_INDEX = "pytorch_model.bin", "pytorch_model.bin.index.json"


def read_json(path: Path) -> Any:
    """A JSON file's content; a file that is not JSON is a BadCheckpoint naming it and where it breaks."""
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except UnicodeDecodeError as exc:
        raise BadCheckpoint(f"{path}: not UTF-8 text ({exc.reason} at byte {exc.start})") from None
    except json.JSONDecodeError as exc:
        raise BadCheckpoint(f"{path}: not valid JSON ({exc.msg} at line {exc.lineno} column {exc.colno})") from None


def read_config(model_dir: Path) -> dict[str, Any]:
    path = model_dir / CONFIG
    if not path.is_file():
        raise FileNotFoundError(f"{model_dir} is not a save_pretrained directory (no {CONFIG})")
    config = read_json(path)
    if not isinstance(config, dict):
        raise BadCheckpoint(f"{path}: not a JSON object")
    return config


def check_files(model_dir: Path) -> Path:
    """Check every JSON file and the weights of `model_dir`; returns the weights' file (or their
    index, for a sharded checkpoint), which the errors about the weights name."""
    for path in sorted(model_dir.glob("*.json")):
        read_json(path)
    weights, shards = _weights(model_dir)
    for shard in shards:
        if not shard.is_file():
            raise BadCheckpoint(f"{weights}: names the shard {shard.name}, which is missing")
        if shard.suffix == ".safetensors":
            _check_safetensors(shard)
        else:
            _check_pickle(shard)
    return weights


def _weights(model_dir: Path) -> tuple[Path, list[Path]]:
    """(the file errors name, the files holding tensors): safetensors first, as transformers prefers."""
    for single, index in ((SAFETENSORS, SAFETENSORS_INDEX), (PICKLE, PICKLE_INDEX)):
        if (model_dir / single).is_file():
            return model_dir / single, [model_dir / single]
        if (model_dir / index).is_file():
            weight_map = read_json(model_dir / index).get("weight_map", {})
            return model_dir / index, [model_dir / name for name in sorted(set(weight_map.values()))]
    raise BadCheckpoint(f"{model_dir}: no weights ({SAFETENSORS} or {PICKLE}, or a sharded index of either)")


def _check_safetensors(path: Path) -> None:
    """The header parses and its tensors cover the file (a file cut short does not)."""
    try:
        with safe_open(str(path), framework="pt") as f:
            f.keys()
    except SafetensorError as exc:
        raise BadCheckpoint(f"{path}: truncated or not a safetensors file ({first_line(exc)})") from None


def _check_pickle(path: Path) -> None:
    """Read with weights_only=True, which rebuilds tensors and plain containers and refuses any other
    object before it is made: a pickle that would run code is refused, and nothing in it runs."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # torch's notes on pickle protocols: not for the user
            torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        # torch names what it refused: "unsupported GLOBAL posix.system", or a pickle opcode.
        found = re.search(r"(GLOBAL [\w.]+|Unsupported operand \d+)", str(exc))
        detail = f" ({found.group(1)})" if found else ""
        raise BadCheckpoint(f"{path}: refused: it holds more than tensors{detail}; pickles are read with "
                            f"weights_only=True only, and nothing in this one ran") from None
    except (EOFError, OSError, RuntimeError, ValueError) as exc:
        raise BadCheckpoint(f"{path}: truncated or not a PyTorch checkpoint ({first_line(exc)})") from None
