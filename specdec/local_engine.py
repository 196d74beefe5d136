"""`Engine.load`: a bundle's models in this process, decoded through `decoding.decode.decode`.

The verifier and the drafter are the services' own in-process classes (`verifier_service.session`,
`drafter_service.session`), so what runs here is what the services run, without the wire.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path
from typing import Any

from core.backends import check_precision
from core.errors import SpecdecError
from core.threads import AUTO, worker_threads
from decoding.config import DecodingConfig, changed_fields, layered_defaults
from decoding.decode import decode
from decoding.report import TextStream, request_stats
from decoding.request import ModelLimits, Policy, Prepared, Request, prepare, prepare_config
from drafter_service.scheduled import ScheduledDrafter
from serving.batching import BatchLimits, StepExecutor
from specdec.api import Chunk, Engine, Hypothesis, Output
from specdec.bulk import BulkRun, Pending
from verifier_service.scheduled import ScheduledVerifier

# A bulk run's forwards: at most this many rows (beam hypotheses count each) and tokens per input
# in flight, and how long the model worker waits for the other rows' steps to join a forward (it
# stops waiting as soon as every row in flight has queued its step: `StepExecutor.callers`).
BULK_ROWS_PER_INPUT = 16
BULK_TOKENS_PER_INPUT = 96
BULK_WAIT_S = 0.005
# Pool rows a bulk lane reserves beyond its share of the batch (`KVPool.reserve`).
BULK_SPARE_ROWS = 4
# How long an ended bulk run waits for a model worker's forward in progress.
LANE_JOIN_S = 60.0


def open_local_engine(
    bundle_dir: Path, backend: str, precision: str, device: str, threads: int | None, dtype: str, policy: Policy,
    defaults: Mapping[str, Any],
) -> LocalEngine:
    """Load the bundle and build its verifier and drafter (`Engine.load` says what each argument is)."""
    from drafter_service.session import make_drafter
    from seq2seq_models.bundle import bundle_decoding_defaults, load_bundle
    from verifier_service.session import make_verifier

    check_precision(backend, precision)  # before the bundle loads: one line, not a traceback
    if dtype not in ("float32", "float64"):
        raise ValueError(f"dtype must be float32 or float64; got {dtype!r}")
    torch_dtype = None
    if backend == "torch" or dtype != "float32":
        try:
            import torch
        except ImportError:
            raise ValueError('the torch backend and dtype float64 need torch: pip install "specdec[torch]"') from None
        torch_dtype = getattr(torch, dtype)
    bundle = load_bundle(bundle_dir, dtype=torch_dtype)

    def make_models(threads: int | None) -> tuple[Any, Any]:
        options = {} if threads is None else {"intra_op_threads": threads}
        return (make_verifier(bundle, backend, device=device, precision=precision, **options),
                make_drafter(bundle, backend, device=device, precision=precision, **options))

    verifier, drafter = make_models(threads)
    # Requests take the caller's defaults (`defaults`, then what `policy` changed), else the bundle's
    # (an imported checkpoint's generate() settings).
    policy = replace(policy, defaults=layered_defaults(bundle_decoding_defaults(bundle_dir),
                                                       changed_fields(policy.defaults), defaults))
    return LocalEngine(verifier, drafter, bundle.tokenizer, policy, bundle.path, make_models, model_threads=threads)


class LocalEngine(Engine):
    """The models in this process: a verifier, a drafter when the bundle has one, and the bundle's
    tokenizer."""

    def __init__(
        self, verifier: Any, drafter: Any, tokenizer: Any, policy: Policy, bundle: Path | None = None,
        make_models: Callable[[int | None], tuple[Any, Any]] | None = None, model_threads: int | None = None,
    ) -> None:
        self.verifier = verifier
        self.drafter = drafter
        self.tokenizer = tokenizer
        self.bundle = bundle
        self.model = ModelLimits.of(verifier)
        self.policy = replace(policy, has_drafter=drafter is not None)
        self.batch_size = 32  # many inputs of one call decode this many at once (`bulk`)
        self.workers = 1
        # (intra-op threads) -> another (verifier, drafter) over the same bundle: a bulk run's lanes.
        self._make_models = make_models
        # The intra-op threads `verifier` and `drafter` were opened with (None: the backend's choice):
        # lanes of as many threads each are twins of them, not another copy of the models.
        self.model_threads = model_threads
        self._lane_models: dict[tuple[int, int], list[tuple[Any, Any]]] = {}
        self._threads: ThreadPoolExecutor | None = None  # bulk runs' decode threads (`_decode_threads`)
        self._thread_count = 0  # its size

    def prepare(self, request: Request) -> Prepared:
        return prepare(request, self.model, self.policy, self.tokenizer)

    def _run(self, requests: Sequence[Request]) -> list[Output]:
        """Every input checked first (a bad one raises before anything is decoded), then one alone,
        or many through a bulk run of `batch_size`."""
        prepared = self.prepare_all(requests)
        for index, item in enumerate(prepared):
            if isinstance(item, SpecdecError):
                raise item if len(prepared) == 1 else SpecdecError(item.code, f"input {index}: {item.message}")
        if len(prepared) == 1:
            return [self.decode(prepared[0])]  # type: ignore[arg-type]
        batch = min(self.batch_size, len(prepared))
        outputs = []
        for index, outcome in self.bulk(prepared, batch, workers=self.workers if batch > 1 else 1):
            if isinstance(outcome, SpecdecError):  # a peer-side failure while decoding
                raise SpecdecError(outcome.code, f"input {index}: {outcome.message}")
            outputs.append(outcome)
        return outputs

    def generate_each(
        self, requests: Iterable[Request | SpecdecError], ordered: bool = True, batch_size: int = 1,
        workers: int = 1, threads: int | None = None,
    ) -> Iterator[tuple[int, Output | SpecdecError]]:
        return iter(self.bulk(requests, batch_size, ordered, workers, threads))

    def bulk(
        self, requests: Iterable[Request | Prepared | SpecdecError], batch_size: int, ordered: bool = True,
        workers: int = 1, threads: int | None = None, cohorts: bool = True,
    ) -> BulkRun:
        """`specdec.bulk.BulkRun` over the requests: `batch_size` decoding at once, their steps in
        shared forwards (`verifier_service.scheduled`); 1: one at a time on the models directly,
        each input read only once the one before it is done. `workers` model workers (lanes: each
        its own rows over one copy of the models, `threads` intra-op threads each, default the
        usable CPUs shared out) run forwards side by side, each over its share of the rows; a lane
        takes new inputs once its cohort is done (`cohorts`), or as each row finishes."""
        items = (self._pending(index, request) for index, request in enumerate(requests))
        if batch_size == 1:
            return BulkRun(items, lambda prepared, stop, _: self.decode(prepared, _stopper(stop)), 1, ordered, window=1,
                           threads=self._decode_threads(1))
        lanes = self._lanes(batch_size, workers, threads)

        def decode_one(prepared: Prepared, stop: threading.Event, index: int) -> Output:
            return self.decode(prepared, _stopper(stop), lanes[index].verifier, lanes[index].drafter)

        def close() -> None:
            for lane in lanes:
                lane.executor.shutdown()
            for lane in lanes:  # the forwards running now end before the run does
                lane.executor.join(LANE_JOIN_S)

        run = BulkRun(items, decode_one, batch_size, ordered, on_close=close, lanes=len(lanes), cohorts=cohorts,
                      threads=self._decode_threads(batch_size))
        for index, lane in enumerate(lanes):
            # Rows admitted to the lane, decoding or about to: a forward waiting for company stops once
            # all of them have queued their steps.
            lane.executor.callers = lambda index=index: run.rows[index]
        return run

    def close(self) -> None:
        """Let the bulk runs' idle decode threads go."""
        if self._threads is not None:
            self._threads.shutdown(wait=False, cancel_futures=True)
            self._threads = None

    def _decode_threads(self, batch_size: int) -> ThreadPoolExecutor:
        """The bulk runs' decode threads, kept from run to run (`specdec.bulk.BulkRun`): a pool of at
        least `batch_size` (a larger batch than any before gets a larger pool)."""
        if self._threads is None or self._thread_count < batch_size:
            if self._threads is not None:
                self._threads.shutdown(wait=False)  # its threads end once their rows are done
            self._threads = ThreadPoolExecutor(max_workers=batch_size, thread_name_prefix="specdec-bulk")
            self._thread_count = batch_size
        return self._threads

    def _lanes(self, batch_size: int, workers: int, threads: int | None) -> list[_Lane]:
        if workers < 1:
            raise ValueError(f"workers must be at least 1; got {workers}")
        limits = BatchLimits(max_rows=BULK_ROWS_PER_INPUT * batch_size, max_tokens=BULK_TOKENS_PER_INPUT * batch_size,
                             wait_s=BULK_WAIT_S)
        per_lane = threads or worker_threads(AUTO, workers)
        if workers == 1 and threads in (None, self.model_threads):
            models = [(self.verifier, self.drafter)]
        else:
            key = (workers, per_lane)
            if key not in self._lane_models:
                # One copy of the models, with each worker's own rows (`twin`): the workers' forwards
                # run side by side over the same weights. The engine's own copy when its threads are
                # the lanes' (opening ONNX sessions takes seconds, and a copy's memory), else one made
                # once per layout.
                if per_lane == self.model_threads:
                    verifier, drafter = self.verifier, self.drafter
                elif self._make_models is None:
                    raise ValueError("this engine cannot make more model workers (it was not opened by Engine.load)")
                else:
                    verifier, drafter = self._make_models(per_lane)
                self._lane_models[key] = [(_twin(verifier), _twin(drafter)) for _ in range(workers)]
            models = self._lane_models[key]
        lanes = []
        # Each lane's rows in flight, and a few more: a finished row's slot is freed once its session
        # closes, while the next row's is taken when it is encoded.
        rows = -(-batch_size // len(models)) + BULK_SPARE_ROWS
        for verifier, drafter in models:
            for model in (verifier, drafter):
                if hasattr(model, "reserve_rows"):
                    model.reserve_rows(rows)
            lane = _Lane(StepExecutor("bulk"))
            lane.verifier = ScheduledVerifier(verifier, lane.executor, limits)
            lane.drafter = None if drafter is None else ScheduledDrafter(drafter, lane.executor, limits)
            lanes.append(lane)
        return lanes

    def _pending(self, index: int, request: Request | Prepared | SpecdecError) -> Pending:
        item = request if isinstance(request, SpecdecError | Prepared) else self.prepare_all([request])[0]
        length = 0 if isinstance(item, SpecdecError) else len(item.source)
        return Pending(index, item, length)

    def prepare_config(self, params: Mapping[str, Any]) -> DecodingConfig:
        """The decoding config `params` give (SpecdecError if they are bad), without an input."""
        return prepare_config(params, self.model, self.policy)

    def prepare_all(self, requests: Sequence[Request]) -> list[Prepared | SpecdecError]:
        """Every request prepared, or the error it failed with."""
        out: list[Prepared | SpecdecError] = []
        for request in requests:
            try:
                out.append(self.prepare(request))
            except SpecdecError as exc:
                out.append(exc)
        return out

    def decode(self, prepared: Prepared, on_tokens: Any = None, verifier: Any = None, drafter: Any = None) -> Output:
        """One prepared request, decoded (on `verifier` and `drafter`, default the engine's own);
        `on_tokens` hears every committed block (the forced first tokens first)."""
        started = time.perf_counter()
        first = prepared.first
        if on_tokens is not None and first:
            on_tokens(list(first))
        result = decode(prepared.source, prepared.config, verifier or self.verifier, drafter or self.drafter,
                        on_tokens, prefix=list(first) or None)
        stats = request_stats(result.stats, prepared.config.mode, time.perf_counter() - started)
        hypotheses = [Hypothesis(self.tokenizer.decode(h.output_ids), h.output_ids, h.score, h.finish_reason,
                                 h.token_logprobs) for h in result.hypotheses]
        return Output(self.tokenizer.decode(result.output_ids), result.output_ids, stats, hypotheses,
                      result.token_logprobs)

    def _stream(self, request: Request) -> Iterator[Chunk]:
        """decode() on a thread of its own, its blocks handed over through a queue; the consumer
        leaving stops it at its next block."""
        prepared = self.prepare(request)
        blocks: queue.Queue = queue.Queue()
        stop = threading.Event()

        def on_tokens(block: list[int]) -> None:
            if stop.is_set():
                raise _Stopped()
            blocks.put(list(block))

        def work() -> None:
            try:
                blocks.put(self.decode(prepared, on_tokens))
            except BaseException as exc:  # handed to the consumer, raised there
                blocks.put(exc)

        worker = threading.Thread(target=work, name="specdec-stream", daemon=True)
        worker.start()
        text = TextStream(self.tokenizer.decode)
        try:
            while True:
                item = blocks.get()
                if isinstance(item, BaseException):
                    raise item
                if isinstance(item, Output):
                    tail, rest = text.finish(item.output_ids)
                    yield Chunk(tail, rest, item)
                    return
                yield Chunk(text.add(item), item)
        finally:
            stop.set()
            worker.join()


class _Lane:
    """One model worker of a bulk run: its thread and its scheduled models."""

    def __init__(self, executor: StepExecutor) -> None:
        self.executor = executor
        self.verifier: Any = None
        self.drafter: Any = None


class _Stopped(Exception):
    """The consumer of a stream left it (or a bulk run was interrupted): the decoding stops at its
    next block."""


def _stopper(stop: threading.Event):
    """An `on_tokens` that ends the decoding at its next block once `stop` is set."""

    def on_tokens(block: list[int]) -> None:
        if stop.is_set():
            raise _Stopped()

    return on_tokens


def _twin(model: Any) -> Any:
    """`model.twin()` (a verifier or drafter with rows of its own over the same weights), or `model`
    itself when it keeps no rows of its own (none, or a backend without pools)."""
    twin = getattr(model, "twin", None)
    return model if twin is None else twin()
