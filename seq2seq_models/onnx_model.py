"""A bundle model exported for one role and opened on ONNX Runtime: what both ONNX backends hold
(the verifier's `verifier_service.onnx_backend`, the NAR drafter's `drafter_service.onnx_nar`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Self

from core.backends import DEFAULT_PRECISION, backend_label, check_precision
from seq2seq_models.onnx_export import OnnxExport, bundle_cache_root, export_model
from seq2seq_models.ort_runner import Device, open_runner
from seq2seq_models.transformer import Seq2SeqTransformer


class OnnxModel:
    """`role`'s export of a model (made on first use, cached by fingerprint) and its runner; with
    precision "int8", the export's dynamically quantized twin (`onnx_quantize`, cached beside it)."""

    role: str  # the bundle role a subclass exports: "verifier" or "nar_drafter"
    default_device: Device = "cpu"
    backend = "onnxruntime"

    def __init__(
        self,
        model: Seq2SeqTransformer,
        fingerprint: str | None = None,
        cache_root: str | Path | None = None,
        device: Device | None = None,
        intra_op_threads: int | None = None,
        precision: str = DEFAULT_PRECISION,
    ) -> None:
        check_precision(self.backend, precision)
        self.config = model.config
        self.precision = precision
        self.export: OnnxExport = export_model(model, self.role, fingerprint, cache_root)
        if precision == "int8":
            from seq2seq_models.onnx_quantize import ensure_int8

            self.export = ensure_int8(self.export, self.role)
        self.runner = open_runner(self.export, device or self.default_device, intra_op_threads)
        self.device = self.runner.device  # "cpu" or "cuda:N": GetModelInfo.backend reports it

    @property
    def backend_label(self) -> str:
        """GetModelInfo.backend: e.g. "onnxruntime-cpu", "onnxruntime-cpu-int8"."""
        return backend_label(self.backend, self.device, self.precision)

    @classmethod
    def from_bundle(cls, bundle: Any, cache_root: str | Path | None = None, **kwargs: Any) -> Self:
        """The bundle's model for `role`; exports go to `cache_root`, else `<bundle>/onnx` when writable."""
        root = cache_root if cache_root is not None else bundle_cache_root(bundle.path)
        return cls(getattr(bundle, cls.role), fingerprint=bundle.fingerprint, cache_root=root, **kwargs)
