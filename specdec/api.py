"""The Python API: decode in this process, or through a running gateway, with the same calls.

    import specdec

    with specdec.Engine.load("bundles/ua-gec") as engine:          # the models in this process
        out = engine.generate("Я хочу подякувати вам.", mode="gad", k=10)
        print(out.text, out.stats.mean_accepted_length)
        outs = engine.generate(["Перше речення.", "Друге."], mode="iad")   # many: a list, in order
        for chunk in engine.generate_stream("Я хочу подякувати вам.", mode="gad"):
            print(chunk.text, end="", flush=True)

    with specdec.Engine.connect() as engine:    # the gateway `specdec serve all` started
        out = engine.generate("Я хочу подякувати вам.", mode="gad")

Decoding parameters are keyword arguments named as `decoding.config.DecodingConfig`'s fields
(`mode`, `k`, `beta`, `tau`, `num_beams`, `max_new_tokens`, ...); an input is a text or a list of
token ids. A bad input or parameter raises `SpecdecError` with its status code and a message, the
same as the gateway answers over gRPC. `specdec decode` and `specdec generate` are thin wrappers over
these calls.
"""

from __future__ import annotations

import numbers
import os
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from core.backends import DEFAULT_BACKEND, DEFAULT_PRECISION
from core.config import GATEWAY_ADDRESS
from core.errors import SpecdecError, StatusCode
from decoding.report import Stats
from decoding.request import Policy, Request

# Where `load` and `specdec decode` look for a bundle when none is given.
BUNDLE_ENV = "SPECDEC_BUNDLE"
DEFAULT_BUNDLE_DIR = Path(__file__).resolve().parent.parent / "bundles" / "ua-gec"
# The gateway address when none is given (`connect`, `specdec generate`, `loadtest`, `health`).
ADDR_ENV = "SPECDEC_ADDR"

Input = str | Sequence[int]


@dataclass(frozen=True)
class Hypothesis:
    """One finished hypothesis of a beam search: its text and ids, its sequence score (its tokens'
    log-probs summed, over its length to the power length_penalty: transformers' `sequences_scores`)
    and why it ended ("eos" or "length")."""

    text: str
    output_ids: list[int]
    score: float
    finish_reason: str
    token_logprobs: list[float] = field(default_factory=list)  # with output_logprobs


@dataclass(frozen=True)
class Output:
    """One decoded input: the output's text and ids (any forced first token and target prefix
    included), its stats, for beam search its `num_return_sequences` best hypotheses, best first
    (the first is the output), and with `output_logprobs` each output token's log-prob, then the
    EOS's when one ended it (forced and prefix tokens: 0)."""

    text: str
    output_ids: list[int]
    stats: Stats
    hypotheses: list[Hypothesis] = field(default_factory=list)
    token_logprobs: list[float] = field(default_factory=list)

    def record(self) -> dict[str, Any]:
        """The output as `specdec decode` and `specdec generate --json` print it."""
        out: dict[str, Any] = {"output_ids": self.output_ids, "text": self.text, "stats": self.stats.record()}
        if self.hypotheses:
            out["hypotheses"] = [{k: v for k, v in asdict(h).items() if v != []} for h in self.hypotheses]
        if self.token_logprobs:
            out["token_logprobs"] = self.token_logprobs
        return out


@dataclass(frozen=True)
class Chunk:
    """A piece of a streamed output: the text and ids it adds; the last chunk carries the whole `output`."""

    text: str
    output_ids: list[int]
    output: Output | None = None


class Engine:
    """Decoding through one model stack: `Engine.load` (in this process) or `Engine.connect` (a gateway)."""

    @staticmethod
    def load(
        bundle: str | Path | None = None, *, backend: str | None = None, precision: str | None = None,
        device: str = "auto", threads: int | None = None, dtype: str = "float32", policy: Policy | None = None,
        batch_size: int = 32, workers: int = 1, defaults: Mapping[str, Any] | None = None,
    ) -> Engine:
        """The bundle's models in this process (default: `$SPECDEC_BUNDLE`, else the bundled UA-GEC
        models). `backend` "onnxruntime" (the default) or "torch"; `precision` "fp32" or "int8"
        (onnxruntime); `device` "auto", "cpu", "cuda" or "cuda:N"; `threads` the models' intra-op
        threads (None: chosen); `dtype` float32 or float64 (torch). `policy`: the defaults and limits
        requests are prepared with (`decoding.request.Policy`); `defaults`: decoding parameters a request
        takes when it sets none, over the bundle's own defaults (an imported checkpoint's generation
        settings), which are over DecodingConfig's. Many inputs decode `batch_size` at a time, their steps
        in shared forwards, on `workers` model workers (`specdec.bulk`); with more than one and no
        `threads`, the models take each worker's share of the CPUs, as the workers run them."""
        from core.threads import AUTO, worker_threads
        from specdec.local_engine import open_local_engine

        if threads is None and workers > 1:  # the models as the bulk runs' workers take them (no second copy)
            threads = worker_threads(AUTO, workers)
        engine = open_local_engine(resolve_bundle(bundle), backend or DEFAULT_BACKEND,
                                   precision or DEFAULT_PRECISION, device, threads, dtype, policy or Policy(),
                                   defaults or {})
        engine.batch_size, engine.workers = batch_size, workers
        return engine

    @staticmethod
    def connect(
        address: str | None = None, *, timeout: float = 120.0, tls: Any = None, token: str | None = None,
        concurrency: int = 16,
    ) -> Engine:
        """A gateway at `address` (default: `$SPECDEC_ADDR`, else the default gateway address). `tls`: a
        `serving.tls.ClientTLS` (None: plaintext); `token`: its bearer token; `timeout`: each request's
        deadline in seconds; `concurrency`: requests in flight at once for many inputs."""
        from specdec.remote_engine import RemoteEngine

        return RemoteEngine(address, timeout=timeout, tls=tls, token=token, concurrency=concurrency)

    # ---- the calls, written once over `_run` / `_stream` -------------------------------------------

    def generate(
        self, inputs: Input | Sequence[Input], *, target_lang: str = "", target_prefix: Input = "", **params: Any
    ) -> Any:
        """Decode one input (returns an `Output`) or many (a list of them, in order). Every input is
        checked before any is decoded; a bad one raises `SpecdecError` naming its index.
        `target_prefix` (text or ids): what every output starts with, after the target language's code."""
        if is_one_input(inputs):
            return self._run([self.request(inputs, target_lang, params, target_prefix)])[0]
        return self._run([self.request(one, target_lang, params, target_prefix)
                          for one in inputs])  # type: ignore[union-attr]

    def generate_each(
        self, requests: Iterable[Request | SpecdecError], ordered: bool = True
    ) -> Iterator[tuple[int, Output | SpecdecError]]:
        """Each request's index and its output, or the `SpecdecError` it failed with (the others go
        on; an item that is already a `SpecdecError`, say an input that could not be read, is its own
        outcome): in input order, or (`ordered=False`) as they finish."""
        raise NotImplementedError

    def generate_stream(
        self, input: Input, *, target_lang: str = "", target_prefix: Input = "", **params: Any
    ) -> Iterator[Chunk]:
        """Decode one input, yielding its text as tokens are accepted; the last chunk has the `Output`.
        Leaving the loop early stops the decoding."""
        return self._stream(self.request(input, target_lang, params, target_prefix))

    @staticmethod
    def request(
        input: Input, target_lang: str = "", params: Mapping[str, Any] | None = None, target_prefix: Input = ""
    ) -> Request:
        """A `decoding.request.Request` for one input (text or ids), its parameters and its target."""
        params = {k: getattr(v, "value", v) for k, v in (params or {}).items()}  # Mode members by value
        target: dict[str, Any] = {"target_lang": target_lang}
        if isinstance(target_prefix, str):
            target["target_prefix"] = target_prefix
        else:
            target["target_prefix_ids"] = [int(i) for i in target_prefix]
        if isinstance(input, str):
            return Request(text=input, overrides=params, **target)
        return Request(input_ids=[int(i) for i in input], overrides=params, **target)

    def close(self) -> None:
        """Free what the engine holds (models, channels)."""

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _run(self, requests: Sequence[Request]) -> list[Output]:
        """The requests' outputs in order; the first failure raises, naming its input's index when
        there are several."""
        outputs: list[Output] = []
        for index, outcome in self.generate_each(requests):
            if isinstance(outcome, SpecdecError):
                raise outcome if len(requests) == 1 else SpecdecError(outcome.code, f"input {index}: {outcome.message}")
            outputs.append(outcome)
        return outputs

    def _stream(self, request: Request) -> Iterator[Chunk]:
        raise NotImplementedError


def is_one_input(inputs: Any) -> bool:
    """A text, or a sequence of token ids, is one input; any other sequence holds many."""
    if isinstance(inputs, str):
        return True
    items = list(inputs)
    return bool(items) and all(isinstance(i, numbers.Integral) for i in items)


def default_address() -> str:
    """`$SPECDEC_ADDR`, else the gateway's default address."""
    return os.environ.get(ADDR_ENV) or GATEWAY_ADDRESS


def resolve_bundle(path: str | Path | None) -> Path:
    """The bundle to load: `path`, else `$SPECDEC_BUNDLE`, else the bundled UA-GEC models."""
    if path:
        return Path(path)
    env = os.environ.get(BUNDLE_ENV)
    if env:
        return Path(env)
    if DEFAULT_BUNDLE_DIR.is_dir():
        return DEFAULT_BUNDLE_DIR
    raise FileNotFoundError("no bundle given: pass --bundle DIR (make one with `specdec tiny-bundle --out DIR`)")


__all__ = ["Chunk", "Engine", "Hypothesis", "Output", "SpecdecError", "Stats", "StatusCode"]
