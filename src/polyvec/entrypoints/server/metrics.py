"""Prometheus metrics, in a registry of the app's own (several apps can live in one process, as in tests)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
_TOKEN_BUCKETS = (16, 64, 256, 1024, 2048, 4096, 8192, 16384, 32768)
_SEQ_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)


class ServerMetrics:
    def __init__(self, queue_depth, pending):
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "polyvec_requests", "HTTP requests by endpoint and status", ["endpoint", "status"], registry=r
        )
        self.latency = Histogram(
            "polyvec_request_latency_seconds",
            "HTTP request latency",
            ["endpoint"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.prompt_tokens = Counter("polyvec_prompt_tokens", "Prompt tokens processed (after truncation)", registry=r)
        self.queue_depth = Gauge("polyvec_queue_depth", "Requests waiting for the engine", registry=r)
        self.queue_depth.set_function(queue_depth)
        self.pending = Gauge("polyvec_requests_in_flight", "Requests submitted and not yet answered", registry=r)
        self.pending.set_function(pending)
        self.batch_tokens = Histogram(
            "polyvec_batch_tokens", "Tokens per forward pass", buckets=_TOKEN_BUCKETS, registry=r
        )
        self.batch_seqs = Histogram(
            "polyvec_batch_sequences", "Sequences per forward pass", buckets=_SEQ_BUCKETS, registry=r
        )
        self.aborted = Counter(
            "polyvec_aborted_requests", "Queued requests dropped because their client left", registry=r
        )
        self.busy = Counter("polyvec_engine_busy_seconds", "Time the engine spent in forward passes", registry=r)

    def on_batch(self, tokens: int, seqs: int, seconds: float) -> None:
        self.batch_tokens.observe(tokens)
        self.batch_seqs.observe(seqs)
        self.busy.inc(seconds)
