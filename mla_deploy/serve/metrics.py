"""``/metrics`` in Prometheus' text format (``prometheus_client``, one registry per server, nothing global).

Requests by endpoint and status; the queue depth, rows in use and cache rows held (read from the batcher when
scraped); time to first token and inter-token latency histograms; prompt and generated token counters; decode
steps and the rows they carried (their ratio: mean batch occupancy); the engine's generated tokens per second
of its own step time.
"""

from __future__ import annotations

import time

from ..generate.batching import ContinuousBatcher, Ticket

#: latency buckets (seconds): milliseconds for an inter-token step up to minutes for a first token behind a queue
BUCKETS = (0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0, 20.0, 60.0, 120.0)


class Metrics:
    """The server's metrics over ``batcher`` (see the module docstring)."""

    def __init__(self, batcher: ContinuousBatcher, model: str):
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

        self.registry = registry = CollectorRegistry()
        stats = batcher.stats
        self.requests = Counter("mla_deploy_requests", "HTTP requests by endpoint and status",
                                ["endpoint", "status"], registry=registry)
        self.ttft = Histogram("mla_deploy_time_to_first_token_seconds", "from submission to the first token",
                              buckets=BUCKETS, registry=registry)
        self.itl = Histogram("mla_deploy_inter_token_latency_seconds", "between two tokens of one request",
                             buckets=BUCKETS, registry=registry)
        Gauge("mla_deploy_queue_depth", "requests waiting for a row", registry=registry).set_function(
            lambda: stats.waiting)
        Gauge("mla_deploy_batch_rows", "rows of the running batch (--max-batch)", registry=registry).set_function(
            lambda: stats.rows)
        Gauge("mla_deploy_batch_rows_in_use", "rows holding a running sequence", registry=registry).set_function(
            lambda: stats.active)
        Gauge("mla_deploy_cache_rows_in_use", "latent cache rows held by running sequences",
              registry=registry).set_function(
            lambda: int(sum(int(batcher.state.lengths[r]) for r, t in enumerate(batcher.slots) if t is not None)))
        Gauge("mla_deploy_cache_rows", "latent cache rows in all (rows of the batch x rows per sequence)",
              registry=registry).set_function(lambda: stats.rows * batcher.capacity)
        self._counter(Counter, "mla_deploy_prompt_tokens", "prompt tokens prefilled", lambda: stats.prompt_tokens)
        self._counter(Counter, "mla_deploy_generated_tokens", "tokens generated", lambda: stats.generated_tokens)
        self._counter(Counter, "mla_deploy_decode_steps", "decode steps run", lambda: stats.decode_steps)
        self._counter(Counter, "mla_deploy_decode_rows", "running sequences summed over decode steps",
                      lambda: stats.decode_rows)
        Gauge("mla_deploy_engine_tokens_per_second", "generated tokens per second of engine step time",
              registry=registry).set_function(
            lambda: stats.generated_tokens / stats.step_seconds if stats.step_seconds else 0.0)
        Gauge("mla_deploy_model_info", "the model served", ["model"], registry=registry).labels(model).set(1)
        self._last: dict[int, float] = {}

    def _counter(self, counter, name, doc, read) -> None:
        """A counter whose value is read from the batcher's stats when scraped."""
        from prometheus_client.core import CounterMetricFamily

        class _Read:
            def collect(self):
                yield CounterMetricFamily(name, doc, value=read())

        self.registry.register(_Read())

    def requested(self, ticket: Ticket) -> None:
        self._last[id(ticket)] = ticket.submitted

    def token(self, ticket: Ticket, count: int) -> None:
        """A request's ``count``-th token has reached the server."""
        now = time.perf_counter()
        before = self._last.get(id(ticket), ticket.submitted)
        (self.ttft if count == 1 else self.itl).observe(now - before)
        self._last[id(ticket)] = now

    def ended(self, ticket: Ticket) -> None:
        self._last.pop(id(ticket), None)

    def render(self) -> tuple[bytes, str]:
        """The text exposition and its content type."""
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        return generate_latest(self.registry), CONTENT_TYPE_LATEST
