"""The gateway's admission control: a request runs only when a worker thread and the model
sessions it will open are free, so its own requests never meet the verifier's RESOURCE_EXHAUSTED
mid-request; otherwise it waits in a bounded queue, or is refused with RESOURCE_EXHAUSTED by the
gateway itself when the queue, or the client's own share, is full.

What a request needs (`sessions_needed`): one verifier session for every mode (beam search keeps
its hypotheses as the rows of one multi-row session, ARCHITECTURE.md, "Design notes"), and one drafter
session for the drafter modes.

Fairness: a client (the `x-client-id` metadata value, else the host of the gRPC peer address) may
have at most `max_per_client` requests in the gateway, running or queued; and when capacity frees,
the waiting request of the client with the fewest running requests goes first (then arrival
order). So a flooding client fills at most its own share and a well-behaved client's request is
next in line however long the flood's queue is.

`AdmissionQueue` is the decision logic, pure and synchronous (unit-tested without servers);
`Admission` runs it on the gateway's event loop with futures for the waiting requests, and reports
how long each admitted request waited (`on_admitted`, the gateway's queue-wait histogram).
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import grpc

from core.errors import SpecdecError, StatusCode
from decoding.config import DecodingConfig
from decoding.modes import MODES

CLIENT_ID_KEY = "x-client-id"


@dataclass(frozen=True)
class Need:
    """Model sessions one request holds at once."""

    verifier: int
    drafter: int


def sessions_needed(config: DecodingConfig, with_drafter: bool) -> Need:
    """What the mode's spec (decoding.modes) says one request holds; no drafter session when there is
    no drafter (the request then runs as plain AR)."""
    spec = MODES[config.mode]
    return Need(spec.verifier_sessions(config), int(with_drafter and spec.needs_drafter))


@dataclass(frozen=True)
class Budget:
    """What the gateway may hold at once. A session budget of 0 is unknown (not reported): unbounded."""

    workers: int
    verifier_sessions: int = 0
    drafter_sessions: int = 0


@dataclass(eq=False)
class Ticket:
    """One request's place: admitted (running) or waiting."""

    client: str
    need: Need
    seq: int
    admitted: bool = False
    on_admit: Callable[[], None] | None = field(default=None, repr=False)


def overloaded(message: str) -> SpecdecError:
    return SpecdecError(StatusCode.RESOURCE_EXHAUSTED, f"gateway overloaded: {message}")


class AdmissionQueue:
    """The admission decisions. Not thread-safe: one event loop calls it."""

    def __init__(self, budget: Callable[[], Budget], max_queued: int, max_per_client: int) -> None:
        # A callable, because the drafter's budget is learnt when it (re)connects.
        self.budget = budget
        self.max_queued = max_queued
        self.max_per_client = max_per_client
        self.running: list[Ticket] = []
        self.waiting: list[Ticket] = []
        self._seq = itertools.count()

    def in_gateway(self, client: str) -> int:
        return sum(t.client == client for t in (*self.running, *self.waiting))

    def running_of(self, client: str) -> int:
        return sum(t.client == client for t in self.running)

    def enter(self, client: str, need: Need) -> Ticket:
        """A ticket, admitted now or waiting; RESOURCE_EXHAUSTED when it may not even wait."""
        budget = self.budget()
        for have, want, what in (
            (budget.verifier_sessions, need.verifier, "verifier"),
            (budget.drafter_sessions, need.drafter, "drafter"),
        ):
            if have and want > have:
                raise overloaded(f"the request needs {want} {what} sessions; the {what} has {have}")
        if self.in_gateway(client) >= self.max_per_client:
            raise overloaded(f"client {client} already has {self.max_per_client} requests in the gateway")
        ticket = Ticket(client, need, next(self._seq))
        if not self.waiting and self._fits(need, budget):
            self._run(ticket)
        elif len(self.waiting) >= self.max_queued:
            raise overloaded(f"{len(self.waiting)} requests are queued; try again later")
        else:
            self.waiting.append(ticket)
        return ticket

    def leave(self, ticket: Ticket) -> list[Ticket]:
        """The request ended (done, failed, cancelled, or gave up waiting); the tickets it let in."""
        if ticket.admitted:
            self.running.remove(ticket)
        elif ticket in self.waiting:
            self.waiting.remove(ticket)
        return self._dispatch()

    def _fits(self, need: Need, budget: Budget) -> bool:
        used_v = sum(t.need.verifier for t in self.running)
        used_d = sum(t.need.drafter for t in self.running)
        return (
            len(self.running) < budget.workers
            and (not budget.verifier_sessions or used_v + need.verifier <= budget.verifier_sessions)
            and (not budget.drafter_sessions or used_d + need.drafter <= budget.drafter_sessions)
        )

    def _dispatch(self) -> list[Ticket]:
        """Admit waiting tickets in fair order while the first in that order fits. The first one
        is never skipped for a smaller one behind it, so a beam request is not starved by AR ones."""
        admitted = []
        budget = self.budget()
        while self.waiting:
            first = min(self.waiting, key=lambda t: (self.running_of(t.client), t.seq))
            if not self._fits(first.need, budget):
                break
            self.waiting.remove(first)
            self._run(first)
            admitted.append(first)
        return admitted

    def _run(self, ticket: Ticket) -> None:
        ticket.admitted = True
        self.running.append(ticket)


class Admission:
    """`AdmissionQueue` on the event loop: `async with admission.slot(client, need, timeout):`."""

    def __init__(
        self,
        queue: AdmissionQueue,
        on_change: Callable[[AdmissionQueue], None] | None = None,
        on_admitted: Callable[[float], None] | None = None,
    ) -> None:
        self.queue = queue
        self.on_change = on_change or (lambda q: None)
        # Called with the seconds each admitted request waited (0 when admitted on arrival).
        self.on_admitted = on_admitted or (lambda waited_s: None)

    def slot(self, client: str, need: Need, timeout: float | None) -> _Slot:
        return _Slot(self, client, need, timeout)

    def _wake(self, tickets: list[Ticket]) -> None:
        for ticket in tickets:
            if ticket.on_admit is not None:
                ticket.on_admit()
        self.on_change(self.queue)


class _Slot:
    def __init__(self, admission: Admission, client: str, need: Need, timeout: float | None) -> None:
        self.admission = admission
        self.client = client
        self.need = need
        self.timeout = timeout
        self.ticket: Ticket | None = None

    async def __aenter__(self) -> Ticket:
        a = self.admission
        arrived = time.perf_counter()
        self.ticket = ticket = a.queue.enter(self.client, self.need)
        a.on_change(a.queue)
        if ticket.admitted:
            a.on_admitted(0.0)
            return ticket
        admitted = asyncio.get_running_loop().create_future()
        ticket.on_admit = lambda: admitted.done() or admitted.set_result(None)
        try:
            # asyncio.timeout, not wait_for: on Python 3.11 wait_for can swallow a cancellation that
            # lands as the future completes, and a request whose client is gone would then run.
            async with asyncio.timeout(self.timeout):
                await admitted
        except TimeoutError:
            self._leave()
            raise SpecdecError(
                StatusCode.DEADLINE_EXCEEDED, "the deadline passed while the request waited in the gateway's queue"
            ) from None
        except BaseException:  # cancelled while waiting: give the place (or a slot just granted) back
            self._leave()
            raise
        a.on_admitted(time.perf_counter() - arrived)
        return ticket

    async def __aexit__(self, *exc) -> None:
        self._leave()

    def _leave(self) -> None:
        if self.ticket is not None:
            ticket, self.ticket = self.ticket, None
            self.admission._wake(self.admission.queue.leave(ticket))


def client_of(context: grpc.aio.ServicerContext) -> str:
    """The fairness key: the `x-client-id` metadata value, else the peer's host (without its port,
    so one process's many connections count as one client)."""
    for key, value in context.invocation_metadata() or ():
        if key == CLIENT_ID_KEY and value:
            return str(value)[:128]
    peer = context.peer() or "unknown"  # "ipv4:127.0.0.1:50432", "ipv6:[::1]:50432", "unix:/path"
    kind, _, rest = peer.partition(":")
    if kind in ("ipv4", "ipv6"):
        return rest.rpartition(":")[0] or rest
    return peer
