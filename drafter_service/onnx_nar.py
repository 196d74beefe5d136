"""The NAR block drafter on ONNX Runtime: one graph call per draft.

Graphs come from `seq2seq_models.onnx_export` (role "nar_drafter", exported on demand and cached by
bundle fingerprint). A draft feeds the committed tokens the cache does not hold yet followed by
k [MASK]s, in one call: the committed tokens attend causally, the masks see everything, and the
graph returns the masks' argmax ids. The torch drafter makes two passes for the same thing (append,
then masks), and in eager mode each pass is a few dozen small ops; on CPU this is the cost that
decides whether GAD beats greedy (BENCHMARKS.md, "where the time goes").

The past K/V are kept as the last call returned them, masks included; the graph slices the past to
`past_len`, so the masks' K/V are simply never counted again, and a rollback is a smaller
`past_len` with no copy. Only the CPU execution provider is used: on a GPU machine the drafter's
torch backend already keeps its cache on the device.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from core.checks import check_source, check_sync
from seq2seq_models.onnx_export import OnnxExport, bundle_cache_root, export_model
from seq2seq_models.ort_session import inference_session
from seq2seq_models.transformer import Seq2SeqTransformer


class OnnxNarDrafter:
    """The exported NAR drafter; `open` gives the per-source state a `DrafterSession` drafts with."""

    backend = "onnxruntime"

    def __init__(
        self,
        model: Seq2SeqTransformer,
        fingerprint: str | None = None,
        cache_root: str | Path | None = None,
        intra_op_threads: int | None = None,
    ) -> None:
        self.config = model.config
        self.export: OnnxExport = export_model(model, "nar_drafter", fingerprint, cache_root)
        providers = ["CPUExecutionProvider"]
        self._encoder = inference_session(self.export.encoder, intra_op_threads, providers)
        self._decoder = inference_session(self.export.decoder, intra_op_threads, providers)

    @classmethod
    def from_bundle(cls, bundle: Any, cache_root: str | Path | None = None, **kwargs: Any) -> OnnxNarDrafter:
        root = cache_root if cache_root is not None else bundle_cache_root(bundle.path)
        return cls(bundle.nar_drafter, fingerprint=bundle.fingerprint, cache_root=root, **kwargs)

    def open(self, source_ids: list[int]) -> OnnxNarState:
        return OnnxNarState(self, source_ids)

    def encode(self, src: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        k, v = self._encoder.run(None, {"src": src})
        return k, v

    def decode(
        self, tokens: np.ndarray, past_len: int, past: tuple[np.ndarray, np.ndarray],
        cross: tuple[np.ndarray, np.ndarray], mask_from: int,
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        present_k, present_v, ids = self._decoder.run(None, {
            "tokens": tokens,
            "past_len": np.array(past_len, dtype=np.int64),
            "past_k": past[0],
            "past_v": past[1],
            "cross_k": cross[0],
            "cross_v": cross[1],
            "mask_from": np.array(mask_from, dtype=np.int64),
        })
        return present_k, present_v, ids


class OnnxNarState:
    """The NAR drafter's view of one source and the client's output prefix (the `PrefixState`
    protocol: `tokens`, `max_tokens`, `sync`), drafting with `draft_block`.

    `sync` only records the new prefix; the tokens the cache lacks are fed with the next draft's
    masks, so a step costs one graph call whatever it appends.
    """

    def __init__(self, drafter: OnnxNarDrafter, source_ids: list[int]) -> None:
        cfg = drafter.config
        check_source(source_ids, cfg)
        self._drafter = drafter
        self._config = cfg
        self.tokens: list[int] = []  # the client's output prefix after BOS
        self._cross = drafter.encode(np.array([[*source_ids, cfg.eos_id]], dtype=np.int64))
        shape = (cfg.decoder_layers, 1, cfg.n_heads, 0, cfg.d_model // cfg.n_heads)
        self._past = (np.zeros(shape, np.float32), np.zeros(shape, np.float32))
        self._valid = 0  # leading positions (BOS first) whose K/V in the past are of real tokens

    @property
    def max_tokens(self) -> int:
        return self._config.max_len - 1

    @property
    def cache_bytes(self) -> int:
        return sum(int(t.nbytes) for t in (*self._past, *self._cross))

    def sync(self, committed_len: int, append_ids: list[int]) -> None:
        check_sync(committed_len, len(self.tokens), append_ids, 0, self._config)
        self.tokens = [*self.tokens[:committed_len], *append_ids]
        self._valid = min(self._valid, 1 + committed_len)

    def draft_block(self, k: int) -> list[int]:
        cfg = self._config
        fed = [cfg.bos_id, *self.tokens][self._valid :]
        block = np.array([[*fed, *([cfg.mask_id] * k)]], dtype=np.int64)
        present_k, present_v, ids = self._drafter.decode(block, self._valid, self._past, self._cross, len(fed))
        self._past = (present_k, present_v)
        self._valid = 1 + len(self.tokens)
        return ids.tolist()
