"""ONNX Runtime as every backend of this project runs an export (verifier and NAR drafter alike).

A runner holds the encoder and decoder sessions of one role's export (`onnx_export.OnnxExport`)
and calls them. For the verifier and the NAR drafter, whose rows' K/V live in a host pool
(`row_cache.KVPool`) on every provider: `encode_batch` sources into cross-attention K/V,
`decode_row` one row through the one-row decoder and `decode_batch` many through the ragged batched
decoder, with named feeds (each K/V stacked over the layers, fed one view per layer). For the small
AR drafter, which keeps its sessions' K/V itself: `encode` a source, `empty_past` for a fresh
session and `decode` with its past and cross K/V; those tensors are the runner's own type (numpy
arrays on CPU, device OrtValues on CUDA), so callers only pass them back in; `nbytes` sizes them.

`OrtRunner` uses the CPU execution provider. `CudaOrtRunner` uses the CUDA provider (on the GPU
`device_id` a "cuda:N" device names); for the AR drafter with I/O binding: its past and
cross-attention K/V stay on the device between steps and only the decoder's other outputs come back
to the host.
"""

from __future__ import annotations

from functools import cache
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from core.config import parse_device
from core.threads import MAX_THREADS, usable_cpus
from seq2seq_models.cuda_devices import count_gpus
from seq2seq_models.row_cache import per_layer, source_feeds

if TYPE_CHECKING:  # onnx_export imports torch; a runner itself needs only onnxruntime
    from seq2seq_models.config import ModelConfig
    from seq2seq_models.onnx_export import OnnxExport

Device = str  # "auto", "cpu", "cuda" or "cuda:N" (core.config.parse_device)
# The decoder inputs that are K/V tensors (runner-native); every other input of these graphs is int64.
KV_INPUTS = ("past_k", "past_v", "cross_k", "cross_v")


def open_runner(export: OnnxExport, device: Device = "cpu", intra_op_threads: int | None = None) -> OrtRunner:
    """A runner for `export`: "cpu", "cuda" / "cuda:N" (onnxruntime-gpu and that GPU), or "auto" (the
    first GPU when usable). A GPU that is not there is a one-line ValueError (`require_device`)."""
    kind, index = parse_device(resolve_device(device, onnx=True))
    if kind == "cuda":
        _preload_cuda_libraries()
        cuda = ("CUDAExecutionProvider", {"device_id": index})
        return CudaOrtRunner(export, intra_op_threads, [cuda, "CPUExecutionProvider"], index or 0)
    return OrtRunner(export, intra_op_threads, ["CPUExecutionProvider"])


def resolve_device(device: Device, onnx: bool = False) -> str:
    """`device` made concrete: "auto" is "cuda:0" when usable (for ONNX Runtime: onnxruntime-gpu too),
    else "cpu"; "cuda" is "cuda:0". A GPU that does not exist is a ValueError, so a service refuses
    to start with one line rather than failing on its first request."""
    kind, index = parse_device(device)
    if kind == "auto":
        usable = cuda_available() if onnx else count_gpus(onnx=False).count > 0
        return "cuda:0" if usable else "cpu"
    if kind == "cpu":
        return "cpu"
    require_device(device, onnx)
    return f"cuda:{index}"


def require_device(device: Device, onnx: bool = False) -> None:
    """A ValueError saying why `device` cannot be used, or nothing."""
    kind, index = parse_device(device)
    if kind != "cuda":
        return
    gpus = count_gpus(onnx)
    if index is None or index >= gpus.count:
        seen = f"{gpus.count} CUDA device(s) visible" if gpus.count else f"no CUDA device visible ({gpus.why_none})"
        raise ValueError(f"device {device!r} does not exist: {seen}")
    if onnx and not _ort_cuda():
        raise ValueError(f"device {device!r} needs onnxruntime-gpu (the CUDA execution provider is not installed)")


class OrtRunner:
    device = "cpu"

    def __init__(self, export: OnnxExport, intra_op_threads: int | None, providers: list[Any]) -> None:
        self.encoder = inference_session(export.encoder, intra_op_threads, providers)
        self.decoder = inference_session(export.decoder, intra_op_threads, providers)
        batch = export.batch_decoder
        self.batch_decoder = None if batch is None else inference_session(batch, intra_op_threads, providers)
        step = export.step_decoder
        self.step_decoder = None if step is None else inference_session(step, intra_op_threads, providers)
        # Opened at the first lone row with logits processors: a server whose requests have none
        # never holds a second copy of the decoder.
        self._processing_decoder: Any = None
        self._open_processing = lambda: inference_session(export.processing_decoder, intra_op_threads, providers)

    def one_row_decoder(self, processing: bool) -> Any:
        """The one-row decoder's session: `decoder.onnx`, or with logits processors `decoder_processing.onnx`."""
        if not processing:
            return self.decoder
        if self._processing_decoder is None:
            self._processing_decoder = self._open_processing()
        return self._processing_decoder

    def encode(self, source_ids: list[int], eos_id: int) -> tuple[Any, Any]:
        """Cross-attention K [L, 1, H, hd, S] (transposed) and V [L, 1, H, S, hd] of one source (EOS
        appended here)."""
        k, v = self.encoder.run(None, source_feeds([source_ids], eos_id))
        return k, v

    def encode_batch(self, sources: list[list[int]], eos_id: int) -> tuple[np.ndarray, np.ndarray]:
        """Cross-attention K [L, B, H, hd, S] (transposed) and V [L, B, H, S, hd] of several sources
        in one encoder run, as host arrays on every provider (EOS appended here; right-padded to the
        longest: row i's first len(sources[i]) + 1 positions are its own)."""
        k, v = self.encoder.run(None, source_feeds(sources, eos_id))
        return k, v

    def empty_past(self, cfg: ModelConfig) -> tuple[Any, Any]:
        """Past K (transposed) and V holding no position yet."""
        layers, heads, hd = cfg.decoder_layers, cfg.decoder_shape.heads, cfg.decoder_shape.head_dim
        return np.zeros((layers, 1, heads, hd, 0), np.float32), np.zeros((layers, 1, heads, 0, hd), np.float32)

    def nbytes(self, t: Any) -> int:
        return int(t.nbytes)

    def decode(self, past: tuple[Any, Any], cross: tuple[Any, Any], **feeds: Any) -> tuple[Any, ...]:
        """One call of the small AR drafter's one-row decoder: `past`/`cross` K and V plus the graph's
        other inputs by name (ints and lists become int64); the outputs in the graph's order, K/V
        runner-native."""
        inputs = {**_kv_feeds(past, cross), **{name: _feed(value) for name, value in feeds.items()}}
        return tuple(self.decoder.run(None, inputs))


    def decode_row(self, feeds: dict[str, Any], processing: bool = False) -> tuple[Any, ...]:
        """One call of the one-row decoder over a pool slot (`processing`: the verifier's graph with
        logits processors): its inputs by name (numpy arrays; ints and lists become int64), each K/V
        stacked over the layers and fed one view per layer (`row_cache.per_layer`); its outputs as
        numpy arrays. On CUDA, ORT copies the inputs to the device and back."""
        inputs = {name: _feed(value) for name, value in per_layer(feeds).items()}
        return tuple(self.one_row_decoder(processing).run(None, inputs))

    def decode_batch(self, feeds: dict[str, Any]) -> tuple[Any, ...]:
        """One call of the batched decoder (its inputs by name, numpy arrays: `onnx_export`'s
        BATCH_DECODER_INPUTS for the verifier, NAR_BATCH_INPUTS for the NAR drafter, each K/V stacked
        over the layers and fed one view per layer, `row_cache.per_layer`); its outputs as numpy
        arrays. On CUDA, ORT copies the inputs to the device and back."""
        if self.batch_decoder is None:
            raise ValueError("this export has no batched decoder")
        # Blocks of one token each: the step graph when the export has one (the verifier's).
        one_token = self.step_decoder is not None and feeds["tokens"].shape[1] == 1
        return tuple((self.step_decoder if one_token else self.batch_decoder).run(None, per_layer(feeds)))


class CudaOrtRunner(OrtRunner):
    """CUDA provider with I/O binding: K/V live as device OrtValues between steps.

    Untested here (no GPU on the development machine); guarded by `open_runner`.
    """

    def __init__(self, export: OnnxExport, intra_op_threads: int | None, providers: list[Any], index: int = 0) -> None:
        super().__init__(export, intra_op_threads, providers)
        self.index = index  # the provider's device_id; every device OrtValue is allocated there too
        self.device = f"cuda:{index}"

    def encode(self, source_ids: list[int], eos_id: int) -> tuple[Any, Any]:
        binding = self.encoder.io_binding()
        for name, value in source_feeds([source_ids], eos_id).items():
            binding.bind_cpu_input(name, value)
        binding.bind_output("cross_k", "cuda", self.index)
        binding.bind_output("cross_v", "cuda", self.index)
        self.encoder.run_with_iobinding(binding)
        k, v = binding.get_outputs()
        return k, v

    def empty_past(self, cfg: ModelConfig) -> tuple[Any, Any]:
        import onnxruntime as ort

        k, v = super().empty_past(cfg)
        return (
            ort.OrtValue.ortvalue_from_numpy(k, "cuda", self.index),
            ort.OrtValue.ortvalue_from_numpy(v, "cuda", self.index),
        )

    def nbytes(self, t: Any) -> int:
        return int(np.prod(t.shape())) * 4

    def decode(self, past: tuple[Any, Any], cross: tuple[Any, Any], **feeds: Any) -> tuple[Any, ...]:
        decoder = self.decoder
        binding = decoder.io_binding()
        for name, value in _kv_feeds(past, cross).items():
            # Host arrays are copied in; device OrtValues are bound.
            if isinstance(value, np.ndarray):
                binding.bind_cpu_input(name, np.ascontiguousarray(value))
            else:
                binding.bind_ortvalue_input(name, value)
        for name, value in feeds.items():
            binding.bind_cpu_input(name, np.ascontiguousarray(_feed(value)))
        names = [o.name for o in decoder.get_outputs()]
        for name in names:
            # The present K/V stay on the device for the next step; only the rest crosses to the host.
            if name.startswith("present_"):
                binding.bind_output(name, "cuda", self.index)
            else:
                binding.bind_output(name, "cpu")
        decoder.run_with_iobinding(binding)
        outputs = binding.get_outputs()
        return tuple(o if n.startswith("present_") else o.numpy() for n, o in zip(names, outputs, strict=True))


def host(t: Any) -> np.ndarray:
    """`t` as a host array (a CUDA runner's OrtValue is copied back)."""
    return t if isinstance(t, np.ndarray) else t.numpy()


def _feed(value: Any) -> np.ndarray:
    """A decoder input: a numpy array as it is (the processors' bool and float inputs), else int64."""
    return value if isinstance(value, np.ndarray) else np.asarray(value, np.int64)


# Graph rewrites of ONNX Runtime's that every session here goes without (see `inference_session`).
UNFUSED = ["MatMulScaleFusion"]


def inference_session(
    path: Path, intra_op_threads: int | None, providers: list[str], optimized_to: Path | None = None,
    profile_to: Path | None = None,
) -> Any:
    """A session of the graph at `path`; for inspection, `optimized_to`: where to write the graph as
    the session runs it (after ONNX Runtime's rewrites), `profile_to`: the prefix of ONNX Runtime's
    profile of its runs (`end_profiling()` writes it)."""
    import onnxruntime as ort

    opts = ort.SessionOptions()
    if optimized_to is not None:
        opts.optimized_model_filepath = str(optimized_to)
    if profile_to is not None:
        opts.enable_profiling = True
        opts.profile_file_prefix = str(profile_to)
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    opts.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    # One step is a chain of small ops: parallelism only pays inside ops, and more threads
    # than cores makes ORT's spinning pool fight the Python thread.
    opts.intra_op_num_threads = intra_op_threads or default_intra_op_threads()
    opts.inter_op_num_threads = 1
    # Idle ORT workers would otherwise spin between steps and steal the cores the Python side
    # (accept loop, the other model, torch) needs; a step is long enough that waking them is cheap.
    opts.add_session_config_entry("session.intra_op.allow_spinning", "0")
    opts.log_severity_level = 3
    # ONNX Runtime would fold the attention's scale into its scores' matmul (FusedMatMul), which runs
    # a query against each row's keys slower than MatMul and a Mul of the small scores together
    # (BENCHMARKS.md, "Attention matmuls (CPU)", "Bulk decoding: notes").
    return ort.InferenceSession(str(path), opts, providers=providers, disabled_optimizers=UNFUSED)


def default_intra_op_threads() -> int:
    """A session's intra-op threads when its service sets none: the CPUs this process may run on
    (its affinity, which a container's cpuset narrows, unlike `os.cpu_count`), at most 8, since a
    step is a chain of small ops that stops scaling well before that. Services that share one host
    are given a split of them by `specdec serve all` (`core.threads.split_threads`)."""
    return min(usable_cpus(), MAX_THREADS)


def cuda_available() -> bool:
    """onnxruntime-gpu with the CUDA provider, and a GPU (`cuda_devices.count_gpus`: the driver's count)."""
    return _ort_cuda() and count_gpus(onnx=True).count > 0


def _ort_cuda() -> bool:
    try:
        import onnxruntime as ort
    except ImportError:
        return False
    return "CUDAExecutionProvider" in ort.get_available_providers()


@cache
def _preload_cuda_libraries() -> None:
    """Load the CUDA and cuDNN libraries of the nvidia-* wheels (onnxruntime-gpu[cuda,cudnn]) before the
    first CUDA session: the CUDA provider links them, and without CUDA torch nothing else puts them
    on the loader's path. ORT < 1.21 has no preload_dlls; there the libraries must be on the
    system's path (a CUDA base image or LD_LIBRARY_PATH)."""
    import onnxruntime as ort

    if hasattr(ort, "preload_dlls"):
        ort.preload_dlls()


def _kv_feeds(past: tuple[Any, Any], cross: tuple[Any, Any]) -> dict[str, Any]:
    return dict(zip(KV_INPUTS, (*past, *cross), strict=True))
