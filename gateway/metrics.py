"""The gateway's Prometheus metrics (serving.metrics), defined and recorded in one place."""

from __future__ import annotations

from decoding.config import Mode
from decoding.policies.loop import DecodeResult
from gateway.admission import AdmissionQueue
from serving.metrics import LATENCY_BUCKETS, Metric, Registry

# One metric a line: attribute, kind, exported name (after the `specdec_` namespace; a counter's gets
# `_total`), its label names ("-": fixed by the first use), then the help text. Histograms are in
# seconds over LATENCY_BUCKETS (1 ms to 60 s), of requests that completed. Speculative decoding is
# also exported under vLLM's spec_decode names, so dashboards written for those read ours.
DEFINITIONS = """
requests counter gateway_requests - requests decoded, by mode
tokens counter gateway_tokens_out - output tokens, by mode
iterations counter gateway_iterations - accept-loop iterations (verifier steps)
drafts counter gateway_drafts - iterations that verified a draft
draft_tokens counter gateway_draft_tokens - draft tokens proposed
accepted counter gateway_accepted_tokens - draft tokens accepted
accepted_pos counter gateway_accepted_tokens_per_position - accepted drafts by position
mean_len gauge gateway_mean_acceptance_length - output tokens per iteration, by mode
predrafts counter gateway_predrafts mode blocks drafted during the verifier's step
predrafts_used counter gateway_predrafts_used mode pre-drafted blocks used
preverified counter gateway_preverified mode iterations whose first position was checked while drafting
preverify_cuts counter gateway_preverify_cuts mode pre-verified blocks cut at their first token, never verified
drafter_s counter gateway_draft_seconds - time waiting for drafts
verifier_s counter gateway_verify_seconds - time waiting for the verifier
gateway_s counter gateway_own_seconds - time in the gateway itself
degraded counter gateway_degraded - requests that fell back to AR
errors counter gateway_errors - requests that failed, by status code
active gauge gateway_active_requests - requests being decoded or queued for a worker
cancelled counter gateway_requests_cancelled - requests the client cancelled
deadline counter gateway_deadline_exceeded - requests whose own deadline passed
queued gauge gateway_queued_requests - requests waiting for a worker and model sessions
admitted_v gauge gateway_verifier_sessions - verifier sessions held by admitted requests
replica_sessions gauge gateway_replica_sessions role,replica sessions this gateway holds on a replica
replica_requests counter gateway_replica_requests role,replica sessions placed on a replica
replica_failures counter gateway_replica_failures role,replica sessions that failed on a replica
replica_usable gauge gateway_replica_usable role,replica 1 while a replica is SERVING and accepted, else 0
failovers counter gateway_failovers role requests moved to another replica mid-request, by role
latency histogram gateway_request_seconds mode,rpc request latency, admission wait included, by mode and rpc
ttft histogram gateway_time_to_first_token_seconds mode GenerateStream: time to the first message with tokens, by mode
queue_wait histogram gateway_queue_wait_seconds - time admitted requests waited for a worker and model sessions
sd_draft counter spec_decode_num_draft_tokens mode draft tokens proposed, by mode
sd_accepted counter spec_decode_num_accepted_tokens mode draft tokens accepted, by mode
sd_emitted counter spec_decode_num_emitted_tokens mode tokens emitted (output tokens), by mode
sd_accepted_pos counter spec_decode_num_accepted_tokens_per_pos mode,position accepted draft tokens by draft position \
(0 = first), by mode
"""

# Counters that add a field of the request's DecodeStats, by mode: metric attribute -> stats field.
_STATS_BY_MODE = {
    "iterations": "iterations", "draft_tokens": "drafted_tokens", "accepted": "accepted_tokens",
    "sd_draft": "drafted_tokens", "sd_accepted": "accepted_tokens", "predrafts": "predrafts",
    "predrafts_used": "predrafts_used", "preverified": "preverified", "preverify_cuts": "preverify_cuts",
}


class GatewayMetrics:
    """Every metric the gateway exports, in `registry`, as attributes named by DEFINITIONS: request
    counts, speculative decoding, time shares, load, replicas and errors."""

    def __init__(self, registry: Registry) -> None:
        for attribute, kind, name, labels, help_text in parse_definitions(DEFINITIONS):
            if kind == "histogram":
                metric: Metric = registry.histogram(name, help_text, LATENCY_BUCKETS, labels=labels)
            else:
                metric = getattr(registry, kind)(name, help_text, labels=labels)
            setattr(self, attribute, metric)

    def __getattr__(self, name: str) -> Metric:  # the attributes set above, for type checkers
        raise AttributeError(f"GatewayMetrics has no metric {name!r}")

    def admission_changed(self, queue: AdmissionQueue) -> None:
        """The queue gauges, whenever admission changes."""
        self.queued.set(len(queue.waiting))
        self.admitted_v.set(sum(t.need.verifier for t in queue.running))

    def record(self, result: DecodeResult, mode: Mode, total_s: float) -> None:
        """One completed request's counters, by mode."""
        s, m = result.stats, mode.value
        self.requests.inc(mode=m)
        self.tokens.inc(len(result.output_ids), mode=m)
        self.sd_emitted.inc(len(result.output_ids), mode=m)
        self.drafts.inc(sum(s.steps_per_draft_length[1:]), mode=m)
        for attribute, field in _STATS_BY_MODE.items():
            getattr(self, attribute).inc(getattr(s, field), mode=m)
        for position, count in enumerate(s.accepted_per_position):
            self.accepted_pos.inc(count, position=str(position))
            self.sd_accepted_pos.inc(count, mode=m, position=str(position))
        self.drafter_s.inc(s.drafter_time_s)
        self.verifier_s.inc(s.verifier_time_s)
        self.gateway_s.inc(max(total_s - s.drafter_time_s - s.verifier_time_s, 0.0))
        its = self.iterations.value(mode=m)
        if its:
            self.mean_len.set(self.tokens.value(mode=m) / its, mode=m)


def parse_definitions(text: str) -> list[tuple[str, str, str, tuple[str, ...] | None, str]]:
    """(attribute, kind, name, label names or None, help) for each line of a DEFINITIONS table."""
    rows = []
    for line in text.strip().splitlines():
        attribute, kind, name, labels, help_text = line.split(" ", 4)
        rows.append((attribute, kind, name, None if labels == "-" else tuple(labels.split(",")), help_text))
    return rows
