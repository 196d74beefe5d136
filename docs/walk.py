"""The newcomer's walk: one real `Generate` request through a tiny `specdec serve all` stack, traced.

    python docs/walk.py                       # GAD, k = 4, on a tiny random bundle
    python docs/walk.py --mode ar --full      # every change of module, in order

It prints the modules of ours the request passes through, in the order it first enters them (with
the thread it runs on and where it came from), and counts how often the walk climbs back up: a call
from a module into one of a higher layer (the layers of ARCHITECTURE.md, "Layers", from
tests/test_layers.py's ALLOWED table), i.e. lower code calling back into code above it through an
object it was handed (an interface, a callback). Returns from calls are not climbs. A call into one
of our modules from library code (grpc, asyncio, a thread pool) is where the request changes hands
and is counted as an entry, not a climb; a call whose nearest caller of ours is further up the same
thread's stack (a future's done callback, `functools.partial`) counts from that caller; resuming a
coroutine or generator is a return to it, not a call. Also listed: calls across, into a package the
caller may not import that is not above it, and calls inside a package against its own imports (a
module calling one that imports it).

A reading aid for ARCHITECTURE.md, "The request path", not a test: what it prints depends on the
mode and the timing of threads. It lives in docs/ beside the documents it illustrates.
"""

from __future__ import annotations

import argparse
import ast
import inspect
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run as a script from anywhere

from tests.test_layers import ALLOWED, layers, module_imports, our_modules  # noqa: E402 - after sys.path

TEXT = "We have been living in this city."
_RESUMABLE = inspect.CO_GENERATOR | inspect.CO_COROUTINE | inspect.CO_ASYNC_GENERATOR


@dataclass(frozen=True)
class Call:
    """One entry into a function of ours: the thread, the nearest caller of ours on that thread's
    stack (None: entered from library code), the library module in between (None: a direct call),
    and the callee's module and function."""

    thread: str
    caller: str | None
    via: str | None
    module: str
    function: str


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mode", default="gad", help="the request's decoding mode (default gad)")
    parser.add_argument("--k", type=int, default=4, help="block size of the block modes (default 4)")
    parser.add_argument("--max-new-tokens", type=int, default=16)
    parser.add_argument("--full", action="store_true", help="also print every change of module, in order")
    args = parser.parse_args(argv)
    overrides = {"mode": args.mode, "max_new_tokens": args.max_new_tokens}
    if args.mode in ("gad", "gad++", "iad"):
        overrides["k"] = args.k
    calls = trace_one_request(overrides)
    report(calls, args.full)
    return 0


def trace_one_request(overrides: dict) -> list[Call]:
    """Serve a tiny bundle (`serve all`, one process), send one request untraced (start-up work done
    once, threads started), then the same request traced; its calls into our modules, in order."""
    import grpc

    from gateway.wire import overrides_to_wire
    from protos.specdec.v1 import gateway_pb2, gateway_pb2_grpc
    from seq2seq_models.bundle import make_tiny_bundle
    from specdec.serve import ServiceStack

    tracer = Tracer({*ALLOWED})
    with tempfile.TemporaryDirectory() as tmp:
        bundle = make_tiny_bundle(Path(tmp) / "bundle", seed=3)
        # The ONNX export before tracing starts: the stack only opens it.
        subprocess.run([sys.executable, "-m", "specdec", "export-onnx", "--bundle", str(bundle)], cwd=ROOT,
                       check=True, capture_output=True, timeout=600)
        threading.setprofile(tracer.profile)  # every thread started from here on (the stack's)
        loopback = {role: {"address": "127.0.0.1:0"} for role in ("verifier", "drafter", "gateway")}
        with ServiceStack("all", bundle, loopback) as stack:
            request = gateway_pb2.GenerateRequest(text=TEXT, config=overrides_to_wire(overrides))
            with grpc.insecure_channel(stack.running.addresses["gateway"]) as channel:
                stub = gateway_pb2_grpc.GatewayServiceStub(channel)
                stub.Generate(request, timeout=60)
                _wait_quiet(stack.running)  # the first request's sessions closed
                time.sleep(0.2)  # and its call's done callbacks run
                tracer.armed = True
                response = stub.Generate(request, timeout=60)
                _wait_quiet(stack.running)  # closing its sessions is part of the walk
                tracer.armed = False
        threading.setprofile(None)
    print(f"request: {overrides}, {len(response.output_ids)} output tokens, "
          f"{response.stats.iterations} iterations, degraded={response.stats.degraded}\n")
    return tracer.calls


def _wait_quiet(running, timeout: float = 10.0) -> None:
    """Until no request is active in the gateway and no session is open on the verifier or drafter."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if running.gateway.metrics.active.value() == 0 and not running.verifier.active_sessions \
                and not running.drafter.active_sessions:
            return
        time.sleep(0.01)


class Tracer:
    """A profile function (`threading.setprofile`) that records calls into our packages while armed."""

    def __init__(self, packages: set[str]) -> None:
        self.packages = packages
        self.armed = False
        self.calls: list[Call] = []
        # Generator and coroutine frames already entered: a later "call" event of one is its resumption
        # after a yield or an await, a return to it rather than a call (kept alive so ids stay unique).
        self._started: dict[int, object] = {}

    def profile(self, frame, event: str, arg) -> None:
        if not self.armed or event != "call":
            return
        module = frame.f_globals.get("__name__", "")
        if not self.ours(module):
            return
        if frame.f_code.co_flags & _RESUMABLE:
            if id(frame) in self._started:
                return
            self._started[id(frame)] = frame
        caller, via = None, None
        back = frame.f_back
        while back is not None:
            name = back.f_globals.get("__name__", "")
            if self.ours(name):
                caller = name
                break
            via = via or name
            back = back.f_back
        if caller is None:
            via = None  # entered from library code: where the request changed hands
        self.calls.append(Call(threading.current_thread().name, caller, via, module, frame.f_code.co_qualname))

    def ours(self, module: str) -> bool:
        return module.partition(".")[0] in self.packages


# ---- what the trace says ------------------------------------------------------------------------


def report(calls: list[Call], full: bool) -> None:
    ranks = layers()
    imports = ModuleImports()

    def package(module: str) -> str:
        return module.partition(".")[0]

    def kind(call: Call) -> str:
        """"climb", "across", "climb inside" (against the package's own imports) or ""."""
        if call.caller is None or call.caller == call.module:
            return ""
        above, below = package(call.module), package(call.caller)
        if above != below:
            if ranks[above] > ranks[below]:
                return "climb"
            return "across" if above not in ALLOWED[below] else ""
        return "climb inside" if imports.reaches(call.module, call.caller) else ""

    print("The rooms, in the order the request first enters them (layer, module, thread, entered from):")
    seen: dict[str, int] = {}
    for call in calls:
        if call.module in seen:
            continue
        seen[call.module] = len(seen) + 1
        source = call.caller or "(library code: grpc, asyncio, a thread pool)"
        via = f" via {call.via}" if call.via else ""
        mark = f"  <- {kind(call)}" if kind(call) else ""
        print(f"  {len(seen):3d}. [{ranks[package(call.module)]}] {call.module}.{call.function}  "
              f"({call.thread}; from {source}{via}){mark}")

    if full:
        print("\nEvery change of module, in order (thread: caller -> callee.function):")
        last: dict[str, str] = {}
        for call in calls:
            if last.get(call.thread) != call.module:
                last[call.thread] = call.module
                print(f"  {call.thread}: {call.caller or '(library)'} -> {call.module}.{call.function}"
                      + (f"  <- {kind(call)}" if kind(call) else ""))

    for label in ("climb", "across", "climb inside"):
        found = Counter((c.caller, c.module, c.function, c.via) for c in calls if kind(c) == label)
        title = {
            "climb": "Climbs back up (a call into a package of a higher layer)",
            "across": "Across (a call into a package it may not import, of the same or a lower layer)",
            "climb inside": "Climbs inside a package (a call into a module that imports the caller)",
        }[label]
        edges = {(caller, module) for caller, module, _, _ in found}
        print(f"\n{title}: {sum(found.values())} calls, {len(found)} distinct functions, "
              f"{len(edges)} distinct module pairs")
        for (caller, module, function, via), count in sorted(found.items(), key=lambda item: -item[1]):
            steps = f"[{ranks[package(caller)]}->{ranks[package(module)]}]"
            print(f"  {count:5d}  {steps} {caller} -> {module}.{function}" + (f"  (via {via})" if via else ""))
    print(f"\n{len(seen)} rooms (modules), {len(calls)} calls into our modules, "
          f"{sum(1 for c in calls if c.caller is None)} of them entries from library code")


class ModuleImports:
    """Which of our modules import which (at module level or inside functions), transitively."""

    def __init__(self) -> None:
        modules = our_modules()
        self.edges = {  # imports inside functions too: a lazy import is an import
            name: module_imports(ast.walk(ast.parse(path.read_text(encoding="utf-8"))), modules) - {name}
            for name, path in modules.items()
        }
        self._reach: dict[str, set[str]] = {}

    def reaches(self, start: str, target: str) -> bool:
        """Whether `start` imports `target`, directly or through other modules of ours."""
        if start not in self._reach:
            seen: set[str] = set()
            stack = [start]
            while stack:
                for nxt in self.edges.get(stack.pop(), ()):
                    if nxt not in seen:
                        seen.add(nxt)
                        stack.append(nxt)
            self._reach[start] = seen
        return target in self._reach[start]


if __name__ == "__main__":
    sys.exit(main())
