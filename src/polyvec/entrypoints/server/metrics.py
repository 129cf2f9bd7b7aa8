"""Prometheus metrics, in a registry of the app's own (several apps can live in one process, as in tests):
polyvec's `polyvec_*`, vLLM's `vllm:*` names for what a pooling server has (labels `model_name`, `engine`), and
TEI's `te_*` ones, so existing vLLM and TEI dashboards read this server too."""

from __future__ import annotations

from collections.abc import Sequence

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
_TOKEN_BUCKETS = (16, 64, 256, 1024, 2048, 4096, 8192, 16384, 32768)
_SEQ_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
# TEI's buckets (router/src/prometheus.rs): durations from 15 µs up by half, powers of two for sizes
_TEI_DURATION_BUCKETS = tuple(1e-5 * 1.5**k for k in range(1, 36))
_TEI_POWERS = tuple(float(2**k) for k in range(21))

TE_COUNTED = "polyvec.te_counted"
"""Scope key: te_request_count's method label ("single" or "batch") of a request a pooling handler counted (so its
failure counts, as TEI's)."""
TE_STAGES = "polyvec.te_stages"
"""Scope key: a pooling request's (tokenization, queue, inference) seconds, TEI's stages (its x-*-time headers)."""
TE_ERR = "polyvec.te_err"
"""Scope key: a failed request's te_request_failure label where the handler knows TEI's (batch_size, model_type,
tokenization, ...)."""


class ServerMetrics:
    def __init__(self, queue_depth, pending, model_name: str = "", max_input_length: int = 1 << 20):
        self.registry = CollectorRegistry()
        self.in_progress = 0
        """POST requests in progress (ServerMiddleware counts them: --max-concurrent-requests, vLLM's /load)."""
        r = self.registry
        labels = {"model_name": model_name, "engine": "0"}
        names = list(labels)
        Gauge("vllm:num_requests_waiting", "Requests waiting for the engine", names, registry=r).labels(
            **labels
        ).set_function(queue_depth)
        Gauge("vllm:num_requests_running", "Requests in the engine", names, registry=r).labels(**labels).set_function(
            lambda: max(0, pending() - queue_depth())
        )
        self.vllm_prompt_tokens = Counter("vllm:prompt_tokens", "Prompt tokens processed", names, registry=r).labels(
            **labels
        )
        self.vllm_success = Counter(
            "vllm:request_success", "Requests finished", [*names, "finished_reason"], registry=r
        ).labels(**labels, finished_reason="stop")
        self.vllm_e2e = Histogram(
            "vllm:e2e_request_latency_seconds", "Request latency", names, buckets=_LATENCY_BUCKETS, registry=r
        ).labels(**labels)
        self.vllm_request_tokens = Histogram(
            "vllm:request_prompt_tokens", "Prompt tokens per request", names, buckets=_TOKEN_BUCKETS, registry=r
        ).labels(**labels)
        self.vllm_iteration_tokens = Histogram(
            "vllm:iteration_tokens_total", "Tokens per engine step", names, buckets=_TOKEN_BUCKETS, registry=r
        ).labels(**labels)
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
            "polyvec_aborted_requests",
            "Inputs dropped because their client left (queued or being tokenized)",
            registry=r,
        )
        self.busy = Counter("polyvec_engine_busy_seconds", "Time the engine spent in forward passes", registry=r)
        # TEI's counters keep their names (no _total): gauges here, typed counter by export()
        self.te_count = Gauge("te_request_count", "Pooling requests received (TEI's)", ["method"], registry=r)
        self.te_success = Gauge("te_request_success", "Pooling requests answered (TEI's)", ["method"], registry=r)
        self.te_failure = Gauge("te_request_failure", "Pooling requests failed, by cause (TEI's)", ["err"], registry=r)
        self.te_duration = Histogram(
            "te_request_duration", "Pooling request latency (TEI's)", buckets=_TEI_DURATION_BUCKETS, registry=r
        )
        self.te_stages = [
            Histogram(f"te_request_{name}_duration", f"{what} (TEI's)", buckets=_TEI_DURATION_BUCKETS, registry=r)
            for name, what in (
                ("tokenization", "Time to tokenize a request's inputs"),
                ("queue", "Time a request's inputs waited for a forward pass, mean over them"),
                ("inference", "Time from a request's inputs' first forward pass to their results, mean over them"),
            )
        ]
        self.te_input_length = Histogram(
            "te_request_input_length",
            "Tokens per input (TEI's)",
            buckets=[b for b in _TEI_POWERS[:20] if b <= max_input_length] or [1.0],
            registry=r,
        )
        self.te_batch_size = Histogram(
            "te_batch_next_size", "Sequences per forward pass (TEI's)", buckets=_TEI_POWERS[:13], registry=r
        )
        self.te_batch_tokens = Histogram(
            "te_batch_next_tokens", "Tokens per forward pass (TEI's)", buckets=_TEI_POWERS, registry=r
        )
        Gauge("te_queue_size", "Requests waiting for the engine (TEI's)", registry=r).set_function(queue_depth)
        # TEI's per-input families: embed for vectors of any kind, predict for classify and scores
        self.te_inputs = {kind: _InputMetrics(kind, r) for kind in ("embed", "predict")}

    def on_batch(self, tokens: int, seqs: int, seconds: float) -> None:
        self.vllm_iteration_tokens.observe(tokens)
        self.batch_tokens.observe(tokens)
        self.batch_seqs.observe(seqs)
        self.busy.inc(seconds)
        self.te_batch_size.observe(seqs)
        self.te_batch_tokens.observe(tokens)

    def on_failure(self, status: int, err: str | None = None) -> None:
        """A pooling request that failed: `err`, TEI's cause where the handler named it, else by status (the
        client's input, overload, a task the model lacks, a client that left, a fault of the server's)."""
        by_status = {429: "overloaded", 424: "model_type", 499: "dropped", 413: "batch_size"}
        self.te_failure.labels(err or by_status.get(status, "validation" if status < 500 else "inference")).inc()

    def on_request(
        self,
        prompt_tokens: list[int],
        seconds: float,
        method: str = "batch",
        stages: tuple[float, float, float] = (0.0, 0.0, 0.0),
        kind: str | None = None,
        per_input: Sequence[tuple[float, float]] = (),
    ) -> None:
        """One HTTP request's engine work done: its prompts' token counts, the time since it was received, TEI's
        method label (single: the body gave one input), its stages' seconds (tokenization, queue, inference) and,
        for TEI's te_embed_* or te_predict_* (`kind`), each input's (queue, inference) seconds."""
        self.te_success.labels(method).inc()
        self.te_duration.observe(seconds)
        for histogram, value in zip(self.te_stages, stages):
            histogram.observe(value)
        if kind is not None:
            self.te_inputs[kind].on_inputs(seconds, stages[0], per_input)
        total = sum(prompt_tokens)
        self.prompt_tokens.inc(total)
        self.vllm_prompt_tokens.inc(total)
        self.vllm_success.inc(len(prompt_tokens))
        for n in prompt_tokens:
            self.vllm_request_tokens.observe(n)
            self.te_input_length.observe(n)
            # vLLM observes each prompt (an engine request); they are answered together, when the last is done
            self.vllm_e2e.observe(seconds)


TE_COUNTERS = (
    "te_request_count", "te_request_success", "te_request_failure",
    "te_embed_count", "te_embed_success", "te_predict_count", "te_predict_success",
)  # fmt: skip
"""TEI's counters, kept under their names without prometheus_client's `_total` (gauges here, typed counter on
export)."""


def export(registry: CollectorRegistry) -> bytes:
    """The text exposition, TEI's counters typed as TEI's exporter types them."""
    text = generate_latest(registry)
    for name in TE_COUNTERS:
        text = text.replace(f"# TYPE {name} gauge\n".encode(), f"# TYPE {name} counter\n".encode())
    return text


class _InputMetrics:
    """TEI's te_embed_* / te_predict_*: counted and timed per input (each of a request's inputs is one call of
    TEI's infer)."""

    def __init__(self, kind: str, r: CollectorRegistry):
        self.count = Gauge(f"te_{kind}_count", f"Inputs received ({kind}, TEI's)", registry=r)
        self.success = Gauge(f"te_{kind}_success", f"Inputs answered ({kind}, TEI's)", registry=r)
        self.duration, self.tokenization, self.queue, self.inference = (
            Histogram(f"te_{kind}{name}_duration", f"{what} ({kind}, TEI's)", buckets=_TEI_DURATION_BUCKETS, registry=r)
            for name, what in (
                ("", "Time from an input's request received to its result"),
                ("_tokenization", "Time to tokenize an input's request"),
                ("_queue", "Time an input waited for a forward pass"),
                ("_inference", "Time from an input's first forward pass to its result"),
            )
        )

    def on_inputs(self, seconds: float, tokenization: float, per_input: Sequence[tuple[float, float]]) -> None:
        self.success.inc(len(per_input))
        for queue, inference in per_input:
            self.duration.observe(seconds)
            self.tokenization.observe(tokenization)
            self.queue.observe(queue)
            self.inference.observe(inference)
