"""A verifier session: the AR model's KV cache over one source, rolled back on every step.

This is the in-process `core.interfaces.Verifier`; the gRPC servicer hosts the same sessions.
"""

from __future__ import annotations

import torch

from core.backends import BACKENDS
from core.errors import invalid
from core.interfaces import VerifyResult
from kernels import output_head
from seq2seq_models.config import ModelConfig
from seq2seq_models.prefix_state import PrefixState
from seq2seq_models.transformer import Seq2SeqTransformer


class VerifierSession:
    def __init__(self, model: Seq2SeqTransformer, source_ids: list[int], head=output_head) -> None:
        self._state = PrefixState(model, source_ids)
        self._head = head

    @property
    def tokens(self) -> list[int]:
        return self._state.tokens

    @property
    def cache_bytes(self) -> int:
        return self._state.cache_bytes

    def step(
        self, committed_len: int, append_ids: list[int], draft_ids: list[int], top_k: int
    ) -> VerifyResult:
        model = self._state.model
        self._state.sync(committed_len, append_ids, lookahead=len(draft_ids))
        if draft_ids:
            self._state.extend(draft_ids)
        # Rows that predict d_1 .. d_n and the token past the draft; row 0 is BOS's state.
        first = committed_len + len(append_ids)
        with torch.no_grad():
            rows = self._state.cache.hidden[0, first : first + len(draft_ids) + 1]
            targets = torch.tensor([*draft_ids, -1], device=rows.device)
            out = self._head(rows, model.embed.weight, model.out_bias, top_k, targets)
        topk_ids = out.topk_ids.tolist()
        return VerifyResult(
            top1=[row[0] for row in topk_ids],
            topk_ids=topk_ids,
            topk_logprobs=out.topk_logprobs.tolist(),
            draft_logprobs=out.target_logprobs[:-1].tolist(),
        )

    def close(self) -> None:
        self._state = None  # type: ignore[assignment]


class ModelVerifier:
    """The `core.interfaces.Verifier` attributes, read off the model's config (both backends)."""

    def __init__(self, config: ModelConfig) -> None:
        self.vocab_size = config.vocab_size
        self.bos_id = config.bos_id
        self.eos_id = config.eos_id
        # The model's max_len counts the source's EOS and the target's BOS; the interface does not.
        self.max_source_len = config.max_len - 1
        self.max_target_len = config.max_len - 1


class LocalVerifier(ModelVerifier):
    """In-process verifier over one AR model."""

    backend = "torch"

    def __init__(self, model: Seq2SeqTransformer, head=output_head) -> None:
        super().__init__(model.config)
        self.model = model
        self.head = head
        self.device = str(model.embed.weight.device)  # "cpu" or "cuda:N", for GetModelInfo.backend

    def open(self, source_ids: list[int]) -> VerifierSession:
        return VerifierSession(self.model, source_ids, self.head)


def make_verifier(bundle, backend: str = "torch", head=output_head, device: str | None = None, **onnx_options):
    """The bundle's verifier on `backend`: "torch" (eager, `LocalVerifier`) or "onnxruntime"
    (`OnnxVerifier`, exported on first use and cached by bundle fingerprint; `onnx_options` go to
    `OnnxVerifier.from_bundle`: cache_root, intra_op_threads). `device` ("auto", "cpu", "cuda",
    "cuda:N"; None keeps each backend's default): where the model runs; a missing GPU is a ValueError."""
    if backend == "torch":
        model = bundle.verifier
        if device is not None:
            from seq2seq_models.ort_runner import resolve_device

            model = model.to(resolve_device(device))
        return LocalVerifier(model, head=head)
    if backend == "onnxruntime":
        from verifier_service.onnx_backend import OnnxVerifier  # onnxruntime is only needed here

        return OnnxVerifier.from_bundle(bundle, device=device, **onnx_options)
    raise invalid(f"unknown verifier backend {backend!r}; expected one of {', '.join(BACKENDS)}")
