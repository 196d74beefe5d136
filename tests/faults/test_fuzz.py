"""A fuzzer against real servers on loopback (issue: "10,000 fuzzed requests: 0 UNKNOWN/INTERNAL,
0 OK answers built from NaN, 0 crashes, every refusal a specific status code with a message").

Random and mutated requests go to a `ServiceStack("all", tiny bundle)`: Generate / GenerateStream
with random field values (extremes, NaN and inf, huge counts, empty / huge / garbage text, random
ids), random Verify and Draft message sequences (open and step in random orders with random
values), and raw bytes (random, or a valid message mutated) on every method. Every answer is
classified; the test fails on UNKNOWN, INTERNAL, any other code outside the specific refusals, a
refusal without a message, an OK answer carrying NaN, or a server that is not healthy after.

Seeded and bounded: SPECDEC_FUZZ_REQUESTS (default 2000), SPECDEC_FUZZ_SEED (default 0),
SPECDEC_FUZZ_SECONDS (default 300, a safety stop). The full run of the issue:
    SPECDEC_FUZZ_REQUESTS=10000 python -m pytest -q -s -m faults tests/faults/test_fuzz.py
"""

from __future__ import annotations

import collections
import math
import os
import random
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import pytest
from google.protobuf.descriptor import FieldDescriptor
from google.protobuf.message import Message
from grpc_health.v1 import health_pb2, health_pb2_grpc

from protos.specdec.v1 import drafter_pb2, gateway_pb2, verifier_pb2
from seq2seq_models.bundle import make_tiny_bundle
from specdec.serve import ServiceStack

REQUESTS = int(os.environ.get("SPECDEC_FUZZ_REQUESTS", "2000"))
SEED = int(os.environ.get("SPECDEC_FUZZ_SEED", "0"))
SECONDS = float(os.environ.get("SPECDEC_FUZZ_SECONDS", "300"))
CLIENTS = 4
TIMEOUT_S = 60.0

# The specific refusals a client may get; anything else (UNKNOWN, INTERNAL, UNAVAILABLE from a
# crashed server, DEADLINE_EXCEEDED from a hang) is a failure.
REFUSALS = {
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.OUT_OF_RANGE,
    grpc.StatusCode.FAILED_PRECONDITION,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
}
INT32 = (-(1 << 31), (1 << 31) - 1)
WORDS = ["We", "have", "been", "living", "in", "this", "city", "since", "years", ".", "she", "go", "to",
         "school", "every", "day", "and", "he", "like", "it"]

METHODS = {
    "Generate": ("gateway", "/specdec.v1.GatewayService/Generate", "unary_unary", gateway_pb2.GenerateRequest),
    "GenerateStream": (
        "gateway", "/specdec.v1.GatewayService/GenerateStream", "unary_stream", gateway_pb2.GenerateRequest,
    ),
    "Verify": ("verifier", "/specdec.v1.VerifierService/Verify", "stream_stream", verifier_pb2.VerifyRequest),
    "Draft": ("drafter", "/specdec.v1.DrafterService/Draft", "stream_stream", drafter_pb2.DraftRequest),
}
RESPONSES = {
    "Generate": gateway_pb2.GenerateResponse,
    "GenerateStream": gateway_pb2.GenerateResponse,
    "Verify": verifier_pb2.VerifyResponse,
    "Draft": drafter_pb2.DraftResponse,
}


@pytest.fixture(scope="module")
def stack(tmp_path_factory) -> Iterator[ServiceStack]:
    bundle = make_tiny_bundle(tmp_path_factory.mktemp("fuzz-bundle"), seed=3)
    sections = {
        "verifier": {"address": "127.0.0.1:0"},
        "drafter": {"address": "127.0.0.1:0"},
        "gateway": {"address": "127.0.0.1:0"},
    }
    with ServiceStack("all", Path(bundle), sections) as s:
        yield s


# ---- random values ------------------------------------------------------------------------------


def _int(rng: random.Random, small: int = 16) -> int:
    return rng.choice(
        [
            rng.randint(0, small),
            rng.randint(1, 4),
            rng.choice([0, -1, 1, 2, 63, 64, 65, 127, 128, 129, 255, 256, 257, 1000, 8000, 65536]),
            rng.choice(INT32),
            rng.randint(*INT32),
        ]
    )


def _float(rng: random.Random) -> float:
    return rng.choice(
        [
            rng.random(),
            rng.uniform(0, 3),
            rng.choice([0.0, -0.0, 1.0, 0.5, 1e-6, 1e-7, 1e-300, 1e-310, 5e-324, 1e308, -1.0, 1.0000001]),
            rng.choice([math.nan, math.inf, -math.inf]),
            rng.uniform(-1e6, 1e6),
        ]
    )


def _ids(rng: random.Random, vocab: int) -> list[int]:
    kind = rng.random()
    if kind < 0.6:
        return [rng.randrange(5, vocab) for _ in range(rng.randint(0, 12))]
    if kind < 0.8:
        return [rng.choice([-1, 0, 1, 2, 3, 4, vocab - 1, vocab, *INT32]) for _ in range(rng.randint(1, 6))]
    if kind < 0.95:
        return [rng.randrange(0, vocab) for _ in range(rng.choice([255, 256, 257, 400, 1000]))]
    return [rng.randrange(5, vocab)] * rng.choice([20_000, 300_000])


def _text(rng: random.Random) -> str:
    kind = rng.random()
    if kind < 0.55:
        return " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 12)))
    if kind < 0.65:
        return ""
    if kind < 0.8:  # garbage: control characters, surrogates are not valid UTF-8 so skip them
        return "".join(chr(rng.choice([rng.randint(0, 0x7F), rng.randint(0x80, 0xD7FF), 0x2047])) for _ in range(40))
    if kind < 0.95:
        return rng.choice(WORDS) * rng.choice([1000, 5000, 16_384, 16_385, 30_000])
    return "a" * rng.choice([2 * 1024 * 1024, 10 * 1024 * 1024])  # over the 1 MiB request limit


def _fill(message: Message, rng: random.Random, vocab: int, p_set: float = 0.5) -> Message:
    """Set a random subset of `message`'s scalar fields to random values of their types."""
    for f in message.DESCRIPTOR.fields:
        if rng.random() <= p_set and f.message_type is None:
            _fill_field(message, f, rng, vocab)
    return message


def _fill_field(message: Message, f: FieldDescriptor, rng: random.Random, vocab: int) -> None:
    if f.is_repeated:
        getattr(message, f.name).extend(_ids(rng, vocab))
    elif f.type == FieldDescriptor.TYPE_DOUBLE:
        setattr(message, f.name, _float(rng))
    elif f.type == FieldDescriptor.TYPE_UINT64:
        setattr(message, f.name, rng.choice([0, 1, rng.getrandbits(64)]))
    elif f.type == FieldDescriptor.TYPE_ENUM:
        setattr(message, f.name, rng.choice([*range(9), 99, -5]))
    elif f.type == FieldDescriptor.TYPE_INT32:
        setattr(message, f.name, _int(rng))
    elif f.type == FieldDescriptor.TYPE_STRING:
        setattr(message, f.name, _text(rng))


def _near_valid_config(rng: random.Random, vocab: int) -> gateway_pb2.DecodingConfig:
    """A config that decodes, then one or two fields set to random values: OK answers get fuzzed too."""
    config = gateway_pb2.DecodingConfig(
        mode=rng.randint(1, 7), block_size=rng.randint(1, 8), top_beta=rng.randint(1, 4), num_beams=rng.randint(1, 4),
        gamma=rng.randint(1, 6), temperature=rng.choice([0.0, 0.7, 1.0, 1e-310, 1e-7, 50.0]),
        top_k=rng.choice([0, 1, 5, vocab]), top_p=rng.choice([1.0, 0.9, 1e-9]), max_new_tokens=rng.randint(1, 12),
    )
    # Only the parameters the mode reads (others are refused): then the base config decodes.
    for name in _parameters_besides(config.mode):
        config.ClearField(name)
    fields = [f for f in config.DESCRIPTOR.fields if f.name != "max_new_tokens"]
    for f in rng.sample(fields, rng.randint(0, 2)):
        _fill_field(config, f, rng, vocab)
    return config


def _parameters_besides(wire_mode: int) -> list[str]:
    """The DecodingConfig wire fields a request of `wire_mode` may not set."""
    from dataclasses import fields as dataclass_fields

    from decoding.config import DecodingConfig, wire_name
    from decoding.modes import MODES
    from gateway.wire import WIRE_TO_MODE

    applicable = MODES[WIRE_TO_MODE[wire_mode]].applicable
    return [wire_name(f) for f in dataclass_fields(DecodingConfig) if f.name not in applicable]


def _generate_request(rng: random.Random, vocab: int) -> gateway_pb2.GenerateRequest:
    if rng.random() < 0.5:
        text = " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 12)))
        return gateway_pb2.GenerateRequest(text=text, config=_near_valid_config(rng, vocab))
    request = gateway_pb2.GenerateRequest()
    if rng.random() < 0.7:
        request.text = _text(rng)
    if rng.random() < 0.4:
        request.input_ids.extend(_ids(rng, vocab))
    if rng.random() < 0.9:
        config = _fill(gateway_pb2.DecodingConfig(), rng, vocab)
        if rng.random() < 0.7:  # keep most requests short enough to decode: the fuzzer is bounded in time
            config.max_new_tokens = rng.randint(1, 12)
        request.config.CopyFrom(config)
    return request


def _verify_messages(rng: random.Random, vocab: int) -> list[verifier_pb2.VerifyRequest]:
    messages = []
    for i in range(rng.randint(1, 5)):
        if (i == 0 and rng.random() < 0.85) or rng.random() < 0.1:
            open_ = verifier_pb2.VerifyOpen(source_ids=_ids(rng, vocab))
            messages.append(verifier_pb2.VerifyRequest(open=open_))
        else:
            step = _fill(verifier_pb2.VerifyStep(), rng, vocab, p_set=0.7)
            if rng.random() < 0.5:  # near-valid: ids that exist, a draft the verifier scores
                step.ClearField("append_ids")
                del step.draft_ids[:]
                step.draft_ids.extend(rng.randrange(5, vocab) for _ in range(rng.randint(0, 6)))
            if rng.random() < 0.5:
                step.committed_len = rng.randint(0, 4)
            if rng.random() < 0.5:
                step.top_k = rng.choice([0, 1, 5, vocab])
            messages.append(verifier_pb2.VerifyRequest(step=step))
    return messages


def _draft_messages(rng: random.Random, vocab: int) -> list[drafter_pb2.DraftRequest]:
    messages = []
    for i in range(rng.randint(1, 5)):
        if (i == 0 and rng.random() < 0.85) or rng.random() < 0.1:
            open_ = _fill(drafter_pb2.DraftOpen(), rng, vocab, p_set=0.8)
            messages.append(drafter_pb2.DraftRequest(open=open_))
            continue
        step = _fill(drafter_pb2.DraftStep(), rng, vocab, p_set=0.6)
        method = rng.choice(["block", "beam", "sample", None])
        if rng.random() < 0.6:  # near-valid: a step that drafts, with one random sampling value
            step = drafter_pb2.DraftStep(committed_len=0)
            method = rng.choice(["block", "beam", "sample", "sample"])
            getattr(step, method).SetInParent()
            if method == "block":
                step.block.k = rng.randint(1, 8)
            elif method == "beam":
                step.beam.gamma, step.beam.num_beams = rng.randint(1, 6), rng.choice([1, 2, 4, 16, 17, 8000])
            else:
                step.sample.gamma, step.sample.top_k = rng.randint(1, 6), rng.choice([0, 3, vocab, vocab + 1])
                step.sample.temperature, step.sample.top_p = _float(rng), rng.choice([0.0, 0.9, 1e-9, _float(rng)])
        elif method is not None:
            inner = getattr(step, method)
            inner.SetInParent()
            _fill(inner, rng, vocab, p_set=0.8)
        messages.append(drafter_pb2.DraftRequest(step=step))
    return messages


def _mutate(data: bytes, rng: random.Random) -> bytes:
    if not data or rng.random() < 0.3:
        return bytes(rng.getrandbits(8) for _ in range(rng.randint(0, 64)))
    out = bytearray(data)
    for _ in range(rng.randint(1, 4)):
        choice = rng.random()
        if choice < 0.4 and out:
            out[rng.randrange(len(out))] = rng.getrandbits(8)
        elif choice < 0.7:
            out = out[: rng.randrange(len(out) + 1)]
        else:
            out[rng.randrange(len(out) + 1) : 0] = bytes([rng.choice([0xFF, 0x80, 0x0A, 0x12, 0x1A])])
    return bytes(out)


# ---- one fuzzed call ----------------------------------------------------------------------------


@dataclass
class Outcome:
    target: str
    code: str  # "OK" or the status code's name
    problem: str | None = None  # why this outcome fails the criterion


@dataclass
class Tally:
    by_target: dict[str, collections.Counter] = field(
        default_factory=lambda: collections.defaultdict(collections.Counter)
    )
    problems: list[str] = field(default_factory=list)

    def add(self, outcome: Outcome) -> None:
        self.by_target[outcome.target][outcome.code] += 1
        if outcome.problem:
            self.problems.append(f"{outcome.target}: {outcome.code}: {outcome.problem}")


def _nan(values) -> bool:
    return any(isinstance(v, float) and math.isnan(v) for v in values)


def _check_ok(rpc: str, responses: list[Message], vocab: int) -> str | None:
    """Why an OK answer is wrong (NaN anywhere, ids outside the vocabulary), or None."""
    for r in responses:
        if rpc in ("Generate", "GenerateStream"):
            s = r.stats
            numbers = [s.mean_accepted_length, s.drafter_time_ms, s.verifier_time_ms, s.gateway_time_ms]
            if _nan(numbers):
                return f"NaN in stats {s}"
            if any(not 0 <= i < vocab for i in r.output_ids):
                return f"output id outside the vocabulary: {list(r.output_ids)}"
        elif rpc == "Verify" and r.WhichOneof("kind") == "step":
            for p in r.step.positions:
                if _nan([*p.topk_logprobs, p.draft_logprob]):
                    return f"NaN in a position {p}"
        elif rpc == "Draft" and r.WhichOneof("kind") == "result":
            res = r.result
            if _nan(res.cum_logq) or any(_nan(row.probs) for row in res.q_rows):
                return f"NaN in a draft {res}"
            if any(abs(sum(row.probs) - 1) > 1e-3 for row in res.q_rows):
                return "a q row does not sum to 1"
    if rpc == "Generate" and not responses[-1].final:
        return "Generate answered without final"
    return None


def _call(channels: dict[str, grpc.Channel], rpc: str, payloads: list[bytes]) -> list[Message]:
    service, method, kind, _ = METHODS[rpc]
    stub = getattr(channels[service], kind)(method, request_serializer=lambda b: b, response_deserializer=lambda b: b)
    if kind == "unary_unary":
        raw = [stub(payloads[0], timeout=TIMEOUT_S)]
    elif kind == "unary_stream":
        raw = list(stub(payloads[0], timeout=TIMEOUT_S))
    else:
        raw = list(stub(iter(payloads), timeout=TIMEOUT_S))
    return [RESPONSES[rpc].FromString(b) for b in raw]


def fuzz_one(index: int, channels: dict[str, grpc.Channel], vocab: int) -> Outcome:
    rng = random.Random(SEED * 1_000_003 + index)
    roll = rng.random()
    if roll < 0.35:
        rpc = rng.choice(["Generate", "GenerateStream"])
        payloads = [_generate_request(rng, vocab).SerializeToString()]
        target = rpc
    elif roll < 0.6:
        rpc, target = "Verify", "Verify"
        payloads = [m.SerializeToString() for m in _verify_messages(rng, vocab)]
    elif roll < 0.85:
        rpc, target = "Draft", "Draft"
        payloads = [m.SerializeToString() for m in _draft_messages(rng, vocab)]
    else:  # raw bytes: random, or a valid message of the method mutated
        rpc = rng.choice(list(METHODS))
        target = f"raw {rpc}"
        valid = {
            "Generate": lambda: [_generate_request(rng, vocab).SerializeToString()],
            "GenerateStream": lambda: [_generate_request(rng, vocab).SerializeToString()],
            "Verify": lambda: [m.SerializeToString() for m in _verify_messages(rng, vocab)],
            "Draft": lambda: [m.SerializeToString() for m in _draft_messages(rng, vocab)],
        }[rpc]()
        payloads = [_mutate(p, rng) if rng.random() < 0.7 else p for p in valid]
    try:
        responses = _call(channels, rpc, payloads)
    except grpc.RpcError as exc:
        code = exc.code()
        if code not in REFUSALS:
            return Outcome(target, code.name, f"not a specific refusal: {exc.details()!r}")
        if not exc.details():
            return Outcome(target, code.name, "a refusal without a message")
        return Outcome(target, code.name)
    return Outcome(target, "OK", _check_ok(rpc, responses, vocab))


def run_fuzz(stack: ServiceStack, count: int, seconds: float, on_outcome: Callable[[Outcome], None]) -> int:
    """Send up to `count` fuzzed calls from CLIENTS threads, stopping after `seconds`; how many ran."""
    vocab = stack.running.verifier.model_info.vocab_size
    big = [("grpc.max_send_message_length", 64 << 20), ("grpc.max_receive_message_length", 64 << 20)]
    channels = {name: grpc.insecure_channel(address, options=big) for name, address in stack.running.addresses.items()}
    stop_at = time.monotonic() + seconds
    tried = 0
    try:
        with ThreadPoolExecutor(CLIENTS) as pool:
            def one(index: int) -> Outcome | None:
                return None if time.monotonic() > stop_at else fuzz_one(index, channels, vocab)

            futures = [pool.submit(one, index) for index in range(count)]
            for future in futures:
                outcome = future.result()
                if outcome is not None:
                    tried += 1
                    on_outcome(outcome)
    finally:
        for channel in channels.values():
            channel.close()
    return tried


def test_fuzzed_requests_get_specific_answers(stack):
    tally = Tally()
    started = time.perf_counter()
    tried = run_fuzz(stack, REQUESTS, SECONDS, tally.add)
    wall = time.perf_counter() - started
    totals = collections.Counter()
    for counts in tally.by_target.values():
        totals.update(counts)
    lines = [f"fuzz: seed {SEED}, {tried}/{REQUESTS} requests in {wall:.1f}s; {dict(sorted(totals.items()))}"]
    lines += [f"  {target}: {dict(sorted(c.items()))}" for target, c in sorted(tally.by_target.items())]
    print("\n".join(lines))
    assert tally.problems == [], "\n".join(tally.problems[:20])
    assert tried == REQUESTS, f"only {tried} of {REQUESTS} requests ran within {SECONDS}s"
    for address in stack.running.addresses.values():
        with grpc.insecure_channel(address) as channel:
            health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
            assert health.status == health_pb2.HealthCheckResponse.SERVING
    with grpc.insecure_channel(stack.running.addresses["gateway"]) as channel:
        request = gateway_pb2.GenerateRequest(text="We have been here .")
        assert _call({"gateway": channel}, "Generate", [request.SerializeToString()])[0].final
