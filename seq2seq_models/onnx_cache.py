"""Where ONNX exports live and how one is found, without torch: the serving path opens exports
(`seq2seq_models.onnx_model`) through this module, and only making one (`seq2seq_models.onnx_export`)
needs torch. An export is a directory per bundle fingerprint and role, complete once its manifest
is written (exports are written aside and renamed into place).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from core.logits_processors import LOGIT_PROCESSING_INPUTS, PROCESSING_INPUTS
from seq2seq_models.row_cache import BATCH_INPUTS

OPSET = 17
EXPORT_FORMAT = 12  # bump when the graphs' interface changes, so stale caches are not reused
CACHE_ENV = "SPECDEC_ONNX_CACHE"
ENCODER_FILE = "encoder.onnx"
DECODER_FILE = "decoder.onnx"
BATCH_DECODER_FILE = "decoder_batch.onnx"
STEP_DECODER_FILE = "decoder_step.onnx"
PROCESSING_DECODER_FILE = "decoder_processing.onnx"
MANIFEST_FILE = "manifest.json"
USER_CACHE = Path.home() / ".cache" / "specdec" / "onnx"

ENCODER_INPUTS = ["src", "src_mask"]
ENCODER_OUTPUTS = ["cross_k", "cross_v"]
# The one-row decoders of the verifier and the NAR drafter read a row's slot of a pool
# (`row_cache.KVPool`): one K/V input per layer (`row_cache.layer_inputs`), past and source masked
# to `past_len` and `src_len`; they return the block's own K/V.
ROW_INPUTS = ["tokens", "past_len", "past_k", "past_v", "cross_k", "cross_v", "src_len"]
DECODER_INPUTS = [*ROW_INPUTS, "head_from", "targets", "top_k"]
# The verifier's decoders with logits processors: the batched one takes all of them (PROCESSING_INPUTS,
# skipped by an If where none acts); a lone row has a graph of its own for them, taking those of
# logit-space rows (LOGIT_PROCESSING_INPUTS), so that its plain graph has not a node more.
PROCESSING_DECODER_INPUTS = [*DECODER_INPUTS, *LOGIT_PROCESSING_INPUTS]
DECODER_OUTPUTS = ["block_k", "block_v", "topk_logprobs", "topk_ids", "target_logprobs"]
BATCH_DECODER_INPUTS = [*BATCH_INPUTS, "targets", "top_k", *PROCESSING_INPUTS]
BATCH_DECODER_OUTPUTS = ["block_k", "block_v", "topk_logprobs", "topk_ids", "target_logprobs"]
NAR_DECODER_INPUTS = [*ROW_INPUTS, "mask_from"]
NAR_DECODER_OUTPUTS = ["block_k", "block_v", "draft_ids"]
NAR_BATCH_DECODER_OUTPUTS = ["block_k", "block_v", "draft_ids"]
# Every role has an export: the AR drafter's decoders end in the logits of the wanted rows; its
# one-row decoder takes the past stacked over the layers and returns the present (past and block).
ROLES = ("verifier", "nar_drafter", "ar_drafter")
AR_DECODER_INPUTS = ["tokens", "past_len", "past_k", "past_v", "cross_k", "cross_v"]
AR_DECODER_OUTPUTS = ["present_k", "present_v", "logits"]
AR_BATCH_DECODER_OUTPUTS = ["block_k", "block_v", "logits"]


@dataclass(frozen=True)
class OnnxExport:
    directory: Path
    fingerprint: str
    reused: bool  # True when the files were already in the cache

    @property
    def encoder(self) -> Path:
        return self.directory / ENCODER_FILE

    @property
    def decoder(self) -> Path:
        return self.directory / DECODER_FILE

    @property
    def processing_decoder(self) -> Path | None:
        """The verifier's one-row decoder with logits processors."""
        path = self.directory / PROCESSING_DECODER_FILE
        return path if path.is_file() else None

    @property
    def step_decoder(self) -> Path | None:
        """The verifier's batched decoder for one-token blocks (AR steps)."""
        path = self.directory / STEP_DECODER_FILE
        return path if path.is_file() else None

    @property
    def batch_decoder(self) -> Path | None:
        """The ragged batched decoder (verifier and NAR drafter exports)."""
        path = self.directory / BATCH_DECODER_FILE
        return path if path.is_file() else None


def export_dir(cache_root: Path, fingerprint: str, role: str = "verifier") -> Path:
    # A bundle's fingerprint covers all its models, so the role is part of the name.
    return cache_root / f"{fingerprint[:16]}-{role}-v{EXPORT_FORMAT}"


def default_cache_root(bundle_path: Path) -> Path:
    """`$SPECDEC_ONNX_CACHE`, else `<bundle>/onnx` (the bundle's optional ONNX exports, ARCHITECTURE.md,
    "Models and training")."""
    env = os.environ.get(CACHE_ENV)
    return Path(env) if env else Path(bundle_path) / "onnx"


def bundle_cache_root(bundle_path: Path) -> Path:
    """`default_cache_root`, or the user's cache when that is not writable (a read-only install)."""
    root = default_cache_root(bundle_path)
    probe = root if root.exists() else root.parent
    return root if os.access(probe, os.W_OK) else USER_CACHE


def loose_cache_root() -> Path:
    """Where exports of models that came without a bundle go: `$SPECDEC_ONNX_CACHE` or the user's cache."""
    return Path(os.environ.get(CACHE_ENV, USER_CACHE))




def cached_export(cache_root: Path, fingerprint: str, role: str) -> OnnxExport | None:
    """The complete export of `role` for `fingerprint` under `cache_root` (this format), or None."""
    directory = export_dir(Path(cache_root), fingerprint, role)
    manifest = directory / MANIFEST_FILE
    if not manifest.is_file():
        return None
    data = json.loads(manifest.read_text())
    if data.get("fingerprint") != fingerprint or data.get("format") != EXPORT_FORMAT:
        return None
    return OnnxExport(directory, fingerprint, reused=True)


def find_export(roots: Iterable[Path], fingerprint: str, role: str) -> OnnxExport | None:
    """The first of `roots` holding a complete export of `role` for `fingerprint`."""
    for root in roots:
        export = cached_export(root, fingerprint, role)
        if export is not None:
            return export
    return None
