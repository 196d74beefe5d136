"""The verifier on ONNX Runtime: the same `Verifier`/`VerifierSession` contract as the torch backend.

Graphs come from `seq2seq_models.onnx_export` (exported on demand, cached by fingerprint). A
step is one decoder call: the block `append_ids + draft_ids` against the cached past, with the
fused head's outputs for the rows that predict d_1..d_n and the token past the draft.

Rollback: the past K/V tensors are kept as the last call returned them, and the graph slices them
to `past_len`; cutting the cache is just passing a smaller start position, with no copy. When a
step appends nothing, the row that predicts d_1 belongs to a position already in the cache; instead
of keeping every position's hidden state, that one position is re-fed (its K/V are recomputed
identically), so a step always is a single graph call whose head rows start inside the block.

The graphs run through `seq2seq_models.ort_runner`: the CPU execution provider by default; with
onnxruntime-gpu and a visible GPU, the CUDA provider with I/O binding (past and cross-attention K/V
stay on the device between steps and only the top-k rows come back to the host).
"""

from __future__ import annotations

from typing import Any

from core.checks import check_session_step
from core.interfaces import VerifyResult
from seq2seq_models.config import ModelConfig
from seq2seq_models.onnx_model import OnnxModel
from seq2seq_models.ort_runner import OrtRunner
from seq2seq_models.transformer import Seq2SeqTransformer
from verifier_service.session import ModelVerifier


class OnnxVerifier(OnnxModel, ModelVerifier):
    """In-process verifier running the exported graphs on ONNX Runtime."""

    role = "verifier"
    default_device = "auto"  # the CUDA provider when onnxruntime-gpu sees a GPU

    def __init__(self, model: Seq2SeqTransformer, **options: Any) -> None:
        """`options`: those of `OnnxModel` (fingerprint, cache_root, device, intra_op_threads)."""
        OnnxModel.__init__(self, model, **options)
        ModelVerifier.__init__(self, model.config)

    def open(self, source_ids: list[int]) -> OnnxVerifierSession:
        return OnnxVerifierSession(self.runner, self.config, source_ids)


class OnnxVerifierSession:
    def __init__(self, runner: OrtRunner, config: ModelConfig, source_ids: list[int]) -> None:
        self._runner = runner
        self._config = config
        self.tokens: list[int] = []  # output tokens after BOS the past holds K/V for (drafts included)
        self._cross = runner.encode(source_ids, config.eos_id)
        self._past = runner.empty_past(config)
        self._held = 0  # positions (BOS first) the past holds K/V for: 0, or 1 + len(tokens)

    @property
    def cache_bytes(self) -> int:
        return sum(self._runner.nbytes(t) for t in (*self._past, *self._cross))

    def step(
        self, committed_len: int, append_ids: list[int], draft_ids: list[int], top_k: int
    ) -> VerifyResult:
        cfg = self._config
        check_session_step(committed_len, len(self.tokens), len(append_ids), len(draft_ids), cfg)

        # Position 0 is BOS. Reuse the cached K/V of the kept positions, except the one whose state
        # predicts d_1 when nothing is appended (it is re-fed, see the module docstring); a fresh
        # session has no cached position yet, so BOS goes in with the first block.
        sequence = [cfg.bos_id, *self.tokens[:committed_len], *append_ids, *draft_ids]
        first_row = committed_len + len(append_ids)
        past_len = min(1 + committed_len if append_ids else committed_len, self._held)
        present_k, present_v, topk_lp, topk_ids, target_lp = self._runner.decode(
            self._past,
            self._cross,
            tokens=[sequence[past_len:]],
            past_len=past_len,
            head_from=first_row - past_len,
            targets=[*draft_ids, -1],
            top_k=[top_k],
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
