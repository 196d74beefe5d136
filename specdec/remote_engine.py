"""`Engine.connect`: the same calls as in process, answered by a gateway over gRPC (`specdec.v1`).

One channel for the engine's life; many inputs go out as concurrent `Generate` calls (at most
`concurrency` in flight), a stream is one `GenerateStream`. A gRPC status maps back to the
`SpecdecError` the gateway raised (INVALID_ARGUMENT, OUT_OF_RANGE, ...); one outside specdec's own
codes (UNAUTHENTICATED, UNIMPLEMENTED, ...) is a `CallError`.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterable, Iterator
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait

import grpc

from core.errors import SpecdecError, StatusCode
from decoding.request import Request
from gateway.wire import overrides_to_wire, report_from_wire
from protos.specdec.v1 import gateway_pb2, gateway_pb2_grpc
from serving.auth import bearer_metadata
from serving.channels import channel_options
from serving.status import REQUEST_ID_KEY, specdec_code
from serving.tls import ClientTLS, open_channel
from specdec.api import Chunk, Engine, Hypothesis, Output, default_address

# How grpc words a call that never reached a server (connection refused, no such host, ...).
_NOT_REACHED = "failed to connect to all addresses"


class CallError(RuntimeError):
    """A gRPC status outside specdec's own codes (UNAUTHENTICATED, UNIMPLEMENTED, ...): `code` is its name."""

    def __init__(self, code: str, details: str) -> None:
        super().__init__(f"{code}: {details}")
        self.code = code
        self.details = details


class RemoteEngine(Engine):
    """A gateway's `GatewayService`, called with the Python API's requests."""

    def __init__(
        self, address: str | None = None, *, timeout: float | None = 120.0, tls: ClientTLS | None = None,
        token: str | None = None, concurrency: int = 16,
    ) -> None:
        if concurrency < 1:
            raise ValueError(f"concurrency must be at least 1; got {concurrency}")
        self.address = address or default_address()
        self.timeout = timeout
        self.token = token
        self.concurrency = concurrency
        self._channel = open_channel(self.address, tls, channel_options())
        self._stub = gateway_pb2_grpc.GatewayServiceStub(self._channel)

    def close(self) -> None:
        self._channel.close()

    def call(self, request: Request, request_id: str | None = None) -> Output:
        """One `Generate` call."""
        try:
            response = self._stub.Generate(_message(request), timeout=self.timeout, metadata=self._metadata(request_id))
        except grpc.RpcError as exc:
            raise self._error(exc) from None
        return _output(response.text, list(response.output_ids), response)

    def generate_each(
        self, requests: Iterable[Request | SpecdecError], ordered: bool = True
    ) -> Iterator[tuple[int, Output | SpecdecError]]:
        """Concurrent `Generate` calls, at most `concurrency` in flight."""
        with ThreadPoolExecutor(max_workers=self.concurrency, thread_name_prefix="specdec-client") as pool:
            pending: dict[Future, int] = {}
            done: dict[int, Output | SpecdecError] = {}
            following = 0
            todo = iter(enumerate(requests))
            for index, request in todo:
                pending[pool.submit(self._outcome, request)] = index
                if len(pending) >= self.concurrency:
                    break
            while pending:
                finished, _ = wait(pending, return_when=FIRST_COMPLETED)
                for future in finished:
                    done[pending.pop(future)] = future.result()
                    nxt = next(todo, None)
                    if nxt is not None:
                        pending[pool.submit(self._outcome, nxt[1])] = nxt[0]
                if ordered:
                    while following in done:
                        yield following, done.pop(following)
                        following += 1
                else:
                    for index in sorted(done):
                        yield index, done.pop(index)

    def _outcome(self, request: Request | SpecdecError) -> Output | SpecdecError:
        if isinstance(request, SpecdecError):
            return request
        try:
            return self.call(request)
        except SpecdecError as exc:
            return exc

    def _stream(self, request: Request) -> Iterator[Chunk]:
        call = self._stub.GenerateStream(_message(request), timeout=self.timeout, metadata=self._metadata(None))
        ids: list[int] = []
        texts: list[str] = []
        try:
            for response in call:
                ids.extend(response.output_ids)
                texts.append(response.text)
                output = None
                if response.final:
                    output = _output("".join(texts), list(ids), response)
                yield Chunk(response.text, list(response.output_ids), output)
        except grpc.RpcError as exc:
            raise self._error(exc) from None
        finally:
            call.cancel()  # a consumer that left early ends the call, and the gateway stops decoding

    def _metadata(self, request_id: str | None) -> list[tuple[str, str]]:
        metadata = [(REQUEST_ID_KEY, request_id or uuid.uuid4().hex)]
        if self.token:
            metadata.append(bearer_metadata(self.token))
        return metadata

    def _error(self, exc: grpc.RpcError) -> Exception:
        details = exc.details() or ""
        if exc.code() == grpc.StatusCode.UNAVAILABLE and _NOT_REACHED in details:
            return SpecdecError(
                StatusCode.UNAVAILABLE,
                f"the gateway at {self.address} is not reachable ({details}); is it running? Start one with "
                "`specdec serve all`, or point --addr / $SPECDEC_ADDR at it",
            )
        code = specdec_code(exc.code())
        if code is None:
            return CallError(exc.code().name, details)
        return SpecdecError(code, details)


def _output(text: str, output_ids: list[int], final: gateway_pb2.GenerateResponse) -> Output:
    """The Output of a call whose last (or only) message is `final`."""
    hypotheses = [Hypothesis(h.text, list(h.output_ids), h.score, h.finish_reason, list(h.token_logprobs))
                  for h in final.hypotheses]
    return Output(text, output_ids, report_from_wire(final.stats), hypotheses, list(final.token_logprobs))


def _message(request: Request) -> gateway_pb2.GenerateRequest:
    return gateway_pb2.GenerateRequest(
        text=request.text, input_ids=list(request.input_ids), config=overrides_to_wire(dict(request.overrides)),
        target_lang=request.target_lang, target_prefix=request.target_prefix,
        target_prefix_ids=list(request.target_prefix_ids),
    )

