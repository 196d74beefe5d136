"""The verifier on ONNX Runtime: the same `Verifier`/`VerifierSession` contract as the torch backend.

Graphs come from `seq2seq_models.onnx_export` (exported on demand, cached by fingerprint). A
step is one decoder call: the block `append_ids + draft_ids` against the cached past, with the
fused head's outputs for the rows that predict d_1..d_n and the token past the draft.

Rollback: the past K/V tensors are kept as the last call returned them, and the graph slices them
to `past_len`; cutting the cache is just passing a smaller start position, with no copy. When a
step appends nothing, the row that predicts d_1 belongs to a position already in the cache; instead
of keeping every position's hidden state, that one position is re-fed (its K/V are recomputed
identically), so a step always is a single graph call whose head rows start inside the block.

CPU execution provider by default. With onnxruntime-gpu and a visible GPU, the CUDA provider is used
with I/O binding: past and cross-attention K/V stay on the device between steps and only the
top-k rows come back to the host.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import numpy as np

from core.checks import check_draft, check_source, check_sync
from core.interfaces import VerifyResult
from seq2seq_models.config import ModelConfig
from seq2seq_models.onnx_export import OnnxExport, bundle_cache_root, export_model
from seq2seq_models.ort_session import cuda_available, inference_session
from seq2seq_models.transformer import Seq2SeqTransformer

Device = Literal["auto", "cpu", "cuda"]


class OnnxVerifier:
    """In-process verifier running the exported graphs on ONNX Runtime."""

    backend = "onnxruntime"

    def __init__(
        self,
        model: Seq2SeqTransformer,
        fingerprint: str | None = None,
        cache_root: str | Path | None = None,
        device: Device = "auto",
        intra_op_threads: int | None = None,
    ) -> None:
        cfg = model.config
        self.config = cfg
        self.vocab_size = cfg.vocab_size
        self.bos_id = cfg.bos_id
        self.eos_id = cfg.eos_id
        self.max_source_len = cfg.max_len - 1
        self.max_target_len = cfg.max_len - 1
        self.export: OnnxExport = export_model(model, "verifier", fingerprint, cache_root)
        self._runner = _make_runner(self.export, device, intra_op_threads)
        self.device = self._runner.device

    @classmethod
    def from_bundle(cls, bundle: Any, cache_root: str | Path | None = None, **kwargs: Any) -> OnnxVerifier:
        """The bundle's verifier; exports go to `cache_root`, else `<bundle>/onnx` when writable."""
        if cache_root is None:
            cache_root = bundle_cache_root(bundle.path)
        return cls(bundle.verifier, fingerprint=bundle.fingerprint, cache_root=cache_root, **kwargs)

    def open(self, source_ids: list[int]) -> OnnxVerifierSession:
        return OnnxVerifierSession(self._runner, self.config, source_ids)


class OnnxVerifierSession:
    def __init__(self, runner: _Runner, config: ModelConfig, source_ids: list[int]) -> None:
        check_source(source_ids, config)  # the torch backend's checks, so both refuse alike
        self._runner = runner
        self._config = config
        self.tokens: list[int] = []  # output tokens after BOS the past holds K/V for (drafts included)
        self._cross = runner.encode(np.array([[*source_ids, config.eos_id]], dtype=np.int64))
        self._past = runner.empty_past(config)
        self._held = 0  # positions (BOS first) the past holds K/V for: 0, or 1 + len(tokens)

    @property
    def cache_bytes(self) -> int:
        return sum(self._runner.nbytes(t) for t in (*self._past, *self._cross))

    def step(
        self, committed_len: int, append_ids: list[int], draft_ids: list[int], top_k: int
    ) -> VerifyResult:
        cfg = self._config
        check_draft(draft_ids, top_k, cfg)
        check_sync(committed_len, len(self.tokens), append_ids, len(draft_ids), cfg)

        # Position 0 is BOS. Reuse the cached K/V of the kept positions, except the one whose state
        # predicts d_1 when nothing is appended (it is re-fed, see the module docstring); a fresh
        # session has no cached position yet, so BOS goes in with the first block.
        sequence = [cfg.bos_id, *self.tokens[:committed_len], *append_ids, *draft_ids]
        first_row = committed_len + len(append_ids)
        past_len = min(1 + committed_len if append_ids else committed_len, self._held)
        present_k, present_v, topk_lp, topk_ids, target_lp = self._runner.decode(
            np.array([sequence[past_len:]], dtype=np.int64),
            past_len,
            self._past,
            self._cross,
            first_row - past_len,
            np.array([*draft_ids, -1], dtype=np.int64),
            top_k,
        )
        self._past = (present_k, present_v)
        self._held = len(sequence)
        self.tokens = [*self.tokens[:committed_len], *append_ids, *draft_ids]
        ids = topk_ids.tolist()
        return VerifyResult(
            top1=[row[0] for row in ids],
            topk_ids=ids,
            topk_logprobs=topk_lp.tolist(),
            draft_logprobs=target_lp[:-1].tolist(),
        )

    def close(self) -> None:
        self._past = self._cross = ()  # type: ignore[assignment]


# ----------------------------------------------------------------------------------------------
# Runners: how the two graphs are called on one execution provider.
# ----------------------------------------------------------------------------------------------


class _Runner:
    device = "cpu"

    def __init__(self, export: OnnxExport, intra_op_threads: int | None, providers: list) -> None:
        self.encoder = inference_session(export.encoder, intra_op_threads, providers)
        self.decoder = inference_session(export.decoder, intra_op_threads, providers)

    def encode(self, src: np.ndarray) -> tuple[Any, Any]:
        k, v = self.encoder.run(None, {"src": src})
        return k, v

    def empty_past(self, cfg: ModelConfig) -> tuple[Any, Any]:
        shape = (cfg.decoder_layers, 1, cfg.n_heads, 0, cfg.d_model // cfg.n_heads)
        return np.zeros(shape, np.float32), np.zeros(shape, np.float32)

    def nbytes(self, t: Any) -> int:
        return int(t.nbytes)

    def decode(self, tokens, past_len, past, cross, head_from, targets, top_k) -> tuple[Any, ...]:
        feeds = {
            "tokens": tokens,
            "past_len": np.array(past_len, dtype=np.int64),
            "past_k": past[0],
            "past_v": past[1],
            "cross_k": cross[0],
            "cross_v": cross[1],
            "head_from": np.array(head_from, dtype=np.int64),
            "targets": targets,
            "top_k": np.array([top_k], dtype=np.int64),
        }
        return tuple(self.decoder.run(None, feeds))


class _CudaRunner(_Runner):
    """CUDA provider with I/O binding: K/V live as device OrtValues between steps.

    Untested here (no GPU on the development machine); guarded by `_make_runner`.
    """

    device = "cuda"

    def encode(self, src: np.ndarray) -> tuple[Any, Any]:
        binding = self.encoder.io_binding()
        binding.bind_cpu_input("src", src)
        binding.bind_output("cross_k", "cuda")
        binding.bind_output("cross_v", "cuda")
        self.encoder.run_with_iobinding(binding)
        k, v = binding.get_outputs()
        return k, v

    def empty_past(self, cfg: ModelConfig) -> tuple[Any, Any]:
        import onnxruntime as ort

        k, v = super().empty_past(cfg)
        return ort.OrtValue.ortvalue_from_numpy(k, "cuda", 0), ort.OrtValue.ortvalue_from_numpy(v, "cuda", 0)

    def nbytes(self, t: Any) -> int:
        return int(np.prod(t.shape())) * 4

    def decode(self, tokens, past_len, past, cross, head_from, targets, top_k) -> tuple[Any, ...]:
        binding = self.decoder.io_binding()
        binding.bind_cpu_input("tokens", tokens)
        binding.bind_cpu_input("past_len", np.array(past_len, dtype=np.int64))
        binding.bind_ortvalue_input("past_k", past[0])
        binding.bind_ortvalue_input("past_v", past[1])
        binding.bind_ortvalue_input("cross_k", cross[0])
        binding.bind_ortvalue_input("cross_v", cross[1])
        binding.bind_cpu_input("head_from", np.array(head_from, dtype=np.int64))
        binding.bind_cpu_input("targets", targets)
        binding.bind_cpu_input("top_k", np.array([top_k], dtype=np.int64))
        binding.bind_output("present_k", "cuda")
        binding.bind_output("present_v", "cuda")
        for name in ("topk_logprobs", "topk_ids", "target_logprobs"):
            binding.bind_output(name, "cpu")  # only these few rows cross to the host
        self.decoder.run_with_iobinding(binding)
        present_k, present_v, topk_lp, topk_ids, target_lp = binding.get_outputs()
        return present_k, present_v, topk_lp.numpy(), topk_ids.numpy(), target_lp.numpy()


def _make_runner(export: OnnxExport, device: Device, intra_op_threads: int | None) -> _Runner:
    if device == "cuda" and not cuda_available():
        raise RuntimeError("device 'cuda' needs onnxruntime-gpu and a visible GPU")
    if device == "cuda" or (device == "auto" and cuda_available()):
        return _CudaRunner(export, intra_op_threads, ["CUDAExecutionProvider", "CPUExecutionProvider"])
    return _Runner(export, intra_op_threads, ["CPUExecutionProvider"])
