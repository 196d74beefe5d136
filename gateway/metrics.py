"""The gateway's Prometheus metrics (serving.metrics), defined and recorded in one place."""

from __future__ import annotations

from gateway.admission import AdmissionQueue
from gateway.decoding_config import Mode
from gateway.policies.loop import DecodeResult
from serving.metrics import LATENCY_BUCKETS, Registry


class GatewayMetrics:
    """Every metric the gateway exports, in `registry`: request counts, speculative decoding
    (named as vLLM's spec_decode metrics), time shares, load and errors."""

    def __init__(self, registry: Registry) -> None:
        r = registry
        self.requests = r.counter("gateway_requests", "requests decoded, by mode")
        self.tokens = r.counter("gateway_tokens_out", "output tokens, by mode")
        self.iterations = r.counter("gateway_iterations", "accept-loop iterations (verifier steps)")
        self.drafts = r.counter("gateway_drafts", "iterations that verified a draft")
        self.draft_tokens = r.counter("gateway_draft_tokens", "draft tokens proposed")
        self.accepted = r.counter("gateway_accepted_tokens", "draft tokens accepted")
        self.accepted_pos = r.counter("gateway_accepted_tokens_per_position", "accepted drafts by position")
        self.mean_len = r.gauge("gateway_mean_acceptance_length", "output tokens per iteration, by mode")
        # Overlapped drafting (gateway.policies.overlap): hit rate = used / predrafts.
        by_mode = ("mode",)
        self.predrafts = r.counter("gateway_predrafts", "blocks drafted during the verifier's step", labels=by_mode)
        self.predrafts_used = r.counter("gateway_predrafts_used", "pre-drafted blocks used", labels=by_mode)
        # Pre-verify (gateway.policies.preverify): cuts / preverified = blocks never verified.
        self.preverified = r.counter(
            "gateway_preverified", "iterations whose first position was checked while drafting", labels=by_mode
        )
        self.preverify_cuts = r.counter(
            "gateway_preverify_cuts", "pre-verified blocks cut at their first token, never verified", labels=by_mode
        )
        self.drafter_s = r.counter("gateway_draft_seconds", "time waiting for drafts")
        self.verifier_s = r.counter("gateway_verify_seconds", "time waiting for the verifier")
        self.gateway_s = r.counter("gateway_own_seconds", "time in the gateway itself")
        self.degraded = r.counter("gateway_degraded", "requests that fell back to AR")
        self.errors = r.counter("gateway_errors", "requests that failed, by status code")
        self.active = r.gauge("gateway_active_requests", "requests being decoded or queued for a worker")
        self.cancelled = r.counter("gateway_requests_cancelled", "requests the client cancelled")
        self.deadline = r.counter("gateway_deadline_exceeded", "requests whose own deadline passed")
        self.queued = r.gauge("gateway_queued_requests", "requests waiting for a worker and model sessions")
        self.admitted_v = r.gauge("gateway_verifier_sessions", "verifier sessions held by admitted requests")
        # Replica sets (gateway.replicas), by role (verifier, drafter) and replica address.
        by_replica = ("role", "replica")
        self.replica_sessions = r.gauge(
            "gateway_replica_sessions", "sessions this gateway holds on a replica", labels=by_replica
        )
        self.replica_requests = r.counter(
            "gateway_replica_requests", "sessions placed on a replica", labels=by_replica
        )
        self.replica_failures = r.counter(
            "gateway_replica_failures", "sessions that failed on a replica", labels=by_replica
        )
        self.replica_usable = r.gauge(
            "gateway_replica_usable", "1 while a replica is SERVING and accepted, else 0", labels=by_replica
        )
        self.failovers = r.counter(
            "gateway_failovers", "requests moved to another replica mid-request, by role", labels=("role",)
        )
        # Load: histograms in seconds (1 ms to 60 s) of requests that completed.
        self.latency = r.histogram(
            "gateway_request_seconds", "request latency, admission wait included, by mode and rpc",
            LATENCY_BUCKETS, labels=("mode", "rpc"),
        )
        self.ttft = r.histogram(
            "gateway_time_to_first_token_seconds", "GenerateStream: time to the first message with tokens, by mode",
            LATENCY_BUCKETS, labels=("mode",),
        )
        self.queue_wait = r.histogram(
            "gateway_queue_wait_seconds", "time admitted requests waited for a worker and model sessions",
            LATENCY_BUCKETS, labels=(),
        )
        # Speculative decoding, named as vLLM's spec_decode metrics (acceptance rate = accepted / draft).
        self.sd_draft = r.counter("spec_decode_num_draft_tokens", "draft tokens proposed, by mode", labels=("mode",))
        self.sd_accepted = r.counter(
            "spec_decode_num_accepted_tokens", "draft tokens accepted, by mode", labels=("mode",)
        )
        self.sd_emitted = r.counter(
            "spec_decode_num_emitted_tokens", "tokens emitted (output tokens), by mode", labels=("mode",)
        )
        self.sd_accepted_pos = r.counter(
            "spec_decode_num_accepted_tokens_per_pos", "accepted draft tokens by draft position (0 = first), by mode",
            labels=("mode", "position"),
        )

    def admission_changed(self, queue: AdmissionQueue) -> None:
        """The queue gauges, whenever admission changes."""
        self.queued.set(len(queue.waiting))
        self.admitted_v.set(sum(t.need.verifier for t in queue.running))

    def record(self, result: DecodeResult, mode: Mode, total_s: float) -> None:
        """One completed request's counters, by mode."""
        s = result.stats
        self.requests.inc(mode=mode.value)
        self.tokens.inc(len(result.output_ids), mode=mode.value)
        self.iterations.inc(s.iterations, mode=mode.value)
        self.drafts.inc(sum(s.steps_per_draft_length[1:]), mode=mode.value)
        self.draft_tokens.inc(s.drafted_tokens, mode=mode.value)
        self.accepted.inc(s.accepted_tokens, mode=mode.value)
        for position, count in enumerate(s.accepted_per_position):
            self.accepted_pos.inc(count, position=str(position))
            self.sd_accepted_pos.inc(count, mode=mode.value, position=str(position))
        self.sd_draft.inc(s.drafted_tokens, mode=mode.value)
        self.sd_accepted.inc(s.accepted_tokens, mode=mode.value)
        self.sd_emitted.inc(len(result.output_ids), mode=mode.value)
        self.predrafts.inc(s.predrafts, mode=mode.value)
        self.predrafts_used.inc(s.predrafts_used, mode=mode.value)
        self.preverified.inc(s.preverified, mode=mode.value)
        self.preverify_cuts.inc(s.preverify_cuts, mode=mode.value)
        self.drafter_s.inc(s.drafter_time_s)
        self.verifier_s.inc(s.verifier_time_s)
        self.gateway_s.inc(max(total_s - s.drafter_time_s - s.verifier_time_s, 0.0))
        its = self.iterations.value(mode=mode.value)
        if its:
            self.mean_len.set(self.tokens.value(mode=mode.value) / its, mode=mode.value)
