"""A bundle model exported for one role and opened on ONNX Runtime: what every ONNX backend holds
(the verifier's `verifier_service.onnx_backend`, the drafters' `drafter_service.onnx_nar` and
`drafter_service.onnx_ar`).

Imports no torch: an export already on disk (`specdec export-onnx`, the image's build stage) is
opened with the model's config and the bundle's fingerprint alone. Only a missing export needs the
torch model, to make it; without torch that is a one-line error saying how to make the export.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, Self

from core.backends import DEFAULT_PRECISION, backend_label, check_precision
from seq2seq_models.config import ModelConfig
from seq2seq_models.onnx_cache import OnnxExport, bundle_cache_root, default_cache_root, find_export
from seq2seq_models.ort_runner import Device, open_runner

if TYPE_CHECKING:
    from seq2seq_models.transformer import Seq2SeqTransformer


class OnnxModel:
    """`role`'s export of a model (made on first use, cached by fingerprint) and its runner; with
    precision "int8", the export's dynamically quantized twin (`onnx_quantize`, cached beside it)."""

    role: str  # the bundle role a subclass exports: "verifier", "nar_drafter" or "ar_drafter"
    default_device: Device = "cpu"
    backend = "onnxruntime"

    def __init__(
        self,
        model: Seq2SeqTransformer | None = None,
        fingerprint: str | None = None,
        cache_root: str | Path | None = None,
        device: Device | None = None,
        intra_op_threads: int | None = None,
        precision: str = DEFAULT_PRECISION,
        *,
        config: ModelConfig | None = None,
        load: Callable[[], Seq2SeqTransformer] | None = None,
        search: tuple[Path, ...] = (),
    ) -> None:
        """`model`, or its `config` and `load` (called only when the export must be made); `search`:
        more cache roots to look in (read-only) before `cache_root`."""
        check_precision(self.backend, precision)
        if model is None and (config is None or load is None):
            raise ValueError("an ONNX model needs the torch model, or its config and a loader")
        self.config: ModelConfig = model.config if model is not None else config  # type: ignore[union-attr,assignment]
        self.precision = precision
        self.export: OnnxExport = self._open_export(model, load, fingerprint, cache_root, search)
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
        """The bundle's model for `role`; exports go to `cache_root`, else `<bundle>/onnx` when writable
        (found there too when it is not: a read-only bundle with its exports inside). The torch model
        is loaded only when no export is found."""
        root = cache_root if cache_root is not None else bundle_cache_root(bundle.path)
        search = () if cache_root is not None else (default_cache_root(bundle.path),)
        return cls(
            fingerprint=bundle.fingerprint, cache_root=root, config=bundle.config(cls.role),
            load=lambda: bundle.models[cls.role], search=search, **kwargs,
        )

    def _open_export(
        self, model: Seq2SeqTransformer | None, load: Callable[[], Seq2SeqTransformer] | None,
        fingerprint: str | None, cache_root: str | Path | None, search: tuple[Path, ...],
    ) -> OnnxExport:
        if fingerprint is not None and cache_root is not None:
            found = find_export((*search, Path(cache_root)), fingerprint, self.role)
            if found is not None:
                return found
        try:
            from seq2seq_models.onnx_export import export_model
        except ImportError as exc:  # a runtime install without torch
            where = Path(cache_root) if cache_root is not None else "the ONNX cache"
            raise ValueError(
                f"no ONNX export of the {self.role} (bundle fingerprint {(fingerprint or '?')[:16]}) in {where}, "
                f"and making one needs torch ({exc}): install it with `pip install \"specdec[torch]\"` (or "
                "`pip install torch==2.13.0`) and start again, or run `specdec export-onnx --bundle BUNDLE` where "
                "torch is installed and serve with that bundle (or SPECDEC_ONNX_CACHE pointing at the exports)"
            ) from None
        return export_model(model if model is not None else load(), self.role, fingerprint, cache_root)  # type: ignore[misc]
